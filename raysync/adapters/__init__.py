"""Adapters: receivers that are not Ray actors of their own, fed from one hub subscriber.

An adapter is a Ray actor placed in the placement-group bundle (or node) of the
receivers it feeds: it subscribes to the hub once, fetches each version once and
fans it out locally, over pipes (:class:`PipeAdapter`), a gloo broadcast
(:class:`DistributedAdapter`) or torch.distributed.rpc (:class:`RPCAdapter`).

Example:
    >>> pipes = raysync.adapters.for_placement_group(pg, "pipe", fn=worker_loop,
    ...                                               model_factory=make_policy, num_receivers=4)
"""

from raysync.adapters.base import KINDS
from raysync.adapters.distributed import DistributedAdapter
from raysync.adapters.launch import for_placement_group, start
from raysync.adapters.pipe import PipeAdapter
from raysync.adapters.placement import placement_group_of, placement_of
from raysync.adapters.rpc import RPCAdapter

__all__ = [
    "KINDS",
    "DistributedAdapter",
    "PipeAdapter",
    "RPCAdapter",
    "for_placement_group",
    "placement_group_of",
    "placement_of",
    "start",
]
