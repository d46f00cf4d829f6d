"""The node-local doorbell without Ray: segments in shared memory, rings and acks between processes."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import threading
import time
from typing import Any

import numpy as np
import pytest

from raysync._protocol import ApplyReport, Ring
from raysync.transports import doorbell
from raysync.transports.doorbell import Doorbell, Ringer, Segment, SegmentWriter, read_segment, sweep_segments

pytestmark = pytest.mark.skipif(not doorbell.available(), reason="needs Linux and a writable /dev/shm")


def _buckets(seed: int) -> list[list[np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [
        [rng.integers(0, 255, n, dtype=np.uint8) for n in (12, 4096, 1)],
        [rng.integers(0, 255, 100_000, dtype=np.uint8)],
        [np.zeros(0, dtype=np.uint8)],
    ]


def test_a_segment_reads_back_bit_for_bit() -> None:
    writer = SegmentWriter()
    buckets = _buckets(1)
    path = writer.write("policy", 7, {"manifest": "m"}, ["a", "b", None], buckets)
    try:
        seg = read_segment(path)
        assert (seg.model_id, seg.version, seg.manifest, seg.ids) == (
            "policy",
            7,
            {"manifest": "m"},
            ["a", "b", None],
        )
        assert [[a.tobytes() for a in b] for b in seg.buckets] == [[a.tobytes() for a in b] for b in buckets]
        assert not seg.buckets[1][0].flags.writeable  # readers cannot scribble on what others read
    finally:
        writer.close()
    assert not os.path.exists(path)


def test_older_segments_are_unlinked_but_a_reader_keeps_what_it_mapped() -> None:
    writer = SegmentWriter(keep=2)
    first = writer.write("policy", 1, None, ["x"], _buckets(1)[:1])
    held = read_segment(first)  # a slow reader maps version 1
    paths = [writer.write("policy", v, None, ["x"], _buckets(v)[:1]) for v in (2, 3)]
    assert not os.path.exists(first) and all(os.path.exists(p) for p in paths)
    with pytest.raises(FileNotFoundError):
        read_segment(first)
    assert [a.tobytes() for a in held.buckets[0]] == [a.tobytes() for a in _buckets(1)[0]]
    writer.close()


def _write_and_exit(conn: Any) -> None:
    conn.send(SegmentWriter().write("policy", 1, None, ["x"], _buckets(1)[:1]))
    os._exit(0)  # dies without unlinking


def test_segments_of_dead_relays_are_swept() -> None:
    ours, theirs = mp.get_context("fork").Pipe()
    proc = mp.get_context("fork").Process(target=_write_and_exit, args=(theirs,))
    proc.start()
    assert ours.poll(30)
    path = ours.recv()
    proc.join(30)
    assert os.path.exists(path)
    assert sweep_segments() >= 1
    assert not os.path.exists(path)


class _Model:
    """A stand-in subscription: holds the bytes of the newest version it was handed."""

    def __init__(self, hold_s: float = 0.0) -> None:
        self.version: int | None = None
        self.data: list[bytes] = []
        self.hold_s = hold_s
        self.threads: set[str] = set()

    def __call__(self, ring: Ring, segment: Segment | None) -> ApplyReport:
        self.threads.add(threading.current_thread().name)
        if segment is None:
            return ApplyReport(applied=self.version, skipped=ring.version)
        time.sleep(self.hold_s)
        self.data = [a.tobytes() for b in segment.buckets for a in b]
        self.version = segment.version
        return ApplyReport(applied=self.version, apply_s=self.hold_s)


def test_a_ring_is_applied_on_the_doorbell_thread_and_acknowledged() -> None:
    bell = Doorbell()
    models = {f"s{i}": _Model() for i in range(600)}  # more than one datagram's worth
    for sub_id, model in models.items():
        bell.register(sub_id, model)
    writer = SegmentWriter()

    async def run() -> tuple[list[Any], list[str]]:
        ringer = Ringer()
        path = writer.write("policy", 5, None, ["x", "y", "z"], _buckets(5))
        tokens = ringer.ring(bell.address, "policy", 5, path, list(models))
        assert len(tokens) == 3
        result = await ringer.wait(tokens, timeout=10)
        ringer.close()
        return result

    acks, missing = asyncio.run(run())
    writer.close()
    assert missing == []
    assert sorted(a.sub_id for a in acks) == sorted(models)
    assert all(a.outcome == "ok" and a.report.applied == 5 for a in acks)
    expected = [a.tobytes() for b in _buckets(5) for a in b]
    assert all(m.version == 5 and m.data == expected for m in models.values())
    assert {t for m in models.values() for t in m.threads} == {"raysync-doorbell"}


def test_a_slow_subscriber_is_pending_and_its_ack_comes_late() -> None:
    bell = Doorbell()
    fast, slow = _Model(), _Model(hold_s=0.5)
    bell.register("fast", fast)
    bell.register("slow", slow)
    writer = SegmentWriter()
    late: list[tuple[str, int, list[Any]]] = []

    async def run() -> tuple[list[Any], list[str]]:
        ringer = Ringer()
        ringer.late = lambda model_id, version, acks: late.append((model_id, version, acks))
        path = writer.write("policy", 2, None, ["x"], _buckets(2)[:1])
        tokens = ringer.ring(bell.address, "policy", 2, path, ["fast"])
        tokens += ringer.ring(bell.address, "policy", 2, path, ["slow"])
        result = await ringer.wait(tokens, timeout=0.2)
        deadline = time.monotonic() + 10
        while not late and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        ringer.close()
        return result

    t0 = time.monotonic()
    acks, missing = asyncio.run(run())
    writer.close()
    assert missing == ["slow"]
    assert [a.sub_id for a in acks] == ["fast"]
    assert late and late[0][:2] == ("policy", 2) and [a.sub_id for a in late[0][2]] == ["slow"]
    assert slow.version == 2 and time.monotonic() - t0 < 10


def test_a_newer_ring_supersedes_one_queued_behind_it() -> None:
    bell = Doorbell()
    model = _Model(hold_s=0.3)
    bell.register("s", model)
    writer = SegmentWriter()

    async def run() -> list[Any]:
        ringer = Ringer()
        tokens = []
        for v in (1, 2, 3):  # 2 and 3 queue while 1 applies: 2 is skipped, 3 applied
            path = writer.write("policy", v, None, ["x"], _buckets(v)[:1])
            tokens += ringer.ring(bell.address, "policy", v, path, ["s"])
            while not model.threads:  # version 1 is being applied
                await asyncio.sleep(0.01)
        acks, missing = await ringer.wait(tokens, timeout=10)
        ringer.close()
        assert missing == []
        return acks

    acks = asyncio.run(run())
    writer.close()
    reports = sorted((a.report.applied, a.report.skipped or 0) for a in acks)
    assert reports == [(1, 0), (3, 0), (3, 2)]
    assert model.version == 3 and model.data == [a.tobytes() for a in _buckets(3)[0]]


def test_ringing_a_process_that_is_gone_raises() -> None:
    async def run() -> None:
        ringer = Ringer()
        with pytest.raises(OSError):
            ringer.ring("\0raysync-sub-nobody", "policy", 1, "/dev/shm/none", ["s"])
        ringer.close()

    asyncio.run(run())


def test_max_bytes_reads_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RAYSYNC_DOORBELL_BYTES", "0")
    assert doorbell.max_bytes() == 0
    monkeypatch.setenv("RAYSYNC_DOORBELL_BYTES", "1024")
    assert doorbell.max_bytes() == 1024
    monkeypatch.setenv("RAYSYNC_DOORBELL_BYTES", "lots")
    assert doorbell.max_bytes() == 8 << 20
    monkeypatch.delenv("RAYSYNC_DOORBELL_BYTES")
    assert doorbell.max_bytes() == 8 << 20
