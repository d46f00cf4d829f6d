"""Adapters: Ray actors that feed receivers which are not Ray actors of their own.

Worker subprocesses of a collector, ranks of a torch.distributed group (an
inference engine's tensor-parallel ranks) cannot subscribe to the hub
themselves. An adapter is a Ray actor placed in the same placement-group
bundle as the receivers it feeds. It subscribes to the hub ONCE (the hub sees
one subscriber), fetches each version's buckets from the object store once
(``ray.get``, zero-copy on its node) and fans the version out locally:

- :class:`PipeAdapter` starts K worker processes running ``fn(receiver, *args)``
  where ``receiver`` is a :class:`raysync.schemes.WeightReceiver` on a
  :class:`raysync.transports.pipe.MPTransport`: one copy of each version into
  shared memory, pipes for the signals, each worker copies out and acks.
- :class:`DistributedAdapter` is rank 0 of a gloo group with K worker
  processes (same ``fn(receiver, *args)``); signals go through the group's
  TCPStore (:class:`raysync.transports.distributed.DistributedTransport`
  mailboxes), bytes as ONE ``broadcast`` per bucket per version.
- :class:`RPCAdapter` is rank 0 of a ``torch.distributed.rpc`` group with K
  RPC worker processes: signals by RPC, bytes by torch.distributed send/recv
  (:class:`raysync.transports.rpc.RPCTransport`).

Each receiver applies versions whole and in order; the adapter replies to the
hub only once every receiver acked (or failed, or timed out). The reply names
every receiver (``hub.status()["subscribers"][i]["receivers"]``). A receiver
whose process died is reported and dropped; a dead adapter is dropped by the
hub like any dead subscriber; neither blocks the next push.

Lifecycle (which side runs what): :func:`start` / :func:`for_placement_group`
(driver) create adapter actors; the adapter's ``__init__`` starts its worker
processes and registers with the hub; the hub calls ``_raysync_notify`` for
each version; workers run the user's ``fn``, calling ``receiver.receive(timeout)``
in their loop.

Example:
    >>> pg = ray.util.placement_group([{"CPU": 1}, {"CPU": 1}])
    >>> adapters = raysync.adapters.for_placement_group(
    ...     pg, "pipe", fn=worker_loop, model_factory=make_policy, num_receivers=4
    ... )  # doctest: +SKIP
    >>> hub.push(policy, wait=True, timeout=60)  # every worker process holds it  # doctest: +SKIP
"""

from __future__ import annotations

import datetime
import functools
import logging
import multiprocessing
import os
import pickle
import re
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import ray
import torch

from raysync._checks import check_timeout
from raysync.errors import ApplyError, RaySyncError, SyncTimeoutError
from raysync.hub import DEFAULT_HUB, DEFAULT_NAMESPACE, get_hub_actor
from raysync.transports.base import DEFAULT_TIMEOUT
from raysync.weights import Manifest, unpack

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

logger = logging.getLogger(__name__)

Kind = Literal["pipe", "distributed", "rpc"]
KINDS: tuple[str, ...] = ("pipe", "distributed", "rpc")
"""The adapter kinds :func:`start` and :func:`for_placement_group` build."""

_HEARTBEAT_S = 2.0
_BUNDLE_RESOURCE = re.compile(r"_group_(\d+)_([0-9a-f]+)$")


def _actor_record(actor_id: str) -> Any:
    """The GCS actor-table entry of an actor (placement group id, resources with bundle indices)."""
    from ray._private import state
    from ray.core.generated import gcs_pb2

    raw = state.state._connect_and_get_accessor().get_actor_info(ray.ActorID.from_hex(actor_id))
    return None if raw is None else gcs_pb2.ActorTableData.FromString(raw)  # type: ignore[attr-defined]


def _bundle_of(resources: Any, pg_id: str | None) -> int | None:
    for name in resources:
        match = _BUNDLE_RESOURCE.search(name)
        if match and (pg_id is None or match.group(2) == pg_id):
            return int(match.group(1))
    return None


def placement_of() -> dict[str, Any]:
    """Where the calling process runs: node id, placement group id, bundle index, pid.

    Read inside the process itself (an adapter actor calls it in ``__init__``):
    the node and placement group from the runtime context, the bundle index
    from the bundle resources the GCS assigned to this actor
    (``CPU_group_<index>_<pg id>``); ``None`` where unknown (outside a
    placement group, or placed with ``bundle_index=-1``).

    Example:
        >>> raysync.adapters.placement_of()["node_id"]  # doctest: +SKIP
        'a1b2...'
    """
    ctx = ray.get_runtime_context()
    pg_id = ctx.get_placement_group_id()
    bundle: int | None = None
    actor_id = ctx.get_actor_id()
    if pg_id is not None and actor_id is not None:
        try:
            record = _actor_record(actor_id)
            bundle = None if record is None else _bundle_of(record.required_resources, pg_id)
        except Exception as err:  # private GCS API: never fail the adapter over it
            logger.debug("could not read the bundle index: %s", err)
    return {
        "node_id": ctx.get_node_id(),
        "placement_group_id": pg_id,
        "bundle_index": bundle,
        "pid": os.getpid(),
    }


