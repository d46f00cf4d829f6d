"""What a node's relay and the hub say to each other about a version's delivery: one message per
node per version (:class:`RelayDelivery`), the acks that come back (compacted for the common case),
and a doorbell's :class:`Ring`.

Example:
    >>> compact(3, [RelayAck("a:policy", ApplyReport(applied=3, apply_s=0.01))]).applied
    (('a:policy', 0.01, None, None, None),)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from raysync._protocol.messages import Announcement, ApplyReport

__all__ = [
    "AppliedRow",
    "RelayAck",
    "RelayDelivery",
    "RelayMember",
    "RelayReply",
    "Ring",
    "compact",
    "expand",
]


@dataclass(frozen=True)
class RelayMember:
    """A subscriber a node's relay delivers to: the hub tells it once, not per version.

    Attributes:
        actor_id: its process's call address (its actor, or ``job:<job>/<node>/<pid>`` for a plain
            process), whose poll collects its calls.
        doorbell: its process's doorbell address: ring it instead of calling, where the
            version fits (:mod:`raysync.transports.doorbell`).
        doorbell_key: the doorbell's secret (rings carry a MAC made with it).
    """

    actor_id: str | None = None
    doorbell: str | None = None
    doorbell_key: bytes | None = dataclasses.field(default=None, repr=False)


@dataclass(frozen=True)
class RelayDelivery:
    """One message per node per version: the version, for every subscription the node's relay serves.

    Attributes:
        announcement: the version; its ``sub_ids`` are the subscriptions to hand it to.
        members: subscribers the relay was not told about yet (sent once per relay
            incarnation, so the hub does not pickle a handle per subscriber per version).
    """

    announcement: Announcement
    members: dict[str, RelayMember]


@dataclass(frozen=True)
class RelayAck:
    """What happened when a relay handed a version to one subscription.

    Attributes:
        sub_id: the subscription.
        report: its report (``None`` when the call failed).
        outcome: ``"ok"``, ``"died"`` (its actor is gone for good), ``"unreachable"``
            (restarting or not answering), ``"restarted"`` (the call was for its actor's
            previous process, which its new one's registration replaces), ``"failed"`` (the call raised), or
            ``"unknown"`` (the relay has no handle for it: the hub sends it again).
        error: why the call failed.
    """

    sub_id: str
    report: ApplyReport | None
    outcome: str = "ok"
    error: BaseException | None = None


AppliedRow = tuple[str, float | None, float | None, int | None, int | None]
"""A plain apply, compact: ``(sub_id, apply_s, pause_s, buckets_fetched, bytes_fetched)``."""


@dataclass(frozen=True)
class RelayReply:
    """A relay's answer to one :class:`RelayDelivery`: every subscription's ack, in one message.

    Subscriptions that simply applied the version come back compact, as rows of
    ``(sub_id, apply_s, pause_s, buckets_fetched, bytes_fetched)`` in ``applied``
    (a thousand of them unpickle and record in a fraction of what as many
    :class:`ApplyReport`\\ s cost the hub); every other outcome as a :class:`RelayAck`.

    Attributes:
        acks: one per subscription that did not simply apply the version.
        applied: one row per subscription that applied it.
        relay_pid: the relay's process (a new one after a restart).
        pending: subscriptions still applying when the relay answered: their acks
            follow (the hub's ``relay_acks``), and they get no newer version meanwhile.
    """

    acks: tuple[RelayAck, ...]
    applied: tuple[AppliedRow, ...] = ()
    relay_pid: int | None = None
    pending: tuple[str, ...] = ()


@dataclass(frozen=True)
class Ring:
    """A relay's doorbell message to one subscriber process: a version waits in a sealed segment.

    The segment itself travels with the message (its file descriptor, ``SCM_RIGHTS``);
    the ring names it by size, inode and device so that the receiver checks it got the
    segment the ringer meant. On the wire it is a fixed binary record MAC'd with the
    receiving process's doorbell key (:mod:`raysync.transports.doorbell.wire`).

    Attributes:
        token: names this ring in the acks.
        model_id: the model.
        version: the version.
        sub_ids: the subscriptions of that process to hand it to.
        segment_size: the segment's size in bytes.
        segment_inode: the segment's inode.
        segment_device: the segment's device.
    """

    token: int
    model_id: str
    version: int
    sub_ids: tuple[str, ...]
    segment_size: int = 0
    segment_inode: int = 0
    segment_device: int = 0


def compact(
    version: int, acks: list[RelayAck], pid: int | None = None, pending: tuple[str, ...] = ()
) -> RelayReply:
    """One reply for ``acks``: the ones that simply applied ``version`` as compact rows.

    Example:
        >>> compact(3, [RelayAck("a:policy", ApplyReport(applied=3, apply_s=0.01))]).applied
        (('a:policy', 0.01, None, None, None),)
    """
    rows = []
    others = []
    for ack in acks:
        r = ack.report
        plain = (
            r is not None
            and ack.outcome == "ok"
            and r.applied == version
            and r.describes_apply()
            and r.error is None
            and r.lost is None
            and r.receivers is None
            and not r.prefetched
            and r.modified_since is None
        )
        if plain:
            assert r is not None
            rows.append((ack.sub_id, r.apply_s, r.pause_s, r.buckets_fetched, r.bytes_fetched))
        else:
            others.append(ack)
    return RelayReply(tuple(others), tuple(rows), pid, pending)


def expand(reply: RelayReply, version: int) -> list[RelayAck]:
    """A compact reply of ``version`` back into one ack per subscription (the inverse of :func:`compact`).

    Example:
        >>> [a.report.applied for a in expand(compact(3, [RelayAck("a", ApplyReport(applied=3))]), 3)]
        [3]
    """
    acks = list(reply.acks)
    for sub_id, apply_s, pause_s, buckets, nbytes in reply.applied:
        report = ApplyReport(
            applied=version, apply_s=apply_s, pause_s=pause_s, buckets_fetched=buckets, bytes_fetched=nbytes
        )
        acks.append(RelayAck(sub_id, report))
    return acks
