"""PPO on CartPole-v1 with torchrl's MultiSyncCollector, its workers synced by raysync's hub.

The collector's worker processes get a weightless copy of the policy; raysync's
``HubWeightSyncScheme`` gives them the trainer's weights through the hub after every
PPO update (``collector.update_policy_weights_()``), and each batch carries the hub
version its worker acted with (``track_policy_version=True``). With ``--check`` the
script recomputes, for every worker's slice of every batch, the log-probabilities of
the actions it took with the weights of the version stamped on it, and fails if one
differs: every worker acted with exactly the weights it reports.

Run it with ``make demo-torchrl`` (or ``python examples/torchrl_ppo.py``); on 2 CPU
cores it reaches a mean episode length above 200 in about two minutes and writes the
reward curve to ``docs/img/torchrl_ppo_reward.png`` (the README's figure; ``--plot PATH`` for another).

Usage:
    python examples/torchrl_ppo.py [--frames 200000] [--target 200] [--workers 2] [--check]
"""

from __future__ import annotations

import argparse
import copy
import logging
import pathlib
import sys
import time
import uuid
from typing import Any

import ray
import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule
from torchrl.collectors import MultiSyncCollector
from torchrl.envs import GymEnv, StepCounter, TransformedEnv
from torchrl.modules import MLP, OneHotCategorical, ProbabilisticActor, ValueOperator
from torchrl.objectives import ClipPPOLoss
from torchrl.objectives.value import GAE

from raysync.torchrl.integration import HubWeightSyncScheme

DEFAULT_PLOT = pathlib.Path(__file__).resolve().parents[1] / "docs" / "img" / "torchrl_ppo_reward.png"
"""Where the reward curve goes: the README's figure, not the directory the script runs in."""


def make_env() -> TransformedEnv:
    return TransformedEnv(GymEnv("CartPole-v1"), StepCounter())


def make_actor() -> ProbabilisticActor:
    spec = make_env().action_spec
    logits = TensorDictModule(
        MLP(in_features=4, out_features=2, num_cells=[64, 64]), ["observation"], ["logits"]
    )
    return ProbabilisticActor(
        logits, in_keys=["logits"], spec=spec, distribution_class=OneHotCategorical, return_log_prob=True
    )


def _log_prob_key(batch: Any) -> str:
    for key in ("action_log_prob", "sample_log_prob"):
        if key in batch.keys():
            return key
    raise KeyError(f"no log-prob in the batch: {list(batch.keys())}")


