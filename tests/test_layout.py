"""The package layout is the architecture: each layer imports only the layers below it.

format < core < sources < executors < daemon < tools < the top level (cli); the client (``prefetchd_client``,
in ``client/``) imports only ``format`` and ``core``. Checked on the source (every import
statement, also those inside functions), so a violation fails here before it ships.
"""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
LAYERS = ["format", "core", "sources", "executors", "daemon", "tools"]
MAX_LINES = 600


def _modules():
    for path in sorted((ROOT / "prefetchd").rglob("*.py")):
        rel = path.relative_to(ROOT).with_suffix("")
        yield path, ".".join(p for p in rel.parts if p != "__init__")
    for path in sorted((ROOT / "client").glob("*.py")):
        yield path, "prefetchd_client" + ("" if path.stem == "__init__" else "." + path.stem)


def _imports(path: pathlib.Path, module: str, runtime_only: bool = False) -> set[str]:
    """The ``prefetchd`` and ``prefetchd_client`` names ``module`` imports (also inside functions);
    with ``runtime_only``, less those under ``if TYPE_CHECKING:`` (type hints, never executed)."""
    package = module if path.stem == "__init__" else module.rpartition(".")[0]
    found = set()
    todo = [ast.parse(path.read_text(), str(path))]
    while todo:
        node = todo.pop()
        if runtime_only and isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            todo.extend(node.orelse)
            continue
        todo.extend(ast.iter_child_nodes(node))
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


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import graph's strongly connected components of more than one module (Tarjan's)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _import_graph() -> dict[str, set[str]]:
    mods = dict((m, p) for p, m in _modules())
    return {m: {t for t in _imports(p, m, runtime_only=True) if t in mods and t != m} for m, p in mods.items()}


def test_no_import_cycle_among_the_modules_outside_type_checking():
    """A cycle (also through an import inside a function) makes the import order matter and hides
    which module is the lower one; an import under ``if TYPE_CHECKING:`` never runs and is fine."""
    cycles = _cycles(_import_graph())
    assert not cycles, f"import cycles: {cycles}"


def test_the_cycle_checker_sees_a_lazy_import_cycle_and_skips_type_checking_imports(tmp_path):
    a, b = tmp_path / "a.py", tmp_path / "b.py"
    a.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from prefetchd.tools.fake_b import B\n")
    b.write_text("def f():\n    from prefetchd.tools.fake_a import A\n")
    graph = {"prefetchd.tools.fake_a": set(), "prefetchd.tools.fake_b": set()}
    for path, m in ((a, "prefetchd.tools.fake_a"), (b, "prefetchd.tools.fake_b")):
        graph[m] = {t for t in _imports(path, m, runtime_only=True) if t in graph and t != m}
    assert graph == {"prefetchd.tools.fake_a": set(), "prefetchd.tools.fake_b": {"prefetchd.tools.fake_a"}} and _cycles(graph) == []
    graph["prefetchd.tools.fake_a"].add("prefetchd.tools.fake_b")  # the same import outside TYPE_CHECKING
    assert _cycles(graph) == [["prefetchd.tools.fake_a", "prefetchd.tools.fake_b"]]


def test_the_daemons_helpers_read_only_its_public_attributes():
    """report.py and teardown.py (split out of the loop for the 600-line bound) take what they need
    through the Daemon's public attributes and accessors, never its private fields nor by name."""
    bad = []
    for name in ("report.py", "teardown.py"):
        for n in ast.walk(ast.parse((ROOT / "prefetchd" / "daemon" / name).read_text())):
            if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "d" \
                    and n.attr.startswith("_"):
                bad.append(f"{name}:{n.lineno}: d.{n.attr}")
            if isinstance(n, ast.Call) and getattr(n.func, "id", "") in ("getattr", "hasattr", "setattr") \
                    and n.args and getattr(n.args[0], "id", "") == "d":
                bad.append(f"{name}:{n.lineno}: {n.func.id}(d, ...)")
    assert not bad, bad


_PATH = re.compile(r"(?<![\w/.])((?:prefetchd|client|tests|examples|systemd)/[\w/]+\.(?:py|service|mount))")
_DOTTED = re.compile(r"(?<![\w.])(prefetchd(?:_client)?)\.([a-z_]\w*)")
_NOT_MODULES = {"yaml", "service", "mount", "conf", "log", "lock", "json", "sock"}  # file names, not modules


def _docs() -> list[str]:
    """The user's and contributor's pages: the README, CONTRIBUTING.md and docs/*.md."""
    return ["README.md", "CONTRIBUTING.md", *(str(p.relative_to(ROOT)) for p in sorted((ROOT / "docs").glob("*.md")))]


def _texts():
    for rel in (*_docs(), "BENCHMARKS.md", "config.example.yaml"):
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


def test_each_docs_page_opens_with_what_it_is_for_and_the_readme_stays_short():
    """docs/*.md: a title, then one sentence saying what the page is for; the README is a first hour
    (under 250 lines) whose table of where to go next names every docs page."""
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) < 250, len(readme.splitlines())
    pages = sorted((ROOT / "docs").glob("*.md"))
    assert pages
    for page in pages:
        paras = [p.strip() for p in page.read_text().split("\n\n") if p.strip()]
        assert paras[0].startswith("# ") and "\n" not in paras[0], f"{page.name}: no title line"
        first = paras[1]
        assert first[0].isalpha() and first.endswith(".") and not first.startswith(("- ", "|", "```")), \
            f"{page.name}: the first paragraph is not a sentence saying what the page is for: {first[:80]!r}"
        assert f"docs/{page.name}" in readme, f"the README's table of where to go next does not name docs/{page.name}"


def test_every_module_that_uses_a_bucket_server_shares_one_worker():
    """`make test`'s workers each start the S3 server and the GCS emulator their tests ask for
    (session fixtures): a module using them that `conftest._ONE_WORKER` does not put in the
    "buckets" group starts them again on another worker, unseen."""
    import conftest

    servers = {"s3", "s3_env", "s3_proxy", "gcs", "gcs_env"}
    using = set()
    for path in sorted(pathlib.Path(__file__).parent.glob("test_*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.FunctionDef) and servers & {a.arg for a in node.args.args}:
                using.add(path.stem)
                break
    assert using and all(conftest._ONE_WORKER.get(m) == "buckets" for m in using), \
        sorted(m for m in using if conftest._ONE_WORKER.get(m) != "buckets")
