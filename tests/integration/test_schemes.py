"""raysync.schemes: the torchrl-style API on raysync's core (processes, shared memory, Ray actors)."""

from __future__ import annotations

import multiprocessing
import pickle
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import ray
import torch

import raysync
from raysync import _compat, schemes
from raysync.channels.base import TransportBackend
from raysync.channels.pipe import MPTransport, SnapshotPool
from tests._scheme_worker import net, serve, shared_mem_worker
from tests._support import assert_same_weights, wait_for_condition

TIMEOUT = 90.0  # generous: a spawned worker imports torch on a busy 2-core machine


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _ask(transport: MPTransport, command: str) -> Any:
    transport.send_message(command)
    reply = transport.next_message(timeout=TIMEOUT)
    assert reply is not None and reply[0] == command, reply
    return reply[1]


# --------------------------------------------------------------------------- in-process pipes


def test_mp_transport_roundtrip_sorted_keys_and_control_messages_kept() -> None:
    parent, child = multiprocessing.Pipe()
    sender, worker = MPTransport(parent, timeout=10), MPTransport(child, timeout=10)
    assert isinstance(sender, TransportBackend)
    a = {"z": torch.arange(4.0), "a": {"b": torch.ones(2, dtype=torch.int64)}}
    parent.send(("collector", "step"))  # not raysync's: must be kept for the worker loop
    sender.send_weights_async("policy", a)  # the seed reference's call shape
    assert worker.receive_weights(timeout=5) is None  # returns early: the worker loop sees the command
    assert worker.next_message() == ("collector", "step")
    got = worker.receive_weights(timeout=5)
    assert got is not None
    model_id, tensors = got
    assert model_id == "policy" and list(tensors) == ["a.b", "z"]  # canonical order
    assert_same_weights(tensors, {"a.b": a["a"]["b"], "z": a["z"]})
    worker.send_ack()
    sender.wait_ack()
    # torchrl 0.14's shape: send_weights(weights); the received tensors are private memory
    b = {"a.b": torch.full((2,), 7, dtype=torch.int64), "z": torch.zeros(4)}
    sender.send_weights_async(b)
    _, again = worker.receive_weights(timeout=5)  # type: ignore[misc]
    b["z"].add_(1)
    assert torch.equal(again["z"], torch.zeros(4)) and torch.equal(again["a.b"], b["a.b"])
    worker.send_ack("error: refused")
    with pytest.raises(raysync.ApplyError, match="refused"):
        sender.wait_ack()


def test_mp_transport_wait_raises_instead_of_hanging() -> None:
    parent, child = multiprocessing.Pipe()
    sender = MPTransport(parent, timeout=0.3)
    sender.send_weights_async({"w": torch.ones(3)})
    with pytest.raises(raysync.SyncTimeoutError):
        sender.wait_ack()
    child.close()  # the worker is gone: raised at once, not after the timeout
    with pytest.raises(raysync.RaySyncError, match="pipe"):
        sender.send_weights({"w": torch.ones(3)})


def test_snapshot_pool_never_writes_a_set_a_worker_reads() -> None:
    pool = SnapshotPool()
    t = {"w": torch.zeros(1024)}
    first = pool.write(t)
    pool.mark_sent(0, first.set_id)
    pool.mark_acked(0, first.set_id, keeps=True)  # worker 0 points into it
    second = pool.write({"w": torch.ones(1024)})
    assert second.set_id != first.set_id
    assert torch.equal(first.buffers[0].view(torch.float32), torch.zeros(1024))
    pool.mark_sent(0, second.set_id)
    pool.mark_acked(0, second.set_id, keeps=True)  # moved on: the first set is free again
    assert pool.write(t).set_id == first.set_id


