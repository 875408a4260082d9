"""The dataset layouts and the chooser (prefetchd.sources): one place chooses, no layout imports it, no import cycle."""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
CORE = ROOT / "prefetchd" / "sources"
KINDS = ("base", "folder", "imagenet", "archive", "store", "tarheaders", "tarrecheck", "devkit", "classlike")


def _core_imports(name: str) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse((CORE / f"{name}.py").read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module.startswith("prefetchd.sources."):
                found.add(node.module.rsplit(".", 1)[1])
            elif node.module == "prefetchd.sources":
                found.update(a.name for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name.rsplit(".", 1)[1] for a in node.names if a.name.startswith("prefetchd.sources."))
    return found


def test_no_dataset_kind_imports_the_chooser():
    for kind in KINDS:
        assert "dataset" not in _core_imports(kind), f"prefetchd.sources.{kind} imports prefetchd.sources.dataset"


def test_no_import_cycle_among_the_sources_modules():
    graph = {p.stem: _core_imports(p.stem) for p in CORE.glob("*.py") if p.stem != "__init__"}
    done: set[str] = set()

    def visit(node: str, path: tuple[str, ...]) -> None:
        assert node not in path, "import cycle: " + " -> ".join((*path[path.index(node):], node))
        if node in done:
            return
        for nxt in graph.get(node, ()):
            visit(nxt, (*path, node))
        done.add(node)

    for node in graph:
        visit(node, ())
