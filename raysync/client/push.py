"""The push pipeline: select keys, cast, check, lay out, snapshot, publish.

One path for every data path (:mod:`raysync.transports`): only the snapshot step
differs. The pipeline remembers the last version its client pushed of each model
(object store only): ``keys=`` and ``delta=`` pushes start from it without asking the
hub, and a hub whose restart lost it gets it offered again.

Example:
    >>> pipeline = PushPipeline(publish=lambda *args: 1)
    >>> pushed = pipeline.push(PushRequest(model, "policy"))      # doctest: +SKIP
    >>> pushed.version
    1
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import ray
import torch
from ray.exceptions import ObjectLostError, RayTaskError

from raysync import _compat
from raysync._checks import require_ray
from raysync.client import deadline
from raysync.client.delta import Delta, SparseDelta, delta_mode, select_keys, sparse_stats
from raysync.client.identity import writer_identity
from raysync.client.posted import PostedParts
from raysync.client.sharded_push import push_shard
from raysync.core.codec import unpack
from raysync.core.dtensor import is_sharded, mesh_of, mesh_rank
from raysync.core.extract import extract_extra_state, extract_with_order
from raysync.core.group import GroupIdentity, identify_group
from raysync.core.layout import DEFAULT_BUCKET_BYTES, Manifest, cast_floating, plan_layout, schema_of
from raysync.errors import InvalidWeightsError
from raysync.hub.state import Version
from raysync.hub.state.rounds import Ahead, PartTaken
from raysync.transports.base import Reuse, Snapshot, Transport, reuse_unchanged, transport_for
from raysync.transports.registry import fetcher

__all__ = ["Offer", "PushPipeline", "PushRequest", "Pushed"]

logger = logging.getLogger(__name__)

Publish = Callable[[str, Manifest, list[Any]], int]
"""``(model_id, manifest, refs) -> version``: the hub's stamp (raises what the hub refuses)."""
Contribute = Callable[[str, Any, list[Any], dict[str, Any], float, bool, "int | None"], PartTaken]
"""``(model_id, part, refs, pusher, timeout, settle, previous) -> PartTaken``: a sharded rank's part
to the hub; its round's number once recorded, or (``settle``) once published; ``previous`` is the
number the rank's last unsettled push got (the answer says if it was abandoned since)."""
Post = Callable[[str, Any, list[Any], dict[str, Any], float, "int | None", int], Any]
"""``(model_id, part, refs, pusher, timeout, previous, stamp) -> ObjectRef``: a sharded rank's part
that the rank numbered itself (from the :class:`Ahead` of an earlier answer), sent without waiting
(its answer is read later: :class:`~raysync.client.posted.PostedParts`)."""
GiveUp = Callable[[str, str, int, int, str], object]
"""``(model_id, group token, push, rank, why)``: a sharded rank's push raised before its part was
recorded; the hub abandons that push (sent without waiting, never raises)."""
Previous = Callable[[str], "Version | None"]
"""``model_id -> the hub's newest version``, for keys/delta pushes after another writer's."""


@dataclass(frozen=True)
class PushRequest:
    """One ``hub.push``: what to push and how (see :meth:`raysync.HubClient.push`)."""

    weights: Any
    model_id: str
    keys: Iterable[str] | Callable[[str], bool] | None = None
    dtype: torch.dtype | None = None
    delta: Delta = False
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    checksum: bool = False
    check_finite: bool = False
    transport: str = "object_store"
    group_timeout: float = 60.0  # a sharded push: how long to wait for every rank's shard


@dataclass(frozen=True)
class Offer:
    """What a writer offers a hub whose restart lost its newest version (:meth:`.HubCalls.offer`).

    ``version`` is the version offered; ``part``: a sharded rank's part of it (the hub's
    ``restore_part``), else a whole version (``restore``); ``args`` go to that call before the
    writer's identity.
    """

    version: int
    part: bool
    args: tuple[Any, ...]


