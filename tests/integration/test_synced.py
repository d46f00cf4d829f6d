"""Receivers on a real local Ray cluster: @synced_model, apply modes, ordering, faults, RayModuleTransform."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import ray
import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule

import raysync
from raysync.core.extract import extract_tensors
from tests._support import assert_same_weights, small_policy, wait_for_condition


def _mixed_model() -> torch.nn.Module:
    """float32 and bfloat16 parameters, an int64 buffer."""
    model = torch.nn.Module()
    model.f32 = torch.nn.Linear(8, 8)
    model.bf16 = torch.nn.Linear(8, 4).to(torch.bfloat16)
    model.register_buffer("steps", torch.zeros(5, dtype=torch.int64))
    return model


def make_collector(hub_name: str, factory: Any = small_policy, **opts: Any) -> Any:
    @ray.remote(num_cpus=0)
    @raysync.synced_model("policy", hub=hub_name, **opts)
    class Collector:
        def __init__(self) -> None:
            self.policy = factory()

        def weights(self) -> dict[str, torch.Tensor]:
            return {k: v.clone() for k, v in self.policy.state_dict().items()}

        def act(self, x: torch.Tensor) -> tuple[torch.Tensor, int | None]:
            with torch.no_grad():
                return self.policy(x), self.raysync_version()

        def sync_now(self) -> bool:
            return self.raysync_sync(timeout=10)

        def where(self) -> str:
            ptr = next(iter(self.policy.parameters())).data_ptr()
            with open("/proc/self/maps") as maps:
                for line in maps:
                    lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
                    if lo <= ptr < hi:
                        return line.split()[-2] if line.rstrip().endswith("(deleted)") else line.split()[-1]
            return "?"

        def write(self) -> str:
            try:
                with torch.no_grad():
                    next(iter(self.policy.parameters())).add_(1.0)
            except raysync.ReadOnlyWeightsError as err:
                return f"refused: {err}"
            return "written"

    return Collector


def _applied(hub: raysync.HubClient, version: int) -> bool:
    return all((s["applied"] or 0) >= version for s in hub.status()["subscribers"])


def test_subscribers_end_bit_equal_for_float32_bfloat16_int64(hub: raysync.HubClient, hub_name: str) -> None:
    collectors = [make_collector(hub_name, _mixed_model).remote() for _ in range(2)]
    ray.get([c.raysync_version.remote() for c in collectors])  # registered
    src = _mixed_model()
    with torch.no_grad():
        src.steps += torch.arange(5) * 10**12  # big int64 values must survive too
    v = hub.push(src, wait=True, timeout=60)
    for c in collectors:
        assert ray.get(c.raysync_version.remote()) == v
        assert_same_weights(ray.get(c.weights.remote()), src.state_dict())


def test_late_subscriber_starts_from_newest_version(hub: raysync.HubClient, hub_name: str) -> None:
    hub.push(small_policy(1))
    src = small_policy(2)
    v = hub.push(src)
    late = make_collector(hub_name).remote()
    assert ray.get(late.raysync_version.remote()) == v
    assert_same_weights(ray.get(late.weights.remote()), src.state_dict())


def test_mismatched_push_is_refused_and_everyone_keeps_weights(hub: raysync.HubClient, hub_name: str) -> None:
    collectors = [make_collector(hub_name).remote() for _ in range(2)]
    ray.get([c.raysync_version.remote() for c in collectors])
    good = small_policy(5)
    v = hub.push(good, wait=True, timeout=60)
    bad = small_policy(6, out=5)  # last layer 16 -> 5 instead of 4
    bad_sd = dict(bad.state_dict())
    bad_sd["extra"] = torch.ones(1)
    del bad_sd["0.bias"]
    with pytest.raises(raysync.WeightMismatchError) as info:
        hub.push(bad_sd)
    err = info.value
    assert err.missing == ["0.bias"] and err.unexpected == ["extra"]
    assert set(err.shape_mismatch) == {"2.weight", "2.bias"}
    assert hub.latest() == v  # nothing was published
    for c in collectors:
        assert ray.get(c.raysync_version.remote()) == v
        assert_same_weights(ray.get(c.weights.remote()), good.state_dict())


def test_killed_subscriber_does_not_fail_pushes(hub: raysync.HubClient, hub_name: str) -> None:
    Collector = make_collector(hub_name)
    doomed, survivor = Collector.remote(), Collector.remote()
    ray.get([doomed.raysync_version.remote(), survivor.raysync_version.remote()])
    ray.kill(doomed)
    for i in range(3):
        v = hub.push(small_policy(i), wait=True, timeout=30)
    assert ray.get(survivor.raysync_version.remote()) == v
    wait_for_condition(lambda: len(hub.status()["subscribers"]) == 1, what="dead subscriber dropped")


def test_wait_names_the_laggard_and_applies_stay_in_order(hub: raysync.HubClient, hub_name: str) -> None:
    lazy = make_collector(hub_name, mode="pull").remote()
    eager = make_collector(hub_name).remote()
    ray.get([lazy.raysync_version.remote(), eager.raysync_version.remote()])
    v1 = hub.push(small_policy(1))
    hub.wait(v1, timeout=60)  # push subscribers only: the eager one holds it
    with pytest.raises(raysync.SyncTimeoutError, match=r"1 subscriber\(s\).*version 1.*Collector") as info:
        hub.wait(v1, timeout=1.0, include_pull=True)
    assert info.value.laggards[0]["applied"] is None
    assert isinstance(info.value, TimeoutError)
    # Pull mode: stays on its version until it asks.
    assert ray.get(lazy.raysync_version.remote()) is None
    v2 = hub.push(small_policy(2))
    # A push returns before the hub has read it; latest() from the pushing client reads the
    # hub's answer, so from here on every process that asks the hub sees v2.
    assert hub.latest() == v2
    assert ray.get(lazy.sync_now.remote()) is True
    assert ray.get(lazy.raysync_version.remote()) == v2
    assert ray.get(lazy.sync_now.remote()) is False  # already current: no-op
    hub.wait(v2, timeout=30)
    # An old or repeated notification never takes a subscriber back.
    old = ray.get(hub.actor.get.remote("policy", v1))
    reply = ray.get(eager._raysync_notify.remote(old))
    assert reply.applied == v2 and reply.skipped == v1
    assert_same_weights(ray.get(eager.weights.remote()), small_policy(2).state_dict())


def test_failed_apply_keeps_previous_version_and_is_reported(hub: raysync.HubClient, hub_name: str) -> None:
    checked = make_collector(hub_name, verify=True).remote()  # refuses versions it cannot check
    ray.get(checked.raysync_version.remote())
    v1 = hub.push(small_policy(1), checksum=True, wait=True, timeout=60)
    v2 = hub.push(small_policy(2))  # no checksums: refused by that subscriber
    row = wait_for_condition(lambda: hub.status()["subscribers"][0]["last_error"], what="error reported")
    assert "ChecksumError" in row
    with pytest.raises(raysync.ApplyError, match=f"failed to apply version {v2}"):
        hub.wait(v2, timeout=10)
    assert ray.get(checked.raysync_version.remote()) == v1
    assert_same_weights(ray.get(checked.weights.remote()), small_policy(1).state_dict())


def test_a_version_of_another_layout_is_not_offered_and_a_wait_says_why(
    hub: raysync.HubClient, hub_name: str
) -> None:
    v = hub.push({"w": torch.ones(3)})  # no subscriber yet: nothing to validate against
    odd = make_collector(hub_name).remote()  # its model has other keys
    assert ray.get(odd.raysync_version.remote()) is None
    before = ray.get(odd.weights.remote())
    row = hub.status()["subscribers"][0]
    assert row["last_error"] is None and "missing keys" in row["waiting_for"]  # not tried, so no error
    assert "missing keys" in row["misfit"]  # a misfit: its own error, not the pushes'
    hub.wait(v, timeout=10)  # it never can apply it: not waited for
    with pytest.raises(raysync.WeightMismatchError, match=r"never apply version \d.*missing keys"):
        hub.wait(v, timeout=10, subscribers=1)  # a wait that counts it: said at once, not after the timeout
    assert_same_weights(ray.get(odd.weights.remote()), before)


def test_view_mode_shares_the_nodes_copy_and_refuses_writes(hub: raysync.HubClient, hub_name: str) -> None:
    viewers = [make_collector(hub_name, apply="view").remote() for _ in range(2)]
    ray.get([c.raysync_version.remote() for c in viewers])
    src = small_policy(7)
    v = hub.push(src, wait=True, timeout=60)
    for c in viewers:
        # A small version came by doorbell: the parameters live in the node's sealed segment of
        # that version (one for every process; larger versions: the object store, test_doorbell).
        assert ray.get(c.where.remote()) == f"/memfd:raysync-v{v}"
        assert_same_weights(ray.get(c.weights.remote()), src.state_dict())
        assert ray.get(c.write.remote()).startswith("refused")
        out, _ = ray.get(c.act.remote(torch.ones(1, 8)))
        assert torch.allclose(out, src(torch.ones(1, 8)))
    assert_same_weights(ray.get(viewers[0].weights.remote()), src.state_dict())  # write refused
    src2 = small_policy(8)
    hub.push(src2, wait=True, timeout=60)  # next version: a pointer swap
    assert_same_weights(ray.get(viewers[1].weights.remote()), src2.state_dict())


def test_case4_view_guard_holds_in_actors_and_pull_stays_clean(hub: raysync.HubClient, hub_name: str) -> None:
    """Case 4: every write one view-mode actor tries is refused; the shared copy stays as pushed."""

    @ray.remote(num_cpus=0)
    @raysync.synced_model("policy", hub=hub_name, apply="view")
    class Viewer:
        def __init__(self) -> None:
            self.policy = small_policy()

        def weights(self) -> dict[str, torch.Tensor]:
            return {k: v.clone() for k, v in self.policy.state_dict().items()}

        def try_writes(self) -> dict[str, str]:
            params = list(self.policy.parameters())
            for p in params:
                p.grad = torch.ones_like(p)
            writes = {
                "foreach_add_": lambda: torch._foreach_add_(params, 1.0),
                "aten.add_": lambda: torch.ops.aten.add_(params[0], 1),
                "aten.fill_": lambda: torch.ops.aten.fill_(params[0], 0),
                "aten.fill_.Scalar": lambda: torch.ops.aten.fill_.Scalar(params[0], 0),
                "adam_foreach": lambda: torch.optim.Adam(params, foreach=True).step(),
                "adam_fused": lambda: torch.optim.Adam(params, fused=True).step(),
                "numpy": lambda: params[0].detach().numpy().__setitem__(slice(None), 0.0),
                "add_": lambda: params[0].add_(1),
                "adam_default": lambda: torch.optim.Adam(params).step(),
            }
            outcome = {}
            for name, write in writes.items():
                try:
                    write()
                    outcome[name] = "written"
                except raysync.ReadOnlyWeightsError:
                    outcome[name] = "refused"
                except ValueError as err:  # numpy's own refusal of a read-only array
                    outcome[name] = "refused" if "read-only" in str(err) else f"ValueError: {err}"
            return outcome

        def train_step(self) -> None:
            """What a learner would do: a foreach optimizer over the synced model."""
            opt = torch.optim.Adam(self.policy.parameters(), foreach=True)
            loss = self.policy(torch.ones(1, 8)).pow(2).sum()
            loss.backward()
            opt.step()

    vandal, bystander = Viewer.remote(), Viewer.remote()
    ray.get([vandal.raysync_version.remote(), bystander.raysync_version.remote()])
    src = small_policy(11)
    hub.push(src, wait=True, timeout=60)
    outcome = ray.get(vandal.try_writes.remote())
    assert outcome == dict.fromkeys(outcome, "refused"), outcome
    # Training it fails in backward(), before any step: with the cause and the fix, not torch's bare words.
    with pytest.raises(
        raysync.ReadOnlyWeightsError, match=r"self\.policy .*apply='view'.*apply='copy'"
    ) as err:
        ray.get(vandal.train_step.remote())
    assert "does not require grad" in str(err.value)  # torch's own words are kept, at the end
    pulled = hub.pull().flatten_keys(".").to_dict()
    assert_same_weights(pulled, src.state_dict())
    assert_same_weights(ray.get(bystander.weights.remote()), src.state_dict())
    assert_same_weights(ray.get(vandal.weights.remote()), src.state_dict())


class _Counted(torch.nn.Module):
    """A policy with extra state: a counter dict (get_extra_state / set_extra_state)."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        self.body = small_policy(seed)
        self.counter = {"pushes": 0, "tag": "init"}

    def get_extra_state(self) -> dict[str, Any]:
        return dict(self.counter)

    def set_extra_state(self, state: dict[str, Any]) -> None:
        self.counter = dict(state)


