"""The sparse delta encoding (``delta="sparse"``): a changed bucket as a patch, rebuilt bit for bit."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from raysync.client.delta import delta_mode
from raysync.core.checksums import bucket_checksums
from raysync.core.codec import pack, unpack
from raysync.core.layout import Manifest, plan_layout
from raysync.core.sparse import MAX_DENSITY, PatchError, encode, rebuild


def _weights(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "a.bf16": torch.randn(300, generator=g).to(torch.bfloat16),
        "b.f32": torch.randn(40, 7, generator=g),
        "c.i64": torch.arange(50),
        "d.c128": torch.randn(20, dtype=torch.complex128, generator=g),
        "e.empty": torch.zeros(0),
        "f.u8": torch.arange(100, dtype=torch.uint8),
    }


def _changed(old: dict[str, torch.Tensor], count: int = 3) -> dict[str, torch.Tensor]:
    new = {k: v.clone() for k, v in old.items()}
    for t in new.values():
        if t.numel():
            t.view(-1)[: min(count, t.numel())] += 1  # type: ignore[operator]
    new["b.f32"][5, 3] = -0.0  # bits differ from +0.0: changed, though equal as numbers
    return new


def _flat(manifest: Manifest, bucket: list[Any]) -> np.ndarray:
    out = np.zeros(manifest.bucket_nbytes[0], dtype=np.uint8)
    for entry, arr in zip(manifest.bucket_entries(0), bucket, strict=True):
        out[entry.offset : entry.offset + entry.nbytes] = arr
    return out


def _case() -> tuple[Manifest, dict[str, torch.Tensor], list[Any], list[Any]]:
    old = _weights()
    new = _changed(old)
    manifest = plan_layout(old)
    return manifest, new, pack(new, manifest)[0], pack(old, manifest)[0]


def test_a_patch_rebuilds_the_new_bucket_bit_for_bit_from_the_old_one() -> None:
    manifest, new, new_bucket, old_bucket = _case()
    encoded = encode(manifest, 0, new_bucket, old_bucket)
    assert encoded is not None
    patch, changed = encoded
    assert changed == 3 * 5 + 1  # complex128 in 8-byte words: += 1 changes the real ones only
    crc = bucket_checksums([new_bucket])[0]
    rebuilt = rebuild(manifest, 0, _flat(manifest, pack(_weights(), manifest)[0]), patch, crc)
    assert rebuilt.fetched_nbytes == sum(p.nbytes for p in patch) < manifest.bucket_nbytes[0]
    got = unpack(manifest, [rebuilt])
    for key, tensor in new.items():
        assert torch.equal(got[key].view(-1).view(torch.uint8), tensor.view(-1).view(torch.uint8)), key


def test_equal_buckets_give_an_empty_patch() -> None:
    manifest, _, _, old_bucket = _case()
    assert encode(manifest, 0, old_bucket, [a.copy() for a in old_bucket]) == ([], 0)


def test_too_many_changed_elements_give_no_patch() -> None:
    old = {"w": torch.zeros(1000, dtype=torch.bfloat16)}
    manifest = plan_layout(old)
    for count, patched in ((int(1000 * MAX_DENSITY), True), (int(1000 * MAX_DENSITY) + 1, False)):
        new = {"w": old["w"].clone()}
        new["w"][:count] = 1
        assert (encode(manifest, 0, pack(new, manifest)[0], pack(old, manifest)[0]) is not None) is patched


def test_gaps_past_uint16_fall_back_to_absolute_indices() -> None:
    old = {"w": torch.zeros(100_000, dtype=torch.bfloat16)}
    new = {"w": old["w"].clone()}
    new["w"][[3, 90_000]] = 1
    manifest = plan_layout(old)
    nb, ob = pack(new, manifest)[0], pack(old, manifest)[0]
    patch, changed = encode(manifest, 0, nb, ob)  # type: ignore[misc]
    assert changed == 2 and patch[0][5] == 4 and patch[1].tolist() == [3, 90_000]
    crc = bucket_checksums([nb])[0]
    rebuilt = rebuild(manifest, 0, _flat(manifest, ob), patch, crc)
    assert torch.equal(unpack(manifest, [rebuilt])["w"].view(torch.int16), new["w"].view(torch.int16))


def test_a_large_tensor_far_past_the_density_is_given_up_on_a_sample() -> None:
    old = {"w": torch.zeros(100_000, dtype=torch.bfloat16)}
    manifest = plan_layout(old)
    g = torch.Generator().manual_seed(0)
    for fraction, patched in ((0.1, True), (0.6, False)):
        new = {"w": (torch.rand(100_000, generator=g) < fraction).to(torch.bfloat16)}
        encoded = encode(manifest, 0, pack(new, manifest)[0], pack(old, manifest)[0])
        assert (encoded is not None) is patched
        if encoded is not None:
            assert encoded[1] == int(new["w"].count_nonzero())


def _refused(manifest: Manifest, patch: list[Any], crc: int, match: str) -> None:
    held = _flat(manifest, pack(_weights(), manifest)[0])
    before = held.copy()
    with pytest.raises(PatchError, match=match):
        rebuild(manifest, 0, held, patch, crc)
    assert np.array_equal(held, before)  # the base is only read


def test_a_flipped_byte_or_a_changed_base_fails_the_checksum() -> None:
    manifest, _, new_bucket, old_bucket = _case()
    patch, _ = encode(manifest, 0, new_bucket, old_bucket)  # type: ignore[misc]
    crc = bucket_checksums([new_bucket])[0]
    flipped = [p.copy() for p in patch]
    flipped[2].view(np.uint8)[0] ^= 1  # a value of the first row
    _refused(manifest, flipped, crc, "fails its checksum")
    _refused(manifest, patch, crc ^ 1, "fails its checksum")  # a base that is not the pusher's


def test_malformed_patches_are_refused_before_any_byte_is_written() -> None:
    manifest, _, new_bucket, old_bucket = _case()
    patch, _ = encode(manifest, 0, new_bucket, old_bucket)  # type: ignore[misc]
    crc = bucket_checksums([new_bucket])[0]

    def altered(part: int, value: Any) -> list[Any]:
        out = [p.copy() for p in patch]
        out[part] = value
        return out

    assert patch[0][5] == 2 and patch[1].dtype == np.uint16  # row 0: gaps
    _refused(manifest, altered(1, np.array([2, 0, 1], dtype=np.uint16)), crc, "not sorted, unique")
    _refused(manifest, altered(1, np.array([1, 1, 65000], dtype=np.uint16)), crc, "below")
    _refused(manifest, altered(1, patch[1].astype(np.int32)), crc, "indices are not")
    absolute = np.cumsum(patch[1], dtype=np.int64) - 1  # the same row as absolute int32 indices
    header = patch[0].copy()
    header[5] = 4

    def row0(indices: Any) -> list[Any]:
        return [header, np.asarray(indices, dtype=np.int32), *[p.copy() for p in patch[2:]]]

    rebuild(manifest, 0, _flat(manifest, pack(_weights(), manifest)[0]), row0(absolute), crc)  # fine
    _refused(manifest, row0(absolute[::-1]), crc, "not sorted, unique")
    _refused(manifest, row0([0, 0, 1]), crc, "not sorted, unique")
    _refused(manifest, row0([0, 1, 10**6]), crc, "below")
    _refused(manifest, row0([-1, 0, 1]), crc, "below")
    header = patch[0].copy()
    header[2] = 99  # a tensor the bucket does not have
    _refused(manifest, altered(0, header), crc, "names no tensor")
    _refused(manifest, patch[:-1], crc, "does not match its parts")
    _refused(manifest, "not a patch", crc, "not a list of arrays")  # type: ignore[arg-type]
    with pytest.raises(PatchError, match=r"not .* bytes"):
        rebuild(manifest, 0, np.zeros(3, dtype=np.uint8), patch, crc)


def test_delta_takes_true_false_or_sparse() -> None:
    assert delta_mode(False) == (False, False)
    assert delta_mode(True) == (True, False)
    assert delta_mode("sparse") == (True, True)
    with pytest.raises(ValueError, match=r"delta must be one of \(False, True, 'sparse'\), got 'dense'"):
        delta_mode("dense")


def test_a_module_target_hands_back_a_bucket_only_as_applied_and_only_when_it_can() -> None:
    from raysync.receivers.target import Incoming, ModuleTarget
    from raysync.transports.fetch import patchable

    module = torch.nn.Linear(4, 3)
    weights = {k: v.detach().clone() + 1 for k, v in module.state_dict().items()}
    manifest = plan_layout(weights, bucket_bytes=16)  # bias and weight in buckets of their own
    target = ModuleTarget(module)
    ids = [f"id{b}" for b in range(manifest.num_buckets)]
    target.commit(Incoming(1, manifest, ids, dict(enumerate(pack(weights, manifest)))))
    held = target.held_bucket(manifest, 0, "id0")
    assert held is not None and bytes(held[: manifest.bucket_nbytes[0]]) == bytes(
        pack(weights, manifest)[0][0]
    )
    assert target.held_bucket(manifest, 0, "another") is None  # not the base it holds
    with torch.no_grad():
        module.bias.add_(1)  # changed in place since it was applied: it no longer holds the base
    bias_bucket = next(e.bucket for e in manifest.entries if e.key == "bias")
    assert target.held_bucket(manifest, bias_bucket, ids[bias_bucket]) is None
    assert patchable(manifest, [0, 1], object()) == {}  # a target that does not read back
    assert not ModuleTarget(torch.nn.Linear(4, 3), view=True).reads_back
