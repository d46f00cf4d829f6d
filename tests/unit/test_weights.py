"""The data layer, without Ray: extract, layout, pack, validate, apply, read-only views."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from tensordict import TensorDict

import raysync
from raysync.core.bound import BoundModel
from raysync.core.codec import bucket_checksums, pack, stage_bucket, unpack, verify_checksums
from raysync.core.extract import extract_extra_state, extract_tensors, module_schema, to_tensordict
from raysync.core.layout import plan_layout, schema_of, validate
from raysync.core.readonly import ReadOnlyTensor
from tests._support import assert_same_weights, in_shared_memory


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


def test_a_modules_tensors_come_detached_sharing_its_memory_even_from_a_hook_that_does_not_detach() -> None:
    model = torch.nn.Linear(3, 2)

    def hook(module: torch.nn.Module, state: dict[str, torch.Tensor], prefix: str, local: object) -> None:
        state[prefix + "weight"] = module.weight  # the Parameter itself: it requires grad

    model.register_state_dict_post_hook(hook)
    with torch.no_grad():
        model.weight.mul_(3.0)
    got = extract_tensors(model)
    assert not any(t.requires_grad for t in got.values())
    assert got["weight"].data_ptr() == model.weight.data_ptr()  # no copy
    assert torch.equal(got["weight"], model.weight.detach()) and torch.equal(got["bias"], model.bias.detach())
    manifest = plan_layout(got)
    assert_same_weights(unpack(manifest, pack(got, manifest)), got)  # packable: numpy takes no grad


def test_key_order_is_canonical_whatever_the_insertion_order() -> None:
    a = {"b": torch.ones(3), "a": torch.zeros(2), "c": torch.ones(1)}
    b = {"c": torch.ones(1), "a": torch.zeros(2), "b": torch.ones(3)}
    assert plan_layout(extract_tensors(a)) == plan_layout(extract_tensors(b))


@pytest.mark.parametrize(
    "weights, needle",
    [
        ({}, "empty"),
        (torch.nn.ReLU(), "empty"),
        ({"w": torch.ones(1), "n": 3}, "'n' is of type int"),
        ({"w": [torch.ones(1)]}, "not a tensor"),
        ([torch.ones(1)], "cannot take weights from an object of type list"),
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
    store, buckets = in_shared_memory(pack(tensors, manifest))  # as the object store holds them
    BoundModel(dst, manifest, view=True).apply(buckets)
    assert isinstance(dst.weight, torch.nn.Parameter) and isinstance(dst.weight, ReadOnlyTensor)
    weight_entry = next(e for e in manifest.entries if e.key == "weight")
    held = buckets[0][weight_entry.index]
    store[held.ctypes.data - np.frombuffer(store, np.uint8).ctypes.data] ^= 0xFF  # the store changes...
    assert not torch.equal(dst.weight, src.weight)  # ... and so does the view: no copy made
    store[held.ctypes.data - np.frombuffer(store, np.uint8).ctypes.data] ^= 0xFF
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


_CASE4_VIEWS = {
    "T": lambda w: w.T,
    "reshape": lambda w: w.reshape(-1),
    "einsum_transpose": lambda w: torch.einsum("ij->ji", w),
    "broadcast_to": lambda w: torch.broadcast_to(w[:1], (4, 3)),
    "chunk": lambda w: torch.chunk(w, 2)[0],
    "unbind": lambda w: w.unbind(0)[1],
    "getitem": lambda w: w[1:, ::2],
    "aten_alias": lambda w: torch.ops.aten.alias(w),
    "detach_data": lambda w: w.detach().data,
    "contiguous": lambda w: w.contiguous(),
}


@pytest.mark.parametrize("view", sorted(_CASE4_VIEWS))
def test_case4_view_guard_views_of_weights_stay_read_only(view: str) -> None:
    """Case 4: skipping the alias check for ops that return new memory still wraps every view."""
    model = torch.nn.Linear(3, 4)
    _shared_view(model)
    out = _CASE4_VIEWS[view](model.weight)
    assert isinstance(out, ReadOnlyTensor)
    with pytest.raises(raysync.ReadOnlyWeightsError):
        out.add_(1)
    fresh = model.weight.detach() @ torch.ones(3)  # new memory: an ordinary tensor
    assert type(fresh) is torch.Tensor


def test_case6_verify_refuses_a_manifest_without_checksums() -> None:
    """Case 6: verifying a version pushed without checksums refuses it and names the fix."""
    tensors = {"w": torch.randn(10)}
    manifest = plan_layout(tensors)
    buckets = pack(tensors, manifest)
    with pytest.raises(raysync.ChecksumError, match=r"carries no checksums.*push\(\.\.\., checksum=True\)"):
        verify_checksums(manifest, buckets)
    with pytest.raises(raysync.ChecksumError, match="came over 'nixl'"):
        verify_checksums(manifest.with_transport("nixl"), buckets)


def test_to_tensordict_nests_dotted_keys() -> None:
    td = to_tensordict({"a.b": torch.ones(1), "a.c": torch.zeros(2), "d": torch.ones(3)})
    assert td["a", "c"].shape == (2,)
    assert isinstance(td, TensorDict)


def test_pack_is_zero_copy() -> None:
    t = torch.randn(4096)
    manifest = plan_layout({"t": t})
    (arr,) = pack({"t": t}, manifest)[0]
    assert isinstance(arr, np.ndarray) and arr.ctypes.data == t.data_ptr()


# ---------------------------------------------------------------------- issue 14 case 4: view-mode writes


def _shared_view(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Make ``model``'s weights read-only views of private read-only buffers (as the object store's).

    Returns the values they must keep (the views keep the buffers alive).
    """
    src = {k: v.clone() for k, v in extract_tensors(model).items()}
    with torch.no_grad():
        for t in src.values():
            if t.is_floating_point():
                t.add_(torch.randn_like(t))  # other values than the model's own
    manifest = plan_layout(src)
    buckets = [[a.copy() for a in bucket] for bucket in pack(src, manifest)]
    for bucket in buckets:
        for a in bucket:
            a.setflags(write=False)
    BoundModel(model, manifest, view=True).apply(buckets)
    for p in model.parameters():
        p.grad = torch.ones_like(p)  # as if a backward pass had run
    return src


