"""A sharded trainer's ranks for tests/integration/test_sharded.py: Ray actors in one gloo group.

Each :class:`Rank` joins a gloo process group over TCP and a 1-D CPU device mesh, holds
:class:`Net` with its parameters as ``DTensor``\\ s (``distribute_tensor``: Shard(0) even,
Shard(1) uneven, Shard(0) uneven, Replicate; a plain buffer), and pushes it with the same
``hub.push(model)`` a single trainer calls.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from benchmarks._harness import join_gloo

PLACES = {"rows": ("shard", 0), "cols": ("shard", 1), "odd": ("shard", 0), "rep": ("replicate", None)}
# Over a 2 x 2 mesh: sharded along both mesh dimensions (two tensor dimensions, or one twice: nested
# uneven chunks), sharded along one and replicated along the other, replicated along both.
PLACES_2D = {
    "rows": (("shard", 0), ("shard", 1)),
    "cols": (("replicate", None), ("shard", 1)),
    "odd": (("shard", 0), ("shard", 0)),
    "rep": (("replicate", None), ("replicate", None)),
}


class Net(torch.nn.Module):
    """Parameters whose shards over 2 ranks are even, uneven along dim 1, uneven along dim 0, replicated."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.rows = torch.nn.Parameter(torch.randn(6, 4, generator=g))
        self.cols = torch.nn.Parameter(torch.randn(3, 5, generator=g))
        self.odd = torch.nn.Parameter(torch.randn(5, generator=g).to(torch.float64))
        self.rep = torch.nn.Parameter(torch.randn(2, 2, generator=g).to(torch.bfloat16))
        self.register_buffer("steps", torch.tensor(seed, dtype=torch.int64))


