"""apply="view" weights over the object store: no route writes the node's shared copy (issue 41, case 3).

The read-only guard refuses torch's in-place ops; a tensor made over the same memory another
way (``as_subclass``, DLPack, ``frombuffer``, the storage) is an ordinary tensor. The view's
pages are mapped read-only in the actor, so such a write stops that actor's process (SIGSEGV,
its traceback in the worker's log) and never reaches another actor or ``hub.pull()``.
"""

from __future__ import annotations

import glob
import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import ray
import torch

import raysync
from tests._support import assert_same_weights, wait_for_condition

# What actor A tries, each on a parameter of its view (p); each returns normally only if it wrote.
ROUTES = {
    "as_subclass": "p.as_subclass(torch.Tensor).add_(1)",
    "from_dlpack": "torch.from_dlpack(p).add_(1)",
    "frombuffer": "torch.frombuffer(p.numpy(), dtype=p.dtype).add_(1)",
    "untyped_storage": "p.untyped_storage().fill_(7)",
}


def _big(seed: int = 0) -> torch.nn.Module:
    """12 MiB of float32: over the doorbell's 8 MiB, so the version comes from the object store."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(*(torch.nn.Linear(1024, 1024) for _ in range(3)))


def _viewer(hub_name: str) -> Any:
    @ray.remote(num_cpus=0)
    @raysync.synced_model("policy", hub=hub_name, apply="view")
    class Viewer:
        def __init__(self) -> None:
            self.policy = _big()

        def weights(self) -> dict[str, torch.Tensor]:
            return {k: v.clone() for k, v in self.policy.state_dict().items()}

        def pid(self) -> int:
            return os.getpid()

        def where(self) -> str:
            ptr = self.policy[0].weight.data_ptr()
            with open("/proc/self/maps") as maps:
                for line in maps:
                    span, perms = line.split()[:2]
                    lo, hi = (int(x, 16) for x in span.split("-"))
                    if lo <= ptr < hi:
                        return f"{perms} {line.split(maxsplit=5)[-1].strip()}"
            return "?"

        def vandalize(self, route: str) -> str:
            p = self.policy[0].weight
            try:
                with torch.no_grad():
                    eval(ROUTES[route], {"torch": torch, "p": p})
            except Exception as err:
                return f"refused: {type(err).__name__}: {err}"
            return "written"

    return Viewer


@pytest.fixture(scope="module")
def bystander(ray_start_regular: dict[str, Any]) -> Iterator[tuple[raysync.HubClient, Any]]:
    """A hub and a second viewer of its versions, shared by the routes: each route's vandal is new."""
    hub = raysync.connect(f"test-view-memory-{uuid.uuid4().hex[:8]}")
    viewer = _viewer(hub.name).remote()
    ray.get(viewer.raysync_version.remote(), timeout=120)
    yield hub, viewer
    ray.kill(viewer)
    ray.kill(hub.actor)


@pytest.mark.parametrize("route", sorted(ROUTES))
def test_case3_no_route_writes_a_view_over_the_object_store(
    route: str, bystander: tuple[raysync.HubClient, Any], ray_start_regular: dict[str, Any]
) -> None:
    """A write through any route raises or faults actor A; B and hub.pull() keep the version."""
    hub, bystander_ = bystander
    vandal = _viewer(hub.name).remote()
    ray.get(vandal.raysync_version.remote(), timeout=120)
    src = _big(5)
    v = hub.push(src, wait=True, timeout=120)
    assert "plasma" in ray.get(vandal.where.remote(), timeout=60)  # the object store's, not the doorbell's
    pid = ray.get(vandal.pid.remote(), timeout=60)
    try:
        outcome = ray.get(vandal.vandalize.remote(route), timeout=120)
    except ray.exceptions.RayActorError:
        outcome = "faulted"  # its process died: the write never happened
        logs = os.path.join(ray_start_regular["session_dir"], "logs", f"worker-*-{pid}.err")
        report = wait_for_condition(
            lambda: next(
                (t for f in glob.glob(logs) if "Segmentation fault" in (t := Path(f).read_text())), ""
            ),
            timeout=30,
            what="faulthandler's report of the write in the worker's log",
        )
        assert "in vandalize" in report  # the traceback names the code that wrote
    finally:
        ray.kill(vandal)
    assert outcome == "faulted" or outcome.startswith("refused"), outcome
    assert_same_weights(ray.get(bystander_.weights.remote(), timeout=60), src.state_dict())
    assert_same_weights(hub.pull().flatten_keys(".").to_dict(), src.state_dict())
    assert ray.get(bystander_.raysync_version.remote(), timeout=60) == v
    perms, where = ray.get(bystander_.where.remote(), timeout=60).split(maxsplit=1)
    assert "plasma" in where and "w" not in perms, (perms, where)  # the store's pages, mapped read-only
