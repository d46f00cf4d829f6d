"""Calls to subscribers' actors carried by their processes' polls (raysync/hub/mailbox.py), and the
node-local delivery built on them (notify_members, late_acks): no Ray, the process simulated."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from raysync import _protocol as proto
from raysync._protocol import Announcement, Answer, ApplyReport, Caller, RelayMember
from raysync.hub import mailbox
from raysync.hub.mailbox import Mailboxes, SubscriberGone, SubscriberUnreachable
from raysync.hub.relay import late_acks, notify_members

A1 = Caller("a1" * 16, pid=100, node_id="n1")


def _ann(version: int = 3, sub_ids: tuple[str, ...] = ()) -> Announcement:
    return Announcement("policy", version, None, (), sub_ids)


def _mail(alive: bool = True) -> Mailboxes:
    async def is_alive(actor_id: str) -> bool:
        return alive

    return Mailboxes(alive=is_alive)


def test_a_call_goes_out_with_the_next_poll_and_ends_with_its_answer() -> None:
    async def main() -> None:
        mail = _mail()
        poll = asyncio.create_task(mail.poll(A1, [], [], timeout=5))
        await asyncio.sleep(0.01)  # the poll is open, nothing queued
        call = mail.call(A1.actor_id, proto.NOTIFY, _ann(3))
        (req,) = await asyncio.wait_for(poll, 4)  # woken by the call, not after 5 s
        assert req.method == proto.NOTIFY and req.announcement == _ann(3)
        assert not call.done()
        await mail.poll(A1, [Answer(req.req_id, ApplyReport(applied=3))], [], timeout=0)
        assert (await call).applied == 3
        assert mail.pending() == 0

    asyncio.run(main())


def test_an_error_raised_by_the_call_is_the_callers_and_an_empty_poll_ends_at_its_timeout() -> None:
    async def main() -> None:
        mail = _mail()
        assert await mail.poll(A1, [], [], timeout=0.05) == ()
        call = mail.call(A1.actor_id, proto.NOTIFY, _ann())
        (req,) = await mail.poll(A1, [], [], timeout=1)
        mail.answer(A1, [Answer(req.req_id, error=ValueError("shape mismatch in fc.weight"))])
        with pytest.raises(ValueError, match=r"fc\.weight"):
            await call

    asyncio.run(main())


def test_a_restarted_actor_fails_the_calls_its_old_process_held() -> None:
    async def main() -> None:
        mail = _mail()
        call = mail.call(A1.actor_id, proto.NOTIFY, _ann())
        await mail.poll(A1, [], [], timeout=1)  # handed to pid 100
        restarted = Caller(A1.actor_id, pid=101, node_id="n1")
        assert await mail.poll(restarted, [], [], timeout=0) == ()
        with pytest.raises(SubscriberUnreachable, match="restarted"):
            await call
        late = Answer(1, ApplyReport(applied=3))
        mail.answer(A1, [late])  # the old process's answer is ignored

    asyncio.run(main())


def test_a_dead_actors_calls_fail_as_gone_once_its_polls_stop(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(mailbox, "_SUSPECT_S", 0.05)
    monkeypatch.setattr(mailbox, "_CHECK_S", 0.02)

    async def main() -> None:
        mail = _mail(alive=False)
        call = mail.call(A1.actor_id, proto.NOTIFY, _ann())
        await mail.poll(A1, [], [], timeout=1)  # handed out; the process then dies: no poll again
        with pytest.raises(SubscriberGone, match="died"):
            await asyncio.wait_for(call, 10)

    asyncio.run(main())


def test_a_live_actor_that_never_polls_is_unreachable_after_pickup(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(mailbox, "_CHECK_S", 0.02)
    monkeypatch.setattr(mailbox, "PICKUP_S", 0.1)

    async def main() -> None:
        mail = _mail(alive=True)
        call = mail.call(A1.actor_id, proto.NOTIFY, _ann())
        with pytest.raises(SubscriberUnreachable, match="did not poll"):
            await asyncio.wait_for(call, 10)

    asyncio.run(main())


def test_a_long_call_reported_running_is_kept_and_an_unconfirmed_one_is_lost(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(mailbox, "_CHECK_S", 0.02)
    # Polls come every 0.05 s; LOST_S is 20 of them, so a loaded machine's pause between two polls
    # does not make the kept call look lost (what the test shows is which call is, not when).
    monkeypatch.setattr(mailbox, "LOST_S", 1.0)

    async def main() -> None:
        mail = _mail(alive=True)
        kept = mail.call(A1.actor_id, proto.NOTIFY, _ann(3))
        lost = mail.call(A1.actor_id, proto.PING)
        reqs = await mail.poll(A1, [], [], timeout=1)
        kept_id = next(r.req_id for r in reqs if r.method == proto.NOTIFY)
        for _ in range(600):  # polls that say the notify still runs, never the ping, until the ping is lost
            if lost.done():
                break
            await mail.poll(A1, [], [kept_id], timeout=0.05)
        with pytest.raises(SubscriberUnreachable, match="no answer"):
            await lost
        assert not kept.done()
        await mail.poll(A1, [Answer(kept_id, ApplyReport(applied=3))], [], timeout=0)
        assert (await kept).applied == 3

    asyncio.run(main())


class _Process:
    """A simulated subscriber process: polls ``mail`` and answers each call after ``delay_s``."""

    def __init__(self, mail: Mailboxes, caller: Caller, delay_s: float = 0.0, fail: bool = False) -> None:
        self.mail, self.caller, self.delay_s, self.fail = mail, caller, delay_s, fail
        self.seen: list[tuple[str, int, tuple[str, ...]]] = []

    async def run(self) -> None:
        while True:
            for req in await self.mail.poll(self.caller, [], [], timeout=1):
                asyncio.get_running_loop().create_task(self._answer(req))

    async def _answer(self, req: Any) -> None:
        a = req.announcement
        self.seen.append((req.method, a.version, a.sub_ids))
        await asyncio.sleep(self.delay_s)
        if self.fail:
            self.mail.answer(self.caller, [Answer(req.req_id, error=RuntimeError("out of memory"))])
            return
        self.mail.answer(self.caller, [Answer(req.req_id, ApplyReport(applied=a.version))])


def test_a_node_delivery_calls_each_subscription_by_name_and_slow_acks_come_later() -> None:
    """One call per subscription, naming it (two of one process: two calls, each answered by its
    own receiver); a slow process's ack is late, not lost."""

    async def main() -> None:
        mail = _mail()
        quick = _Process(mail, Caller("q" * 32, 1))
        shared = _Process(mail, Caller("b" * 32, 2))
        slow = _Process(mail, Caller("s" * 32, 3), delay_s=0.4)
        broken = _Process(mail, Caller("x" * 32, 4), fail=True)
        tasks = [asyncio.create_task(p.run()) for p in (quick, shared, slow, broken)]
        members = {
            "q:policy": RelayMember(quick.caller.actor_id),
            "b1:policy": RelayMember(shared.caller.actor_id),
            "b2:policy": RelayMember(shared.caller.actor_id),
            "s:policy": RelayMember(slow.caller.actor_id),
            "x:policy": RelayMember(broken.caller.actor_id),
        }
        acks, late, calls = await notify_members(_ann(7), members, mail.call, window=0.2)
        assert calls == 5
        assert sorted(shared.seen) == [(proto.NOTIFY, 7, ("b1:policy",)), (proto.NOTIFY, 7, ("b2:policy",))]
        # The slow one answers 0.4 s after it takes the call: always after the 0.2 s window. The
        # others answer at once, but a loaded machine may hold them past it too: late, not lost.
        assert ("s:policy",) in [ids for ids, _ in late]
        later = [ack async for batch in late_acks(late) for ack in batch]
        outcome = {a.sub_id: (a.outcome, a.report.applied if a.report else None) for a in acks + later}
        assert outcome == {
            "q:policy": ("ok", 7),
            "b1:policy": ("ok", 7),
            "b2:policy": ("ok", 7),
            "s:policy": ("ok", 7),
            "x:policy": ("failed", None),
        }
        assert len(acks) + len(later) == 5  # one ack each
        for t in tasks:
            t.cancel()

    asyncio.run(main())


