"""What outlives the hub's process, in Ray's GCS: counters, leases, ``keep``, subscriptions.

And the GCS's word on whether a writer or a subscriber's actor still lives. Ray has no
public key-value or actor-table API that works without the dashboard (``ray.util.state``
needs it), so this module is the one place raysync reaches into
Ray's GCS key-value store and actor and job tables (private parts of Ray: ``raysync._compat``).

Example:
    >>> store = HubStore("raysync")
    >>> models, keep, members = store.load()      # after a restart  # doctest: +SKIP
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import threading
from typing import Any

from raysync import _compat
from raysync._protocol import address_job
from raysync.hub.state import Model, Subscriber

__all__ = ["HubStore", "actor_alive", "address_alive", "forget_hub", "lease_epoch", "writer_alive"]

logger = logging.getLogger(__name__)

_KV_NAMESPACE = "raysync"  # in Ray's GCS key-value store (survives the hub process, not the cluster)
_SOON_S = 0.02  # a published version's record is written this late: one GCS write per burst of publishes


def _model_key(hub_name: str, model_id: str) -> bytes:
    return f"{hub_name}/model/{model_id}".encode()


def lease_epoch(hub_name: str, model_id: str) -> int | None:
    """The fencing epoch of ``model_id``'s writer lease as hub ``hub_name`` last wrote it (``None``: none).

    A grant's record is written before the grant's reply, so a process that asks after
    another one's grant came back reads that grant's epoch (or a later one).
    """
    raw = _compat.kv_get(_model_key(hub_name, model_id), namespace=_KV_NAMESPACE)
    try:
        epoch = json.loads(raw)["epoch"] if raw is not None else None
    except (ValueError, KeyError, TypeError):
        return None
    return epoch if isinstance(epoch, int) and not isinstance(epoch, bool) else None


class HubStore:
    """A hub's records in the GCS.

    A model's record (lease, fencing epoch, the numbers granted so far and the newest
    version) is written by one thread of its own, in order, reading the model when it
    writes: a grant of version numbers waits for its write before it replies (so a
    restarted hub never grants or stamps a number twice), a published version only
    schedules one, 20 ms later, so that a burst of publishes costs one write (a restarted
    hub then knows roughly the newest; the writer offers what it lost). Its counters
    only grow, so a later write never undoes an earlier one. Subscriptions are
    written when first seen and when dropped (not on every apply), in order, by
    one background thread, so the hub's event loop never waits on the GCS for them.
    """

    def __init__(self, hub_name: str) -> None:
        self._name = hub_name
        self._subs = f"{hub_name}/sub/"
        self._stored: set[str] = set()
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="raysync-membership")
        self._models = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="raysync-models")
        self._due: dict[str, Model] = {}  # models whose record a queued write will bring up to date

    def load(self) -> tuple[dict[str, Model], int | None, dict[str, dict[str, Any]]]:
        """Models (counter and lease), the hub's ``keep`` and its subscriptions, as the last hub left them."""
        models = {}
        prefix = f"{self._name}/model/".encode()
        for key in _compat.kv_list(prefix, namespace=_KV_NAMESPACE):
            raw = _compat.kv_get(key, namespace=_KV_NAMESPACE)
            if raw is not None:
                record = json.loads(raw)
                latest = int(record["latest"])
                models[key[len(prefix) :].decode()] = Model(
                    latest=latest,
                    writer=record.get("writer"),
                    epoch=int(record.get("epoch", 0)),
                    session=record.get("session"),
                    reserved=max(latest, int(record.get("reserved", latest))),
                )
        config = _compat.kv_get(self._config_key(), namespace=_KV_NAMESPACE)
        keep = int(json.loads(config)["keep"]) if config is not None else None
        members = {}
        for key in _compat.kv_list(self._subs.encode(), namespace=_KV_NAMESPACE):
            raw = _compat.kv_get(key, namespace=_KV_NAMESPACE)
            if raw is not None:
                members[key.decode()[len(self._subs) :]] = json.loads(raw)
        self._stored = set(members)
        return models, keep, members

    def save_model(self, model_id: str, model: Model) -> concurrent.futures.Future[None]:
        """Write a model's record (lease, epoch, numbers granted, newest); done when the future is.

        Await the future before handing out a number (``asyncio.wrap_future``).
        """
        self._due[model_id] = model
        return self._models.submit(self._write_model, model_id)

    def save_model_soon(self, model_id: str, model: Model) -> None:
        """Bring a model's record up to date in the background, a little later.

        One write serves every call within :data:`_SOON_S` (back-to-back publishes would
        otherwise cost the hub and the GCS one write each); a grant's write in between
        takes it along. On the hub's event loop the write is timed by the loop (a thread
        started per publish cost the loop up to ms on a busy node); elsewhere by a timer.
        """
        if model_id in self._due:
            return
        self._due[model_id] = model
        try:
            asyncio.get_running_loop().call_later(_SOON_S, self._write_due, model_id)
            return
        except RuntimeError:  # no loop in this thread
            pass
        timer = threading.Timer(_SOON_S, self._write_due, args=(model_id,))
        timer.daemon = True
        timer.start()

    def _write_due(self, model_id: str) -> None:
        if model_id in self._due:
            try:
                self._models.submit(self._write_model, model_id)
            except RuntimeError:  # the hub is shutting down
                pass

    def _write_model(self, model_id: str) -> None:
        model = self._due.pop(model_id, None)
        if model is None:  # an earlier queued write already wrote what this one would
            return
        record = {
            "latest": model.latest,
            "reserved": model.reserved,
            "epoch": model.epoch,
            "session": model.session,
            "writer": model.writer,
        }
        key = _model_key(self._name, model_id)
        try:
            _compat.kv_put(key, json.dumps(record).encode(), namespace=_KV_NAMESPACE)
        except Exception:
            self._due.setdefault(model_id, model)  # the next write tries again
            raise

    def save_keep(self, keep: int) -> None:
        """The hub's ``keep`` (blocking: call from a thread)."""
        _compat.kv_put(self._config_key(), json.dumps({"keep": keep}).encode(), namespace=_KV_NAMESPACE)

    def add(self, sub: Subscriber) -> None:
        """Remember a subscription (in the background; once per id)."""
        if sub.sub_id in self._stored:
            return
        self._stored.add(sub.sub_id)
        key, value = (self._subs + sub.sub_id).encode(), json.dumps(sub.persisted()).encode()
        self._pool.submit(_compat.kv_put, key, value, namespace=_KV_NAMESPACE)

    def remove(self, sub_id: str) -> None:
        """Forget a subscription (in the background)."""
        if sub_id in self._stored:
            self._stored.discard(sub_id)
            self._pool.submit(_compat.kv_delete, (self._subs + sub_id).encode(), namespace=_KV_NAMESPACE)

    def _config_key(self) -> bytes:
        return f"{self._name}/config".encode()