def _counted_subscriber(hub_name: str, **opts: Any) -> Any:
    @ray.remote(num_cpus=0)
    @raysync.synced_model("policy", hub=hub_name, **opts)
    class Holder:
        def __init__(self) -> None:
            self.policy = _Counted()

        def held(self) -> tuple[int | None, dict[str, torch.Tensor], dict[str, Any]]:
            tensors = {k: v.clone() for k, v in extract_tensors(self.policy).items()}
            return self.raysync_version(), tensors, dict(self.policy.counter)

    return Holder.remote()


def check_extra_state_travels(hub: raysync.HubClient, subs: list[Any]) -> None:
    """Two pushes of a module with extra state: every subscriber ends with the last one, whole."""
    ray.get([s.held.remote() for s in subs])  # registered (module_schema ignores the extra state)
    src = _Counted(1)
    for pushes in (1, 2):
        with torch.no_grad():
            for p in src.parameters():
                p.add_(1.0)
        src.counter = {"pushes": pushes, "tag": f"v{pushes}"}
        v = hub.push(src, wait=True, timeout=60)
    expected = {k: v.clone() for k, v in extract_tensors(src).items()}
    for s in subs:
        version, tensors, counter = ray.get(s.held.remote())
        assert version == v
        assert_same_weights(tensors, expected)
        assert counter == {"pushes": 2, "tag": "v2"}


