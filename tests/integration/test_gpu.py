"""Modules on a GPU: the trainer's, the receivers', and a sharded trainer's ``DTensor`` shards.

Every test here carries ``@pytest.mark.gpu`` and is skipped without CUDA (CI has no GPU); they
run on a lent GPU machine (``../shared/gpu/README.md``). ``RAYSYNC_TEST_DEVICE=cpu`` runs the
same tests on CPU, to check the tests themselves on a machine without a GPU.

What a user would notice: every receiver's weights stay on the GPU, in the module's own
parameters (``apply="copy"`` copies into them; NIXL swaps in a spare set on the same device),
bit-equal to the trainer's after every push and stamped with the version that holds them;
a CPU trainer feeds GPU receivers and a GPU trainer CPU receivers; a sharded trainer whose
ranks hold their shards on the GPU publishes whole tensors.
"""

from __future__ import annotations

import gc
import os
import time
from typing import Any

import pytest
import ray
import torch

import raysync
from benchmarks._harness import join_gloo
from benchmarks._ports import free_port
from tests._support import assert_same_weights

DEVICE = os.environ.get("RAYSYNC_TEST_DEVICE", "cuda")
GPU_SHARE = 0.2 if DEVICE == "cuda" else 0  # several receivers share the one GPU
TIMEOUT = 120.0

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(DEVICE == "cuda" and not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _model(seed: int, device: str) -> torch.nn.Module:
    """float32, bfloat16 and int64 weights, as a policy with a bf16 head and a step counter has."""
    torch.manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8))
    net[2].to(torch.bfloat16)
    net.register_buffer("steps", torch.tensor(seed, dtype=torch.int64))
    return net.to(device)


def _step(net: torch.nn.Module, k: int) -> None:
    with torch.no_grad():
        for p in net.parameters():
            p.add_(0.01 * k)
        net.steps.add_(1)


def _cpu(net: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().clone() for k, v in net.state_dict().items()}


def _receiver(hub_name: str, device: str, gpus: float) -> Any:
    @ray.remote(num_cpus=0, num_gpus=gpus)
    @raysync.synced_model("policy", hub=hub_name)
    class Receiver:
        def __init__(self) -> None:
            self.policy = _model(99, device)

        def state(self) -> tuple[int | None, dict[str, torch.Tensor], set[str], tuple[int, ...]]:
            """Version, weights (on the CPU, for the driver), the devices they are on, and where
            each weight's storage is."""
            sd = self.policy.state_dict()
            return (
                self.raysync_version(),
                {k: v.detach().cpu().clone() for k, v in sd.items()},
                {str(v.device.type) for v in sd.values()},
                tuple(v.data_ptr() for v in sd.values()),
            )

        def act(self, x: torch.Tensor) -> tuple[int | None, torch.Tensor]:
            with torch.no_grad():
                h = self.policy[1](self.policy[0](x.to(DEVICE)))
                return self.raysync_version(), self.policy[2](h.to(torch.bfloat16)).float().cpu()

    return Receiver.remote()


@pytest.fixture
def gpu_cluster(ray_start_regular: dict[str, Any]) -> None:
    if DEVICE == "cuda" and ray.cluster_resources().get("GPU", 0) < 1:
        pytest.skip("the test cluster has no GPU (ray.init did not find one)")


@pytest.mark.parametrize("transport", ["object_store", "nixl"])
def test_gpu_receivers_hold_every_version_bit_equal_on_the_gpu(
    gpu_cluster: None, hub_name: str, transport: str
) -> None:
    hub = raysync.connect(hub_name, transport=transport)
    try:
        receivers = [_receiver(hub_name, DEVICE, GPU_SHARE) for _ in range(2)]
        trainer = _model(0, DEVICE)
        x = torch.randn(5, 32)
        places: list[set[tuple[int, ...]]] = []
        for k in range(1, 5):
            _step(trainer, k)
            version = hub.push(trainer, wait=True, timeout=TIMEOUT)
            want = _cpu(trainer)
            states = ray.get([r.state.remote() for r in receivers], timeout=TIMEOUT)
            for held, weights, devices, _ in states:
                assert held == version
                assert devices == {DEVICE}
                assert_same_weights(weights, want)
            places.append({s[3] for s in states})
            with torch.no_grad():
                h = trainer[1](trainer[0](x.to(DEVICE)))
                expect = trainer[2](h.to(torch.bfloat16)).float().cpu()
            for held, out in ray.get([r.act.remote(x) for r in receivers], timeout=TIMEOUT):
                assert held == version and torch.equal(out, expect)
        # apply="copy" copies each version into the buffers the first one bound; NIXL receives
        # into a spare set on the same device and swaps it in (docs/api.md)
        if transport == "object_store":
            assert places[1] == places[2] == places[3]
        else:
            assert places[1] != places[2] and places[1] == places[3]
        assert hub.status()["subscribers"] and all(
            s["last_error"] is None for s in hub.status()["subscribers"]
        )
    finally:
        ray.kill(hub.actor)


def test_a_trainer_process_feeds_one_hub_after_another_over_nixl(gpu_cluster: None) -> None:
    """The second hub a GPU trainer process pushes to over NIXL gets the weights too, not zeros.

    Found on the first GPU run: the first hub's snapshot buffers were freed with its client
    while still registered with NIXL, the second hub's were allocated at the same addresses,
    and Ray read them through the stale registration (receivers held zeros, reported as
    applied). Registrations now end with the buffers' owner.
    """
    for round_ in range(2):
        hub_name = f"test-gpu-{round_}-{os.getpid()}-{time.monotonic_ns()}"
        hub = raysync.connect(hub_name, transport="nixl")
        try:
            receivers = [_receiver(hub_name, DEVICE, GPU_SHARE), _receiver(hub_name, "cpu", 0)]
            trainer = _model(round_ + 1, DEVICE)
            for k in range(1, 3):
                _step(trainer, k)
                version = hub.push(trainer, wait=True, timeout=TIMEOUT)
                for held, weights, _, _ in ray.get([r.state.remote() for r in receivers], timeout=TIMEOUT):
                    assert held == version
                    assert_same_weights(weights, _cpu(trainer))
            for r in receivers:
                ray.kill(r)
        finally:
            ray.kill(hub.actor)
        del hub, trainer
        gc.collect()


