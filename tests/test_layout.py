"""The package layout is the architecture: each layer imports only the layers below it.

format < core < executors < daemon < tools < the top level (cli); the client (``prefetchd_client``,
in ``client/``) imports only ``format`` and ``core``. Checked on the source (every import
statement, also those inside functions), so a violation fails here before it ships.
"""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
LAYERS = ["format", "core", "executors", "daemon", "tools"]
MAX_LINES = 600


def _modules():
    for path in sorted((ROOT / "prefetchd").rglob("*.py")):
        rel = path.relative_to(ROOT).with_suffix("")
        yield path, ".".join(p for p in rel.parts if p != "__init__")
    for path in sorted((ROOT / "client").glob("*.py")):
        yield path, "prefetchd_client" + ("" if path.stem == "__init__" else "." + path.stem)


def _imports(path: pathlib.Path, module: str) -> set[str]:
    package = module if path.stem == "__init__" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module
            found.add(name)
            found.update(f"{name}.{a.name}" for a in node.names)  # ``from pkg import module``
    return {n for n in found if n.split(".")[0] in ("prefetchd", "prefetchd_client")}


def _layer(name: str) -> str:
    parts = name.split(".")
    if parts[0] == "prefetchd_client":
        return "client"
    if len(parts) > 1 and parts[1] in LAYERS:
        return parts[1]
    return "top"


def _allowed(layer: str, target: str) -> bool:
    if target in ("prefetchd", "prefetchd.__init__"):  # the package itself: imports nothing
        return True
    to = _layer(target)
    if layer == "client":
        return to in ("client", "format", "core")
    if layer == "top":
        return True
    if layer == "tools":
        return to != "top"
    return to in LAYERS and LAYERS.index(to) <= LAYERS.index(layer)


@pytest.mark.parametrize("path,module", list(_modules()), ids=lambda x: x if isinstance(x, str) else "")
def test_each_module_imports_only_its_own_layer_or_lower(path, module):
    layer = _layer(module)
    bad = sorted(t for t in _imports(path, module) if not _allowed(layer, t))
    assert not bad, f"{module} ({layer}) imports {bad}"


@pytest.mark.parametrize("path,module", list(_modules()), ids=lambda x: x if isinstance(x, str) else "")
def test_no_module_is_over_600_lines(path, module):
    n = len(path.read_text().splitlines())
    assert n <= MAX_LINES, f"{module} has {n} lines"


def test_the_top_level_keeps_only_its_face_and_entry_points():
    top = sorted(p.name for p in (ROOT / "prefetchd").glob("*.py"))
    assert top == ["__init__.py", "__main__.py", "cli.py"]
    subs = sorted(p.name for p in (ROOT / "prefetchd").iterdir() if (p / "__init__.py").exists())
    assert subs == sorted(LAYERS)
    for sub in LAYERS:
        doc = ast.get_docstring(ast.parse((ROOT / "prefetchd" / sub / "__init__.py").read_text()))
        assert doc, f"prefetchd/{sub}/__init__.py says nothing of what lives there"


def test_the_checker_catches_a_lower_layer_importing_a_higher_one(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from prefetchd.daemon.ring import Lock\n    from ..tools import demo\n")
    imports = _imports(bad, "prefetchd.core.bad")
    assert "prefetchd.daemon.ring" in imports and "prefetchd.tools.demo" in imports
    assert not _allowed("core", "prefetchd.daemon.ring") and not _allowed("format", "prefetchd.core.config")
    assert not _allowed("client", "prefetchd.executors.worker") and _allowed("client", "prefetchd.format.batchfile")


_PATH = re.compile(r"(?<![\w/.])((?:prefetchd|client|tests|examples|systemd)/[\w/]+\.(?:py|service|mount))")
_DOTTED = re.compile(r"(?<![\w.])(prefetchd(?:_client)?)\.([a-z_]\w*)")
_NOT_MODULES = {"yaml", "service", "mount", "conf", "log", "lock", "json", "sock"}  # file names, not modules


def _texts():
    for rel in ("README.md", "BENCHMARKS.md", "config.example.yaml"):
        yield rel, (ROOT / rel).read_text()
    for top in ("prefetchd", "client", "tests", "examples"):
        for path in sorted((ROOT / top).rglob("*.py")):
            yield str(path.relative_to(ROOT)), path.read_text()


def test_every_path_and_module_the_docs_and_code_name_exists():
    """A move leaves no stale name behind: each ``prefetchd/...py`` path and each dotted
    ``prefetchd.<x>`` / ``prefetchd_client.<x>`` in the docs, docstrings and tests names a
    sub-package or module that exists (logger names are the exception: ``getLogger("...")``)."""
    client_modules = {p.stem for p in (ROOT / "client").glob("*.py")}
    client_names = set(__import__("prefetchd_client").__all__)
    bad = []
    for rel, text in _texts():
        for m in _PATH.finditer(text):
            if not (ROOT / m.group(1)).exists() and not m.group(1).startswith("tests/test_layout"):
                bad.append(f"{rel}: {m.group(1)}")
        for line in text.splitlines():
            if "getLogger(" in line or "logger=" in line or "at_level(" in line:
                continue
            for m in _DOTTED.finditer(line):
                pkg, name = m.groups()
                if name in _NOT_MODULES:
                    continue
                ok = (name in LAYERS or name in ("cli", "__version__", "__main__", "__init__") if pkg == "prefetchd"
                      else name in client_modules or name in client_names)
                if not ok:
                    bad.append(f"{rel}: {pkg}.{name}")
    assert not bad, "stale names:\n" + "\n".join(sorted(set(bad)))