def test_receiver_in_thread_applies_whole_keeps_parameters_and_refuses_mismatch() -> None:
    scheme_s = schemes.MultiProcessWeightSyncScheme(timeout=20)
    scheme_w = pickle.loads(pickle.dumps(scheme_s))
    parent, child = multiprocessing.Pipe()
    model = net(1)
    params = [id(p) for p in model.parameters()]
    keys = list(model.state_dict())
    scheme_w.init_on_receiver(model_id="policy", pipe=child, model=model)
    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            scheme_w.receive(timeout=0.05)

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    try:
        scheme_s.init_on_sender(model_id="policy", pipes=[parent])
        for seed in (2, 3):
            src = net(seed)
            scheme_s.send(src)
            assert_same_weights(_state(model), _state(src))
        assert [id(p) for p in model.parameters()] == params and list(model.state_dict()) == keys
        before = _state(model)
        bad = _state(net(4))
        bad["0.weight"] = torch.zeros(3, 3)
        with pytest.raises(raysync.ApplyError, match=r"shape mismatch 0\.weight"):
            scheme_s.send(bad)
        assert_same_weights(_state(model), before)  # nothing half-applied
        with pytest.raises(raysync.ApplyError, match="unknown model_id 'critic'"):
            MPTransport(parent, timeout=20).send_weights("critic", _state(net(5)))
        scheme_s.get_sender().update_weights(net(6))  # the reference's legacy name: all workers
        assert_same_weights(_state(model), _state(net(6)))
    finally:
        stop.set()
        thread.join(5)
    scheme_w.get_receiver().apply_weights(net(7))  # applied locally, same registration
    assert_same_weights(_state(model), _state(net(7)))
    assert [id(p) for p in model.parameters()] == params
    scheme_w.shutdown()
    with pytest.raises(RuntimeError, match="init_on_receiver"):
        scheme_w.get_receiver()


def test_shared_mem_worker_points_into_snapshot_not_trainer_memory() -> None:
    scheme = schemes.SharedMemWeightSyncScheme(timeout=20)
    worker_scheme = pickle.loads(pickle.dumps(scheme))
    parent, child = multiprocessing.Pipe()
    model, src = net(1), net(2)
    param = model[0].weight
    worker_scheme.init_on_receiver(model_id="policy", pipe=child, model=model)
    scheme.init_on_sender(model_id="policy", pipes=[parent])
    sent = _state(src)
    scheme.get_sender().send_async(src)
    assert worker_scheme.receive(timeout=10)
    scheme.get_sender().wait_async()
    assert model[0].weight is param  # same Parameter, now a view of the snapshot
    with torch.no_grad():
        src[0].weight.mul_(3)  # the trainer's half-finished optimizer step
    assert_same_weights(_state(model), sent)
    scheme.get_sender().send_async(src)
    assert worker_scheme.receive(timeout=10)
    scheme.get_sender().wait_async()
    assert_same_weights(_state(model), _state(src))
    worker_scheme.shutdown()


# --------------------------------------------------------------------------- configuration


def test_pickled_schemes_keep_configuration_and_drop_runtime_state() -> None:
    parent, _child = multiprocessing.Pipe()
    mp_scheme = schemes.MultiProcessWeightSyncScheme("state_dict", timeout=12)
    mp_scheme.init_on_sender(model_id="value", pipes=[parent])
    ray_scheme = schemes.RayWeightSyncScheme(timeout=7, hub="h1", model_path="env.transform[0]")
    dist = schemes.DistributedWeightSyncScheme(backend="gloo", sync=False, timeout=5)
    for original in (mp_scheme, ray_scheme, dist):
        copy = pickle.loads(pickle.dumps(original))
        assert type(copy) is type(original)
        assert (copy.strategy, copy.timeout) == (original.strategy, original.timeout)
        assert not copy.initialized_on_sender and not copy.initialized_on_receiver
        with pytest.raises(RuntimeError, match="init_on_sender"):
            copy.get_sender()
    copy = pickle.loads(pickle.dumps(ray_scheme))
    assert (copy.hub, copy.model_path) == ("h1", "env.transform[0]")
    copy = pickle.loads(pickle.dumps(dist))
    assert (copy.dist_backend, copy.sync) == ("gloo", False)
    with pytest.raises(TypeError, match="cannot be pickled"):
        pickle.dumps(mp_scheme.get_sender().transports[0])