def test_a_member_that_died_mid_delivery_is_acked_as_died(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(mailbox, "_SUSPECT_S", 0.05)
    monkeypatch.setattr(mailbox, "_CHECK_S", 0.02)

    async def main() -> None:
        mail = _mail(alive=False)
        members = {"d:policy": RelayMember("d" * 32), "p:policy": RelayMember(None)}
        acks, late, _ = await notify_members(_ann(2), members, mail.call, window=0.05)
        assert ("p:policy", "unreachable") in [(a.sub_id, a.outcome) for a in acks]  # no actor: at once
        later = [ack async for batch in late_acks(late) for ack in batch]
        # The dead one is found dead within the window or after it (how soon is the machine's load).
        outcomes = sorted((a.sub_id, a.outcome) for a in acks + later)
        assert outcomes == [("d:policy", "died"), ("p:policy", "unreachable")]

    asyncio.run(main())


def test_a_call_for_a_restarted_actors_old_process_leaves_its_new_registration_live() -> None:
    """The relay's call reached the old process; the new one registered (caught up by itself), then
    polled the relay: that ack says "restarted", and the hub keeps the new registration live."""
    from raysync._protocol import Registration, SubscriberInfo
    from raysync.hub.delivery import Delivery
    from raysync.hub.state import HubState

    async def main() -> list[Any]:
        mail = _mail()
        old, new = Caller("a" * 32, pid=100, node_id="n1"), Caller("a" * 32, pid=101, node_id="n1")
        acks, late, _ = await notify_members(
            _ann(7), {"a:policy": RelayMember(old.actor_id)}, mail.call, window=0.05
        )
        assert acks == [] and len(late) == 1  # handed to nobody yet
        await mail.poll(old, [], [], timeout=0)  # the old process takes it, and dies
        await mail.poll(new, [], [], timeout=0)  # its new process polls
        return [ack async for batch in late_acks(late) for ack in batch]

    (ack,) = asyncio.run(main())
    assert (ack.sub_id, ack.outcome) == ("a:policy", "restarted")

    state = HubState("hub", 2, relay=True)
    info = SubscriberInfo(mode="push", class_name="A", actor_id="a" * 32, node_id="n1")
    state.roster.register(Registration("a:policy", "policy", True, info))
    sub, _, _ = state.roster.register(Registration("a:policy", "policy", True, info))  # registered again
    delivery = Delivery.__new__(Delivery)
    delivery._state = state
    group = state.groups["policy@node:n1"]
    delivery._acks("policy", group, 7, proto.RelayReply((ack,), ()), {})
    assert sub.state == "live" and sub.last_error is None
    unreachable = proto.RelayAck("a:policy", None, "unreachable", RuntimeError("no poll in 30 s"))
    delivery._acks("policy", group, 7, proto.RelayReply((unreachable,), ()), {})
    assert sub.state == "unreachable"  # the test can fail: other outcomes still mark it


def test_a_poll_left_open_by_a_replaced_process_takes_no_call() -> None:
    """An actor restarted: its dead process's poll, still open (or arriving late), never takes
    the calls meant for the new process, which gets them with its own poll."""

    async def main() -> None:
        mail = _mail()
        old = asyncio.create_task(mail.poll(A1, [], [], timeout=5))  # the first process's poll
        await asyncio.sleep(0.01)
        new_caller = Caller(A1.actor_id, pid=101, node_id="n1")
        assert await mail.poll(new_caller, [], [], timeout=0) == ()  # the restarted process polls
        new = asyncio.create_task(mail.poll(new_caller, [], [], timeout=5))
        await asyncio.sleep(0.01)
        call = mail.call(A1.actor_id, proto.NOTIFY, _ann(4))
        assert await asyncio.wait_for(old, 4) == ()  # woken (its timeout is 5 s), yet it takes nothing
        (req,) = await asyncio.wait_for(new, 4)
        assert await mail.poll(A1, [Answer(req.req_id, ApplyReport(applied=9))], [], timeout=0) == ()
        assert not call.done()  # a late poll of the old process answers nothing, fails nothing
        await mail.poll(new_caller, [Answer(req.req_id, ApplyReport(applied=4))], [], timeout=0)
        assert (await call).applied == 4

    asyncio.run(main())


def test_a_newer_poll_of_one_process_takes_the_calls_and_ends_the_older_one() -> None:
    """A process whose poller stopped and began anew (its last Follower stopped, then another
    started), or that gave up on a poll's reply, polls again while its older poll is still open
    at the hub: the older one ends at once, empty, and a call goes with the newer one, never
    into a reply nobody reads (lost until LOST_S)."""

    async def main() -> None:
        mail = _mail()
        old = asyncio.create_task(mail.poll(A1, [], [], timeout=5))
        await asyncio.sleep(0.01)
        new = asyncio.create_task(mail.poll(A1, [], [], timeout=5))
        assert await asyncio.wait_for(old, 1) == ()  # superseded at once (its timeout is 5 s)
        call = mail.call(A1.actor_id, proto.NOTIFY, _ann(5))
        (req,) = await asyncio.wait_for(new, 4)
        await mail.poll(A1, [Answer(req.req_id, ApplyReport(applied=5))], [], timeout=0)
        assert (await call).applied == 5

    asyncio.run(main())


def test_a_process_that_stopped_polling_leaves_no_mailbox(monkeypatch: pytest.MonkeyPatch) -> None:
    """Subscriber processes come and go: the hub (or relay) keeps a mailbox only for those that poll."""
    monkeypatch.setattr(mailbox, "_CHECK_S", 0.02)
    monkeypatch.setattr(mailbox, "PICKUP_S", 0.1)

    async def main() -> None:
        mail = _mail(alive=True)
        polling = Caller("b2" * 16, pid=200, node_id="n1")
        gone = [Caller(f"{i:02d}" * 16, pid=300 + i, node_id="n1") for i in range(24)]
        for caller in gone:  # each polled, was answered, then its process went
            call = mail.call(caller.actor_id, proto.NOTIFY, _ann())
            (req,) = await mail.poll(caller, [], [], timeout=1)
            await mail.poll(caller, [Answer(req.req_id, ApplyReport(applied=3))], [], timeout=0)
            assert (await call).applied == 3
        never = mail.call("c3" * 16, proto.NOTIFY, _ann())  # queued for a process that never polls
        assert len(mail) == 25
        monkeypatch.setattr(mailbox, "IDLE_S", 0.2)  # (60 s, not 0.2, in a hub)
        keep_polling = asyncio.create_task(_poll_forever(mail, polling))
        with pytest.raises(SubscriberUnreachable, match="did not poll"):
            await asyncio.wait_for(never, 10)
        for _ in range(500):  # 10 s at most
            if len(mail) == 1:
                break
            await asyncio.sleep(0.02)
        assert len(mail) == 1  # only the process still polling keeps one
        call = mail.call(polling.actor_id, proto.NOTIFY, _ann(4))
        assert (await asyncio.wait_for(call, 10)).applied == 4  # and its calls still go through
        again = mail.call(gone[0].actor_id, proto.NOTIFY, _ann(5))  # a process back: a new mailbox
        (req,) = await mail.poll(gone[0], [], [], timeout=1)
        mail.answer(gone[0], [Answer(req.req_id, ApplyReport(applied=5))])
        assert (await again).applied == 5
        keep_polling.cancel()

    asyncio.run(main())


async def _poll_forever(mail: Mailboxes, caller: Caller) -> None:
    """A live process: polls again and again, answers each call at once."""
    answers: list[Answer] = []
    while True:
        reqs = await mail.poll(caller, answers, [], timeout=0.05)
        answers = [Answer(r.req_id, ApplyReport(applied=r.announcement.version)) for r in reqs]