# ---------------------------------------------------------------------- worker processes


def _watch_parent(parent: int) -> None:
    """Exit when the adapter that started this worker is gone (it may have been killed)."""
    import signal

    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # not the Ray worker's handler, inherited by fork

    def loop() -> None:
        while True:
            time.sleep(0.5)
            if os.getppid() != parent:
                os._exit(0)

    threading.Thread(target=loop, name="raysync-parent-watch", daemon=True).start()


def _run_user_fn(receiver: Any, fn: Callable[..., Any], args: Sequence[Any], name: str) -> None:
    try:
        fn(receiver, *args)
    except RaySyncError as err:
        # The adapter closed its end (shutdown or death): a normal way for the loop to end.
        logger.info("%s: stopping: %s", name, err)


def _pipe_worker(
    conn: Any,
    fn: Callable[..., Any],
    args: Sequence[Any],
    model_factory: Callable[[], Any],
    model_id: str,
    timeout: float,
    parent: int,
    name: str,
) -> None:
    """Entry point of a PipeAdapter worker process."""
    from raysync.schemes import MultiProcessWeightSyncScheme

    _watch_parent(parent)
    scheme = MultiProcessWeightSyncScheme(timeout=timeout)
    scheme.init_on_receiver(model_id=model_id, pipe=conn, model=model_factory())
    _run_user_fn(scheme.get_receiver(), fn, args, name)


def _dist_worker(
    host: str,
    port: int,
    index: int,
    fn: Callable[..., Any],
    args: Sequence[Any],
    model_factory: Callable[[], Any],
    model_id: str,
    timeout: float,
    channel: str,
    parent: int,
    name: str,
) -> None:
    """Entry point of a DistributedAdapter worker process."""
    import torch.distributed as dist

    from raysync.schemes import DistributedWeightSyncScheme

    _watch_parent(parent)
    store = dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=timeout))
    transport = _BroadcastTransport(store, index, timeout=timeout, channel=channel)
    scheme = DistributedWeightSyncScheme(timeout=timeout)
    scheme.init_on_receiver(model_id=model_id, endpoint=transport, model=model_factory())
    _run_user_fn(scheme.get_receiver(), fn, args, name)


def _rpc_worker(
    host: str,
    port: int,
    rpc_port: int,
    rank: int,
    world: int,
    fn: Callable[..., Any],
    args: Sequence[Any],
    model_factory: Callable[[], Any],
    model_id: str,
    timeout: float,
    channel: str,
    parent: int,
    name: str,
) -> None:
    """Entry point of an RPCAdapter worker process (rank ``rank`` of the gloo and RPC groups)."""
    from raysync.schemes import RPCWeightSyncScheme
    from raysync.transports.rpc import RPCTransport

    _watch_parent(parent)
    _join_rpc(host, port, rpc_port, rank, world, timeout)
    scheme = RPCWeightSyncScheme(timeout=timeout)
    transport = RPCTransport(timeout=timeout, channel=channel)
    scheme.init_on_receiver(model_id=model_id, endpoint=transport, model=model_factory())
    _run_user_fn(scheme.get_receiver(), fn, args, name)


def _join_rpc(host: str, port: int, rpc_port: int, rank: int, world: int, timeout: float) -> None:
    """Join the default gloo group (bytes) and the RPC group (signals) of an RPCAdapter."""
    import torch.distributed as dist
    from torch.distributed import rpc

    store = dist.TCPStore(
        host, port, world, rank == 0, timeout=datetime.timedelta(seconds=timeout), wait_for_workers=False
    )
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=timeout)
    )
    options = rpc.TensorPipeRpcBackendOptions(
        init_method=f"tcp://{host}:{rpc_port}", num_worker_threads=8, rpc_timeout=timeout
    )
    rpc.init_rpc(f"rank{rank}", rank=rank, world_size=world, rpc_backend_options=options)