def _net() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2))


_CASE4_WRITES = {
    # what optimizers with foreach=True run: a list of parameters as args[0]
    "foreach_add_list": lambda m: torch._foreach_add_(list(m.parameters()), 1.0),
    "foreach_add_tuple": lambda m: torch._foreach_add_(tuple(m.parameters()), 1.0),
    "foreach_mul_": lambda m: torch._foreach_mul_(list(m.parameters()), 0.5),
    "foreach_zero_": lambda m: torch._foreach_zero_(list(m.parameters())),
    "foreach_copy_": lambda m: torch._foreach_copy_(
        list(m.parameters()), [torch.zeros_like(p) for p in m.parameters()]
    ),
    "foreach_lerp_": lambda m: torch._foreach_lerp_(
        list(m.parameters()), [torch.zeros_like(p) for p in m.parameters()], 0.5
    ),
    # ATen ops called directly: an OpOverloadPacket and OpOverloads
    "aten_add_packet": lambda m: torch.ops.aten.add_(m[0].weight, 1),
    "aten_add_Tensor": lambda m: torch.ops.aten.add_.Tensor(m[0].weight, torch.ones(8, 4)),
    "aten_fill_Scalar": lambda m: torch.ops.aten.fill_.Scalar(m[0].weight, 0),
    "aten_fill_packet": lambda m: torch.ops.aten.fill_(m[0].weight, 0),
    "aten_copy_default": lambda m: torch.ops.aten.copy_.default(m[0].bias, torch.zeros(8)),
    "aten_index_put_": lambda m: torch.ops.aten.index_put_.default(
        m[0].bias, [torch.tensor([0])], torch.tensor([9.0])
    ),
    # optimizers
    "adam_foreach": lambda m: torch.optim.Adam(m.parameters(), foreach=True).step(),
    "adam_fused": lambda m: torch.optim.Adam(m.parameters(), fused=True).step(),
    "adamw_fused": lambda m: torch.optim.AdamW(m.parameters(), fused=True).step(),
    "sgd_foreach": lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, foreach=True).step(),
    "sgd_fused": lambda m: torch.optim.SGD(m.parameters(), lr=0.1, fused=True).step(),
    # batch norm's running statistics through the functional form
    "batch_norm_functional_train": lambda m: torch.nn.functional.batch_norm(
        torch.randn(4, 8), m[1].running_mean, m[1].running_var, training=True
    ),
    "batch_norm_builtin_train": lambda m: torch.batch_norm(
        torch.randn(4, 8), None, None, m[1].running_mean, m[1].running_var, True, 0.1, 1e-5, False
    ),
    # already refused before the fix: keep it so
    "add_": lambda m: m[0].weight.add_(1),
    "iadd": lambda m: m[0].weight.__iadd__(1),
    "batch_norm_module_train": lambda m: m.train()(torch.randn(4, 4)),
    "adam_default": lambda m: torch.optim.Adam(m.parameters()).step(),
    "out_tuple": lambda m: torch.max(torch.randn(8, 3), 1, out=(m[0].bias, torch.empty(8, dtype=torch.long))),
    "out_list": lambda m: torch.unbind_copy(torch.zeros(2, 8), out=[m[0].bias, torch.empty(8)]),
}


