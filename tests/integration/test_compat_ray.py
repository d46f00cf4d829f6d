"""raysync's private uses of Ray (raysync/_compat.py), probed on the installed Ray.

Each failure names the use that changed, so that a new Ray release says what to fix.
"""

from __future__ import annotations

import uuid
from typing import Any

import numpy as np
import ray
from ray.util.placement_group import placement_group, remove_placement_group

from raysync import _compat
from tests._support import wait_for_condition


def test_the_gcs_key_value_store_round_trips(ray_start_regular: dict[str, Any]) -> None:
    use = _compat.RAY_USES[0]
    ns = f"raysync-test-{uuid.uuid4().hex[:6]}"
    _compat.kv_put(b"a/1", b"one", namespace=ns)
    _compat.kv_put(b"a/2", b"two", namespace=ns)
    assert _compat.kv_get(b"a/1", namespace=ns) == b"one", use
    assert sorted(_compat.kv_list(b"a/", namespace=ns)) == [b"a/1", b"a/2"], use
    _compat.kv_delete(b"a/1", namespace=ns)
    assert _compat.kv_get(b"a/1", namespace=ns) is None, use


@ray.remote(num_cpus=0)
class _Probe:
    def ids(self) -> tuple[str, str]:
        ctx = ray.get_runtime_context()
        return ctx.get_actor_id() or "", ctx.get_job_id()


def test_actor_and_job_liveness_come_from_the_gcs(ray_start_regular: dict[str, Any]) -> None:
    use = _compat.RAY_USES[1]
    probe = _Probe.remote()
    actor_id, job_id = ray.get(probe.ids.remote())
    assert _compat.actor_state(actor_id) == "ALIVE", use
    assert _compat.job_alive(job_id) is True, use
    assert _compat.job_alive("ffffffff") is False, use
    ray.kill(probe)
    wait_for_condition(lambda: _compat.actor_state(actor_id) == "DEAD", what=f"{use}: a killed actor is DEAD")


def test_another_actors_placement_group_and_bundle(ray_start_regular: dict[str, Any]) -> None:
    use = _compat.RAY_USES[2]
    pg = placement_group([{"CPU": 0.01}, {"CPU": 0.01}])
    ray.get(pg.ready(), timeout=60)
    try:
        probe = _Probe.options(placement_group=pg, placement_group_bundle_index=1, num_cpus=0.01).remote()
        actor_id, _ = ray.get(probe.ids.remote())
        found = _compat.actor_placement(actor_id)
        assert found is not None, use
        pg_id, resources = found
        assert pg_id == pg.id.binary(), use
        assert any(name.endswith(f"_group_1_{pg.id.hex()}") for name in resources), (use, resources)
        assert _compat.placement_group(pg_id).id == pg.id, use
        ray.kill(probe)
    finally:
        remove_placement_group(pg)


def test_metrics_interval_and_store_bytes(ray_start_regular: dict[str, Any]) -> None:
    assert _compat.metrics_report_interval_s() > 0, _compat.RAY_USES[3]
    use = _compat.RAY_USES[5]
    before = _compat.object_store_bytes_used()
    ref = ray.put(np.zeros(8 << 20, dtype=np.uint8))
    assert _compat.object_store_bytes_used() - before >= 8 << 20, use
    del ref


@ray.remote(num_cpus=0)
def _task_in_worker() -> bool:
    return _compat.in_worker(ray.get_runtime_context())


def test_a_worker_is_told_from_a_driver(ray_start_regular: dict[str, Any]) -> None:
    use = _compat.RAY_USES[4]
    assert _compat.in_worker(ray.get_runtime_context()) is False, use  # this driver
    assert ray.get(_task_in_worker.remote()) is True, use

    @ray.remote(num_cpus=0)
    class _Actor:
        def in_worker(self) -> bool:  # a worker process too
            return _compat.in_worker(ray.get_runtime_context())

    assert ray.get(_Actor.remote().in_worker.remote()) is True, use
