"""Data paths for a version's bytes, one module each.

- ``object_store`` (built in, see :mod:`raysync.weights` and :mod:`raysync.hub`):
  buckets are lists of uint8 arrays ``ray.put`` once by the trainer; receivers
  read them zero-copy from their node's object store.
- :mod:`raysync.transports.nixl`: buckets are flat tensors sent by Ray's tensor
  transport (NIXL) straight from the trainer's snapshot buffers into the
  receivers' registered buffers.

Pick one per push with ``hub.push(..., transport=...)`` or per client with
``raysync.connect(..., transport=...)``.
"""

TRANSPORTS = ("object_store", "nixl")

__all__ = ["TRANSPORTS"]
