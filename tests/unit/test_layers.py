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


def test_the_hub_imports_no_torch_and_nothing_of_the_trainers_side() -> None:
    assert _layers().hub_offences() == []


def test_the_check_finds_torch_reached_from_the_hub_and_a_hub_module_using_the_client(
    tmp_path: pathlib.Path,
) -> None:
    layers = _layers()
    tree = tmp_path / "raysync"
    shutil.copytree(ROOT / "raysync", tree)
    (tree / "core" / "heavy.py").write_text("import torch\n")
    (tree / "hub" / "uses_heavy.py").write_text("from raysync.core import heavy\n")
    (tree / "hub" / "lazy_torch.py").write_text("def f():\n    import torch\n")  # at call time only: allowed
    (tree / "hub" / "calls_client.py").write_text(
        "def f():\n    pass\n\nfrom raysync.client.push import push\n"
    )
    found = layers.hub_offences(tree)
    assert any("the hub imports torch: raysync.core.heavy <- raysync.hub.uses_heavy" in f for f in found), (
        found
    )
    assert any("raysync.hub.calls_client imports raysync.client.push" in f for f in found), found
    assert not any("lazy_torch" in f for f in found), found


def test_the_check_finds_an_upward_import_and_a_lazy_cycle(tmp_path: pathlib.Path) -> None:
    layers = _layers()
    tree = tmp_path / "raysync"
    shutil.copytree(ROOT / "raysync", tree)
    (tree / "core" / "bad.py").write_text("from raysync.client.hub_client import HubClient\n")
    (tree / "hub" / "loop_a.py").write_text("def f():\n    from raysync.hub import loop_b\n")
    (tree / "hub" / "loop_b.py").write_text("import raysync.hub.loop_a\n")
    found = layers.offences(tree)
    assert any(
        "upward import: raysync.core.bad (core) imports raysync.client.hub_client (client)" in f
        for f in found
    )
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


def test_no_module_over_500_lines_and_a_readme_that_stays_a_front_page() -> None:
    over = {
        str(path.relative_to(ROOT)): n
        for path in (ROOT / "raysync").rglob("*.py")
        if (n := len(path.read_text().splitlines())) > 500
    }
    assert over == {}, f"modules over 500 lines: {over}"
    readme = len((ROOT / "README.md").read_text().splitlines())
    assert readme <= 250, f"README.md has {readme} lines: at most 250, details go in docs/"
