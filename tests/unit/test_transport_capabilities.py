"""What a data path can do is its ``TransportInfo``: nothing outside raysync/transports/ compares names."""

from __future__ import annotations

import ast
import pathlib
import sys
import types

import pytest

from raysync.errors import RaySyncError
from raysync.transports import registry

ROOT = pathlib.Path(__file__).resolve().parents[2] / "raysync"


def _name_comparisons(path: pathlib.Path) -> list[str]:
    """``x == "object_store"``-like comparisons (and ``in ("nixl", ...)``) with a data path's name."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Compare):
            continue
        operands = [node.left, *node.comparators]
        names = [o.value for o in operands if isinstance(o, ast.Constant) and o.value in registry.BUILTIN]
        for o in operands:
            if isinstance(o, (ast.Tuple, ast.List, ast.Set)):
                names += [
                    e.value for e in o.elts if isinstance(e, ast.Constant) and e.value in registry.BUILTIN
                ]
        if names:
            found.append(f"{path.relative_to(ROOT.parent)}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_module_outside_the_transports_compares_a_data_paths_name() -> None:
    outside = [p for p in ROOT.rglob("*.py") if "transports" not in p.relative_to(ROOT).parts]
    found = [line for p in outside for line in _name_comparisons(p)]
    assert found == [], "ask registry.info(name) for a capability instead:\n" + "\n".join(found)


def test_the_check_finds_a_name_comparison(tmp_path: pathlib.Path) -> None:
    bad = tmp_path / "raysync" / "client" / "bad.py"
    bad.parent.mkdir(parents=True)
    bad.write_text('def f(t):\n    return t.name == "nixl" or t in ("sharded",)\n')
    global ROOT
    saved, ROOT = ROOT, tmp_path / "raysync"
    try:
        assert len(_name_comparisons(bad)) == 2
    finally:
        ROOT = saved


def test_a_data_path_that_says_it_receives_in_place_must_have_receive_into(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    module = types.ModuleType("raysync_test_inplace_path")

    class HalfInPlace:
        name = "raysync_test_inplace_path:HalfInPlace"
        info = registry.TransportInfo(name, in_place=True)

    module.HalfInPlace = HalfInPlace  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, module.__name__, module)
    with pytest.raises(ValueError, match="in_place=True but has no receive_into"):
        registry.transport_class(HalfInPlace.name)


def test_what_each_built_in_path_allows() -> None:
    store, nixl, sharded = (registry.info(n) for n in ("object_store", "nixl", "sharded"))
    assert (store.pushable, store.object_store, store.rank_pieces, store.in_place) == (
        True,
        True,
        True,
        False,
    )
    assert (nixl.pushable, nixl.object_store, nixl.rank_pieces, nixl.in_place) == (True, False, False, True)
    assert (sharded.pushable, sharded.object_store, sharded.rank_pieces) == (False, True, False)
    assert registry.DEFAULT == "object_store"


def _raise_only_methods(path: pathlib.Path) -> list[str]:
    """Methods of the classes in ``path`` whose body (past a docstring) is one ``raise``."""
    found = []
    for cls in ast.walk(ast.parse(path.read_text())):
        if not isinstance(cls, ast.ClassDef):
            continue
        for fn in cls.body:
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            body = fn.body[1:] if fn.body and isinstance(fn.body[0], ast.Expr) else fn.body
            if len(body) == 1 and isinstance(body[0], ast.Raise):
                found.append(f"{path.name}: {cls.name}.{fn.name}")
    return found


def test_no_data_path_has_a_method_that_only_raises() -> None:
    """A path lacks what it cannot do (NIXL has no ``fetch``); the registry says why, for every path."""
    modules = [ROOT / "transports" / f"{name}.py" for name in registry.BUILTIN]
    assert [m for m in modules if m.exists()] == modules
    assert [found for m in modules for found in _raise_only_methods(m)] == []
    assert registry.fetcher("object_store") is registry.transport_class("object_store").fetch
    with pytest.raises(RaySyncError, match=r"came over 'nixl', which receives in place.*object_store"):
        registry.fetcher("nixl")


def test_the_check_finds_a_method_that_only_raises(tmp_path: pathlib.Path) -> None:
    planted = tmp_path / "planted.py"
    planted.write_text(
        "class Path:\n    def fetch(self):\n        '''Not here.'''\n        raise RuntimeError('no')\n"
        "    def put(self):\n        return 1\n"
    )
    assert _raise_only_methods(planted) == ["planted.py: Path.fetch"]
