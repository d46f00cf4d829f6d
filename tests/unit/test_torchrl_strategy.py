"""WeightStrategy with extra state (torchrl's ``__extra_state__``), weightless modules, torchrl attributes."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import pytest
import torch

pytest.importorskip("tensordict")

import raysync
from raysync import schemes


class _Stats(torch.nn.Module):
    """Running statistics kept outside parameters and buffers (as torchrl's VecNormV2)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(3, 3)
        self.mean = torch.zeros(3)
        self.count = torch.tensor(0)

    def get_extra_state(self) -> OrderedDict[str, torch.Tensor]:
        return OrderedDict(mean=self.mean.clone(), count=self.count.clone())

    def set_extra_state(self, state: Any) -> None:
        self.mean = state["mean"]
        self.count = state["count"]


def _src(mean: float, count: int) -> _Stats:
    src = _Stats()
    src.mean.fill_(mean)
    src.count.fill_(count)
    return src


def test_tensordict_extract_carries_extra_state_as_torchrl_does() -> None:
    strategy = schemes.WeightStrategy("tensordict")
    weights = strategy.extract_weights(_src(4.0, 7))
    assert set(weights.keys()) == {"linear", "__extra_state__"}
    assert torch.equal(weights["__extra_state__", "mean"], torch.full((3,), 4.0))
    assert "__extra_state__" not in strategy.extract_weights(torch.nn.Linear(2, 2)).keys()
    flat = schemes.WeightStrategy("state_dict").extract_weights(_src(1.0, 1))
    assert "_extra_state" in flat and "linear.weight" in flat


@pytest.mark.parametrize("inplace", [True, False])
def test_apply_restores_extra_state_and_leaves_the_weights_alone(inplace: bool) -> None:
    strategy = schemes.WeightStrategy("tensordict")
    src = _src(9.0, 5)
    weights = strategy.extract_weights(src)
    dst = _Stats()
    strategy.apply_weights(dst, weights, inplace=inplace)
    assert torch.equal(dst.mean, torch.full((3,), 9.0)) and int(dst.count) == 5
    torch.testing.assert_close(dst.linear.weight, src.linear.weight)
    dst.mean.zero_()  # the module's state is its own: applying again restores it
    strategy.apply_weights(dst, weights, inplace=inplace)
    assert "__extra_state__" in weights.keys()
    assert torch.equal(dst.mean, torch.full((3,), 9.0))


def test_extra_state_for_a_module_without_it_is_refused_whole() -> None:
    strategy = schemes.WeightStrategy("tensordict")
    weights = strategy.extract_weights(_src(2.0, 2))
    plain = torch.nn.Module()
    plain.linear = torch.nn.Linear(3, 3)
    before = plain.linear.weight.detach().clone()
    with pytest.raises(raysync.WeightMismatchError, match="extra state"):
        strategy.apply_weights(plain, weights)
    assert torch.equal(plain.linear.weight, before)


def test_a_weightless_module_gets_memory_from_the_first_version() -> None:
    src = torch.nn.Linear(3, 2)
    with torch.device("meta"):
        dst = torch.nn.Linear(3, 2)
    schemes.WeightStrategy().apply_weights(dst, src)
    assert dst.weight.device.type == "cpu"
    torch.testing.assert_close(dst(torch.ones(1, 3)), src(torch.ones(1, 3)))


def test_torchrl_attributes() -> None:
    scheme = schemes.SharedMemWeightSyncScheme("tensordict", False, True, timeout=5)
    assert (scheme.strategy_str, scheme.sync, scheme.per_worker_weights) == ("tensordict", False, True)
    assert not scheme.synchronized_on_sender and scheme.context is None and scheme.model is None

    class Context:
        def __init__(self) -> None:
            self.policy = torch.nn.Linear(2, 2)

    context = Context()
    none = schemes.NoWeightSyncScheme()
    none.init_on_sender(model_id="policy", context=context)
    assert none.context is context and none.model is context.policy
    none.connect()
    assert none.synchronized_on_sender
    none.send(torch.nn.Linear(2, 2))  # a no-op, as torchrl's
    assert schemes.RayWeightSyncScheme("tensordict", "gloo")._backend == "gloo"
    worker = schemes.NoWeightSyncScheme()
    with pytest.raises(ValueError, match="policy_factory"):
        with torch.device("meta"):
            meta = torch.nn.Linear(2, 2)
        worker.init_on_receiver(model_id="policy", model=meta, worker_idx=0)
    mp = schemes.MultiProcessWeightSyncScheme()
    with pytest.raises(ValueError, match="pipe="):
        mp.init_on_receiver(model_id="policy", model=torch.nn.Linear(2, 2), worker_idx=3)


def test_process_scheme_takes_torchrl_params_map() -> None:
    from tensordict import TensorDict

    weights = TensorDict.from_module(torch.nn.Linear(2, 2)).data
    scheme = schemes.SharedMemWeightSyncScheme()
    scheme.init_on_sender(params_map={0: weights, 1: weights, 2: weights})  # torchrl's pre-init
    assert sorted(scheme.get_sender().transports) == [0, 1, 2]  # one pipe per worker, made here
    assert scheme.model is weights
    scheme.shutdown()


def test_non_persistent_buffers_are_carried_only_when_asked() -> None:
    """What HubWeightSyncScheme's workers bind with: parameters, buffers and non-persistent buffers
    (``TensorDict.from_module``'s keys); the default binding keeps the state dict's keys."""
    from tensordict import TensorDict

    from raysync.core.bound import BoundModel
    from raysync.core.extract import extract_tensors, module_schema
    from raysync.core.layout import plan_layout
    from raysync.torchrl.strategy import applier_for, apply_tensors

    def make(scale: float) -> torch.nn.Module:
        module = torch.nn.Linear(3, 2)
        module.register_buffer("scale", torch.full((2,), scale), persistent=False)
        return module

    src = make(3.0)
    full = extract_tensors(src, non_persistent=True)
    assert sorted(full) == sorted(TensorDict.from_module(src).keys()) == ["bias", "scale", "weight"]
    assert "scale" not in module_schema(src) and "scale" in module_schema(src, non_persistent=True)
    with torch.device("meta"):
        dst = make(0.0)  # a worker's weightless policy: the buffer too
    apply_tensors(applier_for(dst, non_persistent=True), full)
    assert not any(t.is_meta for t in (*dst.parameters(), *dst.buffers()))
    assert torch.equal(dst.scale, src.scale) and torch.equal(dst.weight, src.weight)
    with pytest.raises(raysync.WeightMismatchError, match="unexpected keys \\['scale'\\]"):
        BoundModel(make(0.0), plan_layout(full))  # the default (e.g. @synced_model): state dict keys


@pytest.mark.parametrize("kind", ["state_dict", "tensordict"])
def test_a_state_dict_or_tensordict_destination_takes_versions_whole_through_its_target(kind: str) -> None:
    """Plain weights are a target like a module's: checked before any write, copied into in place."""
    from tensordict import TensorDict

    from raysync.core.codec import allocate, write
    from raysync.core.layout import plan_layout
    from raysync.torchrl.strategy import applier_for, raise_failed

    src = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    held = {k: torch.zeros_like(v) for k, v in src.state_dict().items()}
    dest: Any = held if kind == "state_dict" else TensorDict(held, batch_size=[]).unflatten_keys(".")
    before = {k: v.data_ptr() for k, v in held.items()}
    strategy = raysync.torchrl.WeightStrategy(extract_as="state_dict")
    strategy.apply_weights(dest, src)
    for key, value in src.state_dict().items():
        assert torch.equal(held[key], value), key
    assert {k: v.data_ptr() for k, v in held.items()} == before  # copied into, never replaced

    misfit = {k: v.clone() for k, v in src.state_dict().items()} | {"1.bias": torch.ones(3)}
    with pytest.raises(raysync.WeightMismatchError, match=r"1\.bias"):
        strategy.apply_weights(dest, misfit)
    for key, value in src.state_dict().items():
        assert torch.equal(held[key], value), key  # nothing of the refused version was written

    # Out of flat buckets (a shared snapshot), as torchrl's shared-memory transport hands them.
    newer = {k: v + 1 for k, v in src.state_dict().items()}
    manifest = plan_layout(newer)
    flat = allocate(manifest)
    write(newer, manifest, flat)
    raise_failed(applier_for(dest).from_flat(manifest, flat, adopt=False))
    for key, value in newer.items():
        assert torch.equal(held[key], value), key
    assert {k: v.data_ptr() for k, v in held.items()} == before


def test_a_module_adopts_a_kept_snapshot_and_holds_the_version_it_reports() -> None:
    """A transport that keeps its snapshot (torchrl's shared memory): the module's tensors point into
    it (no copy), through the receiver pipeline, which then holds that version; a copy does not."""
    from raysync.core.codec import allocate, write
    from raysync.core.layout import plan_layout
    from raysync.torchrl.strategy import applier_for, raise_failed

    src, dst = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)
    applier = applier_for(dst)
    assert applier_for(dst) is applier  # one pipeline per module: its binding is reused
    manifest = plan_layout(src.state_dict())
    flat = allocate(manifest)
    write(src.state_dict(), manifest, flat)
    raise_failed(applier.from_flat(manifest, flat, adopt=True))
    assert applier.version == 1
    lo, hi = flat[0].data_ptr(), flat[0].data_ptr() + flat[0].numel()
    assert all(lo <= p.data_ptr() < hi for p in dst.parameters())  # adopted, not copied
    assert torch.equal(dst.weight, src.weight) and torch.equal(dst.bias, src.bias)

    other = torch.nn.Linear(3, 2)
    raise_failed(applier_for(other).from_flat(manifest, flat, adopt=False))
    assert not any(lo <= p.data_ptr() < hi for p in other.parameters())  # copied into its own
    assert torch.equal(other.weight, src.weight)

    misfit = plan_layout(torch.nn.Linear(4, 2).state_dict())
    with pytest.raises(raysync.WeightMismatchError):
        raise_failed(applier.from_flat(misfit, allocate(misfit), adopt=True))
    assert applier.version == 1 and torch.equal(dst.weight, src.weight)


def test_a_scheme_version_goes_through_the_object_store_path_and_never_starts_ray() -> None:
    """RayWeightSyncScheme's one put per version is the object-store data path's snapshot: without
    Ray running it refuses, as a hub push does, instead of starting a cluster."""
    import ray

    from raysync.torchrl.ray_transport import snapshot

    if ray.is_initialized():
        pytest.skip("Ray runs in this process")
    with pytest.raises(raysync.RayNotRunningError, match="push"):
        snapshot(torch.nn.Linear(2, 2))
    assert not ray.is_initialized()
