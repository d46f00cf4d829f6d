"""Shared-memory snapshots that workers point into: a new version becomes visible only when sent.

Like :mod:`raysync.channels.pipe` (pipes for signals, a shared-memory
snapshot for bytes, written once for all workers), but the worker does not
copy: on receiving a version it re-points its parameters and buffers at the
snapshot set (the ``Parameter`` objects stay the same) and acks. The sender
writes each version into a set that no worker points at, so workers never see
the trainer's live parameters, nor a version half-written: they see version
*k* from the moment they receive it until they receive the next.

Which side runs what: the sender writes the snapshot (``SnapshotPool.write``)
and calls ``send_weights_async`` / ``wait_ack``; the worker calls
``receive_snapshot`` (zero copy; what :class:`raysync.schemes.WeightReceiver`
uses) or ``receive_weights`` (a private copy, the protocol's call) and
``send_ack``. Worker models must not be written in place: they share memory.

Example:
    >>> scheme = raysync.schemes.SharedMemWeightSyncScheme()
    >>> scheme.init_on_sender(model_id="policy", pipes=[parent_end])  # doctest: +SKIP
"""

from __future__ import annotations

from raysync.channels.pipe import MPTransport

__all__ = ["SharedMemTransport"]


class SharedMemTransport(MPTransport):
    """One worker's pipe; the worker's model points into the shared snapshot it was sent.

    Args:
        pipe_connection: this side's end of a ``multiprocessing.Pipe``.
        timeout: default seconds :meth:`wait_ack` waits.

    Example:
        >>> t = SharedMemTransport(parent_end, timeout=30)  # doctest: +SKIP
        >>> t.send_weights("policy", model)  # doctest: +SKIP
    """

    keeps_snapshot = True
