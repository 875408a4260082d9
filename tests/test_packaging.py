"""The wheel holds every package of the tree: ``pyproject.toml`` lists packages by hand, and a new
sub-package left off the list installs a ``prefetchd`` that cannot import itself (``pip install .``:
``No module named 'prefetchd.core.augment'``), which an editable install never shows."""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_every_package_of_the_tree_is_in_the_wheel():
    text = (ROOT / "pyproject.toml").read_text()  # no tomllib before Python 3.11
    listed = set(re.findall(r'"([\w.]+)"', re.search(r"^packages = \[(.*?)\]", text, re.M | re.S).group(1)))
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "prefetchd").rglob("__init__.py")}
    found.add("prefetchd_client")
    assert found <= listed, f"packages missing from pyproject.toml's [tool.setuptools] packages: {sorted(found - listed)}"