def forget_hub(name: str) -> int:
    """Delete every record of the hub called ``name`` from the GCS; returns how many there were.

    Only for a hub that is gone for good (``raysync bench``'s, say): a hub started later under
    that name then starts afresh instead of restoring its counters, leases and subscriptions.

    Example:
        >>> ray.kill(hub.actor); forget_hub(hub.name)  # doctest: +SKIP
        3
    """
    keys = _compat.kv_list(f"{name}/".encode(), namespace=_KV_NAMESPACE)
    for key in keys:
        _compat.kv_delete(key, namespace=_KV_NAMESPACE)
    return len(keys)


def actor_alive(actor_id: str | None) -> bool:
    """Whether an actor is not DEAD, asked of the GCS (restarting counts as alive; unsure too)."""
    if not actor_id:
        return True
    try:
        return _compat.actor_state(actor_id) != "DEAD"
    except Exception:
        return True


def address_alive(address: str | None) -> bool:
    """Whether the process a call address names may still run: an actor, or a process of a job
    (:func:`~raysync._protocol.process_address`: while the job runs)."""
    job = None if address is None else address_job(address)
    return job_alive(job) if job is not None else actor_alive(address)


def job_alive(job_id: str | None) -> bool:
    """Whether a Ray job (a driver process) still runs, asked of the GCS (unsure means alive)."""
    try:
        return _compat.job_alive(job_id) if job_id else False
    except Exception:
        return True


def writer_alive(writer: dict[str, Any]) -> bool:
    """Whether the process holding a lease still runs: its actor, or its job (unsure means alive)."""
    if writer.get("actor_id"):
        return actor_alive(writer["actor_id"])
    return job_alive(writer.get("job_id"))
