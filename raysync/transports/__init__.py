"""The hub's data paths for a version's bytes, behind one interface (:mod:`.base`).

- :mod:`.object_store` (default): buckets ``ray.put`` once by the trainer; receivers
  read them zero-copy from their node's object store (:mod:`.store_pages` maps the
  store into a process once).
- :mod:`.nixl`: Ray's tensor transport, from the trainer's snapshot buffers straight
  into the receivers' registered buffers.
- :mod:`.doorbell`: the node-local hop of small versions, from a relay (or the hub)
  to the subscriber processes of its node: shared memory and a doorbell per process.

Pick one per push with ``hub.push(..., transport=...)`` or per client with
``raysync.connect(..., transport=...)``. Per-worker links (pipes, RPC,
torch.distributed) are :mod:`raysync.channels`.
"""

# From the registry, which imports no torch: the hub's process imports the doorbell from here.
from raysync.transports.registry import TRANSPORTS

__all__ = ["TRANSPORTS"]