def mlp(seed: int) -> torch.nn.Module:
    """The FSDP2 test's model (7 and 3 rows: uneven shards over 2 ranks)."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))


class Rank:
    """One rank of the trainer (wrapped in ``ray.remote`` by the test)."""

    def __init__(self, rank: int, world: int, port: int, mesh_shape: tuple[int, ...] | None = None) -> None:
        from torch.distributed.device_mesh import init_device_mesh

        join_gloo(rank, world, port, timeout_s=60.0)
        self.rank = rank
        self.mesh = init_device_mesh("cpu", mesh_shape or (world,))
        self.net: Net | None = None
        self.hubs: dict[str, Any] = {}  # one client per hub, as a trainer keeps

    def make(self, seed: int) -> None:
        """A fresh model from ``seed``, its parameters distributed over the mesh."""
        from torch.distributed.tensor import Replicate, Shard, distribute_tensor

        net = Net(seed)
        places = PLACES_2D if self.mesh.ndim == 2 else {k: (v,) for k, v in PLACES.items()}
        for name, per_dim in places.items():
            full = getattr(net, name).detach()
            placements = [Shard(dim) if kind == "shard" else Replicate() for kind, dim in per_dim]
            setattr(net, name, torch.nn.Parameter(distribute_tensor(full, self.mesh, placements)))
        self.net = net

    def make_fsdp(self, seed: int) -> None:
        """A small MLP under FSDP2 (``fully_shard``: each parameter Shard(0), uneven), trained one step."""
        from torch.distributed.fsdp import fully_shard

        net = mlp(seed)
        fully_shard(net, mesh=self.mesh)
        g = torch.Generator().manual_seed(seed + self.rank)
        net(torch.randn(4, 5, generator=g)).square().sum().backward()
        torch.optim.SGD(net.parameters(), lr=0.1).step()
        self.net = net  # type: ignore[assignment]

    def make_policy(self, bias: float) -> None:
        """The torchrl tests' constant policy (every action ``bias``) under FSDP2: one output row, so
        rank 0 holds all of each parameter and rank 1 an empty shard."""
        from torch.distributed.fsdp import fully_shard

        from tests.integration._torchrl_policies import constant_policy

        net = constant_policy(bias)
        fully_shard(net, mesh=self.mesh)
        self.net = net  # type: ignore[assignment]

    def set_bias(self, bias: float) -> None:
        """Every action of :meth:`make_policy`'s policy becomes ``bias``, in place on each shard."""
        assert self.net is not None
        with torch.no_grad():
            for name, p in self.net.named_parameters():
                p.to_local().fill_(bias if name.endswith("bias") else 0.0)

    def step(self, seed: int) -> None:
        """Change the weights in place, as a training step would (replicas stay equal)."""
        assert self.net is not None
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name in PLACES:
                local = getattr(self.net, name).to_local()
                local.add_(torch.randn(local.shape, generator=g).to(local.dtype))
            self.net.steps.add_(1)

    def bump(self, key: str, by: float) -> None:
        """Add ``by`` to one tensor's local shard, in place."""
        assert self.net is not None
        with torch.no_grad():
            getattr(self.net, key).to_local().add_(by)

    def full(self) -> dict[str, torch.Tensor]:
        """Every weight whole (``full_tensor()``: a collective, so every rank must call it)."""
        assert self.net is not None
        out = {}
        for key, t in self.net.state_dict().items():
            out[key] = (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()
        return out

    def local_nbytes(self) -> int:
        """Bytes of this rank's local shards."""
        assert self.net is not None
        return sum(p.to_local().nbytes for p in self.net.parameters())

    def push(
        self,
        hub_name: str,
        timeout: float = 30.0,
        extra: bool = False,
        model_id: str = "policy",
        wait: bool = False,
        checksum: bool = False,
        **opts: Any,
    ) -> tuple[int, dict[str, Any]]:
        """``hub.push(model, **opts)`` on this rank; the version and the push's stats."""
        import raysync

        assert self.net is not None
        if extra:  # this rank's model has a tensor the others lack
            self.net.register_buffer("only_here", torch.zeros(2))
        hub = self.hubs.get(hub_name) or self.hubs.setdefault(hub_name, raysync.connect(hub_name))
        try:
            version = hub.push(self.net, model_id, timeout=timeout, wait=wait, checksum=checksum, **opts)
        finally:
            if extra:
                del self.net.only_here
        return version, dict(hub.last_push)

    def latest(self, hub_name: str, model_id: str = "policy") -> int | None:
        """``hub.latest()`` on this rank: a query, so its parts posted without waiting are at the hub."""
        import raysync

        hub = self.hubs.get(hub_name) or self.hubs.setdefault(hub_name, raysync.connect(hub_name))
        return hub.latest(model_id)

    def wait(self, hub_name: str, version: int, timeout: float = 30.0, model_id: str = "policy") -> None:
        """``hub.wait(version)`` on this rank (after a hub restart: it offers its part again)."""
        import raysync

        hub = self.hubs.get(hub_name) or self.hubs.setdefault(hub_name, raysync.connect(hub_name))
        hub.wait(version, model_id, timeout=timeout)

    def die(self) -> None:
        """Exit the process at once, as a crashed rank does."""
        os._exit(1)


def process_rank(rank: int, world: int, port: int, address: str, hub_name: str, out: Any, done: Any) -> None:
    """A rank as a plain torch.distributed process (as torchrun starts it) that joins Ray to push.

    Puts ``("ok", version, full weights)`` or ``("err", message)`` on ``out``, then stays (its
    shards live in the object store as long as it does) until ``done`` is set. It leaves the
    process group and Ray, then exits without the interpreter's teardown (seconds of CPU with
    torch loaded, for each of the 4 processes, which the test would wait for).
    """
    import ray

    try:
        ray.init(address=address, logging_level="error", log_to_driver=False)
        me = Rank(rank, world, port)
        me.make(0)
        me.step(11)
        version, _ = me.push(hub_name)
        full = me.full()  # a collective: both ranks
        out.put(("ok", version, full if rank == 0 else {}))
        done.wait(120)
    except Exception as err:  # the test reads it
        out.put(("err", f"{type(err).__name__}: {err}"))
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
        ray.shutdown()
        out.close()
        out.join_thread()  # what it put is in the pipe
        os._exit(0)
