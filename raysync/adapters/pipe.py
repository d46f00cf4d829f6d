"""``PipeAdapter``: K worker processes fed through pipes and one shared-memory copy."""

from __future__ import annotations

import functools
from typing import Any

from raysync.adapters._workers import _pipe_end
from raysync.adapters.base import _Adapter, _Receiver
from raysync.channels.pipe import MPTransport, SnapshotPool
from raysync.core.codec import unpack
from raysync.core.layout import Manifest
from raysync.errors import RaySyncError

__all__ = ["PipeAdapter"]


class PipeAdapter(_Adapter):
    """K worker processes fed through pipes (signals) and one shared-memory copy per version (bytes).

    Each worker runs ``fn(receiver, *args)``; ``receiver`` is a
    :class:`raysync.schemes.WeightReceiver` whose model is ``model_factory()``
    (reach it as ``receiver.model``); call ``receiver.receive(timeout)`` in the
    worker's loop to apply a version whole when one has arrived. ``fn``,
    ``args`` and ``model_factory`` must pickle with ``start_method="spawn"`` (the default forks).

    Args:
        fn: the worker loop, ``fn(receiver, *args)``.
        args: more arguments for ``fn``.
        model_factory: builds the worker's model.
        num_receivers: how many worker processes.
        model_id: which model on the hub.
        hub: the hub's name.
        namespace: the hub's namespace.
        timeout: seconds a receiver may take to ack a version (then it is
            reported as failed for that version).
        name: a name for logs and status.

    Create it as an actor with :func:`start` or :func:`for_placement_group`.

    Example:
        >>> adapter = raysync.adapters.start("pipe", worker_loop, model_factory=make_policy, num_receivers=4)
        >>> ray.get(adapter.receivers.remote())  # doctest: +SKIP
    """

    kind = "pipe"

    def _start_receivers(self, count: int) -> None:
        self._pool = SnapshotPool()
        for i in range(count):
            parent, child = self._mp.Pipe()
            transport = MPTransport(parent, timeout=self.timeout)
            self._add_receiver(i, f"{self.name}/pipe-{i}", functools.partial(_pipe_end, child), transport)
            child.close()

    def _fan_out(
        self, model_id: str, version: int, manifest: Manifest, buckets: list[Any], live: list[_Receiver]
    ) -> None:
        # The one copy of the version on this side: object store -> shared memory.
        snapshot = self._pool.write(unpack(manifest, buckets), manifest)
        self._send_all(model_id, version, snapshot, live)

    def _failed(self, r: _Receiver, version: int, err: RaySyncError, *, sent: bool) -> None:
        self._check(r, version, err)
        if not sent or r.state == "dead":
            self._pool.forget(r.transport.reader)  # the snapshot sets it held may be reused
