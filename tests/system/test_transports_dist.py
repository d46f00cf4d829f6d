"""RPCTransport and DistributedTransport between real processes on localhost (gloo, TCPStore, RPC).

One sender (rank 0) and two workers are spawned once for the module and reused
by every test; the last test shuts them down and checks none is left behind.
No Ray here.
"""

from __future__ import annotations

import multiprocessing as mp
import pickle
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from benchmarks._ports import free_ports
from raysync.channels.base import TransportBackend
from raysync.channels.distributed import DistributedTransport
from raysync.channels.rpc import RPCTransport
from raysync.errors import InvalidWeightsError
from tests import _dist_procs
from tests._dist_procs import make_module, make_weights
from tests._support import assert_same_weights

KINDS = ["rpc", "dist"]
WORKERS = [1, 2]
REPLY_TIMEOUT = 90.0  # a child that does not answer fails the test instead of hanging it
START_TIMEOUT = 240.0  # importing torch + raysync in 3 fresh processes on a busy 2-core machine


class Child:
    """A spawned rank, driven over a pipe."""

    def __init__(self, ctx: Any, rank: int, world: int, ports: tuple[int, int]) -> None:
        self.rank = rank
        self.conn, child_conn = ctx.Pipe()
        self.process = ctx.Process(
            target=_dist_procs.main, args=(rank, world, *ports, child_conn), daemon=True
        )
        self.process.start()
        child_conn.close()

    def submit(self, name: str, **kwargs: Any) -> None:
        self.conn.send_bytes(pickle.dumps((name, kwargs)))

    def result(self, timeout: float = REPLY_TIMEOUT) -> Any:
        if not self.conn.poll(timeout):
            raise AssertionError(f"rank {self.rank} did not answer within {timeout} s")
        reply = pickle.loads(self.conn.recv_bytes())
        if reply[0] == "err":
            raise AssertionError(f"rank {self.rank} raised {reply[1]}: {reply[2]}")
        return reply[1]

    def call(self, name: str, **kwargs: Any) -> Any:
        self.submit(name, **kwargs)
        return self.result()


class Group:
    def __init__(self) -> None:
        ctx = mp.get_context("spawn")
        ports = tuple(free_ports(2))
        world = 1 + len(WORKERS)
        self.children = [Child(ctx, rank, world, ports) for rank in range(world)]
        for child in self.children:
            assert child.result(START_TIMEOUT) == "ready"

    @property
    def sender(self) -> Child:
        return self.children[0]

    def worker(self, rank: int) -> Child:
        return self.children[rank]

    def stop(self) -> None:
        for child in self.children:
            child.submit("stop")
        for child in self.children:
            assert child.result() == "stopped"
        for child in self.children:
            child.process.join(timeout=30)

    def kill(self) -> None:
        for child in self.children:
            if child.process.is_alive():
                child.process.kill()
                child.process.join(timeout=10)


@pytest.fixture(scope="module")
def group() -> Iterator[Group]:
    g = Group()
    yield g
    g.kill()  # only does something if the shutdown test failed or did not run


def _receive_all(group: Group, kind: str, ack: str | None = "updated", **kwargs: Any) -> dict[int, Any]:
    for r in WORKERS:
        group.worker(r).submit("receive", kind=kind, ack=ack, **kwargs)
    return {r: group.worker(r).result() for r in WORKERS}


@pytest.mark.parametrize("kind", KINDS)
def test_workers_equal_sender_after_each_send(group: Group, kind: str) -> None:
    for seed in (1, 2, 3):
        group.sender.submit("send", kind=kind, ranks=WORKERS, model_id="policy", seeds=[seed])
        received = _receive_all(group, kind)
        assert group.sender.result() == {1: "ok", 2: "ok"}
        for r in WORKERS:
            model_id, keys, tensors = received[r]
            assert model_id == "policy"
            assert keys == sorted(keys)  # canonical order, whatever order the sender built them in
            assert_same_weights(tensors, make_weights(seed))


@pytest.mark.parametrize("kind", KINDS)
def test_versions_arrive_in_order_and_whole(group: Group, kind: str) -> None:
    # Three versions sent back to back (no wait in between); the sender waits for the newest ack.
    group.sender.submit("send", kind=kind, ranks=WORKERS, model_id="policy", seeds=[11, 12, 13])
    for seed in (11, 12, 13):
        received = _receive_all(group, kind)
        for r in WORKERS:
            assert received[r][0] == "policy"
            assert_same_weights(received[r][2], make_weights(seed))
    assert group.sender.result() == {1: "ok", 2: "ok"}