def test_case13_extra_state_travels_with_the_version(hub: raysync.HubClient, hub_name: str) -> None:
    """Case 13a: get_extra_state() is pushed; copy, view and prefetch subscribers get the last one."""
    subs = [
        _counted_subscriber(hub_name),
        _counted_subscriber(hub_name, apply="view"),
        _counted_subscriber(hub_name, prefetch=True),
    ]
    check_extra_state_travels(hub, subs)
    assert "_extra_state" not in hub.pull().keys()  # pull gives the tensors only


def test_copy_mode_weights_live_in_the_actor(hub: raysync.HubClient, hub_name: str) -> None:
    c = make_collector(hub_name).remote()
    hub.push(small_policy(1), wait=True, timeout=60)
    assert "plasma" not in ray.get(c.where.remote())
    assert ray.get(c.write.remote()) == "written"


def _uniform(value: float, layers: int = 6) -> dict[str, torch.Tensor]:
    return {f"l{i}": torch.full((64, 64), value) for i in range(layers)}


class _Uniform(torch.nn.Module):
    def __init__(self, layers: int = 6) -> None:
        super().__init__()
        for i in range(layers):
            self.register_parameter(f"l{i}", torch.nn.Parameter(torch.zeros(64, 64)))


def _torn_reader(hub_name: str, is_async: bool) -> Any:
    @raysync.synced_model("policy", hub=hub_name)
    class Reader:
        def __init__(self) -> None:
            self.policy = _Uniform()

        def _scan(self) -> set[float]:
            seen = set()
            for p in self.policy.parameters():
                seen.update(p.detach().unique().tolist())
                time.sleep(0.001)  # give a concurrent apply every chance to interleave
            return seen

    if is_async:

        class AsyncReader(Reader):
            async def scan(self) -> list[float]:
                import asyncio

                seen: set[float] = set()
                for p in self.policy.parameters():
                    seen.update(p.detach().unique().tolist())
                    await asyncio.sleep(0.001)
                return sorted(seen)

        return ray.remote(num_cpus=0, max_concurrency=4)(AsyncReader)

    class ThreadedReader(Reader):
        def scan(self) -> list[float]:
            return sorted(self._scan())

    return ray.remote(num_cpus=0, max_concurrency=4)(ThreadedReader)


