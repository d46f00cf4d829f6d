"""Every private use raysync makes of another library, each with why no public API serves.

One place, so that a new release of torch (or Ray) that changes one of them is
found here, by name. Each use is checked against the installed version when this
module is imported (a version compare, nothing more: torch is not imported for
it), and ``tests/unit/test_compat.py`` probes each one's behaviour on the
installed version and fails naming the use that changed.

Uses:

``torch.Tensor._version``
    The tensor's version counter: an integer that every in-place operation on
    the tensor (or on a view sharing its storage through autograd's view
    tracking) increments, and that nothing else changes. raysync reads it right
    after each apply and again on demand to tell, exactly and in O(#tensors)
    integer reads, whether user code changed a synced module's weights in place
    since (``raysync_modified_since()``). No public API gives it: hashing or
    comparing the bytes costs a pass over the weights, and a forward hook tells
    that a forward ran, not whether it wrote anything, and sees no write made
    outside ``forward`` (optimizer steps, ``copy_``).

Example:
    >>> import torch
    >>> from raysync import _compat
    >>> t = torch.zeros(3)
    >>> before = _compat.tensor_version(t)
    >>> _ = t.add_(1)
    >>> _compat.tensor_version(t) > before
    True
"""

from __future__ import annotations

import logging
import re
import sys
from collections.abc import Sequence
from importlib import metadata
from typing import Any

__all__ = ["TORCH_CHECKED", "TORCH_VERSION_COUNTER", "check_versions", "tensor_version", "version_counters"]

logger = logging.getLogger(__name__)

TORCH_VERSION_COUNTER = "torch.Tensor._version"
"""The name of the private torch attribute :func:`tensor_version` reads."""

TORCH_CHECKED = ((2, 4), (2, 13))
"""The torch releases (major, minor), first and last, whose ``Tensor._version`` was checked."""


def tensor_version(tensor: Any) -> int:
    """The version counter of ``tensor`` (``torch.Tensor._version``, private).

    Every in-place operation on the tensor increments it (``add_``, ``copy_``,
    ``torch._foreach_*_``, indexed assignment, ``+=``), under ``no_grad`` and
    ``inference_mode`` too; out-of-place operations and reads do not. Views
    made by slicing share their base's counter; a ``Parameter`` re-pointed
    with ``param.data = other`` keeps its own. Writes through ``tensor.data``
    (a new counter) or through raw memory (numpy views, ``data_ptr``) are not
    counted.

    Args:
        tensor: a ``torch.Tensor``.

    Returns:
        The counter's current value (it only grows).

    Example:
        >>> t = torch.zeros(2)
        >>> tensor_version(t.add_(1)) - tensor_version(torch.zeros(2))
        1
    """
    # Why private: no public torch API exposes the counter (see the module docstring).
    return int(tensor._version)


def version_counters(tensors: Sequence[Any]) -> list[int]:
    """:func:`tensor_version` of each of ``tensors``, in one pass (about 40 ns a tensor).

    Call it with torch functions of tensor subclasses disabled
    (``torch._C.DisableTorchFunctionSubclass``) where ``tensors`` may hold some:
    reading the counter goes through ``__torch_function__`` otherwise.

    Example:
        >>> version_counters([torch.zeros(1).add_(1), torch.zeros(1)])
        [1, 0]
    """
    # Why private: no public torch API exposes the counter (see the module docstring).
    return [t._version for t in tensors]


def _release(version: str) -> tuple[int, int] | None:
    match = re.match(r"(\d+)\.(\d+)", version)
    return (int(match.group(1)), int(match.group(2))) if match else None


def _torch_version() -> str | None:
    torch = sys.modules.get("torch")
    if torch is not None:
        return str(torch.__version__)
    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        return None


def check_versions(torch_version: str | None = None) -> list[str]:
    """The private uses whose library's installed version is outside the versions checked.

    Logs a warning for each (once per call); run at import with the installed
    versions.

    Args:
        torch_version: the torch version to check (default: the installed one).

    Returns:
        One line per use outside its checked versions (empty: all checked).

    Example:
        >>> check_versions("2.13.0+cpu")
        []
    """
    found = torch_version if torch_version is not None else _torch_version()
    release = _release(found) if found else None
    if release is None or TORCH_CHECKED[0] <= release <= TORCH_CHECKED[1]:
        return []
    first, last = (".".join(map(str, r)) for r in TORCH_CHECKED)
    line = (
        f"raysync reads {TORCH_VERSION_COUNTER} (to tell weights changed in place since an apply), "
        f"checked with torch {first} to {last}; torch {found} is installed: if it changed, "
        "tests/unit/test_compat.py fails naming it"
    )
    logger.warning("%s", line)
    return [line]


check_versions()