def test_from_backend_strategy_paths_and_canonical_order() -> None:
    names = {
        "none": schemes.NoWeightSyncScheme,
        "direct": schemes.NoWeightSyncScheme,
        "shared": schemes.SharedMemWeightSyncScheme,
        "process": schemes.MultiProcessWeightSyncScheme,
        "multiprocessing": schemes.MultiProcessWeightSyncScheme,
        "ray": schemes.RayWeightSyncScheme,
        "rpc": schemes.RPCWeightSyncScheme,
        "distributed": schemes.DistributedWeightSyncScheme,
    }
    for name, cls in names.items():
        assert type(schemes.WeightSyncScheme.from_backend(name, timeout=3)) is cls
    with pytest.raises(ValueError, match="Unsupported weight-sync backend 'carrier-pigeon'"):
        schemes.WeightSyncScheme.from_backend("carrier-pigeon")
    with pytest.raises(ValueError, match="extract_as"):
        schemes.WeightStrategy("numpy")  # type: ignore[arg-type]

    one = {"b": torch.ones(2), "a": torch.zeros(3)}
    two = {"a": torch.zeros(3), "b": torch.ones(2)}
    flat = schemes.WeightStrategy("state_dict")
    assert list(flat.extract_weights(one)) == list(flat.extract_weights(two)) == ["a", "b"]
    td = schemes.WeightStrategy("tensordict").extract_weights(net(0))
    assert td["1", "running_var"].shape == (16,)

    class Env:
        def __init__(self) -> None:
            self.transform = [net(3)]

    class Collector:
        def __init__(self) -> None:
            self.env = Env()
            self.models = {"actor": net(4)}

    collector = Collector()
    assert schemes.resolve_model(collector, "env.transform[0]") is collector.env.transform[0]
    assert schemes.resolve_model(collector, "models['actor']") is collector.models["actor"]
    with pytest.raises(raysync.UnknownModelError, match="no attribute 'critic'"):
        schemes.resolve_model(collector, "critic")

    # Whole or nothing through the strategy too; a sender with a context finds the model by path.
    target = net(5)
    before = _state(target)
    with pytest.raises(raysync.WeightMismatchError):
        flat.apply_weights(target, {**_state(net(6)), "extra": torch.ones(1)})
    assert_same_weights(_state(target), before)
    flat.apply_weights(target, collector.env.transform[0])
    assert_same_weights(_state(target), _state(collector.env.transform[0]))


def test_no_weight_sync_scheme_and_remote_weight_update() -> None:
    none = schemes.NoWeightSyncScheme()
    none.init_on_sender(model_id="policy")
    none.send({"w": torch.ones(1)})
    worker = schemes.NoWeightSyncScheme()
    worker.init_on_receiver(model_id="policy_none", model=net(0))
    worker.connect()
    assert worker.receive(timeout=0.01) is False
    worker.shutdown()

    from tensordict import TensorDict

    server = net(1)
    devices = {"cpu:0": TensorDict.from_module(net(2)).data.clone(), "cpu:1": _state(net(3))}
    updater = schemes.MultiProcessedRemoteWeightUpdate(lambda: server, devices)
    assert updater.all_worker_ids() == ["cpu:0", "cpu:1"]
    updater.push_weights(worker_ids="cpu:1")
    assert_same_weights(devices["cpu:1"], _state(server))
    before = devices["cpu:0"]["0", "weight"].clone()
    with pytest.raises(raysync.WeightMismatchError):
        updater.push_weights({"0.weight": torch.ones(16, 8)})  # every worker checked before any write
    assert torch.equal(devices["cpu:0"]["0", "weight"], before)
    updater()
    assert torch.equal(devices["cpu:0"]["0", "weight"], server[0].weight)