@pytest.mark.parametrize("is_async", [False, True], ids=["threaded", "async"])
def test_readers_never_see_a_torn_model_under_rapid_pushes(
    hub: raysync.HubClient, hub_name: str, is_async: bool
) -> None:
    check_no_torn_reads(hub, hub_name, is_async, batches=40)


def check_no_torn_reads(hub: raysync.HubClient, hub_name: str, is_async: bool, *, batches: int) -> None:
    """Batches of 4 concurrent full-model reads while another thread pushes as fast as it can."""
    reader = _torn_reader(hub_name, is_async).remote()
    ray.get(reader.raysync_version.remote())
    hub.push(_uniform(0.5), wait=True, timeout=120)  # warm up: a transport's first transfer is slow
    stop = threading.Event()

    def pusher() -> None:
        value = 1.0
        while not stop.is_set():
            hub.push(_uniform(value))
            value += 1.0

    thread = threading.Thread(target=pusher)
    thread.start()
    results: list[list[float]] = []
    deadline = time.monotonic() + 60
    try:
        # batches of 4 concurrent reads; the hub's deliveries queue in between. On a loaded
        # machine versions may land more slowly: read on (up to a minute) until 4 have been seen.
        while len(results) < 4 * batches or (
            len({r[0] for r in results}) <= 3 and time.monotonic() < deadline
        ):
            results += ray.get([reader.scan.remote() for _ in range(4)])
    finally:
        stop.set()
        thread.join()
    torn = [r for r in results if len(r) != 1]
    assert not torn, f"{len(torn)} of {len(results)} reads saw a mix of versions, e.g. {torn[0]}"
    assert len({r[0] for r in results}) > 3  # and versions did change under the readers


