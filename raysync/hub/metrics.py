"""raysync's metrics, through ``ray.util.metrics``: on the Ray dashboard and Prometheus.

What is recorded, and where (every series carries the ``hub`` and ``model_id`` tags):

==================================== ========= ===========================================
metric                               kind      what it measures
==================================== ========= ===========================================
``raysync_push_duration_seconds``    histogram ``hub.push()`` in the trainer, from the call
                                               until the hub stamped the version (snapshot
                                               into the store + publish; no ``wait``).
                                               Tag ``transport``. Recorded by the pusher
``raysync_push_bytes_total``         counter   bytes a push wrote (object store, or NIXL
                                               snapshot buffers); ``delta`` and ``keys``
                                               pushes count only what moved. Pusher
``raysync_pushes_total``             counter   versions published. Hub
``raysync_apply_duration_seconds``   histogram a subscriber's fetch + apply of one version,
                                               as it reported to the hub. Hub
``raysync_latest_version``           gauge     the newest version of each model. Hub
``raysync_subscriber_lag``           gauge     versions a subscriber is behind the newest
                                               (tags ``subscriber``, ``actor``); set to 0
                                               once it is gone (then dropped by Ray). Hub
``raysync_subscribers``              gauge     subscribers per ``state`` (``live``,
                                               ``unreachable``, ``failing``: live, but its
                                               last apply failed; ``misfit``: its model
                                               does not fit the versions, which it is not
                                               handed). Hub
``raysync_modified_subscribers``     gauge     subscribers whose weights their own code
                                               changed in place since the version they
                                               applied (``raysync_modified_since()``: a
                                               module left in training mode). Hub
==================================== ========= ===========================================

Ray adds its own ``ray_`` prefix where it exports them to Prometheus, and
sends them every few seconds (``RAY_metrics_report_interval_ms``). Nothing is
created at import: the metric objects are made on first use, in the process
that records them, and recording never raises (a failure is logged once).

Example:
    >>> from raysync.hub import metrics
    >>> metrics.record_push("raysync", "policy", seconds=0.012, nbytes=2**20)  # doctest: +SKIP
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from raysync import _compat

__all__ = [
    "DURATION_BOUNDARIES",
    "HubGauges",
    "METRIC_NAMES",
    "SUBSCRIBER_STATES",
    "record_apply",
    "record_applies",
    "record_push",
]

logger = logging.getLogger(__name__)

DURATION_BOUNDARIES = [
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
]
"""Histogram bucket edges in seconds (0.5 ms to 60 s)."""

METRIC_NAMES = (
    "raysync_apply_duration_seconds",
    "raysync_latest_version",
    "raysync_modified_subscribers",
    "raysync_push_bytes_total",
    "raysync_push_duration_seconds",
    "raysync_pushes_total",
    "raysync_subscriber_lag",
    "raysync_subscribers",
)
"""Every metric raysync records (Prometheus shows them with Ray's ``ray_`` prefix)."""

SUBSCRIBER_STATES = ("live", "unreachable", "failing", "misfit")

_GAUGE_INTERVAL_S = 0.5  # the hub refreshes its gauges at most this often
_GAUGE_SHARE = 0.02  # ... and spends at most this share of its time on them (a large fleet's refresh)
APPLIES_OBSERVED = 8  # apply times observed per node and version at most (sampled above)
LAG_SERIES_MAX = 1000
"""A model with more live subscribers than this gets a ``subscriber_lag`` series only for those more
than one version behind (and 0 once for each that caught up): a series per subscriber of a fleet
is a cardinality no Prometheus wants, and setting them would cost the hub O(subscribers) per refresh."""


def _keepalive_s() -> float:
    """How often an idle hub sets its gauges again: half Ray's report interval, 0.5 to 5 s."""
    try:
        interval_s = _compat.metrics_report_interval_s()
    except Exception:
        interval_s = 10.0
    return min(5.0, max(0.5, interval_s / 2))


@dataclass(frozen=True)
class _Metrics:
    push_duration: Any
    push_bytes: Any
    pushes: Any
    apply_duration: Any
    latest_version: Any
    subscriber_lag: Any
    subscribers: Any
    modified: Any


_lock = threading.Lock()
_metrics: _Metrics | None = None
_failed = False


def _get() -> _Metrics | None:
    """The metric objects of this process, made on first use (None if Ray cannot make them)."""
    global _metrics, _failed
    if _metrics is not None or _failed:
        return _metrics
    with _lock:
        if _metrics is None and not _failed:
            try:
                from ray.util.metrics import Counter, Gauge, Histogram

                model = ("hub", "model_id")
                _metrics = _Metrics(
                    push_duration=Histogram(
                        "raysync_push_duration_seconds",
                        description="hub.push() in the trainer until the version is stamped (no wait)",
                        boundaries=DURATION_BOUNDARIES,
                        tag_keys=(*model, "transport"),
                    ),
                    push_bytes=Counter(
                        "raysync_push_bytes_total",
                        description="bytes written by pushes (object store or NIXL snapshot buffers)",
                        tag_keys=(*model, "transport"),
                    ),
                    pushes=Counter("raysync_pushes_total", description="versions published", tag_keys=model),
                    apply_duration=Histogram(
                        "raysync_apply_duration_seconds",
                        description="a subscriber's fetch + apply of one version",
                        boundaries=DURATION_BOUNDARIES,
                        tag_keys=model,
                    ),
                    latest_version=Gauge(
                        "raysync_latest_version", description="newest version of the model", tag_keys=model
                    ),
                    subscriber_lag=Gauge(
                        "raysync_subscriber_lag",
                        description="versions a subscriber is behind the newest",
                        tag_keys=(*model, "subscriber", "actor"),
                    ),
                    subscribers=Gauge(
                        "raysync_subscribers",
                        description="subscribers per state (live, unreachable, failing, misfit)",
                        tag_keys=(*model, "state"),
                    ),
                    modified=Gauge(
                        "raysync_modified_subscribers",
                        description="subscribers whose weights changed in place since the version applied",
                        tag_keys=model,
                    ),
                )
            except Exception as err:  # metrics are an aid: never let them break a push
                _failed = True
                logger.warning("raysync metrics are off in this process: %s", err)
    return _metrics


def record_push(
    hub: str, model_id: str, *, seconds: float, nbytes: int, transport: str = "object_store"
) -> None:
    """Record one push as the pusher saw it (called by ``HubClient.push``).

    Args:
        hub: the hub's name.
        model_id: the model pushed.
        seconds: from the ``push()`` call until the hub stamped the version.
        nbytes: bytes the push wrote.
        transport: ``"object_store"`` or ``"nixl"``.

    Example:
        >>> record_push("raysync", "policy", seconds=0.01, nbytes=4096)  # doctest: +SKIP
    """
    m = _get()
    if m is None:
        return
    try:
        tags = {"hub": hub, "model_id": model_id, "transport": transport}
        m.push_duration.observe(max(0.0, float(seconds)), tags=tags)
        if nbytes > 0:
            m.push_bytes.inc(float(nbytes), tags=tags)
    except Exception as err:
        logger.debug("could not record push of %r to hub %r: %s", model_id, hub, err)


def record_apply(hub: str, model_id: str, seconds: float | None) -> None:
    """Record one subscriber's fetch + apply time (called by the hub as replies arrive).

    Example:
        >>> record_apply("raysync", "policy", 0.004)  # doctest: +SKIP
    """
    m = _get()
    if m is None or seconds is None:
        return
    try:
        m.apply_duration.observe(max(0.0, float(seconds)), tags={"hub": hub, "model_id": model_id})
    except Exception as err:
        logger.debug("could not record apply of %r on hub %r: %s", model_id, hub, err)


def record_applies(hub: str, model_id: str, seconds: list[float | None]) -> None:
    """Record a node's subscribers' apply times of one version (a relay's reply).

    Each time is observed while there are at most :data:`APPLIES_OBSERVED` of them; a larger
    node's are sampled: that many of its times, evenly spaced in sorted order (the
    distribution's shape kept, its count capped), so the hub's cost per version stays bounded
    by nodes rather than subscribers.

    Example:
        >>> record_applies("raysync", "policy", [0.004, 0.005])  # doctest: +SKIP
    """
    times = sorted(s for s in seconds if s is not None)
    if len(times) > APPLIES_OBSERVED:
        step = (len(times) - 1) / (APPLIES_OBSERVED - 1)
        times = [times[round(i * step)] for i in range(APPLIES_OBSERVED)]
    for s in times:
        record_apply(hub, model_id, s)


class HubGauges:
    """The hub's gauges (versions, lag, subscribers by state), refreshed at most every 0.5 s.

    The hub calls :meth:`published` for each version and :meth:`changed` after
    every change; the refresh itself runs later on the hub's event loop, so a
    burst of deliveries to many subscribers costs one pass, not one per reply.
    An idle hub sets its gauges again every few seconds: Ray drops gauge series
    that are not refreshed within two report intervals.

    Example:
        >>> gauges = HubGauges("raysync")  # inside the hub actor
        >>> gauges.changed(models, subscribers)  # doctest: +SKIP
    """

    def __init__(self, hub: str) -> None:
        self.hub = hub
        self._pending = False
        self._last = 0.0
        self._source: tuple[Mapping[str, Any], Mapping[str, Any]] | None = None
        self._lagging: dict[tuple[str, str, str], dict[str, str]] = {}  # series set last time
        self._models_seen: set[str] = set()
        self._keepalive = False
        self._interval = _GAUGE_INTERVAL_S  # grows with the refresh's cost (_GAUGE_SHARE)

    def published(self, model_id: str) -> None:
        """Count one published version of ``model_id``."""
        m = _get()
        if m is None:
            return
        try:
            m.pushes.inc(1.0, tags={"hub": self.hub, "model_id": model_id})
        except Exception as err:
            logger.debug("could not count a push of %r on hub %r: %s", model_id, self.hub, err)

    def changed(self, models: Mapping[str, Any], subscribers: Mapping[str, Any]) -> None:
        """Schedule a refresh from the hub's ``models`` and ``subscribers`` (read when it runs)."""
        self._source = (models, subscribers)
        if self._pending:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self.refresh()
            return
        self._pending = True
        delay = max(0.0, self._last + self._interval - time.monotonic())
        loop.call_later(delay, self.refresh)
        if not self._keepalive:
            self._keepalive = True
            loop.call_later(_keepalive_s(), self._keep_alive, loop)

    def _keep_alive(self, loop: asyncio.AbstractEventLoop) -> None:
        # Ray (2.60) drops a gauge series that was not set again within two report
        # intervals, so an idle hub sets every gauge again regularly.
        if not self._pending:
            self.refresh()
        loop.call_later(_keepalive_s(), self._keep_alive, loop)

    def refresh(self) -> None:
        """Set every gauge from the hub's current state."""
        self._pending = False
        self._last = time.monotonic()
        m = _get()
        if m is None or self._source is None:
            return
        models, subscribers = self._source
        t0 = time.process_time()
        try:
            self._set(m, models, subscribers.values())
        except Exception as err:
            logger.debug("hub %r could not refresh its gauges: %s", self.hub, err)
        self._interval = max(_GAUGE_INTERVAL_S, (time.process_time() - t0) / _GAUGE_SHARE)

    def _set(self, m: _Metrics, models: Mapping[str, Any], subs: Iterable[Any]) -> None:
        counts: dict[str, dict[str, int]] = {}
        modified: dict[str, int] = {}
        lagging: dict[tuple[str, str, str], dict[str, str]] = {}
        for model_id, model in models.items():
            m.latest_version.set(float(model.latest or 0), tags={"hub": self.hub, "model_id": model_id})
            counts.setdefault(model_id, dict.fromkeys(SUBSCRIBER_STATES, 0))
        by_model: dict[str, list[Any]] = {}
        cohorts: dict[Any, str] = {}  # a node's subscribers in step: all live, one version held
        for sub in subs:
            cohort = sub._cohort
            if cohort is not None:
                cohorts[cohort] = sub.model_id
            elif sub.state != "dead":
                by_model.setdefault(sub.model_id, []).append(sub)
        in_cohorts: dict[str, int] = {}
        for cohort, model_id in cohorts.items():
            in_cohorts[model_id] = in_cohorts.get(model_id, 0) + len(cohort.members)
        for model_id in set(by_model) | set(in_cohorts):
            members = by_model.get(model_id, [])
            model = models.get(model_id)
            per_model = counts.setdefault(model_id, dict.fromkeys(SUBSCRIBER_STATES, 0))
            per_model["live"] += in_cohorts.get(model_id, 0)
            stamps = model.stamps if model is not None else []
            # a fleet's subscribers at most one version behind (holding the second newest published or
            # newer) get no series: only its laggards do (those set before read 0, below)
            fleet = len(members) + in_cohorts.get(model_id, 0) > LAG_SERIES_MAX
            close_from = (stamps[-2] if len(stamps) >= 2 else 0) if fleet else None
            for cohort, of in cohorts.items():  # a cohort that lags: a series for each member
                if of == model_id and (close_from is None or (cohort.applied or 0) < close_from):
                    members.extend(cohort.members.values())
                    per_model["live"] -= len(cohort.members)  # counted below, one by one
            for sub in members:
                state = sub.state
                if state == "live" and (sub.misfit or sub.last_error):
                    state = "misfit" if sub.misfit else "failing"
                per_model[state] = per_model.get(state, 0) + 1
                if sub.modified_since is not None:
                    modified[model_id] = modified.get(model_id, 0) + 1
                if close_from is not None and (sub.applied or 0) >= close_from:
                    continue
                # versions published since the one it holds (numbers skip at a new writer; lag does not)
                lag = model.versions_after(sub.applied) if model is not None else 0
                actor = str(sub.info.class_name or "")
                tags = {"hub": self.hub, "model_id": model_id, "subscriber": sub.sub_id, "actor": actor}
                lagging[(model_id, sub.sub_id, actor)] = tags
                m.subscriber_lag.set(float(lag), tags=tags)
        for key, tags in self._lagging.items():
            if key not in lagging:  # gone: a gauge cannot be deleted, so it reads 0
                m.subscriber_lag.set(0.0, tags=tags)
        self._lagging = lagging
        self._models_seen |= set(counts)
        for model_id in self._models_seen:
            for state, count in counts.get(model_id, dict.fromkeys(SUBSCRIBER_STATES, 0)).items():
                m.subscribers.set(float(count), tags={"hub": self.hub, "model_id": model_id, "state": state})
            m.modified.set(float(modified.get(model_id, 0)), tags={"hub": self.hub, "model_id": model_id})
