"""The dataset kinds and the chooser: one place chooses, no kind imports it, no import cycle."""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
CORE = ROOT / "prefetchd" / "core"
KINDS = ("indexbase", "folderindex", "tarindex", "tarheaders", "devkit")


def _core_imports(name: str) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse((CORE / f"{name}.py").read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module.startswith("prefetchd.core."):
                found.add(node.module.rsplit(".", 1)[1])
            elif node.module == "prefetchd.core":
                found.update(a.name for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name.rsplit(".", 1)[1] for a in node.names if a.name.startswith("prefetchd.core."))
    return found


def test_no_dataset_kind_imports_the_chooser():
    for kind in KINDS:
        assert "dataset" not in _core_imports(kind), f"prefetchd.core.{kind} imports prefetchd.core.dataset"


def test_no_import_cycle_among_the_core_modules():
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