@pytest.mark.parametrize("write", sorted(_CASE4_WRITES))
def test_case4_view_guard_refuses_every_write(write: str) -> None:
    """Case 4: in-place writes through lists, ATen ops, foreach/fused optimizers are refused."""
    model = _net().eval()
    values = _shared_view(model)
    with pytest.raises(raysync.ReadOnlyWeightsError, match="apply='copy'"):
        _CASE4_WRITES[write](model)
    assert_same_weights(extract_tensors(model), values)


@pytest.mark.parametrize("how", ["numpy", "np_asarray", "numpy_of_view"])
def test_case4_view_guard_numpy_gives_a_read_only_array(how: str) -> None:
    """Case 4: ``.numpy()`` of a read-only weight is a non-writeable array: numpy raises ValueError."""
    model = _net().eval()
    values = _shared_view(model)
    w = model[0].weight
    array = {
        "numpy": lambda: w.detach().numpy(),
        "np_asarray": lambda: np.asarray(w.detach()),
        "numpy_of_view": lambda: w.detach()[1:].numpy(),
    }[how]()
    assert not array.flags.writeable
    assert np.array_equal(array[-1], values["0.weight"][-1].numpy())  # reading works
    with pytest.raises(ValueError, match="read-only"):
        array[:] = 0
    assert_same_weights(extract_tensors(model), values)


def test_case4_view_guard_lets_reads_and_out_of_place_ops_through() -> None:
    """Case 4: what only reads stays allowed (``int()``, ``~``, indexing, sort, out-of-place foreach)."""
    model = torch.nn.Linear(4, 3)
    model.register_buffer("mask", torch.tensor([True, False]))
    model.register_buffer("step", torch.tensor(7))
    values = _shared_view(model)
    assert int(model.step) == 7 and [10, 11, 12, 13, 14, 15, 16, 17][model.step] == 17
    assert (~model.mask).tolist() == [False, True]
    assert len(list(model.weight)) == 3  # iteration
    assert torch.equal(torch.sort(model.bias).values, values["bias"].sort().values)
    added = torch._foreach_add(list(model.parameters()), 1.0)  # new tensors: writable
    added[0].zero_()
    assert type(added[0]) is torch.Tensor
    plain = torch.empty(3)
    torch.add(model.bias, 1, out=plain)  # out= into an ordinary tensor
    torch._foreach_add_([plain], [model.bias])  # read-only tensors in a list that is only read
    plain[:] = model.bias  # ... or as the value of an assignment
    grads = [p.grad for p in model.parameters()]
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)  # writes gradients, not weights
    assert all(g is not None for g in grads)
    with torch.no_grad():
        out = model(torch.ones(2, 4))
    assert type(out) is torch.Tensor and out.shape == (2, 3)
    assert isinstance(model.weight.detach()[0], ReadOnlyTensor)  # views stay read-only
    assert_same_weights(extract_tensors(model), values)


