"""The layers are enforced, not described: no import cycle, no upward import, and the docs agree."""

from __future__ import annotations

import importlib.util
import pathlib
import re
import shutil
from types import ModuleType

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _layers() -> ModuleType:
    spec = importlib.util.spec_from_file_location("layers", ROOT / ".ci" / "layers.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_tree_has_no_cycle_and_no_upward_import() -> None:
    assert _layers().offences() == []


def test_the_check_finds_an_upward_import_and_a_lazy_cycle(tmp_path: pathlib.Path) -> None:
    layers = _layers()
    tree = tmp_path / "raysync"
    shutil.copytree(ROOT / "raysync", tree)
    (tree / "core" / "bad.py").write_text("from raysync.hub.client import HubClient\n")
    (tree / "hub" / "loop_a.py").write_text("def f():\n    from raysync.hub import loop_b\n")
    (tree / "hub" / "loop_b.py").write_text("import raysync.hub.loop_a\n")
    found = layers.offences(tree)
    assert any("upward import: raysync.core.bad (core) imports raysync.hub.client (hub)" in f for f in found)
    assert any("import cycle" in f and "raysync.hub.loop_a" in f and "raysync.hub.loop_b" in f for f in found)


def test_the_architecture_page_lists_every_module_and_only_those() -> None:
    page = (ROOT / "docs" / "architecture.md").read_text()
    listed = set(re.findall(r"^\| `(raysync/[^`]+\.py)` \|", page, flags=re.MULTILINE))
    actual = {str(p.relative_to(ROOT)) for p in (ROOT / "raysync").rglob("*.py")}
    assert sorted(actual - listed) == [], "modules missing from docs/architecture.md's layout table"
    assert sorted(listed - actual) == [], "docs/architecture.md lists modules that are gone"


def test_the_architecture_page_states_the_layers_of_the_check() -> None:
    page = (ROOT / "docs" / "architecture.md").read_text()
    rows = re.findall(r"^\| (\d+) \| ([^|]+) \| [^|]+ \|$", page, flags=re.MULTILINE)
    stated = [{name.strip(" `/") for name in names.split(",")} for _, names in rows]
    assert stated == _layers().LAYERS, "docs/architecture.md's layer table differs from .ci/layers.py"