def test_two_models_on_one_actor(hub: raysync.HubClient, hub_name: str) -> None:
    @ray.remote(num_cpus=0)
    @raysync.synced_model("critic", model_id="critic", hub=hub_name)
    @raysync.synced_model("actor", model_id="actor", hub=hub_name)
    class ActorCritic:
        def __init__(self) -> None:
            self.actor = small_policy(0)
            self.critic = torch.nn.Linear(8, 1)

        def both(self) -> tuple[Any, Any]:
            return self.raysync_version("actor"), self.raysync_version("critic")

    ac = ActorCritic.remote()
    ray.get(ac.both.remote())
    hub.push(small_policy(3), "actor")
    v = hub.push(torch.nn.Linear(8, 1), "critic")
    hub.push(torch.nn.Linear(8, 1), "critic", wait=True, timeout=30)
    hub.wait(1, "actor", timeout=30)
    assert ray.get(ac.both.remote()) == (1, v + 1)


def test_decorator_refuses_bad_options() -> None:
    with pytest.raises(ValueError, match="mode"):
        raysync.synced_model("policy", mode="sometimes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="apply"):
        raysync.synced_model("policy", apply="maybe")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"put @ray.remote above"):
        raysync.synced_model("policy")(ray.remote(type("A", (), {})))  # type: ignore[arg-type]
    tp = raysync.TensorParallel(0, 2, {"*.weight": 0})
    with pytest.raises(ValueError, match="placement= copies the module's own parts"):
        raysync.synced_model("policy", apply="view", placement=tp)
    with pytest.raises(ValueError, match="without prefetch"):
        raysync.synced_model("policy", prefetch=True, placement=tp)
    with pytest.raises(TypeError, match=r"raysync\.TensorParallel"):
        raysync.synced_model("policy", placement={"*.weight": 0})  # type: ignore[arg-type]


