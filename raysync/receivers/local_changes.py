"""Weights an actor's own code changed in place since raysync applied them.

A rollout actor that leaves a BatchNorm in training mode updates ``running_mean``
with every forward; an optimizer step on a subscriber changes its parameters. The
actor then no longer holds the version it applied, exactly. raysync keeps saying
which version was applied (``raysync_version()``) and says that it was changed
since (``raysync_modified_since()``, the hub's ``status``, ``raysync status``, the
``raysync_modified_subscribers`` gauge); the next version applied clears it.

Detection reads torch's version counters (:meth:`raysync.core.bound.BoundModel.written`):
one integer per tensor, after each apply and on demand, and at each heartbeat, so
the hub learns of a change without a call per version.

Example:
    >>> sub.modified_since()     # a subscription holding version 3, written in place since
    3
    >>> sub.heartbeat_report()   # the hub is told once
    ApplyReport(... modified_since=3)
    >>> sub.heartbeat_report() is None
    True
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch

from raysync._protocol import ApplyReport
from raysync.core.bound import BoundModel

if TYPE_CHECKING:
    from raysync.receivers.pipeline import Applier
    from raysync.receivers.subscription import SyncSpec

__all__ = ["LocalChanges", "running_stats_in_training"]

logger = logging.getLogger(__name__)


class LocalChanges:
    """The local-changes half of a subscription (mixed into it): what to report, log and tell the hub."""

    if TYPE_CHECKING:
        spec: SyncSpec
        sub_id: str

        @property
        def version(self) -> int | None: ...

        @property
        def bound(self) -> BoundModel | None: ...

        _info: Any

        applier: Applier

    _told_modified: int | None = None  # what the hub was last told (heartbeat_report)
    _warned_modified = False

    def modified_since(self) -> int | None:
        """The version held, if user code changed its weights in place since it was applied; else None.

        Exact and cheap: one read of torch's version counter per tensor
        (:meth:`BoundModel.written`). The next version applied clears it (the
        buckets changed are fetched again whatever the version changed). The first
        time it finds a change, it logs why and what to do (unless opted in).
        """
        with self.applier.lock:  # a commit and this check never interleave
            bound, version = self.bound, self.version
            if bound is None or version is None or not bound.intact() or not bound.written():
                return None
        if not self._warned_modified and not self.spec.allow_train_mode:
            self._warned_modified = True
            logger.warning(
                "%s: the weights of self.%s were changed in place since version %d of %r was applied "
                "(a module in training mode updating running statistics, an optimizer step, ...): "
                "raysync_version() still says %d and raysync_modified_since() says %d until the next "
                "version is applied. Call self.%s.eval() on rollout actors, or pass allow_train_mode=True "
                "to @raysync.synced_model to keep training mode (logged once)",
                self.sub_id,
                self.spec.attr,
                version,
                self.spec.model_id,
                version,
                version,
                self.spec.attr,
            )
        return version

    def heartbeat_report(self) -> ApplyReport | None:
        """At each heartbeat: a report for the hub if the held version became modified since it was told.

        One report per change, none otherwise; the report of the next apply clears the
        flag on the hub, and a (re-)registration makes the next heartbeat tell again.
        """
        if self._info is None:
            return None
        modified = self.modified_since()
        if modified == self._told_modified:
            return None
        self._told_modified = modified
        return None if modified is None else ApplyReport(modified_since=modified)

    def warn_train_mode(self, owner: str, module: torch.nn.Module) -> None:
        """Once, at registration: warn if ``module`` (of class ``owner``'s actor) is in training mode
        with running statistics."""
        found = [] if self.spec.allow_train_mode else running_stats_in_training(module)
        if not found:
            return
        logger.warning(
            "%s: self.%s is in training mode and %s running statistics: every forward changes the "
            "weights raysync applied (raysync_version() keeps saying the version applied; "
            "raysync_modified_since() and `raysync status` say it was modified locally). Call "
            "self.%s.eval() on rollout actors, or pass allow_train_mode=True to @raysync.synced_model "
            "to keep training mode",
            owner,
            self.spec.attr,
            f"{', '.join(found[:5])}{' ...' if len(found) > 5 else ''} "
            f"{'updates' if len(found) == 1 else 'update'}",
            self.spec.attr,
        )


def running_stats_in_training(module: torch.nn.Module) -> list[str]:
    """Submodules in training mode that update running statistics in their forward.

    BatchNorm (any dimension, ``SyncBatchNorm``, lazy ones) and InstanceNorm with
    ``track_running_stats=True``: what a rollout actor left in training mode
    changes with every forward.

    Args:
        module: the synced module.

    Returns:
        ``"'<name>' (<class>)"`` for each such submodule.

    Example:
        >>> running_stats_in_training(torch.nn.Sequential(torch.nn.BatchNorm1d(4)))
        ["'0' (BatchNorm1d)"]
        >>> running_stats_in_training(torch.nn.Sequential(torch.nn.BatchNorm1d(4)).eval())
        []
    """
    return [
        f"{name!r} ({type(m).__name__})" if name else type(m).__name__
        for name, m in module.named_modules()
        if m.training
        and getattr(m, "track_running_stats", False) is True
        and isinstance(getattr(m, "running_mean", None), torch.Tensor)
    ]
