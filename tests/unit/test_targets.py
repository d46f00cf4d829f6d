"""Targets without Ray: the module target and the (name, tensor) loader, through commit."""

from __future__ import annotations

import pytest
import torch

import raysync
from raysync.core.codec import pack
from raysync.core.extract import extract_tensors
from raysync.core.layout import plan_layout, validate
from raysync.receivers import pipeline
from raysync.receivers.target import Incoming, ModuleTarget, Target, is_target
from tests._support import assert_same_weights, small_policy


class Engine:
    """A stand-in inference engine: parameters by name, filled by ``load_weights``."""

    def __init__(self, seed: int = 0) -> None:
        self.params = {k: v.clone() for k, v in small_policy(seed).state_dict().items()}
        self.calls: list[list[str]] = []

    def load_weights(self, weights: object) -> None:
        names = []
        for name, tensor in weights:  # type: ignore[attr-defined]
            self.params[name].copy_(tensor)
            names.append(name)
        self.calls.append(names)


def _version(seed: int, bucket_bytes: int | None = None) -> tuple[dict[str, torch.Tensor], Incoming]:
    tensors = extract_tensors(small_policy(seed))
    manifest = plan_layout(tensors, bucket_bytes=bucket_bytes) if bucket_bytes else plan_layout(tensors)
    buckets = dict(enumerate(pack(tensors, manifest)))
    ids = [f"{seed}-{b}" for b in range(manifest.num_buckets)]
    return tensors, Incoming(seed, manifest, ids, buckets)


def test_a_loader_takes_a_version_whole_and_reports_it() -> None:
    engine = Engine()
    loader = raysync.WeightsLoader(engine.load_weights, expected=engine.params)
    assert isinstance(loader, Target) and is_target(loader) and not is_target(small_policy(0))
    tensors, incoming = _version(1)
    loader.check(incoming.manifest)
    assert loader.needed(incoming.manifest, incoming.ids) == list(range(incoming.manifest.num_buckets))
    loader.commit(incoming)
    assert loader.version == 1
    assert_same_weights(engine.params, tensors)
    assert loader.needed(incoming.manifest, incoming.ids) == []  # holds every bucket


def test_a_loader_refuses_a_misfit_naming_each_tensor() -> None:
    engine = Engine()
    loader = raysync.WeightsLoader(engine.load_weights, expected=engine.params)
    other = plan_layout(extract_tensors(small_policy(1, out=3)))
    with pytest.raises(raysync.WeightMismatchError, match=r"shape mismatch 2\.weight") as info:
        loader.check(other)
    assert set(info.value.shape_mismatch) == {"2.weight", "2.bias"}
    unknown = plan_layout({**extract_tensors(small_policy(1)), "extra": torch.zeros(2)})
    with pytest.raises(raysync.WeightMismatchError, match=r"unknown.*extra"):
        loader.check(unknown)
    only_first = raysync.WeightsLoader(
        engine.load_weights, expected=lambda name, shape, dtype: name[0] == "0"
    )
    with pytest.raises(raysync.WeightMismatchError, match=r"refused by expected\(\).*2\.bias"):
        only_first.check(other)
    assert engine.calls == []


def test_a_loader_whose_load_raises_holds_no_version() -> None:
    def broken(weights: object) -> None:
        raise RuntimeError("engine busy")

    loader = raysync.WeightsLoader(broken)
    _, incoming = _version(1)
    with pytest.raises(RuntimeError):
        loader.commit(incoming)
    assert loader.version is None and not loader.intact()


def test_the_module_target_commits_only_what_changed() -> None:
    module = small_policy(0)
    target = ModuleTarget(module)
    tensors, incoming = _version(1, bucket_bytes=256)
    target.check(incoming.manifest)
    assert pipeline.commit(target, 1, incoming.manifest, incoming.ids, incoming.buckets) >= 0
    assert_same_weights(module.state_dict(), tensors)
    assert target.needed(incoming.manifest, incoming.ids) == []
    assert target.intact()


def test_incoming_hands_out_read_only_views_and_byte_ranges() -> None:
    tensors, incoming = _version(2)
    names = incoming.names()
    assert names == sorted(tensors)
    t = incoming.tensor("0.weight")
    assert torch.equal(t, tensors["0.weight"])
    with pytest.raises(raysync.ReadOnlyWeightsError):
        t.add_(1)
    assert incoming.raw("0.bias").nbytes == tensors["0.bias"].numel() * 4


def test_one_checker_names_every_misfit_of_a_loader_and_an_engine_at_once() -> None:
    """A loader's or an engine's check lists every misfit of a version in one error, as a module's does."""
    pushed = {"w": torch.zeros(3), "n": torch.zeros(2, dtype=torch.int64), "extra": torch.zeros(1)}
    manifest = plan_layout(pushed)
    held = {"w": ((4,), None), "n": ((2,), None), "unpushed": ((1,), None)}  # an engine's: shapes only
    with pytest.raises(raysync.WeightMismatchError) as info:
        validate(manifest, held, who="the engine", partial=True, floating=True, extra_state=False)
    err = info.value
    assert "weights do not match the engine" in str(err)
    assert err.unexpected == ["extra"] and err.missing == []  # a partial receiver misses nothing
    assert err.shape_mismatch == {"w": ((3,), (4,))}
    assert err.dtype_mismatch == {"n": ("int64", "a floating dtype")}
    loader = raysync.WeightsLoader(lambda weights: None, expected={"w": torch.zeros(4)}, name="engine")
    with pytest.raises(raysync.WeightMismatchError) as both:
        loader.check(manifest)
    assert set(both.value.unexpected) == {"n", "extra"} and set(both.value.shape_mismatch) == {"w"}