def test_missing_module_attribute_fails_actor_creation_clearly(hub_name: str, ray_start_regular: Any) -> None:
    @ray.remote(num_cpus=0)
    @raysync.synced_model("policy", hub=hub_name)
    class Forgetful:
        def __init__(self) -> None:
            self.model = small_policy()

        def ping(self) -> int:
            return 1

    with pytest.raises(
        ray.exceptions.RayActorError, match=r"self\.policy is missing; the actor's modules: \['model'\]"
    ):
        ray.get(Forgetful.remote().ping.remote())


def test_ray_module_transform_runs_the_pushed_module(hub: raysync.HubClient, hub_name: str) -> None:
    transform = raysync.RayModuleTransform(lambda: small_policy(0), hub=hub_name, num_cpus=0)
    src = small_policy(9)
    hub.push(src, wait=True, timeout=60)
    x = torch.randn(3, 8)
    assert torch.allclose(transform(x), src(x))
    assert transform.raysync_version() == 1

    def td_module() -> torch.nn.Module:
        return TensorDictModule(small_policy(0), in_keys=["obs"], out_keys=["action"])

    td_transform = raysync.RayModuleTransform(td_module, model_id="td", hub=hub_name, num_cpus=0)
    src_td = td_module()
    hub.push(src_td, "td", wait=True, timeout=60)
    out = td_transform(TensorDict({"obs": x}, batch_size=[3]))
    assert torch.allclose(out["action"], src_td(TensorDict({"obs": x}, batch_size=[3]))["action"])
    transform.shutdown()
    td_transform.shutdown()


def test_an_async_actor_made_after_a_push_starts_from_it_then_follows(
    hub: raysync.HubClient, hub_name: str
) -> None:
    """Its constructor (on its event loop) applies the newest version; later versions reach it too,
    also after Ray restarts it (a new constructor, versions already there)."""

    @ray.remote(num_cpus=0, max_restarts=1)
    @raysync.synced_model("policy", hub=hub_name)
    class AsyncCollector:
        def __init__(self) -> None:
            self.policy = small_policy()

        async def weights(self) -> dict[str, torch.Tensor]:
            return {k: v.clone() for k, v in self.policy.state_dict().items()}

        async def pid(self) -> int:
            import os

            return os.getpid()

    v1 = hub.push(small_policy(1))
    actor = AsyncCollector.remote()  # type: ignore[attr-defined]
    assert ray.get(actor.raysync_version.remote(), timeout=60) == v1
    for seed in (2, 3):
        v = hub.push(small_policy(seed), wait=True, timeout=60)
        assert ray.get(actor.raysync_version.remote()) == v
        assert_same_weights(ray.get(actor.weights.remote()), small_policy(seed).state_dict())
    pid = ray.get(actor.pid.remote())
    ray.kill(actor, no_restart=False)
    wait_for_condition(lambda: _answers_pid(actor) not in (None, pid), timeout=60, what="restarted")
    assert ray.get(actor.raysync_version.remote(), timeout=60) == v  # its constructor applied it
    v = hub.push(small_policy(4), wait=True, timeout=60)
    assert ray.get(actor.raysync_version.remote()) == v
    assert_same_weights(ray.get(actor.weights.remote()), small_policy(4).state_dict())


def _answers_pid(actor: Any) -> int | None:
    try:
        return int(ray.get(actor.pid.remote(), timeout=5))
    except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
        return None