@dataclass
class _Ticket:
    """A sharded push's place: its group, its number there, this rank, whether the hub has its part."""

    group: GroupIdentity
    round: int
    rank: int
    recorded: bool = False
    posted: bool = False  # numbered by the rank from its group's block, sent without waiting


@dataclass(frozen=True)
class Pushed:
    """What a push did: the version and what it cost (``HubClient.last_push``)."""

    version: int
    stats: dict[str, Any]


class PushPipeline:
    """The push steps of one client (it keeps layouts, partial-push keys and the last version)."""

    def __init__(
        self,
        publish: Publish,
        *,
        previous: Previous | None = None,
        lost: Any = None,
        contribute: Contribute | None = None,
        post: Post | None = None,
        give_up: GiveUp | None = None,
    ) -> None:
        self._publish = publish
        self._contribute = contribute
        self._post = post
        self._give_up = give_up
        self._rounds: dict[tuple[str, str], int] = {}  # sharded pushes of each (model, group token)
        self._groups: dict[tuple[int, ...], tuple[Any, GroupIdentity]] = {}  # per process group
        # Sharded: the layout of this rank's part the hub published last (a push of another waits
        # for its round), and the number of the last push that did not wait (its failure raises next).
        self._shard_confirmed: dict[str, Any] = {}
        self._shard_unsettled: dict[str, int] = {}
        # How the hub numbers the group's next pushes (group token, Ahead): parts of those are
        # numbered here and posted without waiting for the hub, as a single writer's versions are.
        self._shard_ahead: dict[str, tuple[str, Ahead | None]] = {}
        self.posted = PostedParts()
        self._shard_last: dict[str, Snapshot] = {}  # this rank's last sharded push (keys= fills from it)
        self._previous_of = previous
        self._lost = lost
        self._transports: dict[str, Transport] = {}
        self._layouts: dict[tuple[Any, ...], Manifest] = {}
        self._separate: dict[str, frozenset[str]] = {}
        self.last: dict[str, Version] = {}  # the newest version this client pushed, per model
        self._shard_offer: dict[str, Offer] = {}  # this rank's part of its newest sharded version

    def close(self) -> None:
        """Release what this client's data paths hold for later pushes (:meth:`.Transport.close`)."""
        for transport in self._transports.values():
            transport.close()

    def push(
        self,
        request: PushRequest,
        *,
        writer: dict[str, Any],
        before: Callable[[], None] | None = None,
        bound: float | None = None,
    ) -> Pushed:
        """Run every step; returns once the snapshot is taken and the hub stamped it.

        ``before`` runs once the weights are read and, for a sharded push, once the push is
        numbered (the client's checks that may wait or raise: ``max_lag``, earlier refusals).
        A sharded push that raises before its part reached the hub tells the hub to abandon
        that push, so the ranks' numbering stays in step whatever raised on one rank. The
        hub's answers after ``before`` come within ``bound`` seconds (:mod:`raysync.client.deadline`).
        """
        t0 = time.perf_counter()
        model_id = request.model_id
        transport = self._transports.get(request.transport) or self._transports.setdefault(
            request.transport, transport_for(request.transport)
        )
        _, sparse = delta_mode(request.delta)  # ValueError naming the choices
        if not transport.info.partial and (request.keys is not None or request.delta or request.checksum):
            raise ValueError(
                f"transport={request.transport!r} sends whole versions: drop keys=, delta= and checksum="
            )
        raw, order = extract_with_order(request.weights)
        if is_sharded(raw):  # DTensor weights: this rank pushes its own shards
            if sparse:
                raise ValueError(
                    'delta="sparse" takes one writer\'s weights; a sharded push takes delta=True'
                )
            ticket = self._open_round(model_id, raw, request.group_timeout)
            try:
                if before is not None:
                    before()
                with deadline.within(bound):
                    return self._push_shard(request, raw, writer, transport, ticket)
            except BaseException as err:
                if not ticket.recorded:
                    self._abandon_round(model_id, ticket, err)
                raise
        if before is not None:
            before()
        with deadline.within(bound):
            return self._push_whole(request, raw, writer, transport, t0, order)

    def _push_whole(
        self,
        request: PushRequest,
        raw: dict[str, torch.Tensor],
        writer: dict[str, Any],
        transport: Transport,
        t0: float,
        order: list[str],
    ) -> Pushed:
        model_id = request.model_id
        sparse = delta_mode(request.delta)[1]
        tensors = self._tensors(request, raw)
        selected = select_keys(tensors, request.keys) if request.keys is not None else None
        prev, prev_buckets = (
            self._previous(model_id, partial=selected is not None)
            if (request.delta or selected is not None)
            else (None, None)
        )
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
        manifest = self._layout(tensors, request.bucket_bytes, self._separate.get(model_id, frozenset()))
        manifest = manifest.with_extra_state(extract_extra_state(request.weights))  # get_extra_state()
        manifest = manifest.with_order(order)  # the weights' own key order, for pull(state_dict=True)
        if transport.info.object_store:
            _check_capacity(model_id, manifest)
        reuse: Reuse | None = None
        if prev is not None and prev_buckets is not None:
            if selected is not None:  # the other keys keep the previous version's bytes
                old = unpack(prev.manifest, prev_buckets)
                tensors = {k: (t if k in selected else old[k]) for k, t in tensors.items()}
            if prev.manifest.layout_hash == manifest.layout_hash:
                # delta: buckets whose bytes are the same (sparse: compared element by element there)
                same = prev_buckets if request.delta and not sparse else None
                reuse = reuse_unchanged(prev.refs, manifest, selected, same)
                if sparse:  # a patch besides each bucket where few changed
                    reuse = SparseDelta(reuse, manifest, prev_buckets, prev.refs, prev.version)
        snap = transport.snapshot(model_id, tensors, manifest, checksum=request.checksum, reuse=reuse)
        if sparse:
            patched = reuse if isinstance(reuse, SparseDelta) else None
            snap.manifest = patched.attach(snap.manifest) if patched is not None else snap.manifest
            snap.stats = {**snap.stats, **sparse_stats(patched)}
        del tensors, prev_buckets
        snapshot_s = time.perf_counter() - t0
        stats = {
            "model_id": model_id,
            "snapshot_s": snapshot_s,
            "bytes_put": snap.bytes_put,  # object-store bytes (NIXL: none; see bytes_snapshot)
            "buckets_put": snap.buckets_put,
            "buckets": len(snap.refs),
            **snap.stats,
        }
        pusher = {**writer, **stats}
        version = self._publish(model_id, snap.manifest, snap.refs)
        if snap.keep_locally:
            self.last[model_id] = Version(version, snap.manifest, snap.refs, time.time(), pusher)
        stats["seconds"] = time.perf_counter() - t0
        stats["bytes"] = snap.stats.get("bytes_snapshot", snap.bytes_put)
        logger.debug(
            "pushed %r version %d over %s: %.1f MiB in %d of %d bucket(s), snapshot %.3f s",
            model_id,
            version,
            transport.name,
            snap.bytes_put / 2**20,
            snap.buckets_put,
            manifest.num_buckets,
            snapshot_s,
        )
        return Pushed(version, stats)

    def _open_round(self, model_id: str, tensors: dict[str, Any], timeout: float) -> _Ticket:
        """Number this rank's sharded push of ``model_id`` (first, for each process group, the
        ranks agree on their group: :func:`~raysync.core.group.identify_group`)."""
        if self._contribute is None:
            raise ValueError("this push pipeline takes no sharded (DTensor) weights")
        mesh = mesh_of(tensors)
        groups = tuple(mesh.get_group(dim) for dim in range(mesh.ndim))
        key = tuple(id(g) for g in groups)
        known = self._groups.get(key)
        if known is None:
            ident = identify_group(mesh, writer_identity(), timeout=timeout)
            if len(self._groups) >= 8:  # process groups made again and again: keep the newest
                self._groups.pop(next(iter(self._groups)))
            self._groups[key] = (groups, ident)  # the groups held: their ids stay theirs
        else:
            ident = known[1]
        rank, _ = mesh_rank(mesh)
        count = (model_id, ident.token)
        self._rounds[count] = number = self._rounds.get(count, 0) + 1
        return _Ticket(ident, number, rank)

    def _abandon_round(self, model_id: str, ticket: _Ticket, err: BaseException) -> None:
        if self._give_up is None:
            return
        why = f"{type(err).__name__}: {err}"[:500]
        try:
            self._give_up(model_id, ticket.group.token, ticket.round, ticket.rank, why)
        except Exception as failed:  # the hub is gone or Ray shut down: the round expires instead
            logger.info(
                "could not tell the hub that push %d of %r was given up: %s", ticket.round, model_id, failed
            )

    def _push_shard(
        self,
        request: PushRequest,
        tensors: dict[str, Any],
        writer: dict[str, Any],
        transport: Transport,
        ticket: _Ticket,
    ) -> Pushed:
        assert self._contribute is not None
        contribute = self._contribute
        model_id = request.model_id
        selected = select_keys(tensors, request.keys) if request.keys is not None else None
        # keys= pushed keys are laid apart (in the rank's layout and the whole one) from then on
        separate = self._separate.get(model_id, frozenset()) if selected is None else frozenset(selected)

        def hand(model_id: str, part: Any, refs: list[Any], pusher: dict[str, Any]) -> int:
            # A rank's first push of a layout waits until its round is published (what the hub
            # refuses of it raises here); later ones return once the hub recorded the part, or,
            # numbered here from the group's block (the hub's Ahead), at once.
            layout = (part.world, part.rank, part.specs, part.manifest.layout_hash)
            settle = self._shard_confirmed.get(model_id) != layout
            previous = self._shard_unsettled.pop(model_id, None)
            pusher = {**pusher, "lead": ticket.group.lead}
            if not self.posted.read(model_id, wait=False):  # a push it posted was not taken: ask again
                self._shard_ahead.pop(model_id, None)
                self.posted.raise_stale(model_id)
            token, ahead = self._shard_ahead.get(model_id, ("", None))
            post, stamp = self._post, None
            if not settle and post is not None and ahead is not None and token == ticket.group.token:
                stamp = ahead.number(ticket.round)
            try:
                if post is not None and stamp is not None:  # posted; its answer is read by a later call
                    ref = post(model_id, part, refs, pusher, request.group_timeout, previous, stamp)
                    self.posted.add(model_id, stamp, ref)
                    version, ticket.posted = stamp, True
                else:
                    taken = contribute(model_id, part, refs, pusher, request.group_timeout, settle, previous)
                    if taken.earlier is not None:
                        logger.warning("an earlier push of %r was not published: %s", model_id, taken.earlier)
                    version, self._shard_ahead[model_id] = taken.version, (ticket.group.token, taken.ahead)
            except BaseException:
                self._shard_confirmed.pop(model_id, None)
                self._shard_last.pop(model_id, None)  # a keys= push must not fill from a failed one
                raise
            ticket.recorded = True
            if settle:
                self._shard_confirmed[model_id] = layout
            else:
                self._shard_unsettled[model_id] = version
            self._shard_offer[model_id] = Offer(version, True, (model_id, version, part, list(refs)))
            return version

        version, stats, snap = push_shard(
            request,
            tensors,
            hand,
            round=ticket.round,
            group=ticket.group.token,
            writer=writer,
            transport=transport,
            selected=selected,
            separate=separate,
            previous=self._shard_last.get(model_id),
        )
        self._shard_last[model_id] = snap
        self._separate[model_id] = separate
        stats["one_way"] = ticket.posted
        return Pushed(version, stats)

    def offer(self, model_id: str) -> Offer | None:
        """What this client offers a hub whose restart lost its newest version of ``model_id``.

        One writer's whole version (the hub keeps it again), or a sharded rank's part of its
        newest version (the hub keeps the version again once every rank offered its part).
        ``None`` if this client pushed none it still holds.
        """
        mine = self.last.get(model_id)
        shard = self._shard_offer.get(model_id)
        if shard is not None and (mine is None or shard.version > mine.version):
            return shard
        if mine is None:
            return None
        return Offer(mine.version, False, (model_id, mine.version, mine.manifest, mine.refs))

    def _tensors(self, request: PushRequest, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if request.dtype is not None:
            tensors = cast_floating(tensors, request.dtype)
        if request.check_finite:
            bad = [
                k for k, t in tensors.items() if t.is_floating_point() and not bool(torch.isfinite(t).all())
            ]
            if bad:
                raise InvalidWeightsError(
                    f"weights of {request.model_id!r} hold NaN or Inf in {bad[:20]}"
                    + (f" and {len(bad) - 20} more" if len(bad) > 20 else "")
                    + "; nothing was pushed"
                )
        return tensors

    def _previous(self, model_id: str, *, partial: bool) -> tuple[Version | None, list[Any] | None]:
        """The model's newest version (this client's own if it pushed one) and its buckets.

        A delta push re-uses only buckets whose bytes equal this client's last version,
        so it needs no hub call; a partial push fills the other keys from the newest
        version, so it asks the hub unless that is this client's. ``(None, None)`` for
        a delta push whose previous bytes are gone (its pusher died).
        """
        prev = self.last.get(model_id)
        if self._previous_of is not None and (prev is None or partial):
            newest = self._previous_of(model_id)
            if newest is not None and (prev is None or newest.version != prev.version):
                prev = newest
        if prev is None:
            return None, None
        try:
            require_ray("push")
            every = range(prev.manifest.num_buckets)
            return prev, list(fetcher(prev.manifest.transport)(prev.manifest, prev.refs, every, timeout=None))
        except (ObjectLostError, RayTaskError) as err:
            if isinstance(err, RayTaskError) and not isinstance(err.cause, ObjectLostError):
                raise
        if self._lost is not None:
            self._lost(model_id, prev.version)
        if self.last.get(model_id) is prev:
            del self.last[model_id]
        if partial:
            raise InvalidWeightsError(
                f"push(keys=...) fills the other keys from version {prev.version} of {model_id!r}, "
                "whose bytes are gone (the process that pushed it died): push the whole model once"
            )
        logger.info(
            "version %d of %r is gone (its pusher died): this delta push sends every bucket",
            prev.version,
            model_id,
        )
        return None, None

    def _layout(self, tensors: dict[str, Any], bucket_bytes: int, separate: frozenset[str]) -> Manifest:
        key = (bucket_bytes, separate, tuple((k, *v) for k, v in schema_of(tensors).items()))
        manifest = self._layouts.get(key)
        if manifest is None:
            manifest = plan_layout(tensors, bucket_bytes=bucket_bytes, separate=separate)
            self._layouts = {key: manifest}  # one layout cached: structure rarely changes
        return manifest


_CAPACITY_TTL_S = 60.0
_capacity_cache: dict[str, tuple[float, float | None]] = {}  # node id -> (looked up at, bytes)


def _check_capacity(model_id: str, manifest: Manifest) -> None:
    capacity = _store_capacity()
    if capacity is not None and sum(manifest.bucket_nbytes) > capacity:
        raise InvalidWeightsError(
            f"a version of {model_id!r} takes {sum(manifest.bucket_nbytes) / 2**30:.2f} GiB, more than "
            f"this node's object store ({capacity / 2**30:.2f} GiB): start Ray with a larger "
            "object_store_memory, or push less (dtype=torch.bfloat16, keys=...)"
        )


def _store_capacity() -> float | None:
    """Object-store bytes of the node this process runs on (None if unknown).

    Looked up in the GCS's node table at most once a minute per node: the lookup
    costs ~0.7 ms, a noticeable part of a small push.
    """
    try:
        # without Ray's auto-init: a push racing ray.shutdown() must not start a new Ray here
        node_id = _compat.runtime_context_no_start().get_node_id()
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