def test_no_weight_sync_schemes_sender_does_nothing() -> None:
    """As the reference's no-op sender: no workers, no weights, no error."""
    none = schemes.NoWeightSyncScheme()
    none.init_on_sender(model_id="policy")
    sender = none.get_sender()
    assert sender.send() is None
    sender.send(net(0), worker_ids=[0, 3])
    sender.send_async({"w": torch.ones(1)})
    sender.wait_async()
    sender.update_weights(net(1))
    none.connect()
    none.send()


def test_shared_mem_transport_takes_torchrl_call_shapes() -> None:
    """``SharedMemTransport()``, ``register_weights(params_map, init_queues)``, ``send_weights(weights)``:
    a spawned worker copies each version out of the shared weights it was handed."""
    from tensordict import TensorDict

    ctx = multiprocessing.get_context("spawn")
    transport = schemes.SharedMemTransport()
    shared = TensorDict.from_module(net(0)).data.clone().share_memory_()
    transport.register_weights({0: shared, 1: shared}, {0: ctx.Queue(), 1: ctx.Queue()})
    assert len(transport.unique_weights) == 1  # both workers read one buffer: written once
    commands, replies = ctx.Queue(), ctx.Queue()
    worker = ctx.Process(target=shared_mem_worker, args=(transport, 1, commands, replies), daemon=True)
    worker.start()
    try:
        transport.setup_connection_and_weights_on_sender()
        for version, weights in [
            (net(1), lambda m: TensorDict.from_module(m)),
            (net(2), lambda m: m),
            (net(3), lambda m: m.state_dict()),
        ]:
            transport.send_weights(weights(version))
            commands.put("apply")
            assert_same_weights(replies.get(timeout=TIMEOUT), _state(version))
        # Checked against the buffer before any write: a mismatch changes nothing.
        with pytest.raises(raysync.WeightMismatchError, match="missing keys"):
            transport.send_weights({"0.weight": torch.ones(16, 8)})
        commands.put("apply")
        assert_same_weights(replies.get(timeout=TIMEOUT), _state(net(3)))
    finally:
        commands.put("close")
        worker.join(timeout=TIMEOUT)
        if worker.is_alive():
            worker.kill()
    assert worker.exitcode == 0
    # raysync's own call shapes still work: a pipe, send_weights(model_id, weights), acks.
    parent, child = multiprocessing.Pipe()
    sender, receiver = schemes.SharedMemTransport(parent, timeout=10), schemes.SharedMemTransport(child)
    sender.send_weights_async("policy", net(4))
    model_id, tensors = receiver.receive_weights(timeout=5)  # type: ignore[misc]
    assert model_id == "policy"
    assert_same_weights(tensors, _state(net(4)))
    receiver.send_ack()
    sender.wait_ack()


# --------------------------------------------------------------------------- real processes


@pytest.fixture(scope="module")
def workers() -> Iterator[dict[str, Any]]:
    """Two spawned worker processes, each serving "policy" and "value" over MultiProcess
    pipes and "shared_policy" over SharedMem, reused by the process tests."""
    ctx = multiprocessing.get_context("spawn")
    setup: dict[str, Any] = {}
    specs: list[list[tuple[str, Any, Any, int]]] = [[], []]
    for model_id, cls, seed in (
        ("policy", schemes.MultiProcessWeightSyncScheme, 10),
        ("value", schemes.MultiProcessWeightSyncScheme, 20),
        ("shared_policy", schemes.SharedMemWeightSyncScheme, 30),
    ):
        scheme = cls(timeout=TIMEOUT)
        pipes = [ctx.Pipe() for _ in range(2)]
        for w in range(2):
            specs[w].append((model_id, scheme, pipes[w][1], seed + w))
        scheme.init_on_sender(model_id=model_id, pipes=[p for p, _ in pipes])
        setup[model_id] = scheme
    procs = [ctx.Process(target=serve, args=(specs[w],), daemon=True) for w in range(2)]
    for proc in procs:
        proc.start()
    setup["procs"] = procs
    yield setup
    for proc in procs:
        if proc.is_alive():
            proc.kill()
            proc.join(10)


