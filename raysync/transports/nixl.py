"""The NIXL data path: Ray's tensor transport from trainer buffers into receiver buffers.

Lifecycle of one version (which side runs what):

- **trainer** (:class:`NixlTransport`, used by ``HubClient.push``): copy the
  weights into a set of flat uint8 bucket buffers (the one copy a version
  costs; the trainer may change its model right after), then
  ``ray.put([bucket], _tensor_transport="nixl")`` per bucket. Ray keeps a
  reference to each sent tensor until every ``ObjectRef`` to it is gone, so a
  buffer set is reused only after ``wait_tensor_freed`` says so (double
  buffering: the hub's ``keep`` versions plus those in flight).
- **hub**: unchanged; it forwards the refs.
- **receiver** (:meth:`NixlTransport.receive_into`, used by ``@synced_model``): both bucket
  sets of its :class:`~raysync.core.bound.BoundModel` are registered with NIXL
  once per layout; each version is received with ``set_target_for_ref``
  straight into the spare set (receiving is the copy) and then swapped in
  under the actor's write lock, so readers never see a partial version.

Receivers need no ``enable_tensor_transport``. The trainer's snapshot buffers live on
its GPU when its weights are all on one (host memory otherwise, or when the GPU lacks
room); a receiver's buffers live where its module does (a GPU module receives into device
memory). Each subscriber receives its own copy (no per-node sharing). Tested on CPU in CI
and on one H100 (``tests/integration/test_gpu.py``, BENCHMARKS.md: 2 GiB to a receiver on
the same GPU in 22 ms).

Example:
    >>> hub = raysync.connect(transport="nixl")
    >>> hub.push(model)          # receivers get it over NIXL
"""

from __future__ import annotations

import logging
import os
import time
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import ray
import torch

from raysync.core import codec
from raysync.core.bound import BoundModel
from raysync.core.layout import Manifest
from raysync.errors import SyncTimeoutError
from raysync.transports import registry
from raysync.transports.base import Reuse, Snapshot

__all__ = ["UCX_ENV", "NixlSnapshotPool", "NixlTransport", "register_for_life"]

logger = logging.getLogger(__name__)

UCX_ENV = {
    # Zero-copy GETs over CUDA IPC: NIXL's reads between processes on one GPU went
    # from 0.5 GB/s to 150 GB/s with it (ANCHORS.md). Harmless on CPU.
    "UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "y",
}
"""Environment raysync sets (unless already set) before a process first uses NIXL."""


def _prepare_ucx() -> None:
    # UCX reads its configuration when the NIXL agent starts, i.e. on first use in a process.
    for key, value in UCX_ENV.items():
        os.environ.setdefault(key, value)


class NixlSnapshotPool:
    """Trainer side: reusable, NIXL-registered snapshot buffers for one model.

    Args:
        max_sets: how many versions' buffers may exist at once; with all of
            them still referenced, :meth:`put` waits for the oldest.
        timeout: seconds to wait for a buffer set to be freed.

    Example:
        >>> pool = NixlSnapshotPool(max_sets=4)
        >>> refs = pool.put(tensors, manifest)
    """

    def __init__(self, *, max_sets: int = 4, timeout: float = 60.0) -> None:
        self.max_sets = max_sets
        self.timeout = timeout
        self._sets: list[_SnapshotSet] = []  # oldest first

    def _free_set(self, manifest: Manifest, device: torch.device) -> list[torch.Tensor]:
        from ray.experimental import wait_tensor_freed

        _prepare_ucx()
        key = (manifest.layout_hash, str(device))
        for i, snapshot_set in enumerate(self._sets):
            if snapshot_set.key == key and all(_is_free(b) for b in snapshot_set.buffers):
                self._sets.append(self._sets.pop(i))  # most recently used last
                return snapshot_set.buffers
        # Sets of old layouts (or devices) go: each one's NIXL registration goes with it
        # (register_for_life), once Ray has released the refs still reading it.
        self._sets = [s for s in self._sets if s.key == key]
        if len(self._sets) >= self.max_sets:
            oldest = self._sets[0].buffers
            t0 = time.monotonic()
            for buffer in oldest:
                remaining = self.timeout - (time.monotonic() - t0)
                try:
                    wait_tensor_freed(buffer, timeout=max(remaining, 0.0))
                except Exception as err:
                    raise SyncTimeoutError(
                        f"all {self.max_sets} NIXL snapshot buffer sets are still referenced after "
                        f"{self.timeout} s (receivers or the hub hold old versions); lower keep= or "
                        "raise max_sets"
                    ) from err
            self._sets.append(self._sets.pop(0))
            return oldest
        if device.type == "cuda" and not _fits(device, sum(manifest.bucket_nbytes)):
            logger.warning(
                "NIXL snapshot of %.2f GiB: too little free memory on %s for another set, so it goes "
                "to host memory (slower for receivers on GPUs); lower the hub's keep= to need fewer sets",
                sum(manifest.bucket_nbytes) / 2**30,
                device,
            )
            device = torch.device("cpu")
            key = (manifest.layout_hash, "cpu")
        snapshot_set = _SnapshotSet(key, codec.allocate(manifest, device=device))
        register_for_life(snapshot_set.buffers, snapshot_set)  # once per buffer: later puts skip it
        self._sets.append(snapshot_set)
        logger.debug("new NIXL snapshot set for layout %s on %s (%d in pool)", *key, len(self._sets))
        return snapshot_set.buffers

    def release(self) -> int:
        """Drop the buffer sets no ref reads any more (their NIXL registrations end with them); the
        sets still read (versions the hub keeps) stay, reused as before. The sets left."""
        self._sets = [s for s in self._sets if not all(_is_free(b) for b in s.buffers)]
        return len(self._sets)

    def put(self, tensors: Mapping[str, torch.Tensor], manifest: Manifest) -> list[ray.ObjectRef]:
        """Copy ``tensors`` into a free buffer set and send one NIXL object per bucket.

        The set lives where the weights do: on their GPU when they all are on one (a
        device-to-device snapshot; receivers on that GPU read it over CUDA IPC) and it leaves as
        much again free there, else in host memory. A set is reused once Ray has released
        every ref to it: about ``keep`` + 1 sets exist, each the size of the model.
        """
        buffers = self._free_set(manifest, _device_of(tensors))
        codec.write(tensors, manifest, buffers)
        if buffers and buffers[0].is_cuda:
            torch.cuda.synchronize(buffers[0].device)  # the snapshot is whole before anyone reads it
        return [ray.put([buffer], _tensor_transport="nixl") for buffer in buffers]


