"""What users hold: the picklable ``HubClient`` (push, wait, pull, status), from :func:`raysync.connect`.

Ownership: Ray >= 2.56 has no ``ray.put(_owner=...)``, so the process that pushed a
version owns its objects. If that process dies, the versions it pushed can no longer
be fetched (subscribers keep the version they applied, and the next push from a live
trainer repairs everything).

Example:
    >>> import ray, raysync, torch
    >>> ray.init()  # doctest: +SKIP
    >>> hub = raysync.connect()
    >>> v = hub.push(torch.nn.Linear(4, 2))
    >>> hub.latest()
    1
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, Literal, overload

import torch
from ray.exceptions import GetTimeoutError

from raysync import _compat
from raysync._checks import check_model_id, check_timeout, require_ray
from raysync._protocol import DEFAULT_HUB, DEFAULT_NAMESPACE
from raysync.client import deadline
from raysync.client.hub_calls import HubCalls
from raysync.client.identity import writer_identity
from raysync.client.locate import RETRY_S, call_hub, get_hub_actor, needs_ray
from raysync.client.model_ids import LATEST_NONE, note_absent
from raysync.client.push import PushRequest
from raysync.client.waiting import wait_for, wait_within_lag
from raysync.client.writer import Writer, alive
from raysync.core.codec import unpack
from raysync.core.extract import state_dict_tensordict
from raysync.core.layout import DEFAULT_BUCKET_BYTES
from raysync.hub import metrics
from raysync.hub.settings import HubSettings
from raysync.transports.base import check_transport
from raysync.transports.fetch import fetch
from raysync.transports.registry import info as transport_info

if TYPE_CHECKING:
    from tensordict import TensorDict

__all__ = ["HubClient"]

logger = logging.getLogger(__name__)


class HubClient:
    """What a trainer (or anyone) uses to push, wait, pull and inspect. Picklable.

    Get one from :func:`connect`. Every option is keyword-only.

    Attributes:
        retry_s: seconds a call without a timeout of its own (``latest``, ``status``, ``pull``,
            a push's answers from the hub) waits for the hub, retrying while it restarts:
            :class:`~raysync.SyncTimeoutError` after (60 s; whatever the hub does).

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
        check_transport(transport)
        self.transport = transport
        self.name = name
        self.namespace = namespace or DEFAULT_NAMESPACE
        self.takeover = takeover
        self.retry_s = RETRY_S
        self._handle: Any = None
        me = weakref.ref(self)
        self._writer = Writer(name, self.namespace, takeover=takeover, calls=lambda: alive(me)._calls)
        self._posting: dict[str, Any] = {}  # the hub's methods bound with retries, for _post
        self._posting_to: Any = None

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
        """Call the hub within the call's deadline (:mod:`raysync.client.deadline`; ``retry_s`` outside
        one); while it restarts (or after it died), find it again and retry."""

        def handle(fresh: bool) -> Any:
            if fresh:
                self._handle = None  # a restarted or re-created hub is found by name
            return self.actor

        timeout = deadline.left(self.retry_s)
        try:
            if timeout is not None and timeout <= 0:  # nothing sent: the call is out of time
                raise GetTimeoutError(method)
            return call_hub(handle, method, *args, timeout=timeout, retry_s=self.retry_s)
        except GetTimeoutError:
            raise deadline.timed_out(self.name, method, self.retry_s) from None

    def _post(self, method: str, *args: Any) -> Any:
        """Call the hub without waiting: the reply's ``ObjectRef`` (Ray sends one caller's calls in order)."""
        # Retried by Ray through a hub restart (a retry may run after a later call: publishes
        # are kept in number order whatever order they arrive in, and a repeat is kept once).
        handle = self.actor
        if self._posting_to is not handle:  # the hub was found again: bind its methods afresh
            self._posting, self._posting_to = {}, handle
        bound = self._posting.get(method)
        if bound is None:
            bound = self._posting[method] = getattr(handle, method)
        require_ray(f"call the hub ({method})")
        # Never Ray's auto-init: a push racing ray.shutdown() fails instead of starting a new Ray.
        return _compat.call_no_start(bound, *args, max_task_retries=_POST_RETRIES)

    @property
    def _calls(self) -> HubCalls:
        """The hub's methods, called within this client's deadlines (:meth:`_call`, :meth:`_post`)."""
        return HubCalls(self._call, self._post)

    @property
    def last_push(self) -> dict[str, Any]:
        """What this client's last push did: its transport's figures (bytes and buckets put, ...)."""
        return self._writer.last_push

    # ------------------------------------------------------------------ push
    @needs_ray
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
        delta: bool | Literal["sparse"] = False,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        checksum: bool = False,
        check_finite: bool = False,
        transport: str | None = None,
        include_pull: bool = False,
    ) -> int:
        """Snapshot ``weights`` into the object store once and publish them as a new version.

        Returns as soon as the snapshot is taken: the caller may change its
        model right after. Subscribers apply the version in the background.
        The writer stamps the version itself (from a block of numbers the hub
        granted with its lease) and does not wait for the hub's answer, except
        for a layout the hub has not accepted from it yet (the first push, a
        changed structure): what the hub refuses of a push that did not wait
        raises on the next push of ``model_id`` once the answer arrived (about a
        millisecond), or on ``wait`` (``latest``, ``pull`` and ``status`` read
        the answers first, so the next push raises).

        Args:
            weights: an ``nn.Module``, a ``TensorDict`` or a (nested) state dict.
            model_id: which model this is; one hub serves several.
            wait: also wait until every push-mode subscriber of ``model_id`` applied it.
            timeout: seconds for ``wait=True`` and ``max_lag`` (as :meth:`wait`'s), and for each
                answer the push waits for from the hub (``None``: :attr:`retry_s`), plus
                2 s (``ANSWER_GRACE_S``) for a sharded group's.
            max_lag: first wait while any push-mode subscriber is more than ``max_lag``
                versions behind, so the trainer never runs further ahead.
            keys: push only these tensors (exact keys, ``fnmatch`` patterns
                such as ``"*.lora_*"``, or a predicate on the key); the others
                keep the values of the previous version. Selected keys get
                buckets of their own, so only their bytes move.
            dtype: cast floating-point tensors to this dtype once, here
                (subscribers' parameters must have that dtype).
            delta: ``True``: re-use the previous version's buckets whose bytes did not
                change; subscribers holding them skip them. ``"sparse"``: that, and for a changed
                bucket where few elements changed, a patch too, which subscribers holding its base
                fetch instead (docs/api.md, "only what changed").
            bucket_bytes: target bucket size (a version is a few buckets).
            checksum: add per-bucket CRC32s that ``verify=True`` subscribers check.
            check_finite: refuse NaN or Inf (naming the tensors); off: they push (the check costs ~6 pushes).
            transport: ``"object_store"`` or ``"nixl"``; default: the client's.
                NIXL sends full versions (no ``keys``, ``delta`` or ``checksum``).
            include_pull: let ``wait`` and ``max_lag`` wait for pull-mode
                subscribers too (by default only push subscribers hold the
                trainer back: a pull subscriber moves only when it asks).

        Sharded trainers: when ``weights`` hold ``DTensor``\\ s (FSDP2's
        ``fully_shard``, ``distribute_tensor``), every rank calls ``push`` alike;
        each puts only its own shards and gets the same version number, which the
        hub publishes once all ranks' shards are in. A rank's push returns once the
        hub recorded its own shard (a rank's first push of a layout waits until the
        version is published, so that what the hub refuses raises there); ``wait=True``
        or ``hub.wait(v)`` waits for the version to be published and applied. The first
        push over a process group is collective (the ranks agree on their group: every
        rank of the mesh must call it); each push of a rank is matched with the other
        ranks' pushes of the same count, so every rank calls ``push`` once per step. If a
        rank's push raises (``max_lag`` timed out, say) or it never pushes its shard within
        ``timeout`` (default 60 s; it died or stalled), or the group restarts first, that
        push is abandoned on every rank: nothing is published, readers keep the previous
        version, and ``hub.wait`` of its number (until a newer version is out) raises why;
        the ranks' next pushes go on as usual. Every rank of a group that does not hold
        the model's writer lease gets ``StaleWriterError``.
        Such pushes take no ``keys``, ``delta`` or ``transport``; ``checksum=True`` (on every rank)
        adds one CRC32 per rank bucket, which ``verify=True`` receivers check before assembling.

        Returns:
            The version number (1, 2, ... per model; a new writer, or a restarted
            one, starts past every number granted before, so numbers may skip).

        Raises:
            WeightMismatchError: the weights do not fit the subscribers' models
                (nothing is published; everyone keeps the previous version), or
                those of the previous push did not (a subscriber joined since).
            InvalidWeightsError: empty weights, non-tensor leaves, ``keys``
                that match nothing, ``keys`` before any full push, NaN/Inf
                with ``check_finite``, or a version larger than the object store.
            StaleWriterError: another live trainer holds this model's writer
                lease (see ``connect(takeover=...)``), or took it over since the
                previous push (that push's version was refused).
            SyncTimeoutError: ``wait=True`` or ``max_lag`` and ``timeout`` passed first, or
                the hub did not answer in time (see ``timeout``).

        Example:
            >>> v = hub.push(model)
            >>> v = hub.push(model, max_lag=2, timeout=60)          # bounded staleness
            >>> v = hub.push(model, keys=["*lora*"])                # adapters only
            >>> v = hub.push(model, dtype=torch.bfloat16, delta=True)
        """
        check_model_id(model_id)
        check_timeout(timeout)
        transport = transport or self.transport
        check_transport(transport)
        if not transport_info(transport).pushable:
            raise ValueError(
                f"transport={transport!r} is what the hub names a sharded trainer's versions: push "
                "DTensor weights from every rank over the object store (the default) instead"
            )
        if max_lag is not None and (not isinstance(max_lag, int) or isinstance(max_lag, bool) or max_lag < 1):
            raise ValueError(f"max_lag must be an integer >= 1 (versions), got {max_lag!r}")
        bound = (self.retry_s if timeout is None else timeout) + deadline.ANSWER_GRACE_S

        def before() -> None:
            # Whether the lease moved (asked now); the hub's answers to earlier pushes that arrived (the
            # oldest waited for when too many are unanswered): what the hub refused raises here.
            self._writer.moved.ask(model_id, self._writer.lease(model_id))
            with deadline.within(bound):
                self._writer.settle(model_id, wait=False)
            if max_lag is not None:
                wait_within_lag(self, model_id, max_lag, timeout, include_pull=include_pull)

        request = PushRequest(
            weights,
            model_id,
            keys,
            dtype,
            delta,
            bucket_bytes,
            checksum,
            check_finite,
            transport,
            group_timeout=60.0 if timeout is None else timeout,
        )
        self._writer.last_push = {"model_id": model_id}
        pushed = self._writer.pipeline.push(request, writer=writer_identity(), before=before, bound=bound)
        self._writer.last_push = {k: v for k, v in pushed.stats.items() if k not in ("seconds", "bytes")}
        metrics.record_push(
            self.name,
            model_id,
            seconds=pushed.stats["seconds"],
            nbytes=pushed.stats["bytes"],
            transport=transport,
        )
        if wait:
            self.wait(pushed.version, model_id, timeout=timeout, include_pull=include_pull)
        return pushed.version

    def release_buffers(self) -> None:
        """Give back what this client holds for later pushes: NIXL snapshot sets (and their NIXL
        registrations), the page-locked staging buffer of GPU pushes.

        Sets that a version still being read uses (the hub keeps ``keep`` versions) stay until a
        later call finds them free. The client stays usable: a later push makes what it needs anew.

        Example:
            >>> hub.release_buffers()   # training is over: the GPU memory of the snapshot sets goes back
        """
        self._writer.pipeline.close()

    @needs_ray
    @deadline.bounded
    def next_version(self, model_id: str = "policy") -> int:
        """The version number this writer's next push of ``model_id`` gets (nothing is pushed).

        A writer stamps versions itself from a block of numbers the hub granted with
        its lease, so it knows the next one in advance: to put it into the weights,
        a log or a checkpoint name before pushing. It asks the hub for the lease if
        this process does not hold it (one round trip). Numbers only grow but may
        skip: a restarted trainer or a new writer starts past every number granted
        before, used or not. Exact with one thread pushing.

        Raises:
            StaleWriterError: another live writer holds the model's lease.

        Example:
            >>> v = hub.next_version()
            >>> assert hub.push(model) == v
        """
        check_model_id(model_id)
        return self._writer.next_version(model_id)

    # ------------------------------------------------------------------ wait / query
    @needs_ray
    def wait(
        self,
        version: int,
        model_id: str = "policy",
        *,
        timeout: float | None = None,
        include_pull: bool = False,
        subscribers: int | None = None,
    ) -> None:
        """Block until every push subscriber of ``model_id`` applied ``version`` (or a newer one).

        It waits for the subscribers registered with the hub: an actor registers once its
        ``__init__`` returned, so right after ``Collector.remote()`` there may be none yet.
        Pass ``subscribers=n`` to wait until at least ``n`` have registered too (and hold
        the version). Subscribers whose actor died, and misfits, are not waited for. Pull-mode
        subscribers change version only when they call ``raysync_sync()``, so
        they are waited for only with ``include_pull=True``. After a hub restart
        the subscribers it knew are waited for until they check in again, and
        if the restart lost the version, this client offers it again (when it
        pushed it).

        Args:
            version: a version ``push()`` returned.
            model_id: the model.
            timeout: seconds (``None``: 300 s, ``WAIT_TIMEOUT_S``; ``float("inf")``: no bound; a
                long wait logs who is behind every 10 s); the hub's answer is waited for 2 s longer
                (``ANSWER_GRACE_S``), then ``SyncTimeoutError`` whatever the hub does.
            include_pull: also wait for pull-mode subscribers.
            subscribers: also wait until at least this many subscribers of ``model_id``
                (counted as above) registered, e.g. the actors just created.

        Raises:
            SyncTimeoutError: ``timeout`` seconds passed; the message names the laggards and why
                (or says how many of ``subscribers`` registered, and how many pull-mode ones were
                not counted), or that the hub did not answer.
            ApplyError: some subscriber failed to apply it (it keeps its previous version).
            StaleWriterError, WeightMismatchError: the hub refused a push of this client that
                did not wait (see :meth:`push`); or ``subscribers`` counts misfits (never there).
            UnknownModelError: ``version`` of ``model_id`` was never pushed (a wait for it
                could only run out).

        Example:
            >>> hub.wait(hub.push(model), timeout=30)
            >>> hub.wait(v, timeout=30, subscribers=8)       # the 8 collectors just created
            >>> hub.wait(v, timeout=30, include_pull=True)   # evaluators that pull too
        """
        if subscribers is not None and (
            isinstance(subscribers, bool) or not isinstance(subscribers, int) or subscribers < 0
        ):
            raise ValueError(f"subscribers must be None or an integer >= 0, got {subscribers!r}")
        check_model_id(model_id)
        wait_for(
            self,
            version,
            model_id,
            timeout,
            include_pull=include_pull,
            raise_failures=True,
            need=subscribers or 0,
        )

    @needs_ray
    @deadline.bounded
    def latest(self, model_id: str = "policy") -> int | None:
        """The newest version of ``model_id`` (``None`` before the first push).

        For an id the hub lacks while it holds others' (a typo?), one warning names the models there.

        Raises:
            SyncTimeoutError: the hub did not answer within :attr:`retry_s` (60 s).

        Example:
            >>> hub.latest()
            12
        """
        check_model_id(model_id)
        self._writer.settle(model_id, wait=True, raise_refused=False)
        newest = self._calls.latest(model_id)
        if newest is None:
            note_absent(self.name, model_id, self._calls.status, LATEST_NONE)
        return newest

    @overload
    def pull(
        self, model_id: str = ..., version: int | None = ..., *, state_dict: Literal[False] = ...
    ) -> TensorDict: ...

    @overload
    def pull(
        self, model_id: str = ..., version: int | None = ..., *, state_dict: Literal[True]
    ) -> dict[str, torch.Tensor]: ...

    @needs_ray
    @deadline.bounded
    def pull(
        self, model_id: str = "policy", version: int | None = None, *, state_dict: bool = False
    ) -> TensorDict | dict[str, torch.Tensor]:
        """The weights of a kept version (newest by default), as a TensorDict keyed as a state dict.

        Its keys are the module's state-dict keys (``"0.weight"``), so
        ``model.load_state_dict(hub.pull())`` loads it; ``.unflatten_keys(".")`` gives the
        nested form (``td["0", "weight"]``). The tensors are private copies: change them
        freely. Modules' extra state (``get_extra_state()``) is not in it; it travels in the
        version's manifest and subscribers' modules get it
        (``raysync.core.layout.Manifest.extra_states()``).

        Args:
            model_id: the model.
            version: a kept version (``None``: the newest).
            state_dict: return a plain ``{dotted key: tensor}`` dict instead of a TensorDict.

        Raises:
            UnknownModelError: nothing pushed for ``model_id``, or ``version`` not kept.
            ChecksumError: the version carries checksums (``push(..., checksum=True)``) and
                the bytes fetched do not match them.

        Example:
            >>> model.load_state_dict(hub.pull())
            >>> hub.pull().unflatten_keys(".")["0", "weight"].shape   # nested
            torch.Size([16, 8])
        """
        check_model_id(model_id)
        self._writer.settle(model_id, wait=True, raise_refused=False)
        info = self._calls.get(model_id, version)
        assert info is not None
        every = range(info.manifest.num_buckets)  # checked against the checksums a version carries
        fetched = fetch(info.manifest, list(info.refs), every, timeout=None, verify="if_present")
        unpacked = unpack(info.manifest, [fetched[b] for b in every])
        tensors = {k: unpacked[k].clone() for k in info.manifest.pushed_keys()}  # the pushed order
        return tensors if state_dict else state_dict_tensordict(tensors)

    @needs_ray
    @deadline.bounded
    def status(self) -> dict[str, Any]:
        """Models (versions kept, bytes, last push) and subscribers (applied, lag, errors).

        Raises:
            SyncTimeoutError: the hub did not answer within :attr:`retry_s` (60 s).

        Example:
            >>> hub.status()["subscribers"][0]["lag"]
            0
        """
        self._writer.settle_all()
        return self._calls.status()

    @needs_ray
    @deadline.bounded
    def settings(self) -> HubSettings:
        """How this hub delivers (fixed when it was created; every field set).

        Example:
            >>> hub.settings().doorbell_bytes
            8388608
        """
        return self._calls.settings()


_POST_RETRIES = 10  # hub restarts a call sent without waiting goes through before it fails


def _restore_client(
    name: str, namespace: str, takeover: bool = False, transport: str = "object_store"
) -> HubClient:
    return HubClient(name, namespace=namespace, takeover=takeover, transport=transport)
