"""The node-local doorbell without Ray: sealed segments, MAC'd rings and acks between processes."""

from __future__ import annotations

import array
import asyncio
import contextlib
import errno
import logging
import mmap
import os
import socket
import threading
import time
from typing import Any

import numpy as np
import pytest
import torch

from raysync._protocol import ApplyReport, RelayAck, Ring, compact
from raysync.core.layout import plan_layout
from raysync.transports import doorbell
from raysync.transports.doorbell import Doorbell, Ringer, Segment, SegmentWriter, read_segment, sockets, wire
from tests._support import raysync_files_in_shm

pytestmark = pytest.mark.skipif(not doorbell.available(), reason="needs Linux (memfd, SO_PASSCRED)")

_MANIFEST = plan_layout({"a": torch.zeros(3), "b": torch.zeros(1024, dtype=torch.uint8)})


def _buckets(seed: int) -> list[list[np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [[rng.integers(0, 255, n, dtype=np.uint8) for n in (12, 1024)]]


def _flat(buckets: list[list[np.ndarray]]) -> list[bytes]:
    return [a.tobytes() for b in buckets for a in b]


def _ring_for(segment: doorbell.SegmentHandle, version: int = 7) -> Ring:
    return Ring(1, "policy", version, ("s",), segment.size, segment.inode, segment.device)


def test_a_segment_reads_back_bit_for_bit_and_leaves_no_file() -> None:
    before = raysync_files_in_shm()
    segment = SegmentWriter().write("policy", 7, _MANIFEST, ["a"], _buckets(1))
    seg = read_segment(segment.fd, _ring_for(segment))
    assert (seg.model_id, seg.version, seg.manifest, seg.ids) == ("policy", 7, _MANIFEST, ["a"])
    assert _flat(seg.buckets) == _flat(_buckets(1))
    assert not seg.buckets[0][1].flags.writeable  # readers cannot scribble on what others read
    segment.close()
    assert _flat(seg.buckets) == _flat(_buckets(1))  # a reader keeps what it mapped
    assert raysync_files_in_shm() == before  # nothing named anywhere: nothing to sweep, guess or delete


def test_a_sealed_segment_cannot_be_rewritten_even_by_its_own_user() -> None:
    """What another job of the same uid could try between write and read: every way is refused."""
    segment = SegmentWriter().write("policy", 7, _MANIFEST, ["a"], _buckets(1))
    path = f"/proc/self/fd/{segment.fd}"
    fd = os.open(path, os.O_RDWR)  # reopening by /proc gives a writable descriptor...
    try:
        with pytest.raises(PermissionError):
            os.pwrite(fd, b"forged", 100)  # ...yet the kernel refuses every write
        with pytest.raises(PermissionError):
            os.ftruncate(fd, 10)
        with pytest.raises(PermissionError):
            mmap.mmap(fd, segment.size, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    seg = read_segment(segment.fd, _ring_for(segment))
    assert _flat(seg.buckets) == _flat(_buckets(1))
    segment.close()


def test_a_segment_that_is_not_the_one_rung_is_refused(tmp_path: Any) -> None:
    segment = SegmentWriter().write("policy", 7, _MANIFEST, ["a"], _buckets(1))
    other = SegmentWriter().write("policy", 7, _MANIFEST, ["a"], _buckets(2))
    with pytest.raises(ValueError, match="not the segment"):
        read_segment(other.fd, _ring_for(segment))  # same size, another file
    with pytest.raises(ValueError, match="another version"):
        read_segment(segment.fd, _ring_for(segment, version=8))
    plain = tmp_path / "plain"
    plain.write_bytes(b"\0" * segment.size)
    fd = os.open(plain, os.O_RDONLY)
    st = os.fstat(fd)
    with pytest.raises(ValueError, match="sealed"):  # an ordinary (writable) file
        read_segment(fd, Ring(1, "policy", 7, ("s",), st.st_size, st.st_ino, st.st_dev))
    os.close(fd)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    fd = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    with pytest.raises(ValueError, match="regular file"):
        read_segment(fd, _ring_for(segment))
    os.close(fd)
    segment.close()
    other.close()


def test_wire_records_round_trip_and_refuse_tampering() -> None:
    key = os.urandom(wire.KEY_BYTES)
    ring = Ring(9, "policy", 3, ("a:policy", "b:policy"), 100, 5, 6)
    data = wire.encode_ring(key, ring)
    assert wire.decode_ring(key, data) == ring
    with pytest.raises(wire.WireError, match="MAC"):
        wire.decode_ring(os.urandom(wire.KEY_BYTES), data)
    for i in (0, 5, 20, len(data) - 1):  # any byte changed
        bad = bytearray(data)
        bad[i] ^= 1
        with pytest.raises(wire.WireError):
            wire.decode_ring(key, bytes(bad))
    acks = [
        RelayAck(
            "a:policy", ApplyReport(applied=3, apply_s=0.01, pause_s=0.0, buckets_fetched=1, bytes_fetched=9)
        ),
        RelayAck("b:policy", ApplyReport(applied=2, failed=3, error=ValueError("bad"), timed_out=True)),
        RelayAck("c:policy", None, "unknown"),
    ]
    token, version, reply = wire.decode_ack(key, wire.encode_ack(key, 9, 3, compact(3, acks)))
    assert (token, version) == (9, 3)
    assert reply.applied == (("a:policy", 0.01, 0.0, 1, 9),)
    failed = reply.acks[0].report
    assert failed is not None and (failed.applied, failed.failed, failed.timed_out) == (2, 3, True)
    assert str(failed.error) == "ValueError: bad"  # text only, never an object
    assert (reply.acks[1].sub_id, reply.acks[1].outcome, reply.acks[1].report) == (
        "c:policy",
        "unknown",
        None,
    )


def test_segment_headers_refuse_what_does_not_fit() -> None:
    header = wire.encode_segment_header("policy", 1, _MANIFEST, ["a"], [[12, 1024]])
    assert wire.decode_segment_header(header, len(header) + 2000)[1] == 1
    with pytest.raises(wire.WireError):
        wire.decode_segment_header(header, len(header) - 1)  # longer than the file
    bad = bytearray(header)
    bad[8:12] = b"XXXX"
    with pytest.raises(wire.WireError):
        wire.decode_segment_header(bytes(bad), 10_000)
    extra = _MANIFEST.with_extra_state({"x._extra_state": 1})
    with pytest.raises(wire.WireError, match="extra state"):
        wire.encode_segment_header("policy", 1, extra, ["a"], [[12, 1024]])


class _Model:
    """A stand-in subscription: holds the bytes of the newest version it was handed."""

    def __init__(self, hold_s: float = 0.0) -> None:
        self.version: int | None = None
        self.data: list[bytes] = []
        self.hold_s = hold_s
        self.threads: set[str] = set()
        self.calls = 0

    def __call__(self, ring: Ring, segment: Segment | None) -> ApplyReport:
        self.calls += 1
        self.threads.add(threading.current_thread().name)
        if segment is None:
            return ApplyReport(applied=self.version, skipped=ring.version)
        time.sleep(self.hold_s)
        self.data = _flat(segment.buckets)
        self.version = segment.version
        return ApplyReport(applied=self.version, apply_s=self.hold_s)


def _ring_and_wait(
    bell: Doorbell, sub_ids: list[str], version: int, timeout: float = 10, key: bytes | None = None
) -> tuple[list[Any], list[str]]:
    async def run() -> tuple[list[Any], list[str]]:
        ringer = Ringer()
        segment = SegmentWriter().write("policy", version, _MANIFEST, ["x"], _buckets(version))
        tokens = ringer.ring(bell.address, key or bell.key, "policy", version, segment, sub_ids)
        segment.close()
        result = await ringer.wait(tokens, timeout=timeout)
        ringer.close()
        return result

    return asyncio.run(run())


def test_a_ring_is_applied_on_the_doorbell_thread_and_acknowledged() -> None:
    bell = Doorbell()
    models = {f"actor{i:04d}:policy": _Model() for i in range(3000)}  # more than one datagram's worth
    for sub_id, model in models.items():
        bell.register(sub_id, model)
    acks, missing = _ring_and_wait(bell, list(models), 5)
    bell.close()
    assert missing == []
    assert sorted(a.sub_id for a in acks) == sorted(models)
    assert all(a.outcome == "ok" and a.report.applied == 5 for a in acks)
    assert all(m.version == 5 and m.data == _flat(_buckets(5)) for m in models.values())
    assert {t for m in models.values() for t in m.threads} == {"raysync-doorbell"}


def test_the_sockets_are_reachable_by_this_user_only() -> None:
    bell = Doorbell()
    base = doorbell.runtime_dir()
    assert base is not None and os.path.dirname(bell.address) == base
    st = os.stat(base)
    assert st.st_uid == os.getuid() and st.st_mode & 0o077 == 0
    bell.close()
    assert not os.path.exists(bell.address)


def test_a_ring_with_another_key_is_dropped_and_acknowledges_nothing() -> None:
    bell = Doorbell()
    model = _Model()
    bell.register("s", model)
    acks, missing = _ring_and_wait(bell, ["s"], 4, timeout=0.5, key=os.urandom(wire.KEY_BYTES))
    assert (acks, missing, model.calls) == ([], ["s"], 0)
    assert bell.drops.total["malformed or bad MAC"] == 1
    acks, missing = _ring_and_wait(bell, ["s"], 5)  # the real key still works
    assert missing == [] and model.version == 5
    bell.close()


def _send(address: str, data: bytes, fds: list[int] | None = None) -> bool:
    """What an attacker does: connect, send one message, hang up. Whether the connection was taken."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as sock:
        sock.settimeout(5)
        try:
            sock.connect(address)
        except OSError:
            return False
        anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
        sock.sendmsg([data], anc)
        return True


def test_hostile_datagrams_run_nothing_apply_nothing_and_wedge_nothing(
    tmp_path: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """Pickles, random bytes, rings with a FIFO, replays with another segment: all dropped,
    counted, logged once; the doorbell serves the next real ring at once."""
    fds_before = len(os.listdir(f"/proc/{os.getpid()}/fd"))
    bell = Doorbell()
    model = _Model()
    bell.register("s", model)
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self) -> Any:
            return (open, (str(marker), "w"))

    import pickle

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    fifo_fd = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    real = SegmentWriter().write("policy", 6, _MANIFEST, ["x"], _buckets(6))
    forged = SegmentWriter().write("policy", 9, _MANIFEST, ["x"], _buckets(99))
    # A ring the relay really sent (MAC'd with the key), replayed with another segment.
    replay = wire.encode_ring(bell.key, Ring(1, "policy", 9, ("s",), real.size, real.inode, real.device))
    with caplog.at_level(logging.WARNING, logger="raysync.transports.doorbell"):
        n = 300
        taken = {k: 0 for k in range(5)}  # connections the doorbell's queue took (the rest: EAGAIN)
        for i in range(n):
            kind = i % 5
            if kind == 0:
                sent = _send(bell.address, pickle.dumps(Evil()))
            elif kind == 1:
                sent = _send(bell.address, os.urandom(i % 2000 + 1))
            elif kind == 2:
                fake = wire.encode_ring(os.urandom(32), Ring(1, "policy", 10**9, ("s",), 1, 1, 1))
                sent = _send(bell.address, fake, [fifo_fd])
            elif kind == 3:
                sent = _send(bell.address, replay, [forged.fd])
            else:
                sent = _send(bell.address, b"RSRG" + os.urandom(100), [fifo_fd, forged.fd])
            taken[kind] += sent
            if not sent:
                time.sleep(0.002)  # the queue is full: new connections are taken at a bounded rate
        n = sum(taken.values())
        assert n >= 10
        deadline = time.monotonic() + 30  # new connections are taken at a bounded rate
        while sum(bell.drops.total.values()) < n and time.monotonic() < deadline:
            time.sleep(0.05)
        _, missing = _ring_and_wait(bell, ["s"], 7, timeout=10)
    assert missing == [] and model.version == 7 and model.data == _flat(_buckets(7))
    assert not marker.exists() and model.calls == 1
    assert sum(bell.drops.total.values()) == n  # the replays' MACs check: dropped at their segment
    assert bell.drops.total["segment not the one rung"] == taken[3]
    lines = [r for r in caplog.records if "refused what was not from raysync" in r.getMessage()]
    assert len(lines) == 1  # not 300 tracebacks
    os.close(fifo_fd)
    real.close()
    forged.close()
    bell.close()
    assert len(os.listdir(f"/proc/{os.getpid()}/fd")) <= fds_before  # every descriptor sent along was closed


def test_acks_not_made_with_the_rung_process_key_are_dropped() -> None:
    """A forged ack (any key but the rung process's) does not count: the ring stays missing."""
    base = doorbell.runtime_dir()
    assert base is not None
    address = os.path.join(base, f"fake-{os.getpid()}")
    fake = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)  # a process that answers with forgeries
    fake.bind(address)
    fake.listen(4)
    key = os.urandom(wire.KEY_BYTES)

    async def run() -> tuple[list[Any], list[str], Any, list[Any]]:
        ringer = Ringer()
        segment = SegmentWriter().write("policy", 3, _MANIFEST, ["x"], _buckets(3))
        tokens = ringer.ring(address, key, "policy", 3, segment, ["s"])
        segment.close()
        conn, _ = await asyncio.get_running_loop().run_in_executor(None, fake.accept)
        forged = compact(3, [RelayAck("s", ApplyReport(applied=3))])
        conn.send(wire.encode_ack(os.urandom(wire.KEY_BYTES), tokens[0], 3, forged))
        conn.send(wire.encode_ack(key, tokens[0] + 1, 3, forged))  # no such ring
        conn.send(b"junk")
        acks, missing = await ringer.wait(tokens, timeout=0.5)
        deadline = time.monotonic() + 10  # the three were sent before the wait: each is read, then dropped
        while sum(ringer.drops.total.values()) < 3 and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        drops = dict(ringer.drops.total)
        late: list[Any] = []
        ringer.late = lambda model_id, version, acks: late.append(acks)
        conn.send(wire.encode_ack(key, tokens[0], 3, forged))  # the real one, late
        deadline = time.monotonic() + 10
        while not late and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        ringer.close()
        conn.close()
        return acks, missing, drops, late

    acks, missing, drops, late = asyncio.run(run())
    fake.close()
    os.unlink(address)
    assert acks == [] and missing == ["s"]
    assert drops == {"malformed or bad MAC": 2, "unknown token": 1}
    assert [[a.sub_id for a in batch] for batch in late] == [["s"]]


_LATE_ACK_BOUND_S = 10.0  # how long the test waits for an ack it knows comes (a bound, not a speed)


def test_a_slow_subscriber_is_pending_and_its_ack_comes_late() -> None:
    bell = Doorbell()
    fast, slow = _Model(), _Model(hold_s=0.5)
    bell.register("fast", fast)
    bell.register("slow", slow)
    late: list[tuple[str, int, list[Any]]] = []

    async def run() -> tuple[list[Any], list[str]]:
        ringer = Ringer()
        came = asyncio.Event()  # the late ack: the ringer calls ``late`` on its loop

        def on_late(model_id: str, version: int, acks: list[Any]) -> None:
            late.append((model_id, version, acks))
            came.set()

        ringer.late = on_late
        segment = SegmentWriter().write("policy", 2, _MANIFEST, ["x"], _buckets(2))
        tokens = ringer.ring(bell.address, bell.key, "policy", 2, segment, ["fast"])
        tokens += ringer.ring(bell.address, bell.key, "policy", 2, segment, ["slow"])
        segment.close()
        result = await ringer.wait(tokens, timeout=0.2)
        # The slow one applies for 0.5 s, then acks: the event, within a bound far above that
        # (TimeoutError if its ack never comes).
        await asyncio.wait_for(came.wait(), _LATE_ACK_BOUND_S)
        ringer.close()
        return result

    acks, missing = asyncio.run(run())
    bell.close()
    assert missing == ["slow"]
    assert [a.sub_id for a in acks] == ["fast"]
    assert late and late[0][:2] == ("policy", 2) and [a.sub_id for a in late[0][2]] == ["slow"]
    assert slow.version == 2


def test_a_newer_ring_supersedes_one_queued_behind_it() -> None:
    bell = Doorbell()
    model = _Model(hold_s=0.3)
    bell.register("s", model)

    async def run() -> list[Any]:
        ringer = Ringer()
        tokens = []
        for v in (1, 2, 3):  # 2 and 3 queue while 1 applies: 2 is skipped, 3 applied
            segment = SegmentWriter().write("policy", v, _MANIFEST, ["x"], _buckets(v))
            tokens += ringer.ring(bell.address, bell.key, "policy", v, segment, ["s"])
            segment.close()
            while not model.threads:  # version 1 is being applied
                await asyncio.sleep(0.01)
        acks, missing = await ringer.wait(tokens, timeout=10)
        ringer.close()
        assert missing == []
        return acks

    acks = asyncio.run(run())
    bell.close()
    reports = sorted((a.report.applied, a.report.skipped or 0) for a in acks)
    assert reports == [(1, 0), (3, 0), (3, 2)]
    assert model.version == 3 and model.data == _flat(_buckets(3))


def _connect_until_refused(address: str, flood: list[socket.socket]) -> bool:
    """Silent connections to ``address`` until the kernel refuses one (its queue is full)."""
    for _ in range(4 * (doorbell.bell.PROBATION + 16)):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        sock.setblocking(False)
        try:
            sock.connect(address)
        except BlockingIOError:
            sock.close()
            return True
        flood.append(sock)
    return False


def test_a_flood_of_connections_holds_back_new_ringers_only_and_says_which_queue_is_full(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Silent connections beyond what a doorbell takes fill its queue of new connections: a ringer
    that connects then is told so (its relay calls the process instead: "doorbell busy: new
    connections queued full" in its stats), while a ringer connected before still rings."""
    # The silent connections stay on probation for the whole test, so the doorbell takes no
    # more from the kernel's queue once its probation is full, however slow this machine is.
    monkeypatch.setattr(doorbell.bell, "PROBATION_S", 300.0)
    bell = Doorbell()
    model = _Model()
    bell.register("s", model)
    key = bell.key

    async def run() -> None:
        trusted = Ringer()
        segment = SegmentWriter().write("policy", 1, _MANIFEST, ["x"], _buckets(1))
        acks, missing = await trusted.wait(trusted.ring(bell.address, key, "policy", 1, segment, ["s"]), 10)
        assert missing == [] and model.version == 1
        flood: list[socket.socket] = []
        try:
            # The doorbell's thread takes connections off the kernel's queue into probation
            # while this one connects: once its probation is full, it takes no more, and
            # the kernel's queue is filled for good.
            deadline = time.monotonic() + 30
            while len(bell._probation) < doorbell.bell.PROBATION:
                _connect_until_refused(bell.address, flood)
                assert time.monotonic() < deadline, "the doorbell never filled its probation"
                await asyncio.sleep(0.01)
            if not _connect_until_refused(bell.address, flood):
                pytest.fail("the doorbell took every connection: nothing was queued")
            late = Ringer()
            with pytest.raises(BlockingIOError) as err:
                late.ring(bell.address, key, "policy", 2, segment, ["s"])
            assert err.value.strerror == doorbell.CONNECTIONS_QUEUED_FULL
            late.close()
            segment.close()
            segment = SegmentWriter().write("policy", 2, _MANIFEST, ["x"], _buckets(2))
            acks, missing = await trusted.wait(
                trusted.ring(bell.address, key, "policy", 2, segment, ["s"]), 10
            )
            assert missing == [] and [a.report.applied for a in acks] == [2] and model.version == 2
        finally:
            for sock in flood:
                sock.close()
            segment.close()
            trusted.close()

    asyncio.run(run())
    bell.close()


def test_ringing_a_process_that_is_gone_raises_and_removes_its_socket() -> None:
    base = doorbell.runtime_dir()
    assert base is not None
    address = os.path.join(base, f"sub-dead-{os.getpid()}")
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    dead.bind(address)
    dead.close()  # the process died: its socket file stays behind, nobody listens
    key = os.urandom(wire.KEY_BYTES)

    async def run() -> None:
        ringer = Ringer()
        segment = SegmentWriter().write("policy", 1, _MANIFEST, ["x"], _buckets(1))
        with pytest.raises(OSError) as err:
            ringer.ring(address, key, "policy", 1, segment, ["s"])
        assert err.value.errno == errno.ECONNREFUSED
        with pytest.raises(OSError):
            ringer.ring("/nonexistent/socket", key, "policy", 1, segment, ["s"])
        segment.close()
        ringer.close()

    asyncio.run(run())
    assert not os.path.exists(address)


def test_a_runtime_directory_someone_else_made_is_not_used(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    os.chmod(shared, 0o777)  # as another user would leave it (or a symlink, or group bits)
    monkeypatch.setenv("RAYSYNC_RUNTIME_DIR", str(shared))
    chosen = sockets._make_runtime_dir()
    assert chosen is not None and chosen != str(shared)
    st = os.stat(chosen)
    assert st.st_uid == os.getuid() and st.st_mode & 0o077 == 0
    with contextlib.suppress(OSError):
        os.rmdir(chosen)


def test_an_ack_carries_a_local_change_and_is_then_no_plain_row() -> None:
    key = os.urandom(wire.KEY_BYTES)
    acks = [RelayAck("a:policy", ApplyReport(applied=3, skipped=3, modified_since=3))]
    reply = compact(3, [RelayAck("b:policy", ApplyReport(applied=3, apply_s=0.1, modified_since=3))])
    assert reply.applied == () and len(reply.acks) == 1  # a row would lose it
    _, _, decoded = wire.decode_ack(key, wire.encode_ack(key, 9, 3, compact(3, acks)))
    report = decoded.acks[0].report
    assert report is not None and (report.applied, report.modified_since) == (3, 3)
