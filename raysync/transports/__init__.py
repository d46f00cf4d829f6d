"""The hub's data paths for a version's bytes, behind one interface (:mod:`.base`).

- :mod:`.object_store` (default): buckets ``ray.put`` once by the trainer; receivers
  read them zero-copy from their node's object store (:mod:`.store_pages` maps the
  store into a process once).
- :mod:`.nixl`: Ray's tensor transport, from the trainer's snapshot buffers straight
  into the receivers' registered buffers.

Pick one per push with ``hub.push(..., transport=...)`` or per client with
``raysync.connect(..., transport=...)``. Per-worker links (pipes, RPC,
torch.distributed) are :mod:`raysync.channels`.
"""

from raysync.transports.base import TRANSPORTS

__all__ = ["TRANSPORTS"]