# ---------------------------------------------------------------------- issue 14 case 13: tensor kinds


def _case13_refused() -> dict[str, tuple[object, str, str]]:
    """name -> (weights, the key the error names, a piece of the fix it gives)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # beta/deprecated-API notices from torch
        return {
            "sparse_coo": ({"w": torch.randn(3, 3).to_sparse(), "b": torch.ones(1)}, "'w'", "to_dense()"),
            "sparse_csr": ({"w": torch.randn(3, 3).to_sparse_csr()}, "'w'", "to_dense()"),
            "nested": (
                {"w": torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])},
                "'w'",
                "to_padded_tensor",
            ),
            "meta_dict": ({"w": torch.empty(3, device="meta")}, "'w'", "to_empty(device="),
            "meta_module": (torch.nn.Linear(4, 2, device="meta"), "'bias'", "to_empty(device="),
            "quantized": (
                {"q": torch.quantize_per_tensor(torch.randn(4), 0.1, 2, torch.qint8)},
                "'q'",
                "int_repr()",
            ),
        }


@pytest.mark.parametrize("kind", sorted(_case13_refused()))
def test_case13_unsupported_tensor_kinds_are_refused_naming_key_and_fix(kind: str) -> None:
    """Case 13b: sparse, nested, meta and quantized tensors get InvalidWeightsError, not a torch error."""
    weights, key, fix = _case13_refused()[kind]
    with pytest.raises(raysync.InvalidWeightsError) as info:
        extract_tensors(weights)
    assert key in str(info.value) and fix in str(info.value), str(info.value)


def test_case13_conjugate_and_negative_views_travel_as_their_values() -> None:
    """Case 13b: ``x.conj()``, ``x.conj().imag`` and ``torch._neg_view`` arrive bit-exact as values."""
    torch.manual_seed(3)
    z = torch.randn(5, dtype=torch.complex64)
    r = torch.randn(4, 3)
    weights = {"conj": z.conj(), "neg_imag": z.conj().imag, "neg": torch._neg_view(r), "plain": r}
    assert weights["conj"].is_conj() and weights["neg_imag"].is_neg() and weights["neg"].is_neg()
    expected = {k: v.clone().resolve_conj().resolve_neg() for k, v in weights.items()}
    assert torch.equal(expected["neg"], -r) and torch.equal(expected["conj"].imag, -z.imag)
    tensors = extract_tensors(weights)
    manifest = plan_layout(tensors)
    back = unpack(manifest, pack(tensors, manifest))
    assert_same_weights(back, expected)
    # pack() alone resolves them too (it is public)
    raw = dict(weights)
    assert_same_weights(unpack(manifest, pack(raw, manifest)), expected)


class _Tracker(torch.nn.Module):
    """A submodule with extra state (a dict) next to a buffer."""

    def __init__(self, fail_on: object = None) -> None:
        super().__init__()
        self.register_buffer("scale", torch.ones(3))
        self.counter: dict[str, object] = {"steps": 0}
        self.fail_on = fail_on

    def get_extra_state(self) -> dict[str, object]:
        return dict(self.counter)

    def set_extra_state(self, state: dict[str, object]) -> None:
        if state.get("steps") == self.fail_on:
            raise RuntimeError(f"refusing steps={self.fail_on}")
        self.counter = dict(state)


def _tracked(steps: int = 0, *, fail_on: object = None) -> torch.nn.Module:
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), _Tracker(fail_on), _Tracker(fail_on))
    with torch.no_grad():
        model[0].weight.fill_(float(steps))
    model[1].counter = {"steps": steps, "who": "first"}
    model[2].counter = {"steps": steps, "who": "second"}
    return model


def test_case13_extra_state_is_kept_apart_from_the_tensors() -> None:
    """Case 13a: ``_extra_state`` entries are not tensors to push, but extra state that travels."""
    model = _tracked(5)
    tensors = extract_tensors(model)
    assert list(tensors) == ["0.bias", "0.weight", "1.scale", "2.scale"]
    assert extract_extra_state(model) == {
        "1._extra_state": {"steps": 5, "who": "first"},
        "2._extra_state": {"steps": 5, "who": "second"},
    }
    assert module_schema(model) == schema_of(tensors)
    # The same from the module's state dict (nested or dotted).
    state = model.state_dict()
    assert list(extract_tensors(state)) == list(tensors)
    assert extract_extra_state(state) == extract_extra_state(model)
    assert extract_extra_state({"w": torch.ones(1)}) == {}
    # Extra state is not structure: the layout hash ignores it.
    manifest = plan_layout(tensors)
    with_state = manifest.with_extra_state(extract_extra_state(model))
    assert with_state.layout_hash == manifest.layout_hash
    assert with_state.extra_states() == extract_extra_state(model)
    with pytest.raises(raysync.InvalidWeightsError, match="cannot be pickled"):
        manifest.with_extra_state({"1._extra_state": lambda: 0})


@pytest.mark.parametrize("view", [False, True], ids=["copy", "view"])
def test_case13_bound_model_applies_extra_state_with_the_version(view: bool) -> None:
    """Case 13a: applying a version sets its extra state too, in copy and view mode."""
    dst = _tracked(0)
    for steps in (1, 2):
        src = _tracked(steps)
        tensors = extract_tensors(src)
        manifest = plan_layout(tensors).with_extra_state(extract_extra_state(src))
        bound = BoundModel(dst, manifest, view=view)
        bound.apply(pack(tensors, manifest), extra_state=manifest.extra_state)
        assert_same_weights(extract_tensors(dst), tensors)
        assert extract_extra_state(dst) == extract_extra_state(src)


def test_case13_extra_state_through_stage_swap_and_adopt() -> None:
    """Case 13a: the staged version's extra state is set by swap(); adopt() sets it too."""
    dst = _tracked(0)
    src = _tracked(3)
    tensors = extract_tensors(src)
    manifest = plan_layout(tensors).with_extra_state(extract_extra_state(src))
    bound = BoundModel(dst, manifest)
    buckets = dict(enumerate(pack(tensors, manifest)))
    bound.stage(buckets, ["v3"] * manifest.num_buckets, extra_state=manifest.extra_state)
    assert extract_extra_state(dst)["1._extra_state"]["steps"] == 0  # staged, not yet current
    bound.swap()
    assert extract_extra_state(dst) == extract_extra_state(src)
    assert_same_weights(extract_tensors(dst), tensors)
    src4 = _tracked(4)
    flat = [buf.clone() for buf in BoundModel(src4, manifest).buffers()]  # src4's bytes, laid out
    bound.adopt(flat, extra_state=manifest.with_extra_state(extract_extra_state(src4)).extra_state)
    assert extract_extra_state(dst) == extract_extra_state(src4)
    assert_same_weights(extract_tensors(dst), extract_tensors(src4))


