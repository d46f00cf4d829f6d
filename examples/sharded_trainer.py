"""A sharded trainer: FSDP2 on 2 gloo ranks (Ray actors), every rank pushes its own shard.

Each rank holds half of every parameter (``fully_shard``: ``DTensor``\\ s, Shard(0)) and
calls ``hub.push(policy)`` after each step, exactly as a single trainer does. Nothing is
gathered: each rank puts only its own shard into the object store, and the hub publishes
one version, with one number, once both ranks' shards are in. Two ``@synced_model``
collectors hold a plain (whole) policy and follow; at the end each must hold weights
bit-equal to the trainer's ``full_tensor()``.

Run it on an embedded local Ray (CPU only, gloo)::

    python examples/sharded_trainer.py --steps 20
"""

from __future__ import annotations

import argparse
import datetime
import os
import socket
import time
from typing import Any

import ray
import torch

import raysync

OBS, ACT, WORLD = 16, 4, 2


def make_policy() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(OBS, 63), torch.nn.Tanh(), torch.nn.Linear(63, ACT))


@ray.remote(num_cpus=0)
class TrainerRank:
    """One FSDP2 rank: trains its shard of the policy and pushes it."""

    def __init__(self, rank: int, port: int) -> None:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=WORLD,
            timeout=datetime.timedelta(seconds=60),
        )
        self.rank = rank
        self.policy = make_policy()
        fully_shard(self.policy, mesh=init_device_mesh("cpu", (WORLD,)))
        self.optim = torch.optim.Adam(self.policy.parameters(), lr=1e-2)
        self.hub = raysync.connect()
        self.expert = torch.nn.Linear(OBS, ACT)
        torch.nn.init.constant_(self.expert.weight, 0.1)

    def train(self, steps: int) -> tuple[int, list[float]]:
        """``steps`` steps, a push after each; the last version and the push times (s)."""
        g = torch.Generator().manual_seed(self.rank)
        times, version = [], 0
        for _ in range(steps):
            obs = torch.randn(64, OBS, generator=g)
            with torch.no_grad():
                target = self.expert(obs)
            loss = (self.policy(obs) - target).square().mean()
            self.optim.zero_grad()
            loss.backward()
            self.optim.step()
            t0 = time.perf_counter()
            # this rank's shard only; returns once the hub has it (the same number on both ranks)
            version = self.hub.push(self.policy)
            times.append(time.perf_counter() - t0)
        return version, times

    def full(self) -> dict[str, torch.Tensor]:
        """The whole weights (a collective: both ranks call it)."""
        return {k: t.full_tensor().clone() for k, t in self.policy.state_dict().items()}


@ray.remote(num_cpus=0)
@raysync.synced_model("policy")
class Collector:
    """A rollout worker holding a plain, whole policy."""

    def __init__(self) -> None:
        self.policy = make_policy()

    def state(self) -> tuple[int | None, dict[str, torch.Tensor]]:
        return self.raysync_version(), {k: v.clone() for k, v in self.policy.state_dict().items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args(argv)
    ray.init(include_dashboard=False, logging_level="warning")
    hub = raysync.connect()
    collectors = [Collector.remote() for _ in range(2)]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ranks = [TrainerRank.remote(r, port) for r in range(WORLD)]
    ray.get([c.state.remote() for c in collectors])
    trained: list[Any] = ray.get([r.train.remote(args.steps) for r in ranks])
    latest = trained[0][0]  # published once both ranks' shards are in; wait for it
    hub.wait(latest, timeout=60, subscribers=len(collectors))
    full = ray.get([r.full.remote() for r in ranks])[0]
    ok = True
    for i, c in enumerate(collectors):
        version, state = ray.get(c.state.remote())
        same = all(torch.equal(state[k], full[k]) for k in full)
        ok &= same and version == latest
        print(f"collector {i}: version {version} (newest {latest}), bit-equal to full_tensor(): {same}")
    for rank, (_, ts) in enumerate(trained):
        print(f"rank {rank}: {len(ts)} pushes, median {sorted(ts)[len(ts) // 2] * 1e3:.1f} ms")
    ray.shutdown()
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
