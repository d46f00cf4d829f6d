"""Adapters in the bundles of one placement group: a pipe, a distributed and an RPC adapter.

The three adapters (2 receiver processes each) are created once for the
module and shared by its tests, in order; the last test kills an adapter.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from typing import Any

import pytest
import ray
import torch
from ray.util.placement_group import placement_group_table, remove_placement_group

import raysync
import raysync.adapters as adapters
from tests._adapter_workers import make_policy, record
from tests._support import assert_same_weights, small_policy, wait_for_condition

TIMEOUT = 90.0  # generous: the CI machine is small and busy


@pytest.fixture(scope="module")
def setup(
    ray_start_regular: dict[str, Any], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Any]]:
    name = f"adapters-{os.getpid()}"
    hub = raysync.connect(name)
    out = str(tmp_path_factory.mktemp("receivers"))
    pg = ray.util.placement_group([{"CPU": 0.5}] * 3)
    common = {"args": (out, "r"), "model_factory": make_policy, "hub": name, "timeout": TIMEOUT}
    # Started together (ready_timeout=None returns at once), then awaited together.
    pipe, dist, rpc = handles = tuple(
        adapters.for_placement_group(pg, kind, fn=record, bundles=[b], ready_timeout=None, **common)[0]
        for b, kind in enumerate(("pipe", "distributed", "rpc"))
    )
    ray.get([h._raysync_ping.remote() for h in handles], timeout=2 * TIMEOUT)
    yield {"hub": hub, "pg": pg, "out": out, "pipe": pipe, "dist": dist, "rpc": rpc, "handles": handles}
    for handle in handles:
        ray.kill(handle)
    remove_placement_group(pg)
    ray.kill(hub.actor)


def _state(out: str, pid: int, count: int) -> dict[str, torch.Tensor]:
    """The state a receiver process saved after applying its ``count``-th version."""
    path = os.path.join(out, f"r-{pid}-{count}.pt")
    wait_for_condition(lambda: os.path.exists(path), timeout=TIMEOUT, what=path)
    state: dict[str, torch.Tensor] = torch.load(path)
    return state


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return "\nState:\tZ" in f.read()
    except FileNotFoundError:
        return True


def _rows(hub: raysync.HubClient) -> dict[str, dict[str, Any]]:
    return {row["class_name"]: row for row in hub.status()["subscribers"]}


def test_each_adapter_runs_in_its_bundle(setup: dict[str, Any]) -> None:
    pg = setup["pg"]
    nodes = placement_group_table(pg)["bundles_to_node_id"]
    for bundle, handle in enumerate(setup["handles"]):
        where = ray.get(handle.placement.remote())  # read inside the actor
        assert where["placement_group_id"] == pg.id.hex()
        assert where["bundle_index"] == bundle
        assert where["node_id"] == nodes[bundle]
        # ... and an actor handle leads back to its placement group.
        assert adapters.placement_group_of(handle).id == pg.id
    rows = _rows(setup["hub"])
    assert set(rows) == {"PipeAdapter", "DistributedAdapter", "RPCAdapter"}  # one subscriber each
    assert [rows[c]["placement"]["bundle_index"] for c in ("PipeAdapter", "DistributedAdapter")] == [0, 1]
    assert adapters.placement._choose_bundles(pg, None, "node") == [0]  # every bundle is on this one node
    assert adapters.placement._choose_bundles(pg, [2, 1], "bundle") == [2, 1]


def test_every_receiver_bit_equal_and_bytes_fetched_once_per_adapter(setup: dict[str, Any]) -> None:
    hub, out = setup["hub"], setup["out"]
    handles = setup["handles"]
    for count in (1, 2, 3):
        model = small_policy(count)
        before = ray.get([h.stats.remote() for h in handles])
        version = hub.push(model, wait=True, timeout=TIMEOUT)
        per_version = hub.status()["models"]["policy"]["bytes_per_version"]
        for handle, old in zip(handles, before, strict=True):
            stats = ray.get(handle.stats.remote())
            # One fetch of one version's bytes, whatever the number of receivers behind it.
            assert stats["fetches"] - old["fetches"] == 1
            assert stats["bytes_fetched"] - old["bytes_fetched"] == per_version
            rows = ray.get(handle.receivers.remote())
            assert len(rows) == 2 and all(r["applied"] == version for r in rows), rows
            for row in rows:
                assert_same_weights(_state(out, row["pid"], count), model.state_dict())
        for row in _rows(hub).values():
            assert row["applied"] == version
            assert row["last_bytes_fetched"] == per_version
            assert [r["applied"] for r in row["receivers"]] == [version, version]


def test_refused_version_is_reported_and_previous_weights_stay(setup: dict[str, Any]) -> None:
    hub, out = setup["hub"], setup["out"]
    good = hub.latest()
    # A shape the receivers lack does not fit the layout the model's versions established:
    # the hub refuses it, naming the tensors, and no receiver is handed it.
    with pytest.raises(
        raysync.WeightMismatchError, match=r"shape mismatch 2\.bias.*no version was published"
    ):
        hub.push(small_policy(9, out=5), wait=True, timeout=TIMEOUT)
    assert hub.latest() == good
    for row in _rows(hub).values():
        assert row["applied"] == good
        assert all(r["applied"] == good for r in row["receivers"])
    model = small_policy(4)
    version = hub.push(model, wait=True, timeout=TIMEOUT)
    for handle in setup["handles"]:
        for row in ray.get(handle.receivers.remote()):
            assert row["applied"] == version and row["error"] is None
            assert_same_weights(_state(out, row["pid"], 4), model.state_dict())


def test_dead_receiver_is_reported_and_dropped_without_blocking(setup: dict[str, Any]) -> None:
    hub, out = setup["hub"], setup["out"]
    handles = setup["handles"]
    killed = []
    for handle in handles:
        victim = ray.get(handle.receivers.remote())[0]
        os.kill(victim["pid"], signal.SIGKILL)
        killed.append(victim["pid"])
    for count in (5, 6):  # the push after the failure and the one after it
        model = small_policy(count)
        version = hub.push(model, wait=True, timeout=TIMEOUT)
        for handle in handles:
            rows = ray.get(handle.receivers.remote())
            dead = [r for r in rows if r["pid"] in killed]
            live = [r for r in rows if r["pid"] not in killed]
            assert len(dead) == 1 and dead[0]["state"] == "dead" and "exit" in dead[0]["error"]
            assert len(live) == 1 and live[0]["applied"] == version
            assert_same_weights(_state(out, live[0]["pid"], count), model.state_dict())
    rows = _rows(hub)
    assert all(row["applied"] == version for row in rows.values())
    assert all(any(r["state"] == "dead" for r in row["receivers"]) for row in rows.values())


def test_dead_adapter_is_dropped_and_the_other_keeps_going(setup: dict[str, Any]) -> None:
    hub, out = setup["hub"], setup["out"]
    workers = [r["pid"] for r in ray.get(setup["pipe"].receivers.remote()) if r["state"] == "live"]
    ray.kill(setup["pipe"])
    model = small_policy(7)
    version = hub.push(model, wait=True, timeout=TIMEOUT)  # does not wait for the dead one
    wait_for_condition(lambda: set(_rows(hub)) == {"DistributedAdapter", "RPCAdapter"}, timeout=TIMEOUT)
    for handle in (setup["dist"], setup["rpc"]):
        live = [r for r in ray.get(handle.receivers.remote()) if r["state"] == "live"]
        assert live and all(r["applied"] == version for r in live)
        assert_same_weights(_state(out, live[0]["pid"], 7), model.state_dict())
    # The killed adapter's worker processes exit on their own.
    wait_for_condition(lambda: all(_gone(pid) for pid in workers), timeout=TIMEOUT, what="orphans")


def test_bad_arguments_are_refused_before_anything_starts() -> None:
    with pytest.raises(ValueError, match="kind"):
        adapters.start("carrier-pigeon", record, model_factory=make_policy)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="per"):
        adapters.for_placement_group(None, "pipe", fn=record, model_factory=make_policy, per="rack")  # type: ignore[arg-type]