def test_case13_failed_set_extra_state_changes_nothing() -> None:
    """Case 13a: if a set_extra_state raises, the others are put back and the tensors stay."""
    dst = _tracked(0, fail_on=7)
    before_tensors = {k: v.clone() for k, v in extract_tensors(dst).items()}
    before_state = extract_extra_state(dst)
    src = _tracked(7)
    src[1].counter = {"steps": 6, "who": "first"}  # the first one accepts, the second refuses
    tensors = extract_tensors(src)
    manifest = plan_layout(tensors).with_extra_state(extract_extra_state(src))
    with pytest.raises(RuntimeError, match="refusing steps=7"):
        BoundModel(dst, manifest).apply(pack(tensors, manifest), extra_state=manifest.extra_state)
    assert extract_extra_state(dst) == before_state
    assert_same_weights(extract_tensors(dst), before_tensors)
    # Extra state for a module the receiver lacks is a mismatch, found before anything changes.
    odd = manifest.with_extra_state({"9._extra_state": {"steps": 1}})
    with pytest.raises(raysync.WeightMismatchError, match=r"'9\._extra_state'"):
        BoundModel(dst, manifest).apply(pack(tensors, manifest), extra_state=odd.extra_state)
    assert extract_extra_state(dst) == before_state


def _bn_model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 2))


