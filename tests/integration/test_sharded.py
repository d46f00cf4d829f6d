"""A sharded trainer (2 gloo ranks as Ray actors, ``DTensor`` weights) pushing to every receiver kind.

Each rank calls ``hub.push(model)`` as a single trainer does and puts only its own shards;
its push returns the version's number once the hub recorded its shard, and the hub publishes
the version once both are in. A ``@synced_model`` actor, a ``Follower``
(plain module), a ``WeightsLoader`` and ``hub.pull()`` all end up with weights bit-equal to
the trainer's ``full_tensor()``s (Shard(0) even and uneven, Shard(1) uneven, Replicate, a
plain buffer). Ranks that disagree on the tensors are refused naming the tensor; a rank that
dies mid-push leaves the version unpublished and every reader on the previous one; the
restarted group pushes again.
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Iterator
from typing import Any

import pytest
import ray
import torch

import raysync
from benchmarks import sharded_soak
from benchmarks._ports import free_port
from tests import _sharded
from tests._support import (
    PATH_RING_ACK_S,
    RING_ACK_S,
    assert_same_weights,
    kill_until_gone,
    wait_for_condition,
)
from tests.integration.test_relay import _relay, _until_rung

TIMEOUT = 60.0
HUB_SETTINGS = raysync.HubSettings(ring_ack_s=RING_ACK_S)  # the ``hub`` fixture's: see RING_ACK_S


def _group(world: int = 2, mesh_shape: tuple[int, ...] | None = None) -> list[Any]:
    return _joined(_starting_group(world, mesh_shape))


def _starting_group(world: int = 2, mesh_shape: tuple[int, ...] | None = None) -> list[Any]:
    """The ranks of a new group, their processes starting (see :func:`_joined`)."""
    port = free_port()
    cls = ray.remote(num_cpus=0)(_sharded.Rank)
    return [cls.remote(r, world, port, mesh_shape) for r in range(world)]


def _joined(ranks: list[Any]) -> list[Any]:
    """``ranks`` once every one joined the group and holds a model."""
    ray.get([r.make.remote(0) for r in ranks], timeout=120)
    return ranks


def _full(ranks: list[Any]) -> dict[str, torch.Tensor]:
    fulls = ray.get([r.full.remote() for r in ranks], timeout=TIMEOUT)
    return dict(fulls[0])


def _push(ranks: list[Any], hub_name: str, **opts: Any) -> list[tuple[int, dict[str, Any]]]:
    return list(ray.get([r.push.remote(hub_name, **opts) for r in ranks], timeout=TIMEOUT))


def _collector(hub_name: str, apply: Any = "copy", **opts: Any) -> Any:
    @raysync.synced_model("policy", hub=hub_name, apply=apply, **opts)
    class Collector:
        def __init__(self) -> None:
            self.policy = _sharded.Net(99)

        def state(self) -> tuple[int | None, dict[str, torch.Tensor]]:
            return self.raysync_version(), {k: v.clone() for k, v in self.policy.state_dict().items()}

    return ray.remote(num_cpus=0)(Collector).remote()


def _v1_then_rank0_alone(
    ranks: list[Any], hub_name: str, collector: Any, step: int, **push: Any
) -> tuple[int, int, dict[str, torch.Tensor]]:
    """Every rank pushes v1 (applied by ``collector``); the ranks step and rank 0 alone pushes:
    ``(v1, the number rank 0 got, v1's weights)``."""
    ray.get([r.make.remote(0) for r in ranks], timeout=TIMEOUT)
    v1 = _push(ranks, hub_name)[0][0]  # a rank's first push of a layout waits for the round
    before = _full(ranks)
    wait_for_condition(lambda: ray.get(collector.state.remote())[0] == v1, timeout=TIMEOUT, what="v1")
    ray.get([r.step.remote(step) for r in ranks], timeout=TIMEOUT)
    v2, _ = ray.get(ranks[0].push.remote(hub_name, **push), timeout=TIMEOUT)
    ray.get(ranks[0].latest.remote(hub_name), timeout=TIMEOUT)  # a query: its part is at the hub
    return v1, v2, before


@pytest.fixture(scope="module")
def ranks(ray_start_regular: dict[str, Any]) -> Iterator[list[Any]]:
    group = _group()
    yield group
    for r in group:
        ray.kill(r)


def test_every_receiver_gets_the_whole_tensors(
    ranks: list[Any], hub: raysync.HubClient, hub_name: str
) -> None:
    collector = _collector(hub_name, apply="view")  # read-only views of the assembled buckets
    followed = _sharded.Net(98)
    follower = raysync.follow(followed, "policy", hub=hub_name)
    loaded: dict[int, dict[str, torch.Tensor]] = {}

    def load(pairs: Any) -> None:
        loaded.setdefault(len(loaded), {}).update({k: t.clone() for k, t in pairs})

    loader = raysync.Follower(target=raysync.WeightsLoader(load), model_id="policy", hub=hub_name).start()
    # a tensor-parallel receiver (rank 1 of 2), laid out unlike the trainer: rows Shard(1), cols Shard(0)
    tp = raysync.TensorParallel(1, 2, {"rows": 1, "cols": 0})
    parts: dict[int, dict[str, torch.Tensor]] = {}

    def load_part(pairs: Any) -> None:
        parts.setdefault(len(parts), {}).update({k: t.clone() for k, t in pairs})

    tp_loader = raysync.WeightsLoader(load_part, placement=tp)
    tp_follower = raysync.Follower(target=tp_loader, model_id="policy", hub=hub_name).start()
    try:
        for step in (1, 2):
            if step > 1:
                ray.get([r.step.remote(step) for r in ranks], timeout=TIMEOUT)
            pushed = _push(ranks, hub_name)
            versions = {v for v, _ in pushed}
            assert len(versions) == 1, pushed  # one version, the same number on every rank
            version = versions.pop()
            hub.wait(version, timeout=TIMEOUT)  # a rank's push returns before the hub publishes
            assert hub.latest() == version
            # each rank put only its own shards (the replicated tensor and the buffer once, from rank 0)
            shard_bytes = ray.get([r.local_nbytes.remote() for r in ranks])
            assert pushed[1][1]["bytes_put"] < shard_bytes[1] + 64 * 4
            expected = _full(ranks)
            wait_for_condition(
                lambda v=version: ray.get(collector.state.remote(), timeout=TIMEOUT)[0] == v,
                timeout=TIMEOUT,
                what="the collector applied the sharded version",
            )
            assert_same_weights(ray.get(collector.state.remote(), timeout=TIMEOUT)[1], expected)
            wait_for_condition(lambda v=version: follower.version == v, timeout=TIMEOUT, what="the follower")
            assert_same_weights(followed.state_dict(), expected)
            wait_for_condition(lambda n=step: len(loaded) == n, timeout=TIMEOUT, what="the loader")
            assert_same_weights(loaded[step - 1], expected)
            assert_same_weights(dict(hub.pull().flatten_keys(".").items()), expected)
            wait_for_condition(
                lambda n=step: len(parts) == n, timeout=TIMEOUT, what="the tensor-parallel loader"
            )
            mine = dict(expected)
            mine["rows"] = torch.chunk(expected["rows"], 2, dim=1)[1]
            mine["cols"] = torch.chunk(expected["cols"], 2, dim=0)[1]
            assert_same_weights(parts[step - 1], mine)
        assert hub.status()["models"]["policy"]["latest"] == version
        # the group is the model's writer (the lease in rank 0's name): another live writer is refused
        with pytest.raises(raysync.StaleWriterError):
            hub.push(_sharded.Net(5))
        with pytest.raises(ValueError, match="transport='sharded' is what the hub names"):
            hub.push(_sharded.Net(5), transport="sharded")
        assert hub.latest() == version
    finally:
        follower.stop()
        loader.stop()
        tp_follower.stop()
        ray.kill(collector)


@pytest.mark.parametrize("ringer", ["hub", "relay"])
def test_small_versions_reach_a_node_by_doorbell(ranks: list[Any], hub_name: str, ringer: str) -> None:
    """As one writer's: assembled once on the node, rung (no Ray call per subscriber), bit-equal."""
    settings = raysync.HubSettings(rings_own_node=ringer == "hub", ring_ack_s=PATH_RING_ACK_S)
    hub = raysync.connect(hub_name, settings=settings)
    copy = _collector(hub_name)
    view = _collector(hub_name, apply="view")  # looks into the sealed segment
    verifying = _collector(hub_name, verify=True)  # checks the CRC32s of what it reads
    actors = [copy, view, verifying]

    def stats() -> dict[str, int]:
        if ringer == "hub":
            return dict(hub.status()["here"])
        return dict(ray.get(_relay(hub).stats.remote(), timeout=TIMEOUT))

    try:
        ray.get([a.state.remote() for a in actors], timeout=TIMEOUT)
        ray.get([r.make.remote(0) for r in ranks], timeout=TIMEOUT)
        if ringer == "relay":
            _relay(hub)  # up: the next delivery goes through it
        # from the first version rung on, every version rings every subscriber (see _until_rung)
        _until_rung(hub, lambda: _push(ranks, hub_name, checksum=True)[0][0], stats)
        before = stats()
        for step in (1, 2):
            ray.get([r.step.remote(step) for r in ranks], timeout=TIMEOUT)
            version = _push(ranks, hub_name, checksum=True)[0][0]
            hub.wait(version, timeout=TIMEOUT)
            expected = _full(ranks)
            for actor in actors:
                held, weights = ray.get(actor.state.remote(), timeout=TIMEOUT)
                assert held == version
                assert_same_weights(weights, expected)
        after = stats()
        assert after["pid"] == before["pid"], (before, after)  # one ringer's counts
        assert after["rung"] - before["rung"] == 2 * len(actors), (
            before,
            after,
        )  # every process, per version
        assert after["delivered"] == before["delivered"], (before, after)  # and none called
        rows = hub.status()["subscribers"]
        assert len(rows) == len(actors) and all(r["last_error"] is None for r in rows), rows
    finally:
        for actor in actors:
            ray.kill(actor)
        ray.kill(hub.actor)


def test_a_keys_push_puts_and_fetches_only_those_keys(ranks: list[Any], hub_name: str) -> None:
    """``hub.push(model, keys=[...])`` on every rank: each puts only its shards of those keys
    (once laid apart), the other keys keep the previous push's bytes, receivers fetch only them."""
    hub = raysync.connect(hub_name, settings=raysync.HubSettings(doorbell_bytes=0))  # by call: fetches
    collector = _collector(hub_name)
    try:
        ray.get(collector.state.remote(), timeout=TIMEOUT)
        ray.get([r.make.remote(0) for r in ranks], timeout=TIMEOUT)
        with pytest.raises(raysync.InvalidWeightsError, match="push the whole model once first"):
            _push(ranks, hub_name, keys=["rows"])  # this process has pushed nothing to fill from
        _push(ranks, hub_name)
        kept = _full(ranks)
        for step in (1, 2):  # the first keys= push lays the keys apart (everything put once more)
            ray.get([r.bump.remote("rows", 1.0) for r in ranks], timeout=TIMEOUT)
            ray.get([r.bump.remote("odd", 1.0) for r in ranks], timeout=TIMEOUT)  # not pushed: kept
            pushed = _push(ranks, hub_name, keys=["rows"])
            version = pushed[0][0]
            assert {v for v, _ in pushed} == {version}
            if step == 1:  # laid out anew: rows in a bucket of its own, the rest in another
                assert [stats["buckets_put"] for _, stats in pushed] == [2, 2]
            hub.wait(version, timeout=TIMEOUT)
            expected = {**kept, "rows": _full(ranks)["rows"]}
            held, weights = ray.get(collector.state.remote(), timeout=TIMEOUT)
            assert held == version
            assert_same_weights(weights, expected)
        rows_shards = torch.chunk(expected["rows"], 2, dim=0)
        # each rank put exactly its shard of rows: one bucket of it alone
        assert [stats["bytes_put"] for _, stats in pushed] == [t.nbytes for t in rows_shards]
        assert [stats["buckets_put"] for _, stats in pushed] == [1, 1]
        (row,) = hub.status()["subscribers"]
        assert row["last_buckets_fetched"] == 1 and row["last_bytes_fetched"] == expected["rows"].nbytes
        assert_same_weights(dict(hub.pull().flatten_keys(".").items()), expected)
    finally:
        ray.kill(collector)
        ray.kill(hub.actor)


def test_a_delta_push_puts_and_fetches_only_the_buckets_that_changed(ranks: list[Any], hub_name: str) -> None:
    """``delta=True`` on every rank: each puts only its buckets whose bytes changed since its
    previous push; receivers fetch only the whole buckets made of those."""
    hub = raysync.connect(hub_name, settings=raysync.HubSettings(doorbell_bytes=0))  # by call: fetches
    collector = _collector(hub_name)
    small = 1  # bytes per bucket: every tensor (and every rank's shard of it) in a bucket of its own
    try:
        ray.get(collector.state.remote(), timeout=TIMEOUT)
        ray.get([r.make.remote(0) for r in ranks], timeout=TIMEOUT)
        first = _push(ranks, hub_name, delta=True, bucket_bytes=small)  # nothing before it: all put
        assert all(stats["buckets_put"] == stats["buckets"] > 1 for _, stats in first), first
        ray.get([r.bump.remote("rows", 1.0) for r in ranks], timeout=TIMEOUT)
        pushed = _push(ranks, hub_name, delta=True, bucket_bytes=small)
        version = pushed[0][0]
        assert [stats["buckets_put"] for _, stats in pushed] == [1, 1]  # each rank's bucket of rows
        hub.wait(version, timeout=TIMEOUT)
        expected = _full(ranks)
        held, weights = ray.get(collector.state.remote(), timeout=TIMEOUT)
        assert held == version
        assert_same_weights(weights, expected)
        (row,) = hub.status()["subscribers"]
        assert row["last_buckets_fetched"] == 1 and row["last_bytes_fetched"] == expected["rows"].nbytes
        # sparse patches are one writer's: a rank refuses them before its push is numbered
        with pytest.raises(ValueError, match=r'delta="sparse" takes one writer.s weights; a sharded push'):
            ray.get(ranks[0].push.remote(hub_name, delta="sparse"), timeout=TIMEOUT)
    finally:
        ray.kill(collector)
        ray.kill(hub.actor)


def _parts_of(net: torch.nn.Module, tp: raysync.TensorParallel) -> torch.nn.Module:
    """``net`` holding only ``tp``'s parts of its tensors (as a tensor-parallel engine's rank does)."""
    for key, t in list(net.named_parameters()):
        box = tp.box(key, tuple(t.shape))
        if box is not None:
            setattr(net, key, torch.nn.Parameter(torch.zeros(box[1], dtype=t.dtype)))
    return net


def test_an_async_actor_takes_its_parts_of_one_writers_versions(
    hub: raysync.HubClient, hub_name: str
) -> None:
    """``placement=`` on an async actor (never rung: each version comes by the mailbox and is fetched
    on its event loop): its parts of one writer's whole tensors, bit-equal."""
    tp = raysync.TensorParallel(1, 2, {"rows": 1, "cols": 0})

    @raysync.synced_model("policy", hub=hub_name, placement=tp)
    class AsyncEngine:
        def __init__(self) -> None:
            self.policy = _parts_of(_sharded.Net(7), tp)

        async def state(self) -> tuple[int | None, dict[str, torch.Tensor]]:
            return self.raysync_version(), {k: v.clone() for k, v in self.policy.state_dict().items()}

    engine = ray.remote(num_cpus=0)(AsyncEngine).remote()
    try:
        ray.get(engine.state.remote(), timeout=TIMEOUT)
        trained = _sharded.Net(11)
        version = hub.push(trained, wait=True, timeout=TIMEOUT)
        held, weights = ray.get(engine.state.remote(), timeout=TIMEOUT)
        assert held == version
        whole = {k: v.detach() for k, v in trained.state_dict().items()}
        mine = {**whole, "rows": whole["rows"].chunk(2, dim=1)[1], "cols": whole["cols"].chunk(2, dim=0)[1]}
        assert_same_weights(weights, mine)
    finally:
        ray.kill(engine)


def test_tensor_parallel_actors_and_followers_hold_only_their_parts(ranks: list[Any], hub_name: str) -> None:
    """``placement=`` on ``@synced_model`` and ``raysync.follow``: the module holds its parts only
    (rows split along dim 1 and cols along dim 0, unlike the trainer), bit-equal to those parts of
    the trainer's ``full_tensor()``s, the replicated tensor and the buffer whole; the same from
    one writer pushing whole tensors (model "whole"). The actor verifies: every rank pushes with
    ``checksum=True`` (one CRC32 per rank bucket), and a version without them is refused. These
    small versions reach the actor by doorbell: it cuts its parts from the rung segment."""
    tp = raysync.TensorParallel(1, 2, {"rows": 1, "cols": 0})

    @raysync.synced_model("policy", hub=hub_name, placement=tp, verify=True)
    @raysync.synced_model("single", model_id="whole", hub=hub_name, placement=tp, verify=True)
    class Engine:
        def __init__(self) -> None:
            self.policy = _parts_of(_sharded.Net(7), tp)
            self.single = _parts_of(_sharded.Net(7), tp)

        def state(self, model_id: str) -> tuple[int | None, dict[str, torch.Tensor]]:
            module = self.policy if model_id == "policy" else self.single
            return self.raysync_version(model_id), {k: v.clone() for k, v in module.state_dict().items()}

    def parts(full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {**full, "rows": full["rows"].chunk(2, dim=1)[1], "cols": full["cols"].chunk(2, dim=0)[1]}

    # rung subscribers get PATH_RING_ACK_S to ack: the counts below say doorbell, and no Ray call
    hub = raysync.connect(hub_name, settings=raysync.HubSettings(ring_ack_s=PATH_RING_ACK_S))
    engine = ray.remote(num_cpus=0)(Engine).remote()
    followed, alone = _parts_of(_sharded.Net(8), tp), _parts_of(_sharded.Net(8), tp)
    follower = raysync.follow(followed, "policy", hub=hub_name, placement=tp)
    single = raysync.follow(alone, "whole", hub=hub_name, placement=tp)
    try:
        assert ray.get(engine.state.remote("policy"), timeout=TIMEOUT)[0] is None
        before = hub.status()["here"]  # the hub rings this node's doorbells itself
        for step in (3, 4):
            ray.get([r.step.remote(step) for r in ranks], timeout=TIMEOUT)
            version = _push(ranks, hub_name, checksum=True)[0][0]
            hub.wait(version, timeout=TIMEOUT)  # counts both: each took its parts
            mine = parts(_full(ranks))
            held, weights = ray.get(engine.state.remote("policy"), timeout=TIMEOUT)
            assert held == version
            assert_same_weights(weights, mine)
            assert follower.version == version
            assert_same_weights(followed.state_dict(), mine)
        checked = version
        # small versions: the actor was rung, cut its parts from the segment; the follower in this
        # process (no doorbell) was called by the same delivery, once per version
        after = hub.status()["here"]
        assert (after["rung"] - before["rung"], after["delivered"] - before["delivered"]) == (2, 2)
        rows = {r["class_name"]: r for r in hub.status()["subscribers"] if r["model_id"] == "policy"}
        assert rows["Engine"]["applied"] == version and rows["Engine"]["last_error"] is None
        # what it copied in: its parts and the whole replicated tensors, laid out as Ray aligns buffers
        # (at most 8 bytes of padding after each tensor); the whole model is 212 bytes
        own = sum(t.numel() * t.element_size() for t in mine.values())
        assert own <= rows["Engine"]["last_bytes_fetched"] <= own + 8 * len(mine) < 212, rows["Engine"]
        trained = _sharded.Net(11)  # one writer, whole tensors: cut into the same parts
        version = hub.push(trained, "whole", wait=True, timeout=TIMEOUT, checksum=True)
        whole = {k: v.detach() for k, v in trained.state_dict().items()}
        held, weights = ray.get(engine.state.remote("whole"), timeout=TIMEOUT)
        assert held == version
        assert_same_weights(weights, parts(whole))
        assert single.version == version
        assert_same_weights(alone.state_dict(), parts(whole))
        unchecked = _push(ranks, hub_name)[0][0]  # no checksums: the verifying actor refuses it
        with pytest.raises(raysync.ApplyError, match=r"Engine.*carries no checksums"):
            hub.wait(unchecked, timeout=TIMEOUT)
        assert ray.get(engine.state.remote("policy"), timeout=TIMEOUT)[0] == checked
        follower.wait_for(unchecked, timeout=TIMEOUT)  # verify="if_present": none to check
    finally:
        follower.stop()
        single.stop()
        ray.kill(engine)
        ray.kill(hub.actor)


def test_an_fsdp2_trainer_pushes_from_every_rank(
    ranks: list[Any], hub: raysync.HubClient, hub_name: str
) -> None:
    ray.get([r.make_fsdp.remote(3) for r in ranks], timeout=TIMEOUT)
    followed = _sharded.mlp(0)
    follower = raysync.follow(followed, "mlp", hub=hub_name)
    try:
        pushed = _push(ranks, hub_name, model_id="mlp")
        assert pushed[0][0] == pushed[1][0]
        expected = _full(ranks)
        wait_for_condition(lambda: follower.version == pushed[0][0], timeout=TIMEOUT, what="the follower")
        assert_same_weights(followed.state_dict(), expected)
        assert_same_weights(dict(hub.pull("mlp").flatten_keys(".").items()), expected)
    finally:
        follower.stop()
        ray.get([r.make.remote(0) for r in ranks], timeout=TIMEOUT)


def test_ranks_as_plain_torch_distributed_processes(ray_start_regular: dict[str, Any], hub_name: str) -> None:
    """The torchrun case: 4 ranks are processes of their own (not Ray actors) that join the cluster;
    every tensor split 4 ways along one mesh dimension (6 rows as 2, 2, 1, 1; 5 columns as 2, 1, 1, 1)."""
    ctx = multiprocessing.get_context("spawn")
    out, done = ctx.Queue(), ctx.Event()
    port = free_port()
    address = ray_start_regular["address"]
    procs = [
        ctx.Process(target=_sharded.process_rank, args=(r, 4, port, address, hub_name, out, done))
        for r in range(4)
    ]
    for p in procs:
        p.start()
    hub = raysync.connect(hub_name)
    try:
        results = [out.get(timeout=120) for _ in procs]
        assert all(r[0] == "ok" for r in results), results
        assert len({r[1] for r in results}) == 1
        expected = next(r[2] for r in results if r[2])
        assert hub.latest() == results[0][1]
        assert_same_weights(dict(hub.pull().flatten_keys(".").items()), expected)
    finally:
        done.set()
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
        ray.kill(hub.actor)


def test_ranks_that_disagree_are_refused_naming_the_tensor(ranks: list[Any], hub_name: str) -> None:
    hub = raysync.connect(hub_name)
    futures = [ranks[0].push.remote(hub_name), ranks[1].push.remote(hub_name, extra=True)]
    for f in futures:
        with pytest.raises(raysync.InvalidWeightsError, match="only_here"):
            try:
                ray.get(f, timeout=TIMEOUT)
            except ray.exceptions.RayTaskError as err:
                raise err.cause from None
    assert hub.latest() is None
    ray.kill(hub.actor)


def test_a_rank_s_push_returns_before_the_slow_ranks_push(
    ranks: list[Any], hub: raysync.HubClient, hub_name: str
) -> None:
    """A rank's push returns once the hub recorded its own shard; ``wait=True`` waits for the rest."""
    collector = _collector(hub_name)
    try:
        v1, v2, _ = _v1_then_rank0_alone(ranks, hub_name, collector, 3)  # rank 1 has not pushed
        assert v2 > v1 and hub.latest() == v1  # the number is granted, the version not published
        # rank 0 goes on: its next push waits for that version to be published and applied
        ray.get(ranks[0].step.remote(4), timeout=TIMEOUT)
        waiting = ranks[0].push.remote(hub_name, wait=True)
        ready, _ = ray.wait([waiting], timeout=1.0)
        assert not ready and hub.latest() == v1
        slow, stats = ray.get(ranks[1].push.remote(hub_name), timeout=TIMEOUT)  # the slow rank
        # numbered by the rank itself from its group's block, and posted without waiting for the hub
        assert slow == v2 and stats["one_way"] is True
        ray.get(ranks[1].step.remote(4), timeout=TIMEOUT)
        v3 = ray.get(ranks[1].push.remote(hub_name), timeout=TIMEOUT)[0]
        assert ray.get(waiting, timeout=TIMEOUT)[0] == v3 > v2
        version, state = ray.get(collector.state.remote(), timeout=TIMEOUT)  # applied: no polling
        assert version == v3
        assert_same_weights(state, _full(ranks))
    finally:
        ray.kill(collector)


def test_a_rank_dying_mid_push_publishes_nothing(
    ranks: list[Any], hub: raysync.HubClient, hub_name: str
) -> None:
    collector = _collector(hub_name)
    try:
        # rank 0's part reaches the hub and its push returns the round's number; rank 1's never comes
        v1, v2, before = _v1_then_rank0_alone(ranks, hub_name, collector, 7, timeout=3.0)
        restarted = _starting_group(4, (2, 2))  # its processes start while the round runs out
        ranks[1].die.remote()
        with pytest.raises(raysync.SyncTimeoutError, match=f"version {v2} .*did not push their shards"):
            hub.wait(v2, timeout=TIMEOUT)  # the number is abandoned, never published
        assert hub.latest() == v1  # nothing published: readers stay on the previous version
        version, state = ray.get(collector.state.remote(), timeout=TIMEOUT)
        assert version == v1
        assert_same_weights(state, before)
        # the restarted group pushes again (the dead group's lease passes to it): 4 ranks now, over
        # a 2 x 2 mesh (nested uneven shards, sharded along one mesh dimension and replicated along
        # the other, replicated along both)
        for r in ranks:
            ray.kill(r)
        group = _joined(restarted)  # it pushes once the dead group is gone
        ranks[:] = group
        ray.get([r.step.remote(8) for r in group], timeout=TIMEOUT)
        pushed = _push(group, hub_name)
        v3 = pushed[0][0]
        assert {v for v, _ in pushed} == {v3} and v3 > v2
        expected = _full(group)
        wait_for_condition(
            lambda: ray.get(collector.state.remote())[0] == v3, timeout=TIMEOUT, what="v3 applied"
        )
        assert_same_weights(ray.get(collector.state.remote(), timeout=TIMEOUT)[1], expected)
    finally:
        ray.kill(collector)


def test_a_hub_restart_mid_push_loses_that_push_and_the_group_goes_on(
    ranks: list[Any], hub: raysync.HubClient, hub_name: str
) -> None:
    collector = _collector(hub_name)
    try:
        # 2 ranks, or the 4 of the test before; rank 0's part of push 2 ...
        v1, v2, _ = _v1_then_rank0_alone(ranks, hub_name, collector, 9)
        kill_until_gone(hub.actor, no_restart=False)  # ... is lost with the hub's process
        # the other ranks' parts reach the restarted hub
        lost = {v for v, _ in ray.get([r.push.remote(hub_name) for r in ranks[1:]], timeout=TIMEOUT)}
        assert hub.latest() == v1 and len(lost) == 1  # nothing of push 2 is published
        ray.get([r.step.remote(10) for r in ranks], timeout=TIMEOUT)
        pushed = _push(ranks, hub_name)  # no rank's next push is refused for the lost one
        v3 = pushed[0][0]
        assert {v for v, _ in pushed} == {v3} and v3 > max(v2, *lost)
        hub.wait(v3, timeout=TIMEOUT)
        assert hub.latest() == v3 and lost <= set(hub.status()["abandoned"]["policy"])
        version, state = ray.get(collector.state.remote(), timeout=TIMEOUT)
        assert version == v3
        assert_same_weights(state, _full(ranks))
    finally:
        ray.kill(collector)


def test_a_version_a_hub_restart_lost_is_offered_again_by_every_rank(
    ranks: list[Any], hub: raysync.HubClient, hub_name: str
) -> None:
    """As one writer's wait offers its version again, each rank's offers its part; the hub keeps
    the version once every rank did, and a subscriber that came after the restart gets it."""
    ray.get([r.make.remote(0) for r in ranks], timeout=TIMEOUT)
    before = _collector(hub_name)
    v1 = _push(ranks, hub_name)[0][0]
    expected = _full(ranks)
    wait_for_condition(lambda: ray.get(before.state.remote())[0] == v1, timeout=TIMEOUT, what="v1")
    kill_until_gone(hub.actor, no_restart=False)  # the restarted hub knows the number, not the bytes
    late = _collector(hub_name)
    try:
        wait_for_condition(
            lambda: len(hub.status()["subscribers"]) == 2, timeout=TIMEOUT, what="both registered"
        )
        assert ray.get(late.state.remote(), timeout=TIMEOUT)[0] is None
        # rank 0 alone: its part is not the version; its wait ends as any wait nobody satisfies
        with pytest.raises(ray.exceptions.RayTaskError, match=f"did not apply version {v1}"):
            ray.get(ranks[0].wait.remote(hub_name, v1, timeout=2.0), timeout=TIMEOUT)
        assert ray.get(late.state.remote(), timeout=TIMEOUT)[0] is None
        # every rank's part in: the version is kept again and reaches the newcomer whole
        ray.get([r.wait.remote(hub_name, v1, timeout=TIMEOUT) for r in ranks[1:]], timeout=TIMEOUT)
        version, state = ray.get(late.state.remote(), timeout=TIMEOUT)
        assert version == v1 and hub.latest() == v1
        assert_same_weights(state, expected)
        assert ray.get(before.state.remote(), timeout=TIMEOUT)[0] == v1
    finally:
        ray.kill(before)
        ray.kill(late)


def _cause(ref: Any) -> BaseException | None:
    """What a rank's call raised (raysync's own error, not Ray's wrapper); ``None`` if it returned."""
    try:
        ray.get(ref, timeout=TIMEOUT)
    except ray.exceptions.RayTaskError as err:
        return err.cause
    return None


def test_a_push_that_raised_on_one_rank_never_tears_the_versions_after_it(
    ranks: list[Any], hub: raysync.HubClient, hub_name: str
) -> None:
    """Issue 41, case 1: rank 0's push raised before its shard went (here ``max_lag`` timed out: a
    pull-mode subscriber never syncs) while rank 1's went on. The ranks numbered their pushes by a
    count the failed push did not advance, so every later version held rank 0's shards of one step
    and rank 1's of the step before. Every push now counts, and the hub drops the failed one."""
    evaluator = _collector(hub_name, mode="pull")  # never syncs: max_lag with include_pull waits for it
    collector = _collector(hub_name)
    try:
        ray.get([r.make.remote(0) for r in ranks], timeout=TIMEOUT)
        _push(ranks, hub_name)
        wait_for_condition(lambda: len(hub.status()["subscribers"]) == 2, timeout=TIMEOUT, what="registered")
        ray.get([r.step.remote(20) for r in ranks], timeout=TIMEOUT)
        v1 = _push(ranks, hub_name)[0][0]  # newer than any version the pull subscriber may have taken
        ray.get([r.step.remote(21) for r in ranks], timeout=TIMEOUT)
        lagged = _cause(ranks[0].push.remote(hub_name, max_lag=1, include_pull=True, timeout=0.5))
        assert isinstance(lagged, raysync.SyncTimeoutError)
        went_on = [r.push.remote(hub_name) for r in ranks[1:]]  # no max_lag: their shards go
        for ref in went_on:
            refused = _cause(ref)
            if refused is None:  # its shard reached the hub before rank 0's news: the number is abandoned
                v2 = ray.get(ref, timeout=TIMEOUT)[0]
                with pytest.raises(raysync.InvalidWeightsError, match="rank 0's push of it raised SyncTime"):
                    hub.wait(v2, timeout=TIMEOUT)
            else:
                assert isinstance(refused, raysync.InvalidWeightsError)
                assert "rank 0's push of it raised SyncTimeoutError" in str(refused)
        assert hub.latest() == v1  # nothing of the failed step is published
        for step in (22, 23):  # the next steps: every rank's push gets one number, the version is whole
            ray.get([r.step.remote(step) for r in ranks], timeout=TIMEOUT)
            pushed = _push(ranks, hub_name)
            v = pushed[0][0]
            assert {n for n, _ in pushed} == {v} and v > v1
            hub.wait(v, timeout=TIMEOUT)
            expected = _full(ranks)
            assert_same_weights(dict(hub.pull().flatten_keys(".").items()), expected)
            version, state = ray.get(collector.state.remote(), timeout=TIMEOUT)
            assert version == v
            assert_same_weights(state, expected)
    finally:
        ray.kill(evaluator)
        ray.kill(collector)


def test_every_rank_of_a_second_live_group_is_refused_and_never_mixed_in(
    ranks: list[Any], hub: raysync.HubClient, hub_name: str
) -> None:
    """Issue 41, case 2: a second live group pushing the same model id. Its rank 0 was refused by the
    writer lease, but its rank 1 was taken (only rank 0's part was checked) and published with the
    first group's rank 0: rows from two trainers in one version."""
    ray.get([r.make.remote(0) for r in ranks], timeout=TIMEOUT)
    v1 = _push(ranks, hub_name)[0][0]
    other = _group()  # a second trainer, other weights
    try:
        ray.get([r.make.remote(5) for r in other], timeout=TIMEOUT)
        ray.get([r.step.remote(31) for r in other], timeout=TIMEOUT)
        refusals = [_cause(ref) for ref in [r.push.remote(hub_name) for r in other]]
        assert all(isinstance(e, raysync.StaleWriterError) for e in refusals), refusals
        assert "rank 1 of a sharded group" in str(refusals[1])
        assert hub.latest() == v1
        ray.get([r.step.remote(32) for r in ranks], timeout=TIMEOUT)
        pushed = _push(ranks, hub_name)
        v2 = pushed[0][0]
        assert {n for n, _ in pushed} == {v2} and v2 > v1
        hub.wait(v2, timeout=TIMEOUT)
        assert_same_weights(dict(hub.pull().flatten_keys(".").items()), _full(ranks))
        assert hub.status()["abandoned"].get("policy", []) == []
    finally:
        for r in other:
            ray.kill(r)


def test_a_soak_that_kills_ranks_mid_push_publishes_nothing_torn(
    ray_start_regular: dict[str, Any], hub_name: str
) -> None:
    """benchmarks/sharded_soak.py, short: a kill of a random rank at a random moment (then of the rest
    of its group), a rival group pushing the same model beside the writing one (refused until that one
    dies, then it takes over as the restarted group, and pushes the last versions), and pushes that
    time out on one rank alone (issue 41's cases 1 and 2).

    The rival starts while the writing group pushes (``ahead=1``: the 2 groups the kill needs; a
    second kill would only repeat the takeover, with 2 more rank processes)."""
    result = sharded_soak.soak(
        kills=1,
        seconds=20.0,
        kill_within=1.0,
        push_timeout=3.0,
        hub_name=hub_name,
        ahead=1,
        rivals=1,
        lag_p=0.1,
    )
    assert result["kills"] >= 1 and result["groups"] == result["kills"] + 1
    assert result["last_pushes"] == 3  # the group that took over pushed the last versions after its stop
    assert result["torn"] == 0 and result["abandoned_held"] == 0 and result["numbering_errors"] == 0
    # the hub published every number a rank got and did not abandon (and maybe rounds whose
    # ranks died before they could say which number they got)
    assert result["published_total"] >= result["published"] > 0 and result["unaccounted"] == 0
    assert result["collector_versions"] > 1 and result["loader_versions"] > 1
