"""The torchrl-style API under its earlier name: every name here is :mod:`raysync.torchrl`'s.

Example:
    >>> from raysync import schemes
    >>> schemes.MultiProcessWeightSyncScheme is raysync.torchrl.MultiProcessWeightSyncScheme
    True
"""

from typing import Any

from raysync import torchrl as _torchrl

__all__ = list(_torchrl.__all__)


def __getattr__(name: str) -> Any:
    # The same objects, one layer: raysync.torchrl (torchrl itself is imported only for
    # HubWeightSyncScheme, on first use).
    return getattr(_torchrl, name)