def test_a_bound_module_tells_which_buckets_were_changed_in_place_since_the_apply() -> None:
    """What ``raysync_modified_since()`` rests on: torch's version counters, read per tensor."""
    model, src = _bn_model(), _bn_model()
    tensors = extract_tensors(src)
    manifest = plan_layout(tensors, bucket_bytes=16)  # one bucket per tensor
    bn_buckets = sorted({e.bucket for e in manifest.entries if e.key.startswith("1.")})
    bound = BoundModel(model, manifest)
    ids = [f"v1:{b}" for b in range(manifest.num_buckets)]
    bound.apply(pack(tensors, manifest), ids)
    assert bound.written() == []  # raysync's own copy_ is no local change
    with torch.no_grad():
        model.eval()(torch.randn(3, 4))
    assert bound.written() == []  # eval mode writes nothing
    with torch.inference_mode():
        model.train()(torch.randn(3, 4))  # updates running_mean, running_var, num_batches_tracked
    # the whole BatchNorm, though only num_batches_tracked's write is counted by torch
    assert bound.written() == bn_buckets
    assert bound.needed(ids) == bn_buckets  # the same version offered again: those are taken again
    assert bound.needed(ids, written=False) == []
    bound.apply({b: pack(tensors, manifest)[b] for b in bn_buckets}, ids)
    assert bound.written() == []
    assert_same_weights(dict(model.state_dict()), dict(src.state_dict()))
    with torch.no_grad():
        model[2].weight.add_(1)  # an optimizer step, say
    assert bound.written() == sorted({e.bucket for e in manifest.entries if e.key.startswith("2.")})


def test_a_bucket_staged_through_one_buffer_holds_the_bytes_pack_gives() -> None:
    """GPU weights reach the object store a bucket at a time through one page-locked buffer
    (``stage_bucket``); each bucket's bytes and checksum equal :func:`pack`'s. On CPU the same
    function runs over a plain buffer."""
    g = torch.Generator().manual_seed(0)
    tensors = {
        "a": torch.randn(300, generator=g),
        "b": torch.randn(7, 5, generator=g).to(torch.bfloat16).t(),  # not contiguous
        "c": torch.arange(9, dtype=torch.int64),
        "d": torch.empty(0),
    }
    manifest = plan_layout(tensors, bucket_bytes=1024)
    assert manifest.num_buckets > 1
    packed = pack(tensors, manifest)
    staging = torch.full((max(manifest.bucket_nbytes),), 0xAB, dtype=torch.uint8)
    for b in range(manifest.num_buckets):
        staged = stage_bucket(tensors, manifest, b, staging)
        assert [x.tobytes() for x in staged] == [x.tobytes() for x in packed[b]]
        assert bucket_checksums([staged]) == bucket_checksums([packed[b]])
