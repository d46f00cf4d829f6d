"""A job's driver and tasks share one writer lease: a push never hands out a number it will not publish."""

from __future__ import annotations

import ray

import raysync
from tests._support import assert_same_weights, small_policy

CALL_S = 60.0


@ray.remote(num_cpus=0)
def _push_from_task(client: raysync.HubClient, seed: int) -> int:
    return client.push(small_policy(seed))


def test_the_drivers_pushes_after_a_tasks_are_published_above_the_tasks_number(
    hub: raysync.HubClient,
) -> None:
    assert hub.push(small_policy(1)) == 1  # the driver holds the lease (a block of numbers from 1)
    from_task = ray.get(_push_from_task.remote(hub, 2), timeout=CALL_S)  # another process of the job
    assert from_task > 1
    # Back to back, no query between them: each push's number is one the hub publishes (before,
    # the first returned 2 from the driver's old block and the refusal came only on a later push).
    got = [hub.push(small_policy(seed)) for seed in (3, 4, 5)]
    assert from_task < got[0] < got[1] < got[2], (from_task, got)
    assert hub.latest() == got[-1]
    assert hub.next_version() == got[-1] + 1
    assert_same_weights(hub.pull(state_dict=True), small_policy(5).state_dict())
    # And the other way round: a task's push after the driver's publishes above the driver's too.
    again = ray.get(_push_from_task.remote(hub, 6), timeout=CALL_S)
    assert again > got[-1]
    assert hub.latest() == again
    assert hub.next_version() > again  # the driver's next number too follows the task's
    after = hub.push(small_policy(7))
    assert after > again and hub.latest() == after
    assert_same_weights(hub.pull(state_dict=True), small_policy(7).state_dict())
