"""raysync quick start: a trainer pushes after every step, four collectors follow.

The driver trains a small policy to imitate an "expert" (a fixed linear map) for
a few hundred steps and pushes the weights after each step. Four
``@synced_model`` collectors keep rolling out in the background; each reports
the version it acted with, so we can see how far behind the trainer they ran.

Run it on an embedded local Ray::

    python examples/quickstart.py

or submit it unchanged to a running cluster::

    ray job submit --working-dir . -- python examples/quickstart.py
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import ray
import torch

import raysync

OBS, ACT = 16, 4


def make_policy() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(OBS, 64), torch.nn.Tanh(), torch.nn.Linear(64, ACT))


@ray.remote(num_cpus=0)
@raysync.synced_model("policy")
class Collector:
    """A rollout worker: acts with whatever version the hub last delivered."""

    def __init__(self, seed: int) -> None:
        torch.manual_seed(seed)
        self.policy = make_policy()
        self.expert = _expert()

    def rollout(self, steps: int = 64) -> dict[str, Any]:
        time.sleep(0.01)  # stands in for stepping an environment
        obs = torch.randn(steps, OBS)
        with torch.no_grad():
            actions = self.policy(obs)
        reward = -torch.nn.functional.mse_loss(actions, obs @ self.expert).item()
        return {"version": self.raysync_version(), "reward": reward}


def _expert() -> torch.Tensor:
    g = torch.Generator().manual_seed(1234)
    return torch.randn(OBS, ACT, generator=g) / OBS**0.5


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300, help="training steps (one push each)")
    parser.add_argument("--collectors", type=int, default=4)
    args = parser.parse_args()

    ray.init()  # a local Ray, or the cluster when run with `ray job submit`
    hub = raysync.connect()
    collectors = [Collector.remote(seed) for seed in range(args.collectors)]
    ray.get([c.raysync_version.remote() for c in collectors])  # started and subscribed

    torch.manual_seed(0)
    policy = make_policy()
    optimizer = torch.optim.Adam(policy.parameters(), lr=3e-3)
    expert = _expert()

    pending = {c.rollout.remote(): i for i, c in enumerate(collectors)}
    rows: list[dict[str, Any]] = []
    push_times: list[float] = []
    start = time.perf_counter()
    for step in range(args.steps):
        obs = torch.randn(256, OBS)
        loss = torch.nn.functional.mse_loss(policy(obs), obs @ expert)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        t0 = time.perf_counter()
        version = hub.push(policy)  # returns once the snapshot is in the object store
        push_times.append(time.perf_counter() - t0)
        done, _ = ray.wait(list(pending), num_returns=len(pending), timeout=0)
        for ref in done:
            i = pending.pop(ref)
            result = ray.get(ref)
            rows.append({"collector": i, "step": step, "lag": version - (result["version"] or 0), **result})
            pending[collectors[i].rollout.remote()] = i
    hub.wait(version, timeout=60, subscribers=args.collectors)  # every collector holds the final version
    elapsed = time.perf_counter() - start
    finals = ray.get([c.raysync_version.remote() for c in collectors])

    print(
        f"\ntrained {args.steps} steps and pushed {args.steps} versions (the last: {version}) "
        f"in {elapsed:.1f} s "
        f"(push: median {statistics.median(push_times) * 1e3:.2f} ms)"
    )
    print(
        f"{'collector':>9} {'rollouts':>8} {'versions seen':>13} {'max lag':>7} "
        f"{'final version':>13} {'first reward':>12} {'last reward':>11}"
    )
    for i in range(args.collectors):
        mine = [r for r in rows if r["collector"] == i]
        seen = len({r["version"] for r in mine})
        print(
            f"{i:>9} {len(mine):>8} {seen:>13} {max((r['lag'] for r in mine), default=0):>7} "
            f"{finals[i]:>13} {mine[0]['reward'] if mine else float('nan'):>12.4f} "
            f"{mine[-1]['reward'] if mine else float('nan'):>11.4f}"
        )
    status = hub.status()
    apply_ms = [s["last_apply_s"] * 1e3 for s in status["subscribers"] if s["last_apply_s"]]
    if apply_ms:
        print(f"apply time per version on a collector: median {statistics.median(apply_ms):.2f} ms")
    assert all(f == version for f in finals), f"collectors ended on {finals}, expected {version}"
    print("all collectors hold the newest version")


if __name__ == "__main__":
    main()