class ActedWithCheck:
    """Did each worker act with the weights of the version stamped on its batch? (bit-exact replay)"""

    def __init__(self, actor: ProbabilisticActor) -> None:
        self.replay = copy.deepcopy(actor)
        self.weights: dict[int, TensorDict] = {}
        self.checked = 0
        self.mismatches: list[str] = []

    def remember(self, version: int, actor: ProbabilisticActor) -> None:
        self.weights[version] = TensorDict.from_module(actor).detach().clone()
        for old in [v for v in self.weights if v < version - 2]:
            del self.weights[old]

    def check(self, batch: Any, expected: int) -> None:
        # A step's ("next", "policy_version") is the version whose weights chose its action.
        versions = batch["next", "policy_version"].reshape(batch.shape[0], -1)
        for worker in range(batch.shape[0]):
            held = {int(v) for v in versions[worker].unique()}
            if held != {expected}:
                self.mismatches.append(f"worker {worker}: stamped {sorted(held)}, trainer sent {expected}")
                continue
            part = batch[worker]
            self.weights[expected].to_module(self.replay)
            with torch.no_grad():
                dist = self.replay.get_dist(part.select("observation").clone())
                replayed = dist.log_prob(part["action"])
            if not torch.allclose(replayed, part[_log_prob_key(part)], atol=1e-6, rtol=0):
                self.mismatches.append(
                    f"worker {worker}: actions not taken with version {expected}'s weights"
                )
            self.checked += 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--frames", type=int, default=200_000, help="frame budget")
    parser.add_argument("--frames-per-batch", type=int, default=2_000)
    parser.add_argument("--workers", type=int, default=2, help="torchrl worker processes")
    parser.add_argument("--target", type=float, default=200.0, help="stop at this mean episode length")
    parser.add_argument("--check", action="store_true", help="replay every batch with its stamped version")
    parser.add_argument(
        "--plot",
        default=str(DEFAULT_PLOT),
        help="reward-curve PNG (default: the README's figure; '' for none)",
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    torch.manual_seed(args.seed)
    if not ray.is_initialized():
        ray.init(include_dashboard=False, log_to_driver=False, logging_level=logging.ERROR)
    actor = make_actor()
    critic = ValueOperator(MLP(in_features=4, out_features=1, num_cells=[64, 64]), in_keys=["observation"])
    loss = ClipPPOLoss(actor, critic, clip_epsilon=0.2, entropy_coeff=0.01, normalize_advantage=True)
    gae = GAE(gamma=0.99, lmbda=0.95, value_network=critic, average_gae=False)
    optim = torch.optim.Adam(loss.parameters(), lr=3e-4)
    scheme = HubWeightSyncScheme(hub=f"torchrl-ppo-{uuid.uuid4().hex[:6]}", timeout=60)
    collector = MultiSyncCollector(
        [make_env] * args.workers,
        actor,
        frames_per_batch=args.frames_per_batch,
        total_frames=args.frames,
        weight_sync_schemes={"policy": scheme},
        track_policy_version=True,
    )
    check = ActedWithCheck(actor) if args.check else None
    version = int(scheme.version or 0)  # the scheme pushed the collector's policy as the first version
    if check is not None:
        check.remember(version, actor)

    from tqdm import tqdm

    curve: list[tuple[int, float]] = []
    frames, start, reached = 0, time.monotonic(), None
    bar = tqdm(total=args.frames, unit="frames", file=sys.stdout, dynamic_ncols=True)
    try:
        for i, batch in enumerate(collector):
            if check is not None:
                check.check(batch, version)
            frames += batch.numel()
            done = batch["next", "done"].squeeze(-1)
            lengths = batch["next", "step_count"].squeeze(-1)[done].float()
            mean_len = float(lengths.mean()) if lengths.numel() else float("nan")
            curve.append((frames, mean_len))
            bar.update(batch.numel())
            bar.set_postfix(iteration=i, version=version, episode_length=f"{mean_len:.1f}")
            bar.write(
                f"iteration {i:3d}  frames {frames:7d}  episode length {mean_len:6.1f}  version {version}"
            )
            if reached is None and mean_len >= args.target:
                reached = time.monotonic() - start
                break
            with torch.no_grad():
                gae(batch)
            flat = batch.reshape(-1)
            for _ in range(4):
                for idx in torch.randperm(flat.numel()).split(256):
                    losses = loss(flat[idx])
                    total = losses["loss_objective"] + losses["loss_critic"] + losses["loss_entropy"]
                    optim.zero_grad()
                    total.backward()
                    torch.nn.utils.clip_grad_norm_(loss.parameters(), 1.0)
                    optim.step()
            collector.update_policy_weights_()  # one hub push; returns once every worker holds it
            version = int(scheme.version or 0)
            if check is not None:
                check.remember(version, actor)
    finally:
        bar.close()
        collector.shutdown()
    elapsed = time.monotonic() - start
    final = curve[-1][1] if curve else float("nan")
    print(f"mean episode length {final:.1f} after {frames} frames in {elapsed:.0f} s", end="")
    print(f" (target {args.target:.0f} reached in {reached:.0f} s)" if reached else " (target not reached)")
    if args.plot:
        _plot(curve, args.plot, args.target)
        print(f"reward curve: {args.plot}")
    if check is not None:
        print(
            f"acted-with check: {check.checked} worker batches replayed, {len(check.mismatches)} mismatches"
        )
        for line in check.mismatches[:10]:
            print("  " + line)
        if check.mismatches or not check.checked:
            return 1
    return 0


def _plot(curve: list[tuple[int, float]], path: str, target: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([f for f, _ in curve], [r for _, r in curve], marker=".")
    ax.axhline(target, linestyle="--", color="grey", label=f"target {target:.0f}")
    ax.set_xlabel("frames")
    ax.set_ylabel("mean episode length (= reward)")
    ax.set_title("PPO on CartPole-v1, MultiSyncCollector synced by raysync")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    sys.exit(main())
