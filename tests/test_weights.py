"""The data layer, without Ray: extract, layout, pack, validate, apply, read-only views."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tensordict import TensorDict

import raysync
from raysync.weights import (
    BoundModel,
    ReadOnlyTensor,
    bucket_checksums,
    extract_tensors,
    pack,
    plan_layout,
    to_tensordict,
    unpack,
    validate,
    verify_checksums,
)

from .conftest import assert_same_weights


def _mixed() -> dict[str, torch.Tensor]:
    torch.manual_seed(1)
    return {
        "f32": torch.randn(33, 7),
        "bf16": torch.randn(1000).bfloat16(),
        "f16": torch.randn(5).half(),
        "i64": torch.arange(-5, 600),
        "u8": torch.randint(0, 255, (3, 3), dtype=torch.uint8),
        "flag": torch.tensor([True, False, True]),
        "scalar": torch.tensor(3.5, dtype=torch.float64),
        "empty": torch.zeros(0, 4),
        "nan": torch.tensor([float("nan"), -0.0, float("inf")]),
    }


def test_every_dtype_round_trips_bit_exactly() -> None:
    tensors = _mixed()
    manifest = plan_layout(tensors)
    back = unpack(manifest, pack(tensors, manifest))
    assert_same_weights(back, tensors)


def test_extract_accepts_module_tensordict_nested_and_dotted_dicts() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.BatchNorm1d(3))
    from_module = extract_tensors(model)
    assert list(from_module) == sorted(model.state_dict())  # parameters and buffers, sorted
    assert "1.running_mean" in from_module and "1.num_batches_tracked" in from_module
    nested = {"a": {"b": torch.ones(2)}, "c.d": torch.zeros(1)}
    assert list(extract_tensors(nested)) == ["a.b", "c.d"]
    td = TensorDict({"x": {"y": torch.ones(2)}, "z": torch.zeros(3)}, batch_size=[])
    assert list(extract_tensors(td)) == ["x.y", "z"]


def test_key_order_is_canonical_whatever_the_insertion_order() -> None:
    a = {"b": torch.ones(3), "a": torch.zeros(2), "c": torch.ones(1)}
    b = {"c": torch.ones(1), "a": torch.zeros(2), "b": torch.ones(3)}
    assert plan_layout(extract_tensors(a)) == plan_layout(extract_tensors(b))


@pytest.mark.parametrize(
    "weights, needle",
    [
        ({}, "empty"),
        (torch.nn.ReLU(), "empty"),
        ({"w": torch.ones(1), "n": 3}, "'n' is a int"),
        ({"w": [torch.ones(1)]}, "not a tensor"),
        ([torch.ones(1)], "cannot take weights from a list"),
    ],
)
def test_bad_weights_get_a_clear_error(weights: object, needle: str) -> None:
    with pytest.raises(raysync.InvalidWeightsError, match=needle):
        extract_tensors(weights)


def test_buckets_split_at_the_configured_size_and_cover_every_tensor() -> None:
    tensors = {f"t{i}": torch.zeros(1024) for i in range(10)}  # 4 KiB each
    manifest = plan_layout(tensors, bucket_bytes=3 * 4096)
    assert manifest.num_buckets == 4
    assert sorted(manifest.keys()) == sorted(tensors)
    for b in range(manifest.num_buckets):
        entries = manifest.bucket_entries(b)
        assert sum(e.nbytes for e in entries) <= 3 * 4096
        ends = [e.offset + e.nbytes for e in entries]
        assert all(e2.offset >= end for e2, end in zip(entries[1:], ends[:-1], strict=True))  # no overlap


def test_layout_hash_changes_only_with_structure() -> None:
    a = plan_layout({"w": torch.zeros(4, 4), "b": torch.zeros(4)})
    same = plan_layout({"w": torch.ones(4, 4), "b": torch.randn(4)})
    reshaped = plan_layout({"w": torch.zeros(2, 8), "b": torch.zeros(4)})
    retyped = plan_layout({"w": torch.zeros(4, 4).double(), "b": torch.zeros(4)})
    assert a.layout_hash == same.layout_hash
    assert len({a.layout_hash, reshaped.layout_hash, retyped.layout_hash}) == 3


def test_validate_lists_every_problem_at_once() -> None:
    manifest = plan_layout(
        {"a": torch.zeros(2), "b": torch.zeros(3), "c": torch.zeros(1), "x": torch.zeros(1)}
    )
    model = {"a": ((2,), "float32"), "b": ((4,), "float32"), "c": ((1,), "int64"), "m": ((1,), "float32")}
    with pytest.raises(raysync.WeightMismatchError) as info:
        validate(manifest, model)
    err = info.value
    assert err.missing == ["m"] and err.unexpected == ["x"]
    assert err.shape_mismatch == {"b": ((3,), (4,))}
    assert err.dtype_mismatch == {"c": ("float32", "int64")}
    for needle in ("'m'", "'x'", "b: pushed (3,)", "c: pushed float32"):
        assert needle in str(err)


def test_bound_model_applies_in_place_and_keeps_parameter_objects() -> None:
    dst = torch.nn.Sequential(torch.nn.Linear(8, 600), torch.nn.BatchNorm1d(600)).to(torch.bfloat16)
    src = torch.nn.Sequential(torch.nn.Linear(8, 600), torch.nn.BatchNorm1d(600)).to(torch.bfloat16)
    with torch.no_grad():
        src[1].running_mean.normal_()
    before = [id(p) for p in dst.parameters()]
    tensors = extract_tensors(src)
    manifest = plan_layout(tensors)
    bound = BoundModel(dst, manifest)
    bound.apply(pack(tensors, manifest))
    assert [id(p) for p in dst.parameters()] == before
    assert_same_weights(dst.state_dict(), src.state_dict())
    assert all(p.requires_grad for p in dst.parameters())  # still trainable


def test_view_mode_shares_memory_and_refuses_in_place_writes() -> None:
    src = torch.nn.Linear(4, 3)
    dst = torch.nn.Linear(4, 3)
    tensors = extract_tensors(src)
    manifest = plan_layout(tensors)
    buckets = pack(tensors, manifest)
    BoundModel(dst, manifest, view=True).apply(buckets)
    assert isinstance(dst.weight, torch.nn.Parameter) and isinstance(dst.weight, ReadOnlyTensor)
    weight_entry = next(e for e in manifest.entries if e.key == "weight")
    assert dst.weight.data_ptr() == buckets[0][weight_entry.index].ctypes.data  # no copy made
    assert torch.equal(dst(torch.ones(1, 4)), src(torch.ones(1, 4)))
    writes = [
        lambda: dst.weight.add_(1),
        lambda: dst.weight.data.mul_(2),
        lambda: dst.weight.detach().zero_(),
        lambda: dst.weight[0].fill_(3),
        lambda: dst.weight.__setitem__(0, 1.0),
        lambda: torch.add(dst.weight, 1, out=dst.weight),
        lambda: dst.bias.copy_(torch.zeros(3)),
    ]
    for write in writes:
        with pytest.raises(raysync.ReadOnlyWeightsError, match="apply='copy'"):
            write()
    assert_same_weights(dst.state_dict(), src.state_dict())  # nothing got through
    out = dst.weight * 2  # ordinary ops give ordinary tensors
    assert type(out) is torch.Tensor


def test_checksums_catch_a_flipped_byte() -> None:
    tensors = {"w": torch.randn(1000)}
    manifest = plan_layout(tensors)
    buckets = pack(tensors, manifest)
    manifest = manifest.with_checksums(bucket_checksums(buckets))
    verify_checksums(manifest, buckets)
    corrupt = [[a.copy() for a in b] for b in buckets]
    corrupt[0][0][17] ^= 0xFF
    with pytest.raises(raysync.ChecksumError, match="bucket"):
        verify_checksums(manifest, corrupt)


def test_to_tensordict_nests_dotted_keys() -> None:
    td = to_tensordict({"a.b": torch.ones(1), "a.c": torch.zeros(2), "d": torch.ones(3)})
    assert td["a", "c"].shape == (2,)
    assert isinstance(td, TensorDict)


def test_pack_is_zero_copy() -> None:
    t = torch.randn(4096)
    manifest = plan_layout({"t": t})
    (arr,) = pack({"t": t}, manifest)[0]
    assert isinstance(arr, np.ndarray) and arr.ctypes.data == t.data_ptr()