def _transports(scheme: schemes.WeightSyncScheme) -> list[MPTransport]:
    return [t for _, t in sorted(scheme.get_sender().transports.items())]


def test_processes_connect_send_subsets_several_models_and_shutdown(workers: dict[str, Any]) -> None:
    policy, value, shared = workers["policy"], workers["value"], workers["shared_policy"]
    src = {"policy": net(1), "value": net(2), "shared_policy": net(3)}
    ids_before = [_ask(t, "params")["ids"] for t in _transports(policy)]
    for name, scheme in (("policy", policy), ("value", value), ("shared_policy", shared)):
        scheme.connect(weights=src[name])  # waits for the two workers' acks
        for t in _transports(scheme):
            assert_same_weights(_ask(t, "state"), _state(src[name]))  # parameters and buffers
    # worker_ids: an int, a list; and per-worker weights
    per_worker = [net(4), net(5)]
    for w in (0, 1):
        policy.get_sender().send(per_worker[w], worker_ids=w)
    for w, t in enumerate(_transports(policy)):
        assert_same_weights(_ask(t, "state"), _state(per_worker[w]))
    value.send(net(6), worker_ids=[1])
    assert_same_weights(_ask(_transports(value)[0], "state"), _state(src["value"]))
    assert_same_weights(_ask(_transports(value)[1], "state"), _state(net(6)))
    # SharedMem: the trainer's in-place step is invisible until sent
    with torch.no_grad():
        src["shared_policy"][0].weight.add_(1)
    stale = _ask(_transports(shared)[0], "state")
    assert not torch.equal(stale["0.weight"], src["shared_policy"][0].weight)
    shared.send(src["shared_policy"])
    assert_same_weights(_ask(_transports(shared)[0], "state"), _state(src["shared_policy"]))
    # a mismatched schema raises (it does not hang) and changes nothing
    before = _ask(_transports(policy)[0], "state")
    with pytest.raises(raysync.ApplyError, match="missing keys"):
        policy.send({"0.weight": torch.zeros(16, 8)})
    assert_same_weights(_ask(_transports(policy)[0], "state"), before)
    # registration survives repeated syncs
    for t, ids in zip(_transports(policy), ids_before, strict=True):
        info = _ask(t, "params")
        assert info["ids"] == ids and info["keys"] == list(net(0).state_dict())
    # shutdown leaves no process behind
    for scheme in (policy, value, shared):
        for t in _transports(scheme):
            t.send_message("close")
        scheme.shutdown()
    for proc in workers["procs"]:
        proc.join(TIMEOUT)
        assert proc.exitcode == 0


# --------------------------------------------------------------------------- Ray actors


@ray.remote(num_cpus=0)
class _Collector:
    def __init__(self, seed: int, scheme: Any = None) -> None:
        self.policy = net(seed)
        self.value = net(seed + 100)
        self._ids = [id(p) for p in self.policy.parameters()]
        if scheme is not None:  # a receiver registered in the actor (model id "value")
            scheme.init_on_receiver(model_id="value", model=self.value)

    def state(self, attr: str = "policy") -> dict[str, torch.Tensor]:
        return _state(getattr(self, attr))

    def same_parameters(self) -> bool:
        return [id(p) for p in self.policy.parameters()] == self._ids


@pytest.fixture(scope="module")
def actors(ray_start_regular: dict[str, Any]) -> Iterator[list[Any]]:
    receiver_scheme = schemes.RayWeightSyncScheme(timeout=TIMEOUT)
    handles = [_Collector.remote(s, receiver_scheme) for s in (1, 2)]
    ray.get([h.same_parameters.remote() for h in handles])
    yield handles
    for handle in handles:
        ray.kill(handle)


