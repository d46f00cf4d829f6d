"""Per-worker point-to-point links (torchrl's transports): pipe, shared memory, RPC, torch.distributed.

Each moves a version packed by the one codec (:mod:`raysync.core.codec`) to one
worker: ``pipe`` and ``shared_mem`` to processes, ``rpc`` and ``distributed`` to
torch.distributed ranks. The hub's own data paths are :mod:`raysync.transports`.
"""
