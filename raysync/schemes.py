"""The torchrl-style API under its earlier name: everything here is :mod:`raysync.torchrl`.

Example:
    >>> from raysync import schemes
    >>> schemes.MultiProcessWeightSyncScheme is raysync.torchrl.MultiProcessWeightSyncScheme
    True
"""

from raysync.torchrl import *  # noqa: F403  (the same names, one layer)
from raysync.torchrl import __all__ as __all__