def test_ray_scheme_one_put_per_version_subsets_models_and_errors(
    actors: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    puts: list[Any] = []
    real_put = _compat.put_no_start  # the object-store data path puts each bucket with it
    monkeypatch.setattr(_compat, "put_no_start", lambda v: puts.append(v) or real_put(v))
    scheme = schemes.RayWeightSyncScheme(timeout=TIMEOUT)
    scheme.init_on_sender(model_id="policy", remote_collectors=actors)
    src = net(7)
    scheme.connect(weights=src)
    assert len(puts) == 1  # one bucket, put once for both actors
    for actor in actors:
        assert_same_weights(ray.get(actor.state.remote()), _state(src))
    per_worker = [net(8), net(9)]
    for w in (0, 1):
        scheme.get_sender().send(per_worker[w], worker_ids=[w])
    for w, actor in enumerate(actors):
        assert_same_weights(ray.get(actor.state.remote()), _state(per_worker[w]))
        assert ray.get(actor.same_parameters.remote())
    before = ray.get(actors[0].state.remote())
    with pytest.raises(raysync.ApplyError, match="dtype mismatch"):
        scheme.send({k: v.double() if v.is_floating_point() else v for k, v in _state(net(1)).items()})
    assert_same_weights(ray.get(actors[0].state.remote()), before)
    # a second model through the receiver registered inside the actors; an unknown one fails clearly
    value = schemes.RayWeightSyncScheme(timeout=TIMEOUT)
    value.init_on_sender(model_id="value", actors=actors)
    value.send(net(11), worker_ids=1)
    assert_same_weights(ray.get(actors[1].state.remote("value")), _state(net(11)))
    critic = schemes.RayWeightSyncScheme(timeout=TIMEOUT)
    critic.init_on_sender(model_id="critic", actors=actors)
    with pytest.raises(raysync.ApplyError, match="critic"):
        critic.send(net(12))


def test_ray_hub_routing_and_module_transform_scheme(ray_start_regular: dict[str, Any]) -> None:
    hub_name = f"test-{uuid.uuid4().hex[:8]}"
    hub = raysync.connect(hub_name)
    transform = raysync.RayModuleTransform(lambda: net(1), model_id="module", hub=hub_name, num_cpus=0)
    try:
        wait_for_condition(
            lambda: any(s.get("model_id") == "module" for s in hub.status().get("subscribers", [])),
            timeout=TIMEOUT,
            what="the transform's actor subscribed",
        )

        class Env:
            def __init__(self) -> None:
                self.transform_list = [transform]

        class Collector:
            def __init__(self) -> None:
                self.env = Env()

        scheme = schemes.RayModuleTransformScheme(timeout=TIMEOUT)
        collector = Collector()  # held weakly by the scheme, as torchrl does
        scheme.init_on_sender(model_id="env.transform_list[0]", context=collector)
        src = net(2)
        scheme.send(src)
        x = torch.randn(3, 8)
        torch.testing.assert_close(transform(x), src(x).detach())
        assert transform.raysync_version() == hub.latest("module")
        # RayWeightSyncScheme through the hub: one push, every subscriber applied it
        via_hub = schemes.RayWeightSyncScheme(timeout=TIMEOUT, hub=hub_name)
        via_hub.init_on_sender(model_id="module")
        src2 = net(3)
        via_hub.send(src2)
        torch.testing.assert_close(transform(x), src2(x).detach())
        with pytest.raises(ValueError, match="worker_ids"):
            via_hub.send(src2, worker_ids=[0])
        # RayActorTransport: straight into the hosting actor's module
        direct = schemes.RayModuleTransformScheme(timeout=TIMEOUT)
        direct.init_on_sender(model_id="module", actor_refs=[transform.actor])
        src3 = net(4)
        direct.send(src3)
        torch.testing.assert_close(transform(x), src3(x).detach())
    finally:
        transform.shutdown()
        ray.kill(hub.actor)