@pytest.mark.parametrize("kind", KINDS)
def test_several_models_and_one_argument_call(group: Group, kind: str) -> None:
    group.sender.submit("send", kind=kind, ranks=WORKERS, model_id="value", seeds=[5])
    value = _receive_all(group, kind)
    assert group.sender.result() == {1: "ok", 2: "ok"}
    # send_weights(module): torchrl 0.14's call shape, model id "policy"; buffers travel too.
    group.sender.submit("send", kind=kind, ranks=WORKERS, model_id=None, seeds=[6], what="module")
    policy = _receive_all(group, kind)
    assert group.sender.result() == {1: "ok", 2: "ok"}
    expected = make_module(6).state_dict()
    assert "1.running_var" in expected and "1.num_batches_tracked" in expected
    for r in WORKERS:
        assert value[r][0] == "value"
        assert_same_weights(value[r][2], make_weights(5))
        assert policy[r][0] == "policy"
        assert_same_weights(policy[r][2], {k: v for k, v in expected.items()})


@pytest.mark.parametrize("kind", KINDS)
def test_error_ack_raises_apply_error_on_the_sender(group: Group, kind: str) -> None:
    group.sender.submit("send", kind=kind, ranks=WORKERS, model_id="policy", seeds=[7])
    group.worker(1).submit("receive", kind=kind, ack="error: size mismatch for net.0.weight")
    group.worker(2).submit("receive", kind=kind, ack="updated")
    assert group.worker(1).result()[0] == "policy"  # the bytes were taken whole all the same
    assert group.worker(2).result()[0] == "policy"
    outcome = group.sender.result()
    assert outcome[2] == "ok"
    name, message, _ = outcome[1]
    assert name == "ApplyError" and "size mismatch for net.0.weight" in message


@pytest.mark.parametrize("kind", KINDS)
def test_silent_worker_times_out_then_recovers(group: Group, kind: str) -> None:
    # Worker 1 never receives nor acks: wait_ack raises instead of hanging.
    outcome = group.sender.call("send", kind=kind, ranks=[1], model_id="policy", seeds=[8], timeout=1.0)
    name, message, elapsed = outcome[1]
    assert name == "SyncTimeoutError", message
    assert elapsed < _dist_procs.TIMEOUT  # returned on its own timeout, not the transport's
    # The worker wakes up: it gets that version, its late ack is ignored, the next send goes through.
    late = group.worker(1).call("receive", kind=kind)
    assert_same_weights(late[2], make_weights(8))
    group.sender.submit("send", kind=kind, ranks=[1], model_id="policy", seeds=[9])
    fresh = group.worker(1).call("receive", kind=kind)
    assert group.sender.result() == {1: "ok"}
    assert_same_weights(fresh[2], make_weights(9))


@pytest.mark.parametrize("kind", KINDS)
def test_receive_without_a_version_returns_none(group: Group, kind: str) -> None:
    assert group.worker(2).call("receive", kind=kind, timeout=0.2) is None


def test_distributed_keeps_control_messages(group: Group) -> None:
    # A message that is not a version is kept for the caller, in order, never dropped.
    group.sender.call("send_message", kind="dist", rank=1, message=b"update_weights")
    group.sender.submit("send", kind="dist", ranks=[1], model_id="policy", seeds=[10])
    got = group.worker(1).call("receive", kind="dist")
    assert group.sender.result() == {1: "ok"}
    assert_same_weights(got[2], make_weights(10))
    assert group.worker(1).call("next_message", kind="dist") == b"update_weights"
    assert group.worker(1).call("next_message", kind="dist", timeout=0.1) is None
    # Reading control messages stops before a version: it stays for receive_weights().
    group.sender.call("send_message", kind="dist", rank=1, message=b"pause")
    group.sender.submit("send", kind="dist", ranks=[1], model_id="policy", seeds=[14])
    assert group.worker(1).call("next_message", kind="dist", timeout=5.0) == b"pause"
    assert group.worker(1).call("next_message", kind="dist", timeout=0.1) is None
    got = group.worker(1).call("receive", kind="dist")
    assert group.sender.result() == {1: "ok"}
    assert_same_weights(got[2], make_weights(14))