class _SnapshotSet:
    """One version's worth of snapshot buffers (``key``: layout hash and device)."""

    def __init__(self, key: tuple[str, str], buffers: list[torch.Tensor]) -> None:
        self.key = key
        self.buffers = buffers


def _device_of(tensors: Mapping[str, torch.Tensor]) -> torch.device:
    devices = {t.device for t in tensors.values()}
    if len(devices) == 1:
        (device,) = devices
        if device.type == "cuda":
            return device
    return torch.device("cpu")


def _fits(device: torch.device, nbytes: int) -> bool:
    """Whether ``nbytes`` more leave at least as much again free on ``device`` (the trainer's GPU
    is for training: a snapshot set never takes the last of it)."""
    free, _ = torch.cuda.mem_get_info(device)
    return free >= 2 * nbytes


def register_for_life(buffers: Sequence[torch.Tensor], owner: object) -> None:
    """Register ``buffers`` with NIXL until ``owner`` is garbage-collected, then deregister them.

    Ray keys a registration by the memory's address and keeps one made by
    ``register_nixl_memory`` until ``deregister_nixl_memory``. Memory freed while still
    registered, then allocated again at the same address, is read and written through the
    stale registration: on a GPU machine, receivers of a second hub in the same trainer
    process got zeros, reported as applied. So every registration raysync makes ends with
    the buffers' owner (a snapshot set, a receiver's bound model).
    """
    from ray.experimental import register_nixl_memory

    for buffer in buffers:
        register_nixl_memory(buffer)
    weakref.finalize(owner, _deregister, tuple(buffers))


def _deregister(buffers: tuple[torch.Tensor, ...]) -> None:
    try:
        from ray.experimental import deregister_nixl_memory

        for buffer in buffers:
            deregister_nixl_memory(buffer)
    except Exception as err:  # at interpreter exit, or Ray shut down: nothing left to read them
        logger.debug("NIXL deregistration skipped: %s", err)


class NixlTransport:
    """The NIXL data path, both sides: the trainer keeps one buffer pool per model (whole versions
    only); receivers receive in place (:meth:`receive_into`)."""

    name = "nixl"
    info = registry.info("nixl")

    @staticmethod
    def receive_into(
        bound: BoundModel,
        refs: Sequence[ray.ObjectRef],
        ids: Sequence[str | None],
        *,
        timeout: float,
        extra_state: Sequence[tuple[str, bytes]] = (),
    ) -> int:
        """Receiver side: fetch the buckets the spare set lacks straight into it; returns bytes received.

        The caller then swaps (``bound.swap()``) under its write lock; ``extra_state``
        (the version's ``Manifest.extra_state``) is set by that swap.
        """
        from ray.experimental import set_target_for_ref

        _prepare_ucx()
        if not getattr(bound, "_nixl_registered", False):
            register_for_life((*bound.buffers(), *bound.buffers(spare=True)), bound)
            bound._nixl_registered = True  # type: ignore[attr-defined]
        spare = bound.buffers(spare=True)
        needed = bound.needed(ids, staging=True)
        for b in needed:
            set_target_for_ref(refs[b], [spare[b]])
        received: Any = ray.get([refs[b] for b in needed], timeout=timeout)
        for b, (tensor,) in zip(needed, received, strict=True):
            if tensor.data_ptr() != spare[b].data_ptr():  # not received in place: copy it there
                spare[b].copy_(tensor)
        bound.mark_staged(needed, ids, extra_state=extra_state)
        return sum(bound.manifest.bucket_nbytes[b] for b in needed)

    def __init__(self) -> None:
        self._pools: dict[str, NixlSnapshotPool] = {}

    def close(self) -> None:
        """Release every pool's buffer sets no version being read uses (:meth:`NixlSnapshotPool.release`)."""
        self._pools = {model_id: pool for model_id, pool in self._pools.items() if pool.release()}

    def snapshot(
        self,
        model_id: str,
        tensors: Mapping[str, torch.Tensor],
        manifest: Manifest,
        *,
        checksum: bool = False,
        reuse: Reuse | None = None,
    ) -> Snapshot:
        if checksum or reuse is not None:
            raise ValueError("transport='nixl' sends whole versions: drop keys=, delta= and checksum=")
        manifest = manifest.with_transport("nixl")
        refs = self._pools.setdefault(model_id, NixlSnapshotPool()).put(tensors, manifest)
        nbytes = sum(manifest.bucket_nbytes)
        # The pool reuses a buffer set once Ray released every ref to it: the pusher keeps none.
        stats = {"transport": "nixl", "bytes_snapshot": nbytes}
        return Snapshot(manifest, refs, 0, len(refs), keep_locally=False, stats=stats)


def _is_free(buffer: torch.Tensor) -> bool:
    from ray.experimental import wait_tensor_freed

    try:
        wait_tensor_freed(buffer, timeout=0)
    except Exception:
        return False
    return True
