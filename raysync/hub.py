"""The control plane: the ``WeightHub`` actor and the ``HubClient`` users hold.

The hub is one named, detached, async Ray actor per cluster (per name). It
never sees tensor bytes: a pusher puts a version's buckets into the object
store itself and hands the hub their ``ObjectRef``\\ s, which the hub borrows
and forwards. The hub stamps versions (monotonic per model), keeps the newest
``keep`` of each model, remembers every subscriber and the version it applied,
and delivers each new version to push-mode subscribers, one delivery loop per
subscriber so that a slow or dead one holds up nobody.

Ownership: Ray >= 2.56 has no ``ray.put(_owner=...)``, so the process that
pushed a version owns its objects. If that process dies, the versions it
pushed can no longer be fetched (subscribers keep the version they applied,
and the next push from a live trainer repairs everything).

Example:
    >>> import ray, raysync, torch
    >>> ray.init()  # doctest: +SKIP
    >>> hub = raysync.connect()
    >>> v = hub.push(torch.nn.Linear(4, 2))
    >>> hub.latest()
    1
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import fnmatch
import functools
import json
import logging
import os
import socket
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import ray
import torch
from ray.exceptions import ActorDiedError, ActorUnavailableError, ObjectLostError, RayActorError, RayTaskError

from raysync import metrics
from raysync._checks import check_timeout
from raysync._store_pages import populate_store_mapping
from raysync.errors import (
    ApplyError,
    InvalidWeightsError,
    StaleWriterError,
    SyncTimeoutError,
    UnknownModelError,
    WeightMismatchError,
)
from raysync.transports import TRANSPORTS
from raysync.weights import (
    DEFAULT_BUCKET_BYTES,
    Manifest,
    bucket_checksums,
    cast_floating,
    extract_extra_state,
    extract_tensors,
    pack,
    plan_layout,
    same_bytes,
    schema_of,
    to_tensordict,
    unpack,
    validate,
)

if TYPE_CHECKING:
    from tensordict import TensorDict

__all__ = ["DEFAULT_HUB", "DEFAULT_NAMESPACE", "HubClient", "WeightHub", "connect", "get_hub_actor"]

logger = logging.getLogger(__name__)

DEFAULT_HUB = "raysync"
"""The hub's actor name unless told otherwise."""
DEFAULT_NAMESPACE = "raysync"
"""raysync's own Ray namespace: every driver, job and the CLI find the same hub there."""

_KV_NAMESPACE = "raysync"
DEFAULT_KEEP = 2
"""Versions per model a new hub keeps unless a client asks for more."""
_REAP_INTERVAL_S = 1.0  # how often a waiting hub checks that laggards are still alive
_SWEEP_S = 5.0  # how often the hub looks for subscribers that stopped checking in
_STALE_S = 10.0  # a subscriber silent this long (5 heartbeats) is pinged, and dropped if dead
_CLIENT_RETRY_S = 60.0  # how long a client keeps retrying while the hub restarts
_PING_TIMEOUT_S = 0.5


@dataclass
class _Version:
    version: int
    manifest: Manifest
    refs: list[ray.ObjectRef]
    pushed_at: float
    pusher: dict[str, Any]


@dataclass
class _Model:
    versions: dict[int, _Version] = field(default_factory=dict)
    latest: int = 0
    pushes: int = 0
    bytes_pushed: int = 0
    last_push_time: float | None = None
    writer: dict[str, Any] | None = None  # the process (or actor) holding the writer lease

    @property
    def newest(self) -> _Version | None:
        return self.versions.get(self.latest)


@dataclass
class _Subscriber:
    sub_id: str
    model_id: str
    handle: Any
    info: dict[str, Any]
    schema: dict[str, tuple[tuple[int, ...], str]] | None
    applied: int | None = None
    sent: int = 0
    failed: int = 0  # newest version that failed to apply
    last_apply_time: float | None = None
    last_apply_s: float | None = None
    last_pause_s: float | None = None
    last_buckets_fetched: int | None = None
    last_bytes_fetched: int | None = None
    last_prefetched: bool = False
    last_error: str | None = None
    state: str = "live"
    task: asyncio.Task[None] | None = None
    schema_key: tuple[Any, ...] | None = None  # equal schemas are validated once per publish
    receivers: list[dict[str, Any]] | None = None  # an adapter's receivers (raysync.adapters)
    last_seen: float = field(default_factory=time.monotonic)  # registration, heartbeat or reply

    @property
    def mode(self) -> str:
        return str(self.info.get("mode", "push"))

    @functools.cached_property
    def group(self) -> str | None:
        """Subscriptions of one actor that asked for batched notifications share one delivery loop."""
        if not self.info.get("batch") or not self.info.get("actor_id"):
            return None
        return f"{self.model_id}/{self.info['actor_id']}"

    def settled(self, version: int) -> bool:
        """Holds ``version`` (or newer), or failed to apply it: a ``wait`` for it no longer waits."""
        return (self.applied is not None and self.applied >= version) or self.failed >= version

    def record(self) -> dict[str, Any]:
        """What the hub persists of a subscription, so that a restarted hub knows whom to wait for."""
        keys = ("actor_id", "class_name", "node_id", "pid", "mode", "apply")
        return {"model_id": self.model_id, "info": {k: self.info.get(k) for k in keys}}


@dataclass(eq=False)
class _Group:
    """Batched subscriptions of one actor to one model: one notification call carries them all."""

    members: dict[str, _Subscriber] = field(default_factory=dict)
    task: asyncio.Task[None] | None = None


@dataclass(eq=False)
class _Waiter:
    """One ``wait`` call: the subscribers it still waits for, and the event set when none is left."""

    version: int
    pending: set[str]
    include_pull: bool = False
    event: asyncio.Event = field(default_factory=asyncio.Event)


def _cancel(task: asyncio.Task[None] | None) -> None:
    """Stop a delivery loop, unless it is the one running this code (it returns by itself)."""
    if task is not None and task is not asyncio.current_task():
        task.cancel()


def _kv() -> Any:
    """Ray's GCS key-value store (survives the hub process, not the cluster)."""
    from ray.experimental import internal_kv

    class _KV:
        put = staticmethod(internal_kv._internal_kv_put)
        get = staticmethod(internal_kv._internal_kv_get)
        list = staticmethod(internal_kv._internal_kv_list)
        delete = staticmethod(internal_kv._internal_kv_del)

    return _KV


class _Membership:
    """Which subscriptions exist, kept in the GCS: a restarted hub knows whom a wait waits for.

    Written when a subscription is first seen and when it is dropped (not on
    every apply), in order, by one background thread, so the hub's event loop
    never waits on the GCS for it.
    """

    def __init__(self, hub_name: str) -> None:
        self._prefix = f"{hub_name}/sub/"
        self._stored: set[str] = set()
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="raysync-membership")

    def load(self) -> dict[str, dict[str, Any]]:
        records = {}
        for key in _kv().list(self._prefix.encode(), namespace=_KV_NAMESPACE):
            raw = _kv().get(key, namespace=_KV_NAMESPACE)
            if raw is not None:
                records[key.decode()[len(self._prefix) :]] = json.loads(raw)
        self._stored = set(records)
        return records

    def add(self, sub: _Subscriber) -> None:
        if sub.sub_id in self._stored:
            return
        self._stored.add(sub.sub_id)
        key, value = (self._prefix + sub.sub_id).encode(), json.dumps(sub.record()).encode()
        self._pool.submit(_kv().put, key, value, namespace=_KV_NAMESPACE)

    def remove(self, sub_id: str) -> None:
        if sub_id in self._stored:
            self._stored.discard(sub_id)
            self._pool.submit(_kv().delete, (self._prefix + sub_id).encode(), namespace=_KV_NAMESPACE)


def _lease(pusher: dict[str, Any]) -> dict[str, Any]:
    keys = ("writer_id", "kind", "actor_id", "job_id", "pid", "host")
    return {k: pusher.get(k) for k in keys} | {"since": time.time()}