@pytest.mark.parametrize("kind", KINDS)
def test_scheme_over_real_processes(group: Group, kind: str) -> None:
    """RPCWeightSyncScheme / DistributedWeightSyncScheme: connect, worker_ids, a mismatched schema."""
    for child in group.children:
        child.submit("scheme_init", kind=kind)
    keys = {r: group.worker(r).result() for r in WORKERS}
    assert group.sender.result() == []
    # connect(): the sender pushes its model, each worker waits for that first version.
    for child in group.children:
        child.submit("scheme_connect", kind=kind)
    assert group.sender.result() == "ok"
    for r in WORKERS:
        state, same_params = group.worker(r).result()
        assert_same_weights(state, make_module(100).state_dict())
        assert same_params and list(state) == keys[r]
    # worker_ids: only the first worker (rank 1) gets version 101.
    group.sender.submit("scheme_send", kind=kind, seed=101, worker_ids=[0])
    applied, error, (state, _) = group.worker(1).call("scheme_receive", kind=kind)
    assert group.sender.result() == "ok"
    assert applied and error is None
    assert_same_weights(state, make_module(101).state_dict())
    applied, _, (state, _) = group.worker(2).call("scheme_receive", kind=kind, timeout=0.2)
    assert not applied
    assert_same_weights(state, make_module(100).state_dict())
    # A mismatched schema: refused whole on the worker, ApplyError on the sender, no hang.
    group.sender.submit("scheme_send", kind=kind, seed=0, worker_ids=0, bad=True)
    applied, error, (state, same_params) = group.worker(1).call("scheme_receive", kind=kind)
    name, message = group.sender.result()
    assert name == "ApplyError" and "mismatch" in message
    assert not applied and error == "WeightMismatchError"
    assert_same_weights(state, make_module(101).state_dict())
    assert same_params and list(state) == keys[1]
    # A model id the worker has no receiver for: refused with a clear error, nothing changes.
    group.sender.submit("send_raw", kind=kind, rank=2, channel="scheme", model_id="critic", seed=3)
    applied, error, (state, _) = group.worker(2).call("scheme_receive", kind=kind)
    name, message = group.sender.result()
    assert name == "ApplyError" and "critic" in message
    assert not applied and error == "UnknownModelError"
    assert_same_weights(state, make_module(100).state_dict())


def test_shutdown_leaves_no_process(group: Group) -> None:
    group.stop()
    for child in group.children:
        assert not child.process.is_alive()
        assert child.process.exitcode == 0


# ------------------------------------------------------------------- in this process (no group)


@pytest.mark.parametrize(
    "transport",
    [
        RPCTransport("worker3", worker_rank=3, timeout=7.0, channel="value", bucket_bytes=1024),
        DistributedTransport(None, 3, timeout=7.0, channel="value", bucket_bytes=1024),
    ],
)
def test_pickling_keeps_configuration_and_drops_runtime_state(transport: Any) -> None:
    transport._pending = object()  # runtime state that must not travel
    copy = pickle.loads(pickle.dumps(transport))
    assert type(copy) is type(transport)
    assert (copy.timeout, copy.channel, copy.bucket_bytes) == (7.0, "value", 1024)
    assert getattr(copy, "worker_rank", getattr(copy, "rank", None)) == 3
    assert copy._pending is None
    copy.wait_ack()  # nothing in flight: returns at once
    assert isinstance(copy, TransportBackend)


def test_bad_calls_raise_clear_errors() -> None:
    with pytest.raises(ValueError, match="no worker to send to"):
        RPCTransport().send_weights({"w": torch.ones(1)})
    with pytest.raises(ValueError, match="no store"):
        DistributedTransport(None, 1).send_weights({"w": torch.ones(1)})
    with pytest.raises(TypeError, match=r"takes \(weights\) or \(model_id: str, weights\)"):
        RPCTransport("w1", worker_rank=1).send_weights(3, {"w": torch.ones(1)})
    with pytest.raises(TypeError, match="got 0 argument"):
        RPCTransport("w1", worker_rank=1).send_weights_async()
    with pytest.raises(RuntimeError, match="nothing to acknowledge"):
        RPCTransport().send_ack()
    with pytest.raises(ValueError, match="timeout must be"):
        DistributedTransport(None, 1, timeout=0)
    # No process group here: raysync says so. (An in-process vLLM engine, in test_vllm.py, leaves
    # one in the test process: then torch's RPC says it has no agent.)
    with pytest.raises(RuntimeError, match=r"not initiali[sz]ed"):
        RPCTransport("w1", worker_rank=1).send_weights({"w": torch.ones(1)})
    with pytest.raises(InvalidWeightsError):
        RPCTransport("w1", worker_rank=1).send_weights("policy", {})
