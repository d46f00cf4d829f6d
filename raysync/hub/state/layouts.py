"""What fits a model id: the layout its versions established, and the subscribers that misfit it.

A push is checked against the model id's *established layout* (the tensors of its
versions): one that does not fit it is refused. A subscriber whose model does not fit
the versions is that subscriber's error, not the pushes': it is marked a misfit (with
the reason), is not handed versions it cannot apply, and no wait waits for it.

Example:
    >>> state.layouts.refusal("policy", manifest)     # None: it fits what "policy" established
    >>> state.layouts.mark_misfits("policy")  # the subscribers newly found not to fit
    []
"""

from __future__ import annotations

import logging
from typing import Any

from raysync.core.layout import Manifest, validate
from raysync.errors import WeightMismatchError
from raysync.hub.state.records import Model, Subscriber, Tables

__all__ = ["Layouts"]

logger = logging.getLogger(__name__)

_FITS_KEPT = 4096  # (layout, schema) pairs remembered as fitting before the memo starts afresh


class Layouts:
    """The established layout of each model id, and which subscribers fit its versions."""

    def __init__(self, tables: Tables) -> None:
        self.tables = tables
        self._fits: set[tuple[str, Any]] = set()  # (layout hash, schema key) found to fit
        self._misfits: dict[tuple[str, Any], str] = {}  # (layout hash, schema key) -> why it does not

    # ------------------------------------------------------------------ pushes
    def refusal(self, model_id: str, manifest: Manifest) -> WeightMismatchError | None:
        """Why a version does not fit the layout ``model_id``'s versions established (``None``: it fits).

        A version fits when it has the model's tensors, with their shapes and dtypes (a
        ``keys=`` push fits: its version holds every tensor, the others as before). Nothing
        is established before the first version (see :meth:`first_mismatches`).
        """
        model = self.tables.models.get(model_id)
        if model is None or model.layout is None or manifest.layout_hash == model.layout_hash:
            return None  # the same hash: the same keys, shapes and dtypes (no check per push)
        try:
            validate(manifest, model.layout)
        except WeightMismatchError as err:
            err.args = (
                f"{err.args[0]} (against the layout the versions of model {model_id!r} established, "
                f"up to version {model.latest}; no version was published and every subscriber keeps "
                "its weights. A model of another structure needs another model_id, or a new writer)",
            )
            return err
        model.layout_hash = manifest.layout_hash  # fits (another bucket plan): no check next time
        return None

    def first_mismatches(
        self, model_id: str, manifest: Manifest
    ) -> list[tuple[WeightMismatchError, list[Subscriber]]]:
        """For a version with no layout established yet: why it fits none of the subscribers.

        Empty when a layout is established (:meth:`refusal` decides), when there is no
        subscriber, or when it fits one (then it establishes the layout and the others are
        misfits). The caller drops dead ones and refuses only if a live one is left.
        """
        model = self.tables.models.get(model_id)
        if model is not None and model.layout is not None:
            return []
        subs = self.tables.subscribers(model_id)
        if not subs:
            return []
        found = self.mismatches(model_id, manifest)
        return found if sum(len(misfits) for _, misfits in found) == len(subs) else []

    def establish(self, model: Model, manifest: Manifest) -> None:
        """A version was kept: the first one (of its writer) establishes the model's layout."""
        if model.layout is None:
            model.layout, model.layout_hash = manifest.schema(), manifest.layout_hash

    # ------------------------------------------------------------------ subscribers
    def misfit(self, sub: Subscriber, manifest: Manifest) -> str | None:
        """Why a version's layout does not fit ``sub``'s model (``None``: it fits, or nothing to check).

        Remembered per (layout, schema): a hub checks each new subscriber once per layout,
        not once per delivery.
        """
        if sub.schema is None:
            return None
        key = (manifest.layout_hash, sub.schema_key)
        if key in self._fits:
            return None
        why = self._misfits.get(key)
        if why is None:
            try:
                validate(manifest, sub.schema)
            except WeightMismatchError as err:
                why = str(err)
            if len(self._fits) + len(self._misfits) > _FITS_KEPT:
                self._fits.clear()
                self._misfits.clear()
            if why is None:
                self._fits.add(key)
                return None
            self._misfits[key] = why
        return why

    def mismatches(
        self, model_id: str, manifest: Manifest
    ) -> list[tuple[WeightMismatchError, list[Subscriber]]]:
        """Why a version does not fit the subscribers' models: one error per schema, with its subscribers."""
        by_schema: dict[Any, list[Subscriber]] = {}
        for sub in self.tables.subscribers(model_id):
            if sub.schema is not None and (manifest.layout_hash, sub.schema_key) not in self._fits:
                by_schema.setdefault(sub.schema_key, []).append(sub)
        found = []
        for key, subs in by_schema.items():
            try:
                validate(manifest, subs[0].schema)  # type: ignore[arg-type]
            except WeightMismatchError as err:
                found.append((err, subs))
                continue
            if len(self._fits) > _FITS_KEPT:
                self._fits.clear()
            self._fits.add((manifest.layout_hash, key))  # a layout fits a schema or not, for good
        return found

    def judge(self, sub: Subscriber, manifest: Manifest | None) -> bool:
        """Mark ``sub`` a misfit of ``manifest`` (the model's newest version) or not; newly marked?

        A subscriber newly marked is logged once (a warning naming each tensor); the waits
        on its model stop waiting for it (it never applies a version of that layout).
        """
        why = None if manifest is None else self.misfit(sub, manifest)
        was, sub.misfit = sub.misfit, why
        if why is None or was is not None:
            if why is None and was is not None:
                logger.info(
                    "hub %r: subscriber %s of %r fits its versions now",
                    self.tables.name,
                    sub.sub_id,
                    sub.model_id,
                )
            return False
        logger.warning(
            "hub %r: subscriber %s (%s) of %r does not fit the model's versions and is not handed "
            "them; pushes go on for the others, waits do not wait for it (re-create it with the "
            "right model): %s",
            self.tables.name,
            sub.sub_id,
            sub.info.class_name,
            sub.model_id,
            why[:500],
        )
        for waiter in self.tables.waiters.get(sub.model_id, ()):
            if sub.sub_id in waiter.pending:
                waiter.let_go(sub.sub_id)
        return True

    def mark_misfits(self, model_id: str) -> list[Subscriber]:
        """Judge every subscriber of ``model_id`` against its newest version; the newly marked ones.

        Called when the newest version's layout changed (the first version, a new writer's).
        """
        model = self.tables.models.get(model_id)
        newest = model.newest if model is not None else None
        manifest = newest.manifest if newest is not None else None
        return [sub for sub in self.tables.subscribers(model_id) if self.judge(sub, manifest)]