def _who(writer: dict[str, Any]) -> str:
    kind = writer.get("kind") or ("actor" if writer.get("actor_id") else "driver")
    where = f"pid {writer.get('pid')} on {writer.get('host')}"
    if kind == "actor":
        return f"actor {writer['actor_id']} ({where})"
    if kind == "tasks":
        return f"tasks of job {writer.get('job_id')} (last push from {where})"
    return f"driver of job {writer.get('job_id')} ({where})"


def _actor_alive(actor_id: str) -> bool:
    """Whether an actor is not DEAD, asked of the GCS (restarting counts as alive; unsure too).

    ``ray.util.state`` would need the dashboard, which clusters may run without.
    """
    from ray._private import state

    try:
        return bool(state.actors(actor_id=actor_id).get("State") != "DEAD")
    except Exception:
        return True


def _writer_alive(writer: dict[str, Any]) -> bool:
    """Whether the process holding a lease still runs (asked of the GCS; unsure means alive)."""
    from ray._private import state

    if writer.get("actor_id"):
        return _actor_alive(writer["actor_id"])
    try:
        for job in state.jobs():
            if job.get("JobID") == writer.get("job_id"):
                return not job.get("IsDead", False)
        return False
    except Exception:
        return True


@ray.remote(num_cpus=0)
class WeightHub:
    """The hub actor. Reach it through :func:`connect`; its methods are internal.

    Example:
        >>> hub = raysync.connect("my-hub", keep=3)   # creates or finds the actor
    """

    def __init__(self, name: str = DEFAULT_HUB, keep: int = 2) -> None:
        self._name = name
        self._keep = max(1, int(keep))
        self._models: dict[str, _Model] = {}
        self._subs: dict[str, _Subscriber] = {}
        # Indexes so that no event costs a scan over every subscriber of the hub:
        self._by_model: dict[str, dict[str, _Subscriber]] = {}
        self._groups: dict[str, _Group] = {}
        self._waiters: dict[str, set[_Waiter]] = {}
        self._cond: asyncio.Condition | None = None  # wakes long polls (wait_newer) on publish
        self._started = time.time()
        self._gauges = metrics.HubGauges(name)
        self._membership = _Membership(name)
        self._sweeper: asyncio.Task[None] | None = None
        self._restored = self._restore()

    # ------------------------------------------------------------------ helpers
    def _condition(self) -> asyncio.Condition:
        if self._cond is None:
            self._cond = asyncio.Condition()
        return self._cond

    async def _changed(self) -> None:
        self._gauges.changed(self._models, self._subs)
        cond = self._condition()
        async with cond:
            cond.notify_all()

    def _model_subs(self, model_id: str) -> list[_Subscriber]:
        return [s for s in self._by_model.get(model_id, {}).values() if s.state != "dead"]

    def _add(self, sub: _Subscriber) -> None:
        old = self._subs.get(sub.sub_id)
        if old is not None:
            self._remove(old)
        self._subs[sub.sub_id] = sub
        self._by_model.setdefault(sub.model_id, {})[sub.sub_id] = sub
        if sub.group is not None:
            self._groups.setdefault(sub.group, _Group()).members[sub.sub_id] = sub
        for waiter in self._waiters.get(sub.model_id, ()):
            if (waiter.include_pull or sub.mode == "push") and not sub.settled(waiter.version):
                waiter.pending.add(sub.sub_id)

    def _remove(self, sub: _Subscriber) -> None:
        """Forget a subscriber: indexes, its delivery loop, and the waits that waited for it."""
        if self._subs.get(sub.sub_id) is sub:
            del self._subs[sub.sub_id]
        members = self._by_model.get(sub.model_id)
        if members is not None and members.get(sub.sub_id) is sub:
            del members[sub.sub_id]
            if not members:
                del self._by_model[sub.model_id]
        group = self._groups.get(sub.group) if sub.group is not None else None
        if group is not None and group.members.get(sub.sub_id) is sub:
            del group.members[sub.sub_id]
            if not group.members:
                _cancel(group.task)
                del self._groups[sub.group]  # type: ignore[arg-type]
        _cancel(sub.task)
        for waiter in self._waiters.get(sub.model_id, ()):
            waiter.pending.discard(sub.sub_id)
            if not waiter.pending:
                waiter.event.set()

    def _settle(self, sub: _Subscriber) -> None:
        """Tell the waits on ``sub``'s model that it holds (or failed) what they wait for."""
        for waiter in self._waiters.get(sub.model_id, ()):
            if sub.sub_id in waiter.pending and sub.settled(waiter.version):
                waiter.pending.discard(sub.sub_id)
                if not waiter.pending:
                    waiter.event.set()

    def _drop(self, sub: _Subscriber, why: str) -> None:
        self._remove(sub)
        self._membership.remove(sub.sub_id)
        sub.state = "dead"
        logger.warning(
            "hub %r dropped subscriber %s of %r (at version %s): %s",
            self._name,
            sub.sub_id,
            sub.model_id,
            sub.applied,
            why,
        )

    # ------------------------------------------------------------------ persistence
    def _kv_key(self, model_id: str) -> bytes:
        return f"{self._name}/model/{model_id}".encode()

    def _persist(self, model_id: str, model: _Model) -> None:
        """Version counter and writer lease outlive the hub process (GCS key-value store)."""
        record = {"latest": model.latest, "writer": model.writer}
        _kv().put(self._kv_key(model_id), json.dumps(record).encode(), namespace=_KV_NAMESPACE)

    def _restore(self) -> list[str]:
        """After a restart: continue version numbers and leases where the last hub left them.

        The kept versions themselves are lost with the old process (it held the
        only references the hub had); the next push brings everyone forward.
        """
        restored = []
        try:
            prefix = f"{self._name}/model/".encode()
            for key in _kv().list(prefix, namespace=_KV_NAMESPACE):
                raw = _kv().get(key, namespace=_KV_NAMESPACE)
                if raw is None:
                    continue
                record = json.loads(raw)
                model_id = key[len(prefix) :].decode()
                self._models[model_id] = _Model(latest=int(record["latest"]), writer=record.get("writer"))
                restored.append(model_id)
            config = _kv().get(self._config_key(), namespace=_KV_NAMESPACE)
            if config is not None:
                self._keep = max(self._keep, int(json.loads(config)["keep"]))
            members = self._membership.load()
        except Exception as err:  # a fresh cluster, or no GCS access: start empty
            logger.warning("hub %r could not restore its state: %s", self._name, err)
            members = {}
        for sub_id, record in members.items():
            # Known, not yet heard from: a wait counts it until it registers again (its heartbeat
            # finds this hub within seconds) or Ray reports its actor dead.
            sub = _Subscriber(sub_id, record["model_id"], None, dict(record["info"]), None, state="restoring")
            self._subs[sub_id] = sub
            self._by_model.setdefault(sub.model_id, {})[sub_id] = sub
        if restored:
            logger.warning(
                "hub %r restarted: continuing %s from their last version numbers, waiting for %d "
                "subscriber(s) to check in again; versions kept before the restart are gone until their "
                "writer offers them again or pushes",
                self._name,
                {m: self._models[m].latest for m in restored},
                len(members),
            )
        return restored

    def _config_key(self) -> bytes:
        return f"{self._name}/config".encode()

    async def _fence(self, model_id: str, model: _Model, pusher: dict[str, Any], takeover: bool) -> Any:
        """One writer per model: None if ``pusher`` may publish, else the error to raise."""
        me = pusher.get("writer_id")
        current = model.writer
        if me is None or current is None or current.get("writer_id") == me:
            if me is not None and current is None:
                model.writer = _lease(pusher)
            return None
        if takeover:
            logger.warning(
                "hub %r: %s took over model %r (at version %d) from %s",
                self._name,
                _who(pusher),
                model_id,
                model.latest,
                _who(current),
            )
        elif await asyncio.to_thread(_writer_alive, current):
            return StaleWriterError(
                f"model {model_id!r} is written by {_who(current)}; this process ({_who(pusher)}) may not "
                "push to it. Stop the other trainer, push under another model_id, or take over with "
                "raysync.connect(..., takeover=True)"
            )
        else:
            logger.info(
                "hub %r: writer %s of %r is gone; %s takes over at version %d",
                self._name,
                _who(current),
                model_id,
                _who(pusher),
                model.latest,
            )
        model.writer = _lease(pusher)
        return None

    async def heartbeat(self, sub_id: str) -> bool:
        """A subscriber checks in; False tells it to register again (the hub restarted or dropped it)."""
        self._start_sweeper()
        sub = self._subs.get(sub_id)
        if sub is None or sub.handle is None:  # unknown, or known from before a restart only
            return False
        sub.last_seen = time.monotonic()
        if sub.state == "unreachable":
            sub.state = "live"
        return True

    def _start_sweeper(self) -> None:
        if self._sweeper is None or self._sweeper.done():
            self._sweeper = asyncio.get_running_loop().create_task(self._sweep())

    async def _sweep(self) -> None:
        """Drop subscribers whose actor died while nobody waited for them (failed ones too)."""
        while True:
            await asyncio.sleep(_SWEEP_S)
            stale = time.monotonic() - _STALE_S
            rows = [{"subscriber": s.sub_id} for s in self._subs.values() if s.last_seen < stale]
            if rows:
                await self._reap(rows)

    # ------------------------------------------------------------------ admin
    async def configure(self, keep: int | None = None) -> dict[str, Any]:
        """Raise how many versions per model the hub keeps; never lower it under another client.

        Clients that pass no ``keep`` leave it alone; one that asks for fewer than
        another client did gets the larger number (a warning says so), so an
        evaluation job's ``connect()`` never drops versions a trainer keeps.
        """
        if keep is not None and keep != self._keep:
            if keep < self._keep:
                logger.warning(
                    "hub %r: a client asked for keep=%d; it keeps %d versions per model, as another "
                    "client asked (a hub never lowers keep under a client that relies on it)",
                    self._name,
                    keep,
                    self._keep,
                )
            else:
                logger.info("hub %r now keeps %d versions per model (was %d)", self._name, keep, self._keep)
                self._keep = int(keep)
                record = json.dumps({"keep": self._keep}).encode()
                await asyncio.to_thread(_kv().put, self._config_key(), record, namespace=_KV_NAMESPACE)
        return {"name": self._name, "keep": self._keep, "pid": os.getpid()}

    def _trim(self, model: _Model) -> None:
        for v in sorted(model.versions)[: -self._keep]:
            del model.versions[v]  # drops the hub's borrow of that version's objects

    # ------------------------------------------------------------------ publish
    async def publish(
        self,
        model_id: str,
        manifest: Manifest,
        refs: list[ray.ObjectRef],
        pusher: dict[str, Any],
        takeover: bool = False,
    ) -> dict[str, Any]:
        """Stamp and keep a version; start delivering it. Returns ``{"version": v}`` or ``{"error": e}``."""
        refused = await self._mismatch(model_id, manifest)
        if refused is not None:
            return {"error": refused}
        model = self._models.setdefault(model_id, _Model())
        refused = await self._fence(model_id, model, pusher, takeover)
        if refused is not None:
            return {"error": refused}
        model.latest += 1
        version = model.latest
        model.versions[version] = _Version(version, manifest, list(refs), time.time(), pusher)
        model.pushes += 1
        self._gauges.published(model_id)
        model.bytes_pushed += manifest.total_nbytes
        model.last_push_time = time.time()
        self._trim(model)
        await asyncio.to_thread(self._persist, model_id, model)
        # Deliver just after this reply has left: the pusher is waiting on it, and
        # receivers starting their copies would otherwise compete with it for CPU.
        asyncio.get_running_loop().call_later(0.001, self._kick_model, model_id)
        await self._changed()
        logger.debug("hub %r: %r version %d published", self._name, model_id, version)
        return {"version": version}

    async def _mismatch(self, model_id: str, manifest: Manifest) -> WeightMismatchError | None:
        """The error for a version that does not fit a live subscriber's model (each schema checked once).

        Subscribers whose actor died are dropped here instead: a dead subscriber
        never blocks a push.
        """
        by_schema: dict[Any, list[_Subscriber]] = {}
        for sub in self._model_subs(model_id):
            if sub.schema is not None:
                by_schema.setdefault(sub.schema_key or sub.sub_id, []).append(sub)
        for subs in by_schema.values():
            try:
                validate(manifest, subs[0].schema)  # type: ignore[arg-type]
                continue
            except WeightMismatchError as err:
                error = err
            alive = await asyncio.gather(*(self._alive(sub) for sub in subs))
            for sub, ok in zip(subs, alive, strict=True):
                if not ok:
                    self._drop(sub, "actor died")
            live = [sub for sub, ok in zip(subs, alive, strict=True) if ok]
            if live:
                who = f"{live[0].sub_id} ({live[0].info.get('class_name')})"
                error.args = (
                    f"{error.args[0]} (against subscriber {who} of model {model_id!r}; no version was "
                    "published and every subscriber keeps its weights)",
                )
                return error
        return None

    def _kick_model(self, model_id: str) -> None:
        for sub in self._model_subs(model_id):
            if sub.mode == "push":
                self._kick(sub)

    def _kick(self, sub: _Subscriber) -> None:
        if sub.handle is None:  # known from before a restart: it gets the newest when it registers
            return
        key = sub.group
        if key is not None:
            group = self._groups.get(key)
            if group is not None and (group.task is None or group.task.done()):
                group.task = asyncio.get_running_loop().create_task(self._deliver_group(sub.model_id, group))
        elif sub.task is None or sub.task.done():
            sub.task = asyncio.get_running_loop().create_task(self._deliver(sub))

    async def _deliver_group(self, model_id: str, group: _Group) -> None:
        """Batched delivery: one call carries every member that lacks the newest version.

        Each member is in at most one call at a time and gets the newest version,
        exactly as with :meth:`_deliver`; the actor answers with one reply per member.
        """
        while True:
            model = self._models.get(model_id)
            newest = model.newest if model else None
            if newest is None:
                return
            due = [
                s
                for s in group.members.values()
                if s.state != "dead" and s.mode == "push" and newest.version > max(s.applied or 0, s.sent)
            ]
            if not due:
                return
            for sub in due:
                sub.sent = newest.version
            try:
                replies = await due[0].handle._raysync_notify_batch.remote(
                    model_id, newest.version, newest.manifest, newest.refs, [s.sub_id for s in due]
                )
                if len(replies) != len(due):
                    raise ApplyError(f"batched notify: {len(replies)} replies for {len(due)} subscribers")
            except ActorDiedError as err:
                for sub in list(group.members.values()):
                    self._drop(sub, f"actor died ({type(err).__name__})")
                return
            except (ActorUnavailableError, RayActorError) as err:
                for sub in due:
                    sub.state = "unreachable"
                    sub.sent = 0
                    sub.last_error = f"{type(err).__name__}: {str(err)[:300]}"
                return
            except Exception as err:
                for sub in due:
                    sub.last_error = f"{type(err).__name__}: {str(err)[:500]}"
                    sub.failed = max(sub.failed, newest.version)
                    self._settle(sub)
                return
            for sub, reply in zip(due, replies, strict=True):
                self._record(sub, reply)

    async def _deliver(self, sub: _Subscriber) -> None:
        """Send the newest version to one subscriber until it holds it (one call in flight)."""
        while sub.state != "dead":
            model = self._models.get(sub.model_id)
            newest = model.newest if model else None
            if newest is None or newest.version <= max(sub.applied or 0, sub.sent):
                return
            sub.sent = newest.version
            try:
                reply = await sub.handle._raysync_notify.remote(
                    sub.model_id, newest.version, newest.manifest, newest.refs
                )
            except ActorDiedError as err:
                self._drop(sub, f"actor died ({type(err).__name__})")
                return
            except (ActorUnavailableError, RayActorError) as err:
                # Restarting or unreachable: it re-registers when it is back.
                sub.state = "unreachable"
                sub.sent = 0
                sub.last_error = f"{type(err).__name__}: {str(err)[:300]}"
                return
            except Exception as err:  # the notify itself failed: record, do not loop
                sub.last_error = f"{type(err).__name__}: {str(err)[:500]}"
                sub.failed = max(sub.failed, newest.version)
                self._settle(sub)
                return
            self._record(sub, reply)

    def _record(self, sub: _Subscriber, reply: dict[str, Any]) -> None:
        sub.last_seen = time.monotonic()
        lost = reply.get("lost")
        if lost is not None:
            self._forget_version(sub.model_id, int(lost), f"subscriber {sub.sub_id} could not fetch it")
        applied = reply.get("applied")
        newer = applied is not None and (sub.applied is None or applied > sub.applied)
        if newer:
            sub.applied = applied
        # A reply that applied something describes that apply (a "skipped" one does not): the
        # report of a prefetched swap may arrive after the delivery reply for the same version.
        # (An adapter that dropped a dead receiver but applied the version describes it too.)
        described = not ("skipped" in reply or "deferred" in reply or reply.get("failed")) and (
            "receivers" in reply or not reply.get("error")
        )
        if applied is not None and described and (newer or applied == sub.applied):
            sub.last_apply_time = time.time()
            sub.last_apply_s = reply.get("apply_s")
            metrics.record_apply(self._name, sub.model_id, sub.last_apply_s)
            sub.last_pause_s = reply.get("pause_s")
            sub.last_buckets_fetched = reply.get("buckets_fetched")
            sub.last_bytes_fetched = reply.get("bytes_fetched")
            sub.last_prefetched = bool(reply.get("prefetched"))
        if reply.get("error"):
            sub.last_error = reply["error"]
            sub.failed = max(sub.failed, int(reply.get("failed") or 0))
        elif applied is not None:
            sub.last_error = None
        if reply.get("receivers") is not None:
            sub.receivers = list(reply["receivers"])
        if sub.state == "unreachable":
            sub.state = "live"
        self._settle(sub)
        self._gauges.changed(self._models, self._subs)  # rate-limited: lag and states stay current

    # ------------------------------------------------------------------ subscribers
    async def register(
        self,
        model_id: str,
        sub_id: str,
        handle: Any,
        info: dict[str, Any],
        schema: dict[str, tuple[tuple[int, ...], str]] | None,
    ) -> dict[str, Any] | None:
        """Add (or re-add, after a restart) a subscriber; return the newest version to start from.

        ``info["batch"] = True`` (with ``info["actor_id"]``) puts the subscription in its
        actor's batch: every subscription of one actor to one model is then notified by a
        single ``_raysync_notify_batch(model_id, version, manifest, refs, sub_ids)`` call
        that answers one reply per ``sub_id`` (what an actor holding many subscriptions,
        such as a per-node relay, implements). Without it each subscription gets its own
        ``_raysync_notify(model_id, version, manifest, refs)`` call.
        """
        self._start_sweeper()
        sub = _Subscriber(sub_id, model_id, handle, dict(info), schema, applied=info.get("applied"))
        if schema is not None:
            sub.schema_key = tuple(sorted((k, tuple(shape), str(dt)) for k, (shape, dt) in schema.items()))
        self._add(sub)  # replaces (and stops delivering to) an older registration of the same id
        self._membership.add(sub)
        model = self._models.get(model_id)
        newest = model.newest if model else None
        logger.info(
            "hub %r: subscriber %s registered for %r at version %s (newest %s)",
            self._name,
            sub_id,
            model_id,
            sub.applied,
            newest.version if newest else None,
        )
        self._gauges.changed(self._models, self._subs)
        if newest is None or (sub.applied is not None and sub.applied >= newest.version):
            return None
        sub.sent = newest.version  # the subscriber applies it itself, from __init__
        return {"version": newest.version, "manifest": newest.manifest, "refs": newest.refs}

    async def unregister(self, sub_id: str) -> None:
        sub = self._subs.get(sub_id)
        if sub is not None:
            self._remove(sub)
        self._membership.remove(sub_id)

    def _forget_version(self, model_id: str, version: int, why: str) -> None:
        """Stop offering a version whose bytes are gone (its pusher died)."""
        model = self._models.get(model_id)
        if model is not None and model.versions.pop(version, None) is not None:
            logger.warning(
                "hub %r: version %d of %r is lost (%s; the process that pushed it died); the next push "
                "brings subscribers forward",
                self._name,
                version,
                model_id,
                why,
            )

    async def lost(self, model_id: str, version: int) -> None:
        """A client found a kept version's bytes gone: stop offering it."""
        self._forget_version(model_id, version, "a client could not fetch it")

    async def restore(
        self,
        model_id: str,
        version: int,
        manifest: Manifest,
        refs: list[ray.ObjectRef],
        pusher: dict[str, Any],
    ) -> dict[str, Any]:
        """The writer offers its newest version again after a hub restart lost it.

        Accepted only for the model's newest version number, when the hub keeps
        nothing of it, and from the lease holder. Returns ``{"restored": bool}``.
        """
        model = self._models.get(model_id)
        if model is None or version != model.latest or version in model.versions:
            return {"restored": False}
        if await self._fence(model_id, model, pusher, False) is not None:
            return {"restored": False}
        model.versions[version] = _Version(version, manifest, list(refs), time.time(), pusher)
        logger.info("hub %r: %r version %d offered again by its writer", self._name, model_id, version)
        self._kick_model(model_id)
        await self._changed()
        return {"restored": True}

    async def report(self, sub_id: str, reply: dict[str, Any]) -> None:
        """A subscriber applied (or failed to apply) a version on its own (start-up, pull mode).

        ``{"reset": True}``: it holds no version any more (user code re-pointed its
        parameters); in push mode it gets the newest again.
        """
        sub = self._subs.get(sub_id)
        if sub is None:
            return
        if reply.get("reset"):
            sub.applied, sub.sent, sub.failed = None, 0, 0
            sub.last_error = reply.get("error")
            sub.last_seen = time.monotonic()
            if sub.mode == "push":
                self._kick(sub)
            return
        self._record(sub, reply)
        if sub.mode == "push":
            self._kick(sub)  # a version may have been pushed while it was busy

    # ------------------------------------------------------------------ queries
    async def latest(self, model_id: str) -> int | None:
        model = self._models.get(model_id)
        return model.latest if model and model.latest else None

    async def get(
        self, model_id: str, version: int | None = None, newer_than: int | None = None
    ) -> dict[str, Any] | None:
        """The refs of one kept version (newest by default); None if nothing newer than ``newer_than``."""
        model = self._models.get(model_id)
        if model is None or not model.versions:
            return {
                "error": UnknownModelError(
                    f"no version of model {model_id!r} on hub {self._name!r}; models here: "
                    f"{sorted(self._models)}. Push one first with hub.push(model, model_id={model_id!r})"
                )
            }
        v = model.versions.get(version if version is not None else model.latest)
        if v is None:
            return {
                "error": UnknownModelError(
                    f"version {version} of model {model_id!r} is not kept (kept: "
                    f"{sorted(model.versions)}); raise keep= on connect() to keep more"
                )
            }
        if newer_than is not None and v.version <= newer_than:
            return None
        return {"version": v.version, "manifest": v.manifest, "refs": v.refs}

    async def wait_newer(self, model_id: str, version: int, timeout: float) -> dict[str, Any] | None:
        """Long poll: the newest version once it is newer than ``version``, or None after ``timeout``."""
        cond = self._condition()

        def newer() -> bool:
            model = self._models.get(model_id)
            return model is not None and model.latest > version

        try:
            async with cond:
                await asyncio.wait_for(cond.wait_for(newer), timeout)
        except asyncio.TimeoutError:
            return None
        return await self.get(model_id)

    async def wait(
        self,
        model_id: str,
        version: int,
        timeout: float | None,
        include_pull: bool = False,
        report_missing: bool = False,
    ) -> dict[str, Any]:
        """Wait until every live subscriber of ``model_id`` applied ``version`` (or failed it).

        Push subscribers only, unless ``include_pull``: a pull subscriber moves when it
        asks. With ``report_missing``, answer at once (``{"missing": True}``) if some
        subscriber lacks the version and the hub keeps nothing that new (a restart lost
        it): the caller, its writer, can offer it again (:meth:`restore`).
        """
        model = self._models.get(model_id)
        if model is None or version > model.latest:
            return {
                "error": UnknownModelError(
                    f"version {version} of model {model_id!r} was never pushed on hub {self._name!r} "
                    f"(newest: {model.latest if model and model.latest else None}; models here: "
                    f"{sorted(self._models)}); wait for a version push() returned"
                )
            }
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            laggards, failures = self._pending(model_id, version, include_pull)
            if laggards and report_missing and not any(v >= version for v in model.versions):
                return {"laggards": laggards, "failures": failures, "missing": True}
            if not laggards:
                if failures:  # a dead subscriber's failure is no failure of this version
                    await self._reap(failures)
                    laggards, failures = self._pending(model_id, version, include_pull)
                if not laggards:
                    return {"laggards": [], "failures": failures}
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                await self._reap(laggards + failures)
                laggards, failures = self._pending(model_id, version, include_pull)
                return {"laggards": laggards, "failures": failures}
            # Each record, drop or registration updates this waiter in O(1); it wakes once,
            # when no laggard is left, instead of re-scanning every subscriber per event.
            waiter = _Waiter(version, {r["subscriber"] for r in laggards}, include_pull)
            waiters = self._waiters.setdefault(model_id, set())
            waiters.add(waiter)
            try:
                while not waiter.event.is_set():
                    remaining = None if deadline is None else deadline - time.monotonic()
                    if remaining is not None and remaining <= 0:
                        break
                    step = _REAP_INTERVAL_S if remaining is None else min(remaining, _REAP_INTERVAL_S)
                    try:
                        await asyncio.wait_for(waiter.event.wait(), step)
                    except asyncio.TimeoutError:
                        await self._reap([{"subscriber": s} for s in waiter.pending])
            finally:
                waiters.discard(waiter)
                if not waiters:
                    self._waiters.pop(model_id, None)

    def _pending(
        self, model_id: str, version: int, include_pull: bool = True
    ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        laggards: list[dict[str, Any]] = []
        failures: list[dict[str, Any]] = []
        for sub in self._model_subs(model_id):
            if not (include_pull or sub.mode == "push"):
                continue
            if sub.applied is not None and sub.applied >= version:
                continue
            row = {
                "subscriber": sub.sub_id,
                "actor": sub.info.get("class_name"),
                "applied": sub.applied,
                "error": sub.last_error,
                "state": sub.state,
            }
            (failures if sub.failed >= version else laggards).append(row)
        return laggards, failures

    async def _alive(self, sub: _Subscriber) -> bool:
        """Whether a subscriber's actor may still run (a dead actor answers a ping at once)."""
        if sub.handle is None:  # known from before a restart: ask the GCS
            return await asyncio.to_thread(_actor_alive, str(sub.info.get("actor_id")))
        try:
            await asyncio.wait_for(sub.handle._raysync_ping.remote(), _PING_TIMEOUT_S)
        except ActorDiedError:
            return False
        except (asyncio.TimeoutError, Exception):
            return True  # busy or restarting: alive as far as we know
        sub.last_seen = time.monotonic()
        return True

    async def _reap(self, rows: list[dict[str, Any]]) -> None:
        """Drop the subscribers of ``rows`` whose actor is dead."""
        # A subscriber whose notification is in flight needs no ping: a dead actor fails that
        # call. Subscriptions of one actor share one ping.
        actors: dict[str, list[_Subscriber]] = {}
        for r in rows:
            sub = self._subs.get(r["subscriber"])
            if sub is None or (sub.task is not None and not sub.task.done()):
                continue
            group = self._groups.get(sub.group) if sub.group is not None else None
            if group is not None and group.task is not None and not group.task.done():
                continue
            actors.setdefault(str(sub.info.get("actor_id") or sub.sub_id), []).append(sub)

        async def check_actor(subs: list[_Subscriber]) -> None:
            if not await self._alive(subs[0]):
                for sub in subs:
                    self._drop(sub, "actor died")

        await asyncio.gather(*(check_actor(subs) for subs in actors.values()))

    async def status(self) -> dict[str, Any]:
        now = time.time()
        models = {}
        for model_id, model in sorted(self._models.items()):
            newest = model.newest
            models[model_id] = {
                "latest": model.latest or None,
                "versions_kept": sorted(model.versions),
                "bytes_per_version": newest.manifest.total_nbytes if newest else 0,
                "buckets": newest.manifest.num_buckets if newest else 0,
                "layout_hash": newest.manifest.layout_hash if newest else None,
                "pushes": model.pushes,
                "bytes_pushed": model.bytes_pushed,
                "last_push_time": model.last_push_time,
                "last_push_age_s": None if model.last_push_time is None else now - model.last_push_time,
                "writer": model.writer,
            }
        subs = []
        for sub in sorted(self._subs.values(), key=lambda s: (s.model_id, s.sub_id)):
            latest = self._models[sub.model_id].latest if sub.model_id in self._models else 0
            subs.append(
                {
                    "subscriber": sub.sub_id,
                    "model_id": sub.model_id,
                    "actor_id": sub.info.get("actor_id"),
                    "class_name": sub.info.get("class_name"),
                    "node_id": sub.info.get("node_id"),
                    "pid": sub.info.get("pid"),
                    "mode": sub.mode,
                    "apply": sub.info.get("apply"),
                    "applied": sub.applied,
                    "lag": latest - (sub.applied or 0),
                    "last_apply_time": sub.last_apply_time,
                    "last_apply_s": sub.last_apply_s,
                    "last_pause_s": sub.last_pause_s,
                    "last_buckets_fetched": sub.last_buckets_fetched,
                    "last_bytes_fetched": sub.last_bytes_fetched,
                    "last_prefetched": sub.last_prefetched,
                    "last_error": sub.last_error,
                    "state": sub.state,
                    "receivers": sub.receivers,
                    "placement": sub.info.get("placement"),
                }
            )
        return {
            "hub": self._name,
            "keep": self._keep,
            "uptime_s": now - self._started,
            "restored_models": self._restored,
            "models": models,
            "subscribers": subs,
        }


# ---------------------------------------------------------------------- client side


_RESTARTING = (ActorDiedError, ActorUnavailableError)


def call_hub(
    handle: Callable[[bool], Any],
    method: str,
    *args: Any,
    timeout: float | None = None,
    retry_s: float = _CLIENT_RETRY_S,
) -> Any:
    """Call a hub method; while the hub restarts (or was re-created), find it again and retry.

    The one retry loop every caller of the hub uses (clients, subscribers, adapters).

    Args:
        handle: returns the hub's actor handle; ``handle(True)`` looks it up afresh.
        method: the hub method.
        args: its arguments.
        timeout: seconds for the whole call, retries included (``GetTimeoutError`` after).
        retry_s: how long to keep retrying while the hub is unavailable.

    Example:
        >>> call_hub(lambda fresh: get_hub_actor("raysync"), "latest", "policy")  # doctest: +SKIP
    """
    now = time.monotonic()
    give_up = now + retry_s if timeout is None else now + min(retry_s, timeout)
    deadline = None if timeout is None else now + timeout
    delay, fresh = 0.05, False
    while True:
        try:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            return ray.get(getattr(handle(fresh), method).remote(*args), timeout=left)
        except _RESTARTING as err:
            if time.monotonic() >= give_up:
                raise
            logger.warning("hub unavailable (%s); retrying %s", type(err).__name__, method)
            fresh = True
            time.sleep(delay)
            delay = min(delay * 2, 1.0)


async def call_hub_async(
    handle: Callable[[bool], Any], method: str, *args: Any, timeout: float | None = None
) -> Any:
    """:func:`call_hub` for event loops (``asyncio.TimeoutError`` after ``timeout``)."""
    loop = asyncio.get_running_loop()
    deadline = None if timeout is None else loop.time() + timeout
    give_up = loop.time() + (_CLIENT_RETRY_S if timeout is None else min(_CLIENT_RETRY_S, timeout))
    delay, fresh = 0.05, False
    while True:
        try:
            left = None if deadline is None else max(0.0, deadline - loop.time())
            return await asyncio.wait_for(getattr(handle(fresh), method).remote(*args), left)
        except _RESTARTING as err:
            if loop.time() >= give_up:
                raise
            logger.warning("hub unavailable (%s); retrying %s", type(err).__name__, method)
            fresh = True
            await asyncio.sleep(delay)
            delay = min(delay * 2, 1.0)


def get_hub_actor(name: str = DEFAULT_HUB, namespace: str | None = None, *, keep: int | None = None) -> Any:
    """Get or create the named, detached hub actor (safe when many processes race).

    Example:
        >>> handle = get_hub_actor("raysync")  # doctest: +SKIP
    """
    if not ray.is_initialized():
        ray.init()
    return WeightHub.options(  # type: ignore[attr-defined]
        name=name,
        namespace=namespace or DEFAULT_NAMESPACE,
        lifetime="detached",
        get_if_exists=True,
        max_restarts=-1,
        max_concurrency=10_000,
    ).remote(name=name, keep=DEFAULT_KEEP if keep is None else keep)


def connect(
    name: str = DEFAULT_HUB,
    *,
    namespace: str | None = None,
    keep: int | None = None,
    takeover: bool = False,
    transport: str = "object_store",
) -> HubClient:
    """Connect to the hub called ``name``, creating it if no one has.

    Args:
        name: the hub's actor name; one hub serves many models.
        namespace: Ray namespace of the hub; ``None`` is raysync's own
            (``"raysync"``), so every driver, job and the CLI share it.
        keep: how many versions per model the hub keeps at least (older ones are
            released). ``None`` leaves the hub's setting alone (2 for a new hub);
            a hub never lowers ``keep`` because one client asked for fewer than
            another (an evaluation job's ``connect()`` cannot drop versions a
            trainer keeps).
        takeover: push even to models another live trainer writes; that
            trainer's later pushes are then refused (``StaleWriterError``).
            Without it, a second writer gets ``StaleWriterError``. A writer
            is a process or an actor: every client it makes shares one lease.
        transport: the client's default data path, ``"object_store"`` or
            ``"nixl"`` (Ray's tensor transport; see :mod:`raysync.transports.nixl`).

    Returns:
        A picklable :class:`HubClient`: hand it to trainer actors or tasks.

    Example:
        >>> import ray, raysync, torch
        >>> ray.init()  # doctest: +SKIP
        >>> hub = raysync.connect()
        >>> v = hub.push(torch.nn.Linear(4, 2))
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"hub name must be a non-empty string, got {name!r}")
    if keep is not None and (not isinstance(keep, int) or isinstance(keep, bool) or keep < 1):
        raise ValueError(f"keep must be None or an integer >= 1 (versions kept per model), got {keep!r}")
    client = HubClient(name, namespace=namespace, takeover=takeover, transport=transport)
    handle = get_hub_actor(name, namespace, keep=keep)
    ray.get(handle.configure.remote(keep))
    client._handle = handle
    return client


class HubClient:
    """What a trainer (or anyone) uses to push, wait, pull and inspect. Picklable.

    Get one from :func:`connect`. Every option is keyword-only.

    Example:
        >>> hub = raysync.connect()
        >>> v = hub.push(model)                     # returns once the snapshot is in the object store
        >>> hub.wait(v, timeout=30)                 # until every subscriber applied it
        >>> hub.pull()["fc", "weight"].shape
    """

    def __init__(
        self,
        name: str = DEFAULT_HUB,
        *,
        namespace: str | None = None,
        takeover: bool = False,
        transport: str = "object_store",
    ) -> None:
        _check_transport(transport)
        self.transport = transport
        self._pools: dict[str, Any] = {}
        self.name = name
        self.namespace = namespace or DEFAULT_NAMESPACE
        self.takeover = takeover
        self.retry_s = _CLIENT_RETRY_S
        self._handle: Any = None
        self._layouts: dict[tuple[Any, ...], Manifest] = {}
        self._separate: dict[str, frozenset[str]] = {}
        # The newest version this client pushed of each model (object store only): delta/keys
        # pushes start from it, and it is offered again to a hub that lost it in a restart.
        self._last: dict[str, _Version] = {}
        self.last_push: dict[str, Any] = {}

    def __reduce__(self) -> tuple[Any, ...]:
        # Only the address travels; the handle is looked up again where it lands.
        return (_restore_client, (self.name, self.namespace, self.takeover, self.transport))

    def __repr__(self) -> str:
        return f"HubClient(name={self.name!r}, namespace={self.namespace!r})"

    @property
    def actor(self) -> Any:
        """The hub's Ray actor handle (looked up by name on first use)."""
        if self._handle is None:
            self._handle = get_hub_actor(self.name, self.namespace)
        return self._handle

    def _call(self, method: str, *args: Any) -> Any:
        """Call the hub; while it restarts (or after it died), find it again and retry."""

        def handle(fresh: bool) -> Any:
            if fresh:
                self._handle = None  # a restarted or re-created hub is found by name
            return self.actor

        return call_hub(handle, method, *args, retry_s=self.retry_s)

    # ------------------------------------------------------------------ push
    def push(
        self,
        weights: Any,
        model_id: str = "policy",
        *,
        wait: bool = False,
        timeout: float | None = None,
        max_lag: int | None = None,
        keys: Iterable[str] | Callable[[str], bool] | None = None,
        dtype: torch.dtype | None = None,
        delta: bool = False,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        checksum: bool = False,
        check_finite: bool = False,
        transport: str | None = None,
        include_pull: bool = False,
    ) -> int:
        """Snapshot ``weights`` into the object store once and publish them as a new version.

        Returns as soon as the snapshot is taken: the caller may change its
        model right after. Subscribers apply the version in the background.

        Args:
            weights: an ``nn.Module``, a ``TensorDict`` or a (nested) state dict.
            model_id: which model this is; one hub serves several.
            wait: also wait until every subscriber of ``model_id`` applied it.
            timeout: seconds for ``wait=True`` and ``max_lag`` (``None``: no limit).
            max_lag: first wait while any subscriber is more than ``max_lag``
                versions behind, so the trainer never runs further ahead.
            keys: push only these tensors (exact keys, ``fnmatch`` patterns
                such as ``"*.lora_*"``, or a predicate on the key); the others
                keep the values of the previous version. Selected keys get
                buckets of their own, so only their bytes move.
            dtype: cast floating-point tensors to this dtype once, here
                (subscribers' parameters must have that dtype).
            delta: re-use the previous version's buckets whose bytes did not
                change; subscribers holding them skip them.
            bucket_bytes: target bucket size (a version is a few buckets).
            checksum: add per-bucket CRC32s that ``verify=True`` subscribers check.
            check_finite: refuse weights with NaN or Inf (names the tensors).
            transport: ``"object_store"`` or ``"nixl"``; default: the client's.
                NIXL sends full versions (no ``keys``, ``delta`` or ``checksum``).
            include_pull: let ``wait`` and ``max_lag`` wait for pull-mode
                subscribers too (by default only push subscribers hold the
                trainer back: a pull subscriber moves only when it asks).

        Returns:
            The version number the hub stamped (1, 2, ... per model).

        Raises:
            WeightMismatchError: the weights do not fit the subscribers' models
                (nothing is published; everyone keeps the previous version).
            InvalidWeightsError: empty weights, non-tensor leaves, ``keys``
                that match nothing, ``keys`` before any full push, NaN/Inf
                with ``check_finite``, or a version larger than the object store.
            StaleWriterError: another live trainer holds this model's writer
                lease (see ``connect(takeover=...)``).
            SyncTimeoutError: ``wait=True`` or ``max_lag`` and ``timeout`` passed first.

        Example:
            >>> v = hub.push(model)
            >>> v = hub.push(model, max_lag=2, timeout=60)          # bounded staleness
            >>> v = hub.push(model, keys=["*lora*"])                # adapters only
            >>> v = hub.push(model, dtype=torch.bfloat16, delta=True)
        """
        _check_model_id(model_id)
        _check_timeout(timeout)
        transport = transport or self.transport
        _check_transport(transport)
        if transport == "nixl" and (keys is not None or delta or checksum):
            raise ValueError("transport='nixl' sends whole versions: drop keys=, delta= and checksum=")
        if max_lag is not None:
            if not isinstance(max_lag, int) or isinstance(max_lag, bool) or max_lag < 1:
                raise ValueError(f"max_lag must be an integer >= 1 (versions), got {max_lag!r}")
            target = (self.latest(model_id) or 0) + 1 - max_lag
            if target >= 1:
                # A subscriber that failed an old version is not behind in a way waiting can fix
                # (this push brings it forward): only laggards hold the trainer back.
                self._wait(target, model_id, timeout, include_pull=include_pull, raise_failures=False)
        t0 = time.perf_counter()
        tensors = extract_tensors(weights)
        if dtype is not None:
            tensors = cast_floating(tensors, dtype)
        if check_finite:
            bad = [
                k for k, t in tensors.items() if t.is_floating_point() and not bool(torch.isfinite(t).all())
            ]
            if bad:
                raise InvalidWeightsError(
                    f"weights of {model_id!r} hold NaN or Inf in {bad[:20]}"
                    + (f" and {len(bad) - 20} more" if len(bad) > 20 else "")
                    + "; nothing was pushed"
                )
        selected = _select_keys(tensors, keys) if keys is not None else None
        prev = self._previous(model_id) if (delta or selected is not None) else None
        prev_buckets: list[Any] | None = None
        if prev is not None:
            prev_buckets = self._fetch_previous(model_id, prev, partial=selected is not None)
            if prev_buckets is None:
                prev = None  # its bytes are gone: a delta push sends everything
        if selected is not None:
            if prev is None:
                raise InvalidWeightsError(
                    f"push(keys=...) needs a previous full version of {model_id!r} to fill in the other "
                    "keys: push the whole model once first"
                )
            if prev.manifest.schema() != schema_of(tensors):
                raise InvalidWeightsError(
                    f"push(keys=...) needs the rest of the model to keep the structure of version "
                    f"{prev.version} of {model_id!r}; it changed, so push the whole model"
                )
            self._separate[model_id] = frozenset(selected)
        manifest = self._layout(tensors, bucket_bytes, self._separate.get(model_id, frozenset()))
        manifest = manifest.with_extra_state(extract_extra_state(weights))  # get_extra_state(), pickled
        if transport == "nixl":
            manifest = manifest.with_transport("nixl")
        capacity = _store_capacity() if transport == "object_store" else None
        if capacity is not None and sum(manifest.bucket_nbytes) > capacity:
            raise InvalidWeightsError(
                f"a version of {model_id!r} takes {sum(manifest.bucket_nbytes) / 2**30:.2f} GiB, more than "
                f"this node's object store ({capacity / 2**30:.2f} GiB): start Ray with a larger "
                "object_store_memory, or push less (dtype=torch.bfloat16, keys=...)"
            )
        if transport == "nixl":
            return self._push_nixl(
                model_id, tensors, manifest, t0, wait=wait, timeout=timeout, include_pull=include_pull
            )
        if prev is not None and prev_buckets is not None and selected is not None:
            # the other keys keep the previous version's bytes
            old = unpack(prev.manifest, prev_buckets)
            tensors = {k: (t if k in selected else old[k]) for k, t in tensors.items()}
        buckets = pack(tensors, manifest)
        if checksum:
            manifest = manifest.with_checksums(bucket_checksums(buckets))
        refs: list[ray.ObjectRef] = []
        put_bytes = puts = 0
        same_layout = prev is not None and prev.manifest.layout_hash == manifest.layout_hash
        for b, bucket in enumerate(buckets):
            if (
                same_layout
                and prev_buckets is not None
                and _unchanged(b, manifest, selected, delta, bucket, prev_buckets)
            ):
                refs.append(prev.refs[b])  # type: ignore[union-attr]
                continue
            refs.append(ray.put(bucket))
            put_bytes += manifest.bucket_nbytes[b]
            puts += 1
        del buckets, prev_buckets
        snapshot_s = time.perf_counter() - t0
        self.last_push = {
            "model_id": model_id,
            "snapshot_s": snapshot_s,
            "bytes_put": put_bytes,
            "buckets_put": puts,
            "buckets": len(refs),
        }
        pusher = {**_writer_identity(), **self.last_push}
        reply = self._call("publish", model_id, manifest, refs, pusher, self.takeover)
        if "error" in reply:
            raise reply["error"]
        version = int(reply["version"])
        self._last[model_id] = _Version(version, manifest, refs, time.time(), pusher)
        metrics.record_push(self.name, model_id, seconds=time.perf_counter() - t0, nbytes=put_bytes)
        populate_store_mapping(True, put_bytes)  # once per process: later puts take no page faults
        logger.debug(
            "pushed %r version %d: %.1f MiB put in %d of %d bucket(s), snapshot %.3f s",
            model_id,
            version,
            put_bytes / 2**20,
            self.last_push["buckets_put"],
            manifest.num_buckets,
            snapshot_s,
        )
        if wait:
            self.wait(version, model_id, timeout=timeout, include_pull=include_pull)
        return version

    def _push_nixl(
        self,
        model_id: str,
        tensors: dict[str, Any],
        manifest: Manifest,
        t0: float,
        *,
        wait: bool,
        timeout: float | None,
        include_pull: bool,
    ) -> int:
        from raysync.transports.nixl import SnapshotPool

        pool = self._pools.setdefault(model_id, SnapshotPool())
        refs = pool.put(tensors, manifest)
        snapshot_s = time.perf_counter() - t0
        self.last_push = {
            "model_id": model_id,
            "transport": "nixl",
            "snapshot_s": snapshot_s,
            "bytes_put": 0,  # nothing in the object store: receivers read the trainer's buffers
            "bytes_snapshot": (snapshot_bytes := sum(manifest.bucket_nbytes)),
            "buckets_put": len(refs),
            "buckets": len(refs),
        }
        reply = self._call(
            "publish", model_id, manifest, refs, {**_writer_identity(), **self.last_push}, self.takeover
        )
        if "error" in reply:
            raise reply["error"]
        version = int(reply["version"])
        metrics.record_push(
            self.name, model_id, seconds=time.perf_counter() - t0, nbytes=snapshot_bytes, transport="nixl"
        )
        logger.debug("pushed %r version %d over NIXL, snapshot %.3f s", model_id, version, snapshot_s)
        if wait:
            self.wait(version, model_id, timeout=timeout, include_pull=include_pull)
        return version

    def _previous(self, model_id: str) -> _Version | None:
        """The model's newest version: this client's own if it pushed it, else the hub's."""
        latest = self.latest(model_id)
        mine = self._last.get(model_id)
        if mine is not None and mine.version == latest:
            return mine
        info: dict[str, Any] | None = self._call("get", model_id)
        if info is None or "error" in info:
            return None
        return _Version(info["version"], info["manifest"], info["refs"], 0.0, {})

    def _fetch_previous(self, model_id: str, prev: _Version, *, partial: bool) -> list[Any] | None:
        """The previous version's buckets (zero-copy); None for a delta push if they are gone."""
        try:
            return list(ray.get(list(prev.refs)))
        except (ObjectLostError, RayTaskError) as err:
            if isinstance(err, RayTaskError) and not isinstance(err.cause, ObjectLostError):
                raise
            self._call("lost", model_id, prev.version)
            if self._last.get(model_id) is prev:
                del self._last[model_id]
            if partial:
                raise InvalidWeightsError(
                    f"push(keys=...) fills the other keys from version {prev.version} of {model_id!r}, "
                    "whose bytes are gone (the process that pushed it died): push the whole model once"
                ) from None
            logger.info(
                "version %d of %r is gone (its pusher died): this delta push sends every bucket",
                prev.version,
                model_id,
            )
            return None

    def _layout(self, tensors: dict[str, Any], bucket_bytes: int, separate: frozenset[str]) -> Manifest:
        key = (bucket_bytes, separate, tuple((k, *v) for k, v in schema_of(tensors).items()))
        manifest = self._layouts.get(key)
        if manifest is None:
            manifest = plan_layout(tensors, bucket_bytes=bucket_bytes, separate=separate)
            self._layouts = {key: manifest}  # one layout cached: structure rarely changes
        return manifest

    # ------------------------------------------------------------------ wait / query
    def wait(
        self,
        version: int,
        model_id: str = "policy",
        *,
        timeout: float | None = None,
        include_pull: bool = False,
    ) -> None:
        """Block until every push subscriber of ``model_id`` applied ``version`` (or a newer one).

        Subscribers whose actor died are dropped, not waited for. Pull-mode
        subscribers change version only when they call ``raysync_sync()``, so
        they are waited for only with ``include_pull=True``. After a hub restart
        the subscribers it knew are waited for until they check in again, and
        if the restart lost the version, this client offers it again (when it
        pushed it).

        Args:
            version: a version ``push()`` returned.
            model_id: the model.
            timeout: seconds (``None``: no limit).
            include_pull: also wait for pull-mode subscribers.

        Raises:
            SyncTimeoutError: ``timeout`` seconds passed; the message names the laggards.
            ApplyError: some subscriber failed to apply it (it keeps its previous version).
            UnknownModelError: ``version`` of ``model_id`` was never pushed (a wait for it
                could only run out).

        Example:
            >>> hub.wait(hub.push(model), timeout=30)
            >>> hub.wait(v, timeout=30, include_pull=True)   # evaluators that pull too
        """
        self._wait(version, model_id, timeout, include_pull=include_pull, raise_failures=True)

    def _wait(
        self, version: int, model_id: str, timeout: float | None, *, include_pull: bool, raise_failures: bool
    ) -> None:
        _check_model_id(model_id)
        _check_timeout(timeout)
        if isinstance(version, bool) or not isinstance(version, int) or version < 1:
            raise ValueError(f"version must be an integer >= 1 (what push() returned), got {version!r}")
        deadline = None if timeout is None else time.monotonic() + timeout
        mine = self._last.get(model_id)
        offer = mine is not None and mine.version >= version
        reply = self._call("wait", model_id, version, timeout, include_pull, offer)
        if reply.get("missing") and mine is not None:
            # The hub restarted and lost the version: offer ours again, then wait as usual.
            self._call("restore", model_id, mine.version, mine.manifest, mine.refs, _writer_identity())
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            reply = self._call("wait", model_id, version, left, include_pull, False)
        if "error" in reply:
            raise reply["error"]
        if reply["laggards"]:
            rows = reply["laggards"]
            names = ", ".join(
                f"{r['subscriber']} ({r['actor']}, applied {r['applied']}"
                + (f", {r['state']}" if r["state"] != "live" else "")
                + (f", error: {r['error']}" if r["error"] else "")
                + ")"
                for r in rows[:10]
            )
            raise SyncTimeoutError(
                f"{len(rows)} subscriber(s) of {model_id!r} did not apply version {version} "
                f"within {timeout} s: {names}",
                laggards=rows,
            )
        if reply["failures"] and raise_failures:
            rows = reply["failures"]
            names = "; ".join(f"{r['subscriber']} ({r['actor']}): {r['error']}" for r in rows[:10])
            raise ApplyError(
                f"{len(rows)} subscriber(s) of {model_id!r} failed to apply version {version} "
                f"and kept their previous weights: {names}",
                failures=rows,
            )

    def latest(self, model_id: str = "policy") -> int | None:
        """The newest version of ``model_id`` (``None`` before the first push).

        Example:
            >>> hub.latest()
            12
        """
        _check_model_id(model_id)
        result: int | None = self._call("latest", model_id)
        return result

    def pull(self, model_id: str = "policy", version: int | None = None) -> TensorDict:
        """The weights of a kept version (newest by default), as a nested TensorDict.

        The tensors are private copies: change them freely. Modules' extra
        state (``get_extra_state()``) is not in the TensorDict; it travels in
        the version's manifest and subscribers' modules get it
        (``raysync.weights.Manifest.extra_states()``).

        Raises:
            UnknownModelError: nothing pushed for ``model_id``, or ``version`` not kept.

        Example:
            >>> td = hub.pull()
            >>> model.load_state_dict(td.flatten_keys(".").to_dict())
        """
        _check_model_id(model_id)
        info = self._call("get", model_id, version)
        if info is not None and "error" in info:
            raise info["error"]
        assert info is not None
        buckets = ray.get(info["refs"])
        tensors = {k: t.clone() for k, t in unpack(info["manifest"], buckets).items()}
        return to_tensordict(tensors)

    def status(self) -> dict[str, Any]:
        """Models (versions kept, bytes, last push) and subscribers (applied, lag, errors).

        Example:
            >>> hub.status()["subscribers"][0]["lag"]
            0
        """
        result: dict[str, Any] = self._call("status")
        return result


def _select_keys(tensors: dict[str, Any], keys: Iterable[str] | Callable[[str], bool]) -> set[str]:
    """The keys a partial push sends: exact names, fnmatch patterns, or a predicate."""
    if callable(keys):
        chosen = {k for k in tensors if keys(k)}
        if not chosen:
            raise InvalidWeightsError("push(keys=<predicate>) selected no tensor")
        return chosen
    if isinstance(keys, str):
        keys = [keys]
    chosen = set()
    for pattern in keys:
        hits = {k for k in tensors if fnmatch.fnmatchcase(k, pattern)}
        if not hits:
            raise InvalidWeightsError(
                f"push(keys=...): {pattern!r} matches no tensor; keys look like {sorted(tensors)[:5]}"
            )
        chosen |= hits
    return chosen


def _unchanged(
    b: int,
    manifest: Manifest,
    selected: set[str] | None,
    delta: bool,
    bucket: list[Any],
    prev_buckets: list[Any],
) -> bool:
    """Whether bucket ``b`` can re-use the previous version's object (same layout assumed)."""
    if selected is not None and not any(e.key in selected for e in manifest.bucket_entries(b)):
        return True  # holds only keys this partial push leaves alone
    return delta and same_bytes(bucket, prev_buckets[b])


def _restore_client(
    name: str, namespace: str, takeover: bool = False, transport: str = "object_store"
) -> HubClient:
    return HubClient(name, namespace=namespace, takeover=takeover, transport=transport)


def _check_transport(transport: Any) -> None:
    if transport not in TRANSPORTS:
        raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")


def _writer_identity() -> dict[str, Any]:
    """Who is pushing: an actor, or a job (its driver and its tasks share one lease).

    Task workers are pooled and outlive their tasks, so a lease held by one would
    outlive the task and name an idle process; a job's tasks and driver are one writer.
    """
    ctx = ray.get_runtime_context()
    actor_id = ctx.get_actor_id()
    job_id = ctx.get_job_id()
    # get_task_id() would log a warning on every push from a driver: ask the worker's mode.
    is_task = getattr(getattr(ctx, "worker", None), "mode", None) == ray._private.worker.WORKER_MODE
    kind = "actor" if actor_id else ("tasks" if is_task else "driver")
    return {
        "writer_id": actor_id or f"job:{job_id}",
        "kind": kind,
        "actor_id": actor_id,
        "job_id": job_id,
        "pid": os.getpid(),
        "host": socket.gethostname(),
    }


_CAPACITY_TTL_S = 60.0
_capacity_cache: dict[str, tuple[float, float | None]] = {}  # node id -> (looked up at, bytes)


def _store_capacity() -> float | None:
    """Object-store bytes of the node this process runs on (None if unknown).

    Looked up in the GCS's node table at most once a minute per node: the
    lookup costs ~0.7 ms, a noticeable part of a small push.
    """
    try:
        node_id = ray.get_runtime_context().get_node_id()
        cached = _capacity_cache.get(node_id)
        if cached is not None and time.monotonic() - cached[0] < _CAPACITY_TTL_S:
            return cached[1]
        capacity = None
        for node in ray.nodes():
            if node.get("NodeID") == node_id:
                capacity = float(node["Resources"]["object_store_memory"])
        _capacity_cache[node_id] = (time.monotonic(), capacity)
        return capacity
    except Exception:
        return None


def _check_model_id(model_id: Any) -> None:
    if not isinstance(model_id, str) or not model_id:
        raise ValueError(f"model_id must be a non-empty string, got {model_id!r}")


def _check_timeout(timeout: Any) -> None:
    check_timeout(timeout)
