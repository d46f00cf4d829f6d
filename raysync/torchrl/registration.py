"""Register raysync's torchrl-style schemes with torchrl's ``WeightSyncScheme`` ABC (torchrl not imported).

torchrl's collectors check ``isinstance(scheme, torchrl...WeightSyncScheme)``, an ABC:
raysync's base class is registered with it (``ABC.register``, torchrl's public way) as
soon as torchrl's module is loaded, in whichever order the two are imported: now, if
it is loaded; else by a one-shot import hook that runs right after torchrl's module.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import threading
from collections.abc import Sequence
from types import ModuleType
from typing import Any

__all__ = ["register_with_torchrl", "set_scheme_base"]

_BASE: list[type] = []  # raysync's WeightSyncScheme (set by raysync.torchrl.base)


def set_scheme_base(cls: type) -> None:
    """The class to register with torchrl's ABC (raysync's ``WeightSyncScheme``)."""
    _BASE[:] = [cls]


_TORCHRL_SCHEMES = "torchrl.weight_update.weight_sync_schemes"
_HOOK_LOCK = threading.Lock()
_REGISTERED = False


def _register(module: ModuleType) -> bool:
    global _REGISTERED
    abc_cls = getattr(module, "WeightSyncScheme", None)
    if abc_cls is None or not hasattr(abc_cls, "register"):
        return False
    if not _BASE:
        return False
    abc_cls.register(_BASE[0])  # subclasses of a registered class pass isinstance too
    _REGISTERED = True
    return True


class _RegisterAfterExec(importlib.abc.Loader):
    """Wraps torchrl's loader for its schemes module: registers raysync's schemes once it has run."""

    def __init__(self, loader: Any) -> None:
        self._loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        create: Any = getattr(self._loader, "create_module", None)
        return create(spec) if create is not None else None

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        _register(module)

    def __getattr__(self, name: str) -> Any:  # get_source, get_filename, ... as the real loader
        return getattr(self._loader, name)


class _TorchRLHook(importlib.abc.MetaPathFinder):
    """Finds nothing itself: when torchrl's schemes module is imported, registers raysync with it."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != _TORCHRL_SCHEMES:
            return None
        _remove_hook()
        spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = _RegisterAfterExec(spec.loader)
        return spec


_HOOK = _TorchRLHook()


def _remove_hook() -> None:
    with _HOOK_LOCK:
        if _HOOK in sys.meta_path:
            sys.meta_path.remove(_HOOK)


def register_with_torchrl(*, import_torchrl: bool = False) -> bool:
    """Make torchrl's collectors accept raysync's schemes (``isinstance`` of torchrl's ABC).

    Called by every scheme's constructor, so users never need to: if torchrl's
    ``weight_sync_schemes`` module is loaded, raysync's :class:`WeightSyncScheme`
    is registered with torchrl's ABC now; if not, once it is (a one-shot import
    hook), without importing torchrl.

    Args:
        import_torchrl: import torchrl now (if installed) and register.

    Returns:
        Whether raysync's schemes are registered with torchrl now.

    Example:
        >>> import torchrl.weight_update as tw
        >>> register_with_torchrl()
        True
        >>> isinstance(MultiProcessWeightSyncScheme(), tw.WeightSyncScheme)
        True
    """
    if _REGISTERED:
        return True
    module = sys.modules.get(_TORCHRL_SCHEMES)
    if module is None and import_torchrl:
        try:
            module = importlib.import_module(_TORCHRL_SCHEMES)
        except ImportError:
            return False
    if module is not None and hasattr(module, "WeightSyncScheme"):
        _remove_hook()
        return _register(module)
    with _HOOK_LOCK:
        if _HOOK not in sys.meta_path:
            sys.meta_path.insert(0, _HOOK)
    return False