def test_a_cpu_trainer_feeds_gpu_receivers_and_a_gpu_trainer_cpu_ones(
    gpu_cluster: None, hub_name: str
) -> None:
    hub = raysync.connect(hub_name)
    try:
        on_gpu, on_cpu = _receiver(hub_name, DEVICE, GPU_SHARE), _receiver(hub_name, "cpu", 0)
        for k, where in enumerate(["cpu", DEVICE, "cpu"], start=1):
            trainer = _model(k, where)
            version = hub.push(trainer, wait=True, timeout=TIMEOUT)
            for receiver, device in ((on_gpu, DEVICE), (on_cpu, "cpu")):
                held, weights, devices, _ = ray.get(receiver.state.remote(), timeout=TIMEOUT)
                assert (held, devices) == (version, {device})
                assert_same_weights(weights, _cpu(trainer))
    finally:
        ray.kill(hub.actor)


class _GpuRank:
    """One rank of a sharded trainer whose shards live on the GPU (gloo group, CUDA device mesh).

    NCCL refuses two ranks on one GPU, so the group is gloo; the DTensors are built from each
    rank's local shard (``DTensor.from_local``), which needs no collective.
    """

    def __init__(self, rank: int, world: int, port: int, device: str) -> None:
        from torch.distributed.device_mesh import DeviceMesh

        join_gloo(rank, world, port, timeout_s=60.0)
        self.rank, self.world, self.device = rank, world, device
        self.mesh = DeviceMesh(device, list(range(world)))
        self.net: torch.nn.Module | None = None

    def make(self, seed: int) -> dict[str, torch.Tensor]:
        """The model of ``seed``: Shard(0) rows, Shard(1) uneven columns, a replicated bf16 bias;
        returns the whole weights (on the CPU) for the driver to compare with."""
        from torch.distributed.tensor import DTensor, Replicate, Shard

        g = torch.Generator().manual_seed(seed)
        whole = {
            "rows": torch.randn(6, 4, generator=g),
            "cols": torch.randn(3, 5, generator=g),
            "bias": torch.randn(4, generator=g).to(torch.bfloat16),
        }
        places = {"rows": Shard(0), "cols": Shard(1), "bias": Replicate()}
        net = torch.nn.Module()
        for name, full in whole.items():
            place = places[name]
            if isinstance(place, Shard):
                local = full.tensor_split(self.world, dim=place.dim)[self.rank].contiguous()
            else:
                local = full.clone()
            dt = DTensor.from_local(
                local.to(self.device),
                self.mesh,
                [place],
                run_check=False,
                shape=full.shape,
                stride=full.stride(),
            )
            setattr(net, name, torch.nn.Parameter(dt))
        self.net = net
        return whole

    def devices(self) -> set[str]:
        assert self.net is not None
        return {p.to_local().device.type for p in self.net.parameters()}

    def push(self, hub_name: str) -> int:
        assert self.net is not None
        return raysync.connect(hub_name).push(self.net, timeout=TIMEOUT)


def test_a_sharded_trainer_with_shards_on_the_gpu_publishes_whole_tensors(
    gpu_cluster: None, hub_name: str
) -> None:
    port = free_port()
    hub = raysync.connect(hub_name)
    cls = ray.remote(num_cpus=0, num_gpus=GPU_SHARE)(_GpuRank)
    ranks = [cls.remote(r, 2, port, DEVICE) for r in range(2)]
    try:
        receiver = _receiver_of_shards(hub_name)
        for seed in (1, 2):
            wholes = ray.get([r.make.remote(seed) for r in ranks], timeout=TIMEOUT)
            assert ray.get(ranks[0].devices.remote()) == {DEVICE}
            versions = ray.get([r.push.remote(hub_name) for r in ranks], timeout=TIMEOUT)
            assert versions[0] == versions[1]
            hub.wait(versions[0], timeout=TIMEOUT)
            held, weights, devices = ray.get(receiver.state.remote(), timeout=TIMEOUT)
            assert held == versions[0] and devices == {DEVICE}
            assert_same_weights(weights, wholes[0])
    finally:
        for r in ranks:
            ray.kill(r)
        ray.kill(hub.actor)


def _receiver_of_shards(hub_name: str) -> Any:
    @ray.remote(num_cpus=0, num_gpus=GPU_SHARE)
    @raysync.synced_model("policy", hub=hub_name)
    class Whole:
        def __init__(self) -> None:
            net = torch.nn.Module()
            net.rows = torch.nn.Parameter(torch.zeros(6, 4, device=DEVICE))
            net.cols = torch.nn.Parameter(torch.zeros(3, 5, device=DEVICE))
            net.bias = torch.nn.Parameter(torch.zeros(4, dtype=torch.bfloat16, device=DEVICE))
            self.policy = net

        def state(self) -> tuple[int | None, dict[str, torch.Tensor], set[str]]:
            sd = self.policy.state_dict()
            return (
                self.raysync_version(),
                {k: v.detach().cpu().clone() for k, v in sd.items()},
                {v.device.type for v in sd.values()},
            )

    return Whole.remote()
