"""The hub's versions: numbers granted and stamped, the newest ``keep`` kept."""

from __future__ import annotations

import logging
import time
from typing import Any

from raysync._protocol import (
    BLOCK,
    Announcement,
    Grant,
)
from raysync.core.layout import Manifest
from raysync.errors import StaleWriterError, UnknownModelError
from raysync.hub.state.layouts import Layouts
from raysync.hub.state.leases import lease_record, who
from raysync.hub.state.records import DeliveryGroup, Model, Subscriber, Tables, Version

__all__ = ["Versions"]

logger = logging.getLogger(__name__)


class Versions:
    """Stamping, granting, keeping and handing out versions."""

    def __init__(self, tables: Tables, layouts: Layouts) -> None:
        self.tables = tables
        self.layouts = layouts  # a kept version establishes its model's layout, judges its subscribers
        self.round_blocks: dict[str, tuple[int, int]] = {}  # model -> (next, last) of its rounds' numbers

    # ------------------------------------------------------------------ versions
    def latest(self, model_id: str) -> int | None:
        model = self.tables.models.get(model_id)
        return model.latest if model and model.latest else None

    def newest(self, model_id: str) -> Version | None:
        model = self.tables.models.get(model_id)
        return model.newest if model else None

    def grant(self, model_id: str, count: int, pusher: dict[str, Any]) -> Grant:
        """A block of ``count`` version numbers for the lease holder (persist before replying).

        A process of the writer other than the one holding the epoch (a restarted
        trainer, another task of a job) gets a new epoch: the other process's later
        publishes are refused, never interleaved with this one's.
        """
        model = self.tables.models.setdefault(model_id, Model())
        session = pusher.get("session")
        if session != model.session:
            model.epoch += 1
            model.session = session
            if pusher.get("writer_id") is not None:
                model.writer = lease_record(pusher)
        first = model.issued + 1
        model.reserved = first + max(1, int(count)) - 1
        return Grant(model_id, model.epoch, first, model.reserved)

    def accept(
        self,
        model_id: str,
        manifest: Manifest,
        refs: list[Any],
        pusher: dict[str, Any],
        version: int,
        epoch: int,
    ) -> Version:
        """Keep a version its writer stamped from a :class:`Grant` (no reply awaited).

        An older one arriving after a newer one (an async actor may run one caller's
        calls out of order) is kept as an older version, never made the newest; the
        same version offered again (after a hub restart lost it) is kept once.

        Raises:
            StaleWriterError: the lease passed to another writer (older ``epoch``), or
                ``version`` was never granted.
        """
        model = self.tables.models.get(model_id)
        if model is not None and epoch != model.epoch and model.writer is not None:
            same = model.writer.get("writer_id") == pusher.get("writer_id")
            if same:
                raise StaleWriterError(
                    f"another process of this writer ({who(model.writer)}) took the writer lease of "
                    f"model {model_id!r} after this process ({who(pusher)}) stamped version {version}, "
                    "so that version was refused; push from one process at a time (this process's "
                    "next push takes the lease back)"
                )
        if model is None or epoch != model.epoch:
            holder = who(model.writer) if model is not None and model.writer else "no writer"
            raise StaleWriterError(
                f"model {model_id!r} is now written by {holder} (lease epoch "
                f"{model.epoch if model else 0}); this process ({who(pusher)}) lost its writer lease "
                f"(epoch {epoch}), so its version {version} was refused. Stop the other trainer, push "
                "under another model_id, or take over with raysync.connect(..., takeover=True)"
            )
        if version > model.reserved:
            raise StaleWriterError(
                f"version {version} of {model_id!r} was never granted (granted up to {model.reserved}); "
                "push again"
            )
        kept = model.versions.get(version)
        if kept is not None:
            return kept
        return self._keep(model_id, model, Version(version, manifest, list(refs), time.time(), pusher))

    def reserve(self, model_id: str, count: int = BLOCK) -> tuple[int, bool]:
        """One version number for a version the hub stamps later (:meth:`stamp` ``version=``);
        ``(number, whether to persist the model's record before handing it out)``.

        A sharded push's ranks get it before their round is published. Numbers come from a
        block of ``count`` reserved at once (one GCS write per block, not per push); a block
        ends when any other number is issued (a single writer's grant, a hub stamp), and a
        hub restart skips what was left of it.
        """
        model = self.tables.models.setdefault(model_id, Model())
        block = self.round_blocks.get(model_id)
        if block is not None and block[1] == model.reserved and model.latest < block[0] <= block[1]:
            self.round_blocks[model_id] = (block[0] + 1, block[1])
            return block[0], False
        first = model.issued + 1
        model.reserved = first + max(1, int(count)) - 1
        self.round_blocks[model_id] = (first + 1, model.reserved)
        return first, True

    def continue_block(self, model_id: str, number: int | None) -> None:
        """The model's next round takes the number after ``number`` (a sharded group numbered a
        push from its block); ``None``: its next round takes a new block."""
        model = self.tables.models.get(model_id)
        if number is None or model is None or number >= model.reserved:
            self.round_blocks.pop(model_id, None)
        else:
            self.round_blocks[model_id] = (number + 1, model.reserved)

    def stamp(
        self,
        model_id: str,
        manifest: Manifest,
        refs: list[Any],
        pusher: dict[str, Any],
        version: int | None = None,
    ) -> Version:
        """Give a version its number (or the one :meth:`reserve` gave it) and keep it.

        The oldest beyond ``keep`` are let go. A new number follows every number ever
        granted to a writer (persist before replying), and it ends the blocks granted
        before it (a new epoch): a writer stamping from one would publish versions older
        than this one.
        """
        model = self.tables.models.setdefault(model_id, Model())
        if model.session is not None:
            model.epoch += 1
            model.session = None
        if version is None:
            version = model.reserved = model.issued + 1
        else:
            assert version <= model.reserved, "a reserved number"
        return self._keep(model_id, model, Version(version, manifest, list(refs), time.time(), pusher))

    def offer_again(
        self, model_id: str, version: int, manifest: Manifest, refs: list[Any], pusher: dict[str, Any]
    ) -> bool:
        """The writer offers its newest version again after a restart lost it; whether it is kept now.

        Accepted for a number not older than the newest the hub knows (a restarted hub
        knows the newest of a moment before it died) and not newer than it ever issued,
        when nothing of it is kept, and only from the lease holder.
        """
        model = self.tables.models.get(model_id)
        if model is None or not model.latest <= version <= model.issued or version in model.versions:
            return False
        writer = model.writer
        if writer is not None and writer.get("writer_id") != pusher.get("writer_id"):
            return False
        self._keep(model_id, model, Version(version, manifest, list(refs), time.time(), pusher), pushed=False)
        logger.info("hub %r: %r version %d offered again by its writer", self.tables.name, model_id, version)
        return True

    def _keep(self, model_id: str, model: Model, v: Version, *, pushed: bool = True) -> Version:
        """Keep ``v`` (the oldest beyond ``keep`` let go; ``pushed``: counted as a push, not a
        version offered again). Its tensors join the established layout; a newest version of
        another layout than the newest before it judges the model's subscribers again."""
        before = None if model.newest is None else model.newest.manifest.layout_hash
        model.versions[v.version] = v
        model.latest = max(model.latest, v.version)
        model.published(v.version)
        if pushed:
            model.pushes += 1
            model.bytes_pushed += v.manifest.total_nbytes
            model.last_push_time = v.pushed_at
        self.trim(model)
        self.layouts.establish(model, v.manifest)
        if model.latest == v.version and v.manifest.layout_hash != before:
            self.layouts.mark_misfits(model_id)
        return v

    def forget_version(self, model_id: str, version: int, why: str) -> None:
        """Stop offering a version whose bytes are gone (its pusher died)."""
        model = self.tables.models.get(model_id)
        if model is not None and model.versions.pop(version, None) is not None:
            logger.warning(
                "hub %r: version %d of %r is lost (%s; the process that pushed it died); the next push "
                "brings subscribers forward",
                self.tables.name,
                version,
                model_id,
                why,
            )

    def trim(self, model: Model) -> None:
        for v in sorted(model.versions)[: -self.tables.keep]:
            del model.versions[v]  # drops the hub's borrow of that version's objects

    def raise_keep(self, keep: int | None) -> bool:
        """Keep at least ``keep`` versions per model; never fewer than another client asked. Changed?"""
        if keep is None or keep == self.tables.keep:
            return False
        if keep < self.tables.keep:
            logger.warning(
                "hub %r: a client asked for keep=%d; it keeps %d versions per model, as another client "
                "asked (a hub never lowers keep under a client that relies on it)",
                self.tables.name,
                keep,
                self.tables.keep,
            )
            return False
        logger.info(
            "hub %r now keeps %d versions per model (was %d)", self.tables.name, keep, self.tables.keep
        )
        self.tables.keep = int(keep)
        for model in self.tables.models.values():
            self.trim(model)
        return True

    def get(
        self, model_id: str, version: int | None = None, newer_than: int | None = None
    ) -> Announcement | None:
        """A kept version (the newest by default); None if it is not newer than ``newer_than``.

        Raises:
            UnknownModelError: nothing kept of ``model_id``, or not ``version``.
        """
        model = self.tables.models.get(model_id)
        if model is None or not model.versions:
            raise UnknownModelError(
                f"no version of model {model_id!r} on hub {self.tables.name!r}; models here: "
                f"{sorted(self.tables.models)}. Push one first with hub.push(model, model_id={model_id!r})"
            )
        v = model.versions.get(version if version is not None else model.latest)
        if v is None:
            raise UnknownModelError(
                f"version {version} of model {model_id!r} is not kept (kept: {sorted(model.versions)}); "
                "raise keep= on connect() to keep more"
            )
        if newer_than is not None and v.version <= newer_than:
            return None
        return v.announce(model_id)

    def due(self, sub: Subscriber) -> Version | None:
        """The version a push subscriber should be handed now (the newest it lacks), if any."""
        newest = self.newest(sub.model_id)
        if sub.state == "dead" or newest is None or newest.version <= max(sub.applied or 0, sub.sent):
            return None
        if self.layouts.misfit(sub, newest.manifest) is not None:
            return None  # another layout (kept from another job): it waits for one that fits
        return newest

    def due_in_group(
        self, model_id: str, group: DeliveryGroup
    ) -> tuple[Version | None, bool, list[Subscriber]]:
        """The newest version; whether the group's cohort lacks it (all of it, one test); and the
        members outside the cohort that lack it (one pass of plain fields each)."""
        newest = self.newest(model_id)
        if newest is None:
            return None, False, []
        v, manifest, misfit = newest.version, newest.manifest, self.layouts.misfit
        cohort = group.cohort
        whole = (
            bool(cohort.members) and v > cohort.sent and not cohort.holds(v) and cohort.fits(manifest, misfit)
        )
        due = [
            s
            for s in group.outside.values()
            if v > s.sent
            and (s.applied is None or v > s.applied)
            and s.pushed
            and s.reachable
            and not s.relay_pending
            and s.state != "dead"
            and (s.schema is None or misfit(s, manifest) is None)
        ]
        return newest, whole, due