def _join_group(store: Any, channel: str, generation: int, rank: int, world: int, timeout: float) -> None:
    """(Re)form the gloo group of one generation (membership changes start a new one)."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group(
        "gloo",
        store=dist.PrefixStore(f"raysync/{channel}/group/{generation}", store),
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=timeout),
    )


def _broadcast_transport_class() -> type:
    from raysync.transports._p2p import Transfer, wait_until
    from raysync.transports.distributed import DistributedTransport

    class BroadcastTransport(DistributedTransport):  # type: ignore[misc]
        """Worker side of a DistributedAdapter: the mailbox of DistributedTransport, bytes by broadcast.

        For each version: take the message, say "ready", wait for "go" (the
        group generation and this worker's rank in it), join that group if it
        is new, then receive every bucket by ``broadcast`` from rank 0.
        """

        generation: int | None = None

        def receive_snapshot(
            self, timeout: float | None = 1.0
        ) -> tuple[str, Manifest, list[torch.Tensor]] | None:
            import torch.distributed as dist

            store = self._store()
            deadline = None if timeout is None else time.monotonic() + timeout
            message = self._take_next(deadline, keep_weights=False)
            if message is None:
                return None
            number, payload = message
            store.set(self._key("ready", number), b"1")
            go_key = self._key("go", number)
            if not wait_until(lambda: bool(store.check([go_key])), time.monotonic() + self.timeout):
                raise SyncTimeoutError(f"the adapter did not start broadcasting message {number}")
            go = pickle.loads(bytes(store.get(go_key)))
            store.delete_key(go_key)
            if go["generation"] != self.generation:
                _join_group(store, self.channel, go["generation"], go["rank"], go["world"], self.timeout)
                self.generation = go["generation"]
            manifest: Manifest = payload["manifest"]
            flats = [torch.empty(n, dtype=torch.uint8) for n in manifest.bucket_nbytes]
            works = [dist.broadcast(f, src=0, async_op=True) for f in flats if f.numel()]
            Transfer(works, flats).wait(time.monotonic() + self.timeout, f"broadcast of message {number}")
            self._last = number
            return payload["model_id"], manifest, flats

    return BroadcastTransport


class _LazyBroadcastTransport:
    """Builds the BroadcastTransport class on first use (torch.distributed imports lazily)."""

    _cls: type | None = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._cls is None:
            self._cls = _broadcast_transport_class()
        return self._cls(*args, **kwargs)


_BroadcastTransport = _LazyBroadcastTransport()


# ---------------------------------------------------------------------- adapter actors


@dataclass
class _Receiver:
    """One receiver behind an adapter, as the adapter sees it."""

    index: int
    name: str
    process: Any
    transport: Any
    applied: int | None = None
    error: str | None = None
    state: str = "live"  # "live" or "dead" (dropped)

    def row(self) -> dict[str, Any]:
        return {
            "receiver": self.name,
            "pid": self.process.pid,
            "applied": self.applied,
            "error": self.error,
            "state": self.state,
        }


class _Adapter:
    """What every adapter does: subscribe once, fetch once per version, fan out, report."""

    kind = ""

    def __init__(
        self,
        fn: Callable[..., Any],
        args: Sequence[Any] = (),
        *,
        model_factory: Callable[[], Any],
        num_receivers: int = 2,
        model_id: str = "policy",
        hub: str = DEFAULT_HUB,
        namespace: str | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        name: str | None = None,
        start_method: str = "fork",
    ) -> None:
        if not callable(fn):
            raise TypeError(f"fn must be a callable fn(receiver, *args), got {type(fn).__name__}")
        if not callable(model_factory):
            raise TypeError(f"model_factory must be callable, got {type(model_factory).__name__}")
        if not isinstance(num_receivers, int) or num_receivers < 1:
            raise ValueError(f"num_receivers must be an integer >= 1, got {num_receivers!r}")
        check_timeout(timeout, allow_none=False, positive=True)
        self.model_id = model_id
        self.timeout = float(timeout)
        self.name = name or f"{self.kind}-adapter-{os.getpid()}"
        self._hub_name = hub
        self._namespace = namespace
        self._lock = threading.Lock()  # one version at a time
        self._version: int | None = None
        self._fetches = 0
        self._bytes_fetched = 0
        self._receivers: list[_Receiver] = []
        self._placement = placement_of()
        self._mp: Any = multiprocessing.get_context(start_method)
        self._start_receivers(fn, tuple(args), model_factory, num_receivers)
        self._sub_id = ""
        self._hub: Any = None
        ctx = ray.get_runtime_context()
        if ctx.get_actor_id() is not None:
            self._register(ctx)
            threading.Thread(target=self._heartbeat_loop, args=(ctx,), daemon=True).start()

    # -------------------------------------------------------------- hub protocol
    def _register(self, ctx: Any) -> None:
        self._sub_id = f"{ctx.get_actor_id()}:{self.model_id}"
        self._hub = get_hub_actor(self._hub_name, self._namespace)
        info = {
            "actor_id": ctx.get_actor_id(),
            "class_name": type(self).__name__,
            "node_id": self._placement["node_id"],
            "pid": os.getpid(),
            "mode": "push",
            "apply": "adapter",
            "kind": self.kind,
            "placement": dict(self._placement),
            "applied": self._applied(),
        }
        newest = ray.get(
            self._hub.register.remote(self.model_id, self._sub_id, ctx.current_actor, info, None)
        )
        if newest is not None:
            reply = self._raysync_notify(self.model_id, newest["version"], newest["manifest"], newest["refs"])
            self._hub.report.remote(self._sub_id, reply)

    def _heartbeat_loop(self, ctx: Any) -> None:
        while True:
            time.sleep(_HEARTBEAT_S)
            try:
                known = ray.get(self._hub.heartbeat.remote(self._sub_id), timeout=_HEARTBEAT_S * 5)
            except Exception:
                try:
                    self._hub = ray.get_actor(self._hub_name, namespace=self._namespace or DEFAULT_NAMESPACE)
                except Exception:
                    continue
                known = False
            if not known:
                try:
                    logger.warning("%s: the hub does not know this adapter; registering again", self.name)
                    self._register(ctx)
                except Exception as err:
                    logger.warning("%s could not register again: %s", self.name, err)

    def _raysync_ping(self) -> bool:
        return True

    def _raysync_notify(
        self, model_id: str, version: int, manifest: Manifest, refs: list[ray.ObjectRef]
    ) -> dict[str, Any]:
        """The hub delivers a version: fetch it once, hand it to every receiver, reply with their acks."""
        with self._lock:
            return self._deliver(model_id, version, manifest, refs)

    def _deliver(
        self, model_id: str, version: int, manifest: Manifest, refs: list[ray.ObjectRef]
    ) -> dict[str, Any]:
        t0 = time.perf_counter()
        if self._version is not None and version <= self._version:
            return {"applied": self._applied(), "skipped": version, "receivers": self.receivers()}
        self._reap()
        live = [r for r in self._receivers if r.state == "live"]
        try:
            if manifest.transport != "object_store":
                raise RaySyncError(
                    "adapters read versions from the object store; this one came over "
                    f"{manifest.transport!r} (push with transport='object_store')"
                )
            if not live:
                raise RaySyncError(f"{self.name} has no live receivers left")
            buckets = ray.get(list(refs), timeout=self.timeout)
            self._fetches += 1
            self._bytes_fetched += sum(manifest.bucket_nbytes)
            self._fan_out(model_id, version, manifest, buckets, live)
            del buckets
        except Exception as err:
            logger.warning("%s could not deliver version %d: %s", self.name, version, err)
            return {
                "applied": self._applied(),
                "failed": version,
                "error": f"{type(err).__name__}: {str(err)[:1000]}",
                "receivers": self.receivers(),
            }
        self._version = version
        dropped = [r for r in live if r.state == "dead"]
        failed = [r for r in live if r.state == "live" and r.applied != version]
        reply: dict[str, Any] = {"applied": self._applied(), "receivers": self.receivers()}
        problems = [f"{r.name}: {r.error}" for r in (*failed, *dropped)]
        if failed or not any(r.state == "live" for r in live):
            reply["failed"] = version
        else:
            reply.update(
                apply_s=time.perf_counter() - t0,
                buckets_fetched=manifest.num_buckets,
                bytes_fetched=sum(manifest.bucket_nbytes),
            )
        if problems:
            reply["error"] = "; ".join(problems)[:2000]
        return reply

    def _applied(self) -> int | None:
        """The version every live receiver holds (the oldest of theirs)."""
        versions = [r.applied for r in self._receivers if r.state == "live"]
        if not versions or any(v is None for v in versions):
            return None
        return min(v for v in versions if v is not None)

    def _reap(self) -> None:
        for r in self._receivers:
            if r.state == "live" and not r.process.is_alive():
                self._drop(r, f"receiver process exited (exit code {r.process.exitcode})")

    def _drop(self, r: _Receiver, why: str, *, level: int = logging.WARNING) -> None:
        r.state = "dead"
        r.error = why
        logger.log(level, "%s dropped receiver %s: %s", self.name, r.name, why)
        if r.process.is_alive():
            r.process.terminate()
        r.process.join(timeout=1.0)

    def _check(self, r: _Receiver, version: int, err: BaseException | None) -> None:
        """Record one receiver's outcome for ``version``."""
        if err is None:
            r.applied, r.error = version, None
        elif not r.process.is_alive() or (
            isinstance(err, RaySyncError)
            and not isinstance(err, ApplyError)
            and not isinstance(err, SyncTimeoutError)
        ):
            r.process.join(timeout=1.0)
            self._drop(r, f"receiver process died (exit code {r.process.exitcode}): {err}")
        else:
            r.error = f"{type(err).__name__}: {str(err)[:500]}"

    def _start_receivers(
        self, fn: Callable[..., Any], args: tuple[Any, ...], model_factory: Callable[[], Any], count: int
    ) -> None:
        raise NotImplementedError

    def _fan_out(
        self, model_id: str, version: int, manifest: Manifest, buckets: list[Any], live: list[_Receiver]
    ) -> None:
        raise NotImplementedError

    # -------------------------------------------------------------- public methods
    def placement(self) -> dict[str, Any]:
        """Where this adapter runs (node id, placement group id, bundle index), read inside it."""
        return dict(self._placement)

    def receivers(self) -> list[dict[str, Any]]:
        """One row per receiver: name, pid, applied version, last error, state (live / dead)."""
        return [r.row() for r in self._receivers]

    def stats(self) -> dict[str, Any]:
        """Versions fetched from the object store by this adapter (``fetches``, ``bytes_fetched``)."""
        return {
            "name": self.name,
            "kind": self.kind,
            "version": self._version,
            "fetches": self._fetches,
            "bytes_fetched": self._bytes_fetched,
            "receivers": len([r for r in self._receivers if r.state == "live"]),
        }

    def shutdown(self) -> None:
        """Stop the receivers and leave the hub."""
        if self._hub is not None and self._sub_id:
            try:
                ray.get(self._hub.unregister.remote(self._sub_id), timeout=10)
            except Exception:
                pass
        for r in self._receivers:
            if r.state == "live":
                self._drop(r, "adapter shut down", level=logging.INFO)


class PipeAdapter(_Adapter):
    """K worker processes fed through pipes (signals) and one shared-memory copy per version (bytes).

    Each worker runs ``fn(receiver, *args)``; ``receiver`` is a
    :class:`raysync.schemes.WeightReceiver` whose model is ``model_factory()``
    (reach it as ``receiver.model``); call ``receiver.receive(timeout)`` in the
    worker's loop to apply a version whole when one has arrived. ``fn``,
    ``args`` and ``model_factory`` must pickle (the workers are spawned).

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

    def _start_receivers(
        self, fn: Callable[..., Any], args: tuple[Any, ...], model_factory: Callable[[], Any], count: int
    ) -> None:
        from raysync.transports.pipe import MPTransport, SnapshotPool

        self._pool = SnapshotPool()
        for i in range(count):
            parent, child = self._mp.Pipe()
            name = f"{self.name}/pipe-{i}"
            process = self._mp.Process(
                target=_pipe_worker,
                args=(child, fn, args, model_factory, self.model_id, self.timeout, os.getpid(), name),
                name=name,
                daemon=True,
            )
            process.start()
            child.close()
            self._receivers.append(_Receiver(i, name, process, MPTransport(parent, timeout=self.timeout)))

    def _fan_out(
        self, model_id: str, version: int, manifest: Manifest, buckets: list[Any], live: list[_Receiver]
    ) -> None:
        from raysync.transports.pipe import SnapshotPool

        # The one copy of the version on this side: object store -> shared memory.
        if self._pool is None:
            self._pool = SnapshotPool()
        snapshot = self._pool.write(unpack(manifest, buckets), manifest)
        started: list[_Receiver] = []
        for r in live:
            try:
                r.transport.send_weights_async(model_id, snapshot)
                started.append(r)
            except RaySyncError as err:
                self._pool.forget(r.transport._reader)
                self._check(r, version, err)
        deadline = time.monotonic() + self.timeout
        for r in started:
            try:
                r.transport.wait_ack(max(deadline - time.monotonic(), 0.01))
            except RaySyncError as err:
                self._check(r, version, err)
                if r.state == "dead":
                    self._pool.forget(r.transport._reader)
                continue
            self._check(r, version, None)


class DistributedAdapter(_Adapter):
    """Rank 0 of a gloo group with K worker processes: one broadcast per bucket per version.

    Each worker runs ``fn(receiver, *args)`` like :class:`PipeAdapter`'s. Per
    version the adapter posts the manifest in each worker's mailbox (the
    group's TCPStore), waits until every worker is ready, then broadcasts each
    bucket once and collects the acks. A worker that is not ready within
    ``timeout`` (dead or stuck: a collective cannot wait for it) is stopped
    and dropped, and the others form a new group without it.

    Args: as :class:`PipeAdapter`.

    Example:
        >>> adapter = raysync.adapters.start("distributed", worker_loop, model_factory=make_policy)
    """

    kind = "distributed"

    def _start_receivers(
        self, fn: Callable[..., Any], args: tuple[Any, ...], model_factory: Callable[[], Any], count: int
    ) -> None:
        import torch.distributed as dist

        self._channel = f"adapter-{os.getpid()}"
        self._store = dist.TCPStore(
            "127.0.0.1",
            0,
            is_master=True,
            wait_for_workers=False,
            timeout=datetime.timedelta(seconds=self.timeout),
        )
        self._generation = 0
        self._members: list[int] | None = None
        port = int(self._store.port)
        from raysync.transports.distributed import DistributedTransport

        for i in range(count):
            name = f"{self.name}/rank-{i + 1}"
            process = self._mp.Process(
                target=_dist_worker,
                args=(
                    "127.0.0.1",
                    port,
                    i,
                    fn,
                    args,
                    model_factory,
                    self.model_id,
                    self.timeout,
                    self._channel,
                    os.getpid(),
                    name,
                ),
                name=name,
                daemon=True,
            )
            process.start()
            transport = DistributedTransport(self._store, i, timeout=self.timeout, channel=self._channel)
            self._receivers.append(_Receiver(i, name, process, transport))

    def _ready_or_gone(self, key: str, r: _Receiver) -> bool:
        return bool(self._store.check([key])) or not r.process.is_alive()

    def _fan_out(
        self, model_id: str, version: int, manifest: Manifest, buckets: list[Any], live: list[_Receiver]
    ) -> None:
        import torch.distributed as dist

        from raysync.transports._p2p import Transfer, wait_until
        from raysync.transports.distributed import _Pending

        numbers = {}
        for r in live:
            message = {"kind": "weights", "model_id": model_id, "manifest": manifest, "tags": [], "src": 0}
            numbers[r.index] = r.transport._post(message)
        deadline = time.monotonic() + self.timeout
        ready: list[_Receiver] = []
        for r in live:
            key = r.transport._key("ready", numbers[r.index])
            ok = wait_until(functools.partial(self._ready_or_gone, key, r), deadline)
            if ok and self._store.check([key]):
                self._store.delete_key(key)
                ready.append(r)
            elif not r.process.is_alive():
                self._drop(r, f"receiver process exited (exit code {r.process.exitcode})")
            else:
                self._drop(r, f"did not take version {version} within {self.timeout} s (stopped)")
        if not ready:
            return
        members = [r.index for r in ready]
        if members != self._members:
            self._generation += 1
            self._members = members
        for rank, r in enumerate(ready, start=1):
            go = {"generation": self._generation, "rank": rank, "world": len(ready) + 1}
            self._store.set(r.transport._key("go", numbers[r.index]), pickle.dumps(go))  # type: ignore[arg-type]
        if getattr(self, "_joined", None) != self._generation:
            _join_group(self._store, self._channel, self._generation, 0, len(ready) + 1, self.timeout)
            self._joined = self._generation
        # One flat buffer per bucket (the one copy on this side), one broadcast each.
        flats = []
        for b in range(manifest.num_buckets):
            flat = torch.empty(manifest.bucket_nbytes[b], dtype=torch.uint8)
            for entry, arr in zip(manifest.bucket_entries(b), buckets[b], strict=True):
                if entry.nbytes:
                    with warnings.catch_warnings():  # read-only object-store buffers: we only read them
                        warnings.simplefilter("ignore", UserWarning)
                        src = torch.from_numpy(arr)
                    flat[entry.offset : entry.offset + entry.nbytes].copy_(src)
            flats.append(flat)
        works = [dist.broadcast(f, src=0, async_op=True) for f in flats if f.numel()]
        try:
            Transfer(works, flats).wait(time.monotonic() + self.timeout, f"broadcast of version {version}")
        except RaySyncError as err:
            self._members = None  # the group is unusable after a failed collective: form a new one
            for r in ready:
                self._check(r, version, err if r.process.is_alive() else RaySyncError(str(err)))
            return
        for r in ready:
            r.transport._pending = _Pending(numbers[r.index], model_id, Transfer([], []))
            try:
                r.transport.wait_ack(max(deadline - time.monotonic(), 0.01) + self.timeout)
            except RaySyncError as err:
                self._check(r, version, err)
                continue
            self._check(r, version, None)


class RPCAdapter(_Adapter):
    """Rank 0 of a ``torch.distributed.rpc`` group with K RPC worker processes.

    Each worker runs ``fn(receiver, *args)`` like :class:`PipeAdapter`'s. Per
    version the adapter signals every worker by RPC (the manifest) and sends
    the bytes with torch.distributed ``isend`` (gloo), through
    :class:`raysync.transports.rpc.RPCTransport`; the worker's RPC thread
    receives them whole, its loop applies them and acks by RPC. A worker that
    dies is reported and dropped (nothing more is sent to it).

    Args: as :class:`PipeAdapter`.

    Example:
        >>> adapter = raysync.adapters.start("rpc", worker_loop, model_factory=make_policy)
    """

    kind = "rpc"

    def _start_receivers(
        self, fn: Callable[..., Any], args: tuple[Any, ...], model_factory: Callable[[], Any], count: int
    ) -> None:
        from raysync.transports.rpc import RPCTransport

        host = "127.0.0.1"
        port, rpc_port = _free_port(), _free_port()
        world = count + 1
        channel = f"adapter-{os.getpid()}"
        for i in range(count):
            name = f"{self.name}/rank{i + 1}"
            process = self._mp.Process(
                target=_rpc_worker,
                args=(
                    host,
                    port,
                    rpc_port,
                    i + 1,
                    world,
                    fn,
                    args,
                    model_factory,
                    self.model_id,
                    self.timeout,
                    channel,
                    os.getpid(),
                    name,
                ),
                name=name,
                daemon=True,
            )
            process.start()
            transport = RPCTransport(f"rank{i + 1}", worker_rank=i + 1, timeout=self.timeout, channel=channel)
            self._receivers.append(_Receiver(i, name, process, transport))
        _join_rpc(host, port, rpc_port, 0, world, self.timeout)

    def _fan_out(
        self, model_id: str, version: int, manifest: Manifest, buckets: list[Any], live: list[_Receiver]
    ) -> None:
        tensors = unpack(manifest, buckets)
        started: list[_Receiver] = []
        for r in live:
            try:
                r.transport.send_weights_async(model_id, tensors)
                started.append(r)
            except Exception as err:
                self._check(r, version, err if isinstance(err, RaySyncError) else RaySyncError(str(err)))
        deadline = time.monotonic() + self.timeout
        for r in started:
            try:
                r.transport.wait_ack(max(deadline - time.monotonic(), 0.01))
            except RaySyncError as err:
                if not r.process.is_alive() or "failed to receive" in str(err):
                    r.process.join(timeout=1.0)
                    self._drop(r, f"RPC worker unreachable (exit code {r.process.exitcode}): {err}"[:500])
                else:
                    self._check(r, version, err)
                continue
            self._check(r, version, None)


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


_CLASSES: dict[str, type[_Adapter]] = {
    "pipe": PipeAdapter,
    "distributed": DistributedAdapter,
    "rpc": RPCAdapter,
}


def start(
    kind: Kind,
    fn: Callable[..., Any],
    args: Sequence[Any] = (),
    *,
    model_factory: Callable[[], Any],
    num_receivers: int = 2,
    model_id: str = "policy",
    hub: str = DEFAULT_HUB,
    namespace: str | None = None,
    timeout: float = DEFAULT_TIMEOUT,
    placement_group: Any = None,
    bundle_index: int | None = None,
    num_cpus: float = 0.5,
    name: str | None = None,
    start_method: str = "fork",
) -> Any:
    """Create one adapter actor (optionally in a bundle of a placement group); return its handle.

    Args:
        kind: ``"pipe"`` (:class:`PipeAdapter`), ``"distributed"``
            (:class:`DistributedAdapter`) or ``"rpc"`` (:class:`RPCAdapter`).
        fn: each worker's loop, ``fn(receiver, *args)``.
        args: more arguments for ``fn``.
        model_factory: builds each worker's model.
        num_receivers: worker processes behind this adapter.
        model_id, hub, namespace: what to follow.
        timeout: seconds any wait of the adapter may take.
        placement_group, bundle_index: where to place the actor.
        num_cpus: the actor's CPUs (its workers are its own processes, not Ray's).
        name: for logs and ``hub.status()``.
        start_method: how the adapter starts its workers (``"fork"``: at once,
            no imports; ``"spawn"``: fresh interpreters, slower).

    Example:
        >>> a = raysync.adapters.start("pipe", worker_loop, model_factory=make_policy, hub="h")
    """
    if kind not in _CLASSES:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    options: dict[str, Any] = {"num_cpus": num_cpus, "max_concurrency": 8}
    if placement_group is not None:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
            placement_group=placement_group,
            placement_group_bundle_index=-1 if bundle_index is None else int(bundle_index),
        )
    actor_cls = ray.remote(_CLASSES[kind])
    return actor_cls.options(**options).remote(  # type: ignore[attr-defined]
        fn,
        tuple(args),
        model_factory=model_factory,
        num_receivers=num_receivers,
        model_id=model_id,
        hub=hub,
        namespace=namespace,
        timeout=timeout,
        name=name,
        start_method=start_method,
    )


def placement_group_of(target: Any = None) -> Any:
    """A placement group: ``target`` itself, the one an actor handle runs in, or the caller's own.

    Raises:
        ValueError: the actor (or the caller, for ``None``) runs in no placement group.

    Example:
        >>> pg = raysync.adapters.placement_group_of(engine_actor)  # doctest: +SKIP
    """
    from ray.util.placement_group import PlacementGroup, get_current_placement_group

    if target is None:
        pg = get_current_placement_group()
        if pg is None:
            raise ValueError("no placement group given and the caller does not run in one")
        return pg
    if isinstance(target, PlacementGroup):
        return target
    actor_id = getattr(target, "_actor_id", None)
    if actor_id is None:
        raise TypeError(f"expected a PlacementGroup or an actor handle, got {type(target).__name__}")
    from ray._raylet import PlacementGroupID

    record = _actor_record(actor_id.hex())
    pg_id = b"" if record is None else bytes(record.placement_group_id)
    if not pg_id or set(pg_id) == {0xFF}:
        raise ValueError(f"actor {actor_id.hex()} does not run in a placement group")
    return PlacementGroup(PlacementGroupID(pg_id))


def _choose_bundles(group: Any, bundles: Sequence[int] | None, per: str) -> list[int]:
    """The bundle indices to put adapters in: the chosen ones, or the first on each node."""
    count = len(group.bundle_specs)
    chosen = list(range(count)) if bundles is None else [int(b) for b in bundles]
    bad = [b for b in chosen if not 0 <= b < count]
    if bad:
        raise ValueError(f"bundle indices {bad} out of range: the placement group has {count} bundle(s)")
    if per == "node":
        from ray.util.placement_group import placement_group_table

        nodes = placement_group_table(group).get("bundles_to_node_id", {})
        seen: set[Any] = set()
        picked = []
        for b in chosen:
            node = nodes.get(b)
            if node not in seen:
                seen.add(node)
                picked.append(b)
        chosen = picked
    return chosen


def for_placement_group(
    pg: Any,
    kind: Kind,
    *,
    fn: Callable[..., Any],
    args: Sequence[Any] = (),
    model_factory: Callable[[], Any],
    bundles: Sequence[int] | None = None,
    per: Literal["bundle", "node"] = "bundle",
    num_receivers: int = 2,
    model_id: str = "policy",
    hub: str = DEFAULT_HUB,
    namespace: str | None = None,
    timeout: float = DEFAULT_TIMEOUT,
    num_cpus: float = 0.5,
    ready_timeout: float | None = 120.0,
    start_method: str = "fork",
) -> list[Any]:
    """One adapter per bundle (or per node) of a placement group; returns their handles.

    Args:
        pg: a ``PlacementGroup``, an actor handle (its placement group is
            used), or ``None`` (the caller's own placement group).
        kind: ``"pipe"``, ``"distributed"`` or ``"rpc"``.
        fn, args, model_factory, num_receivers, model_id, hub, namespace,
            timeout, num_cpus, start_method: as :func:`start`, for every adapter.
        bundles: which bundle indices (default: all).
        per: ``"bundle"`` (one adapter per bundle) or ``"node"`` (one per node,
            in the first chosen bundle on it).
        ready_timeout: wait this long for the group and the adapters to be up
            (``None``: return at once).

    Example:
        >>> pg = ray.util.placement_group([{"CPU": 1}] * 2)
        >>> handles = raysync.adapters.for_placement_group(
        ...     pg, "distributed", fn=worker_loop, model_factory=make_policy, hub="h"
        ... )  # doctest: +SKIP
    """
    if kind not in _CLASSES:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if per not in ("bundle", "node"):
        raise ValueError(f"per must be 'bundle' or 'node', got {per!r}")
    group = placement_group_of(pg)
    if ready_timeout is not None:
        ray.get(group.ready(), timeout=ready_timeout)
    chosen = _choose_bundles(group, bundles, per)
    handles = [
        start(
            kind,
            fn,
            args,
            model_factory=model_factory,
            num_receivers=num_receivers,
            model_id=model_id,
            hub=hub,
            namespace=namespace,
            timeout=timeout,
            placement_group=group,
            bundle_index=b,
            num_cpus=num_cpus,
            name=f"{kind}-bundle-{b}",
            start_method=start_method,
        )
        for b in chosen
    ]
    if ready_timeout is not None:
        ray.get([h._raysync_ping.remote() for h in handles], timeout=ready_timeout)
    return handles
