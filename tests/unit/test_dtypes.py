"""Every dtype a module can hold applies bit for bit (issue 41, case 5).

torch views a byte buffer as a dtype only at an offset that is a multiple of the dtype's
element size: a tensor under 2 KiB placed at Ray's 8-byte alignment could not be a view of
its bucket when its elements take 16 bytes (complex128), so a module could never take it.
Each module here holds, of one dtype, a small tensor placed right after a 4-byte one (an
offset of 8 mod 16 under 8-byte alignment), a large one, an empty one and a second small
one; its values are random bytes, so every bit pattern travels.
"""

from __future__ import annotations

import math

import pytest
import torch

from raysync.core.bound import BoundModel
from raysync.core.codec import allocate, pack, unpack, views, write
from raysync.core.extract import extract_tensors
from raysync.core.layout import Manifest, plan_layout
from raysync.core.placement import TensorParallel
from raysync.core.shards import ShardPart, ShardPiece, TensorSpec, merge
from raysync.receivers import pipeline
from raysync.receivers.target import ModuleTarget
from raysync.transports import fetch
from raysync.transports.sharded import Assembly
from tests._support import assert_same_weights

# Quantized dtypes are left out: their tensors carry a scale and zero point besides their
# bytes, and extract_tensors refuses them (naming dequantize() and int_repr()).
DTYPES = sorted(
    {
        d
        for d in vars(torch).values()
        if isinstance(d, torch.dtype) and not str(d).startswith(("torch.qint", "torch.quint"))
    },
    key=str,
)
LARGE = 4096 + 64  # bytes of the large tensor (2 KiB or more: Ray aligns it to 64)


def _random(numel: int, dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    size = torch.empty(0, dtype=dtype).element_size()
    raw = torch.randint(0, 256, (numel * size,), dtype=torch.uint8, generator=g)
    if dtype == torch.bool:
        raw %= 2  # a bool is one byte holding 0 or 1
    return raw.view(dtype)


def _module(dtype: torch.dtype, seed: int) -> torch.nn.Module:
    g = torch.Generator().manual_seed(seed)
    size = torch.empty(0, dtype=dtype).element_size()
    m = torch.nn.Module()
    m.a_pad = torch.nn.Parameter(_random(1, torch.float32, g))  # 4 bytes: the next small one at byte 8
    m.b_small = torch.nn.Parameter(_random(3, dtype, g), requires_grad=False)
    m.c_large = torch.nn.Parameter(_random(LARGE // size, dtype, g), requires_grad=False)
    m.register_buffer("d_empty", torch.empty(0, 2, dtype=dtype))
    m.register_buffer("e_small", _random(5, dtype, g))
    return m


def _copy(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t``'s bytes (torch copies no sub-byte dtype, such as ``int1``, as itself)."""
    return t.detach().reshape(-1).view(torch.uint8).clone().view(t.dtype).reshape(t.shape)


def _zeros(t: torch.Tensor) -> torch.Tensor:
    return torch.zeros(t.numel() * t.element_size(), dtype=torch.uint8).view(t.dtype).reshape(t.shape)


def _state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: _copy(t) for k, t in extract_tensors(module).items()}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_dtype_applies_bit_exactly_through_the_codec_and_a_bound_module(dtype: torch.dtype) -> None:
    src = _state(_module(dtype, seed=1))
    manifest = plan_layout(src)
    for e in manifest.entries:  # every tensor starts at a multiple of its element size
        assert e.offset % src[e.key].element_size() == 0, (e.key, e.offset)
    buckets = pack(src, manifest)
    assert_same_weights(unpack(manifest, buckets), src)  # the receivers' views of received buckets
    flats = allocate(manifest)  # flat buffers: pipes, NIXL, torch.distributed, a bound module's own
    write(src, manifest, flats)
    assert_same_weights(views(manifest, flats), src)

    copy_target, view_target = _module(dtype, seed=2), _module(dtype, seed=3)
    BoundModel(copy_target, manifest).apply(buckets)  # apply="copy": into the module's own buffers
    assert_same_weights(_state(copy_target), src)
    BoundModel(view_target, manifest, view=True).apply(buckets)  # apply="view": views of the buckets
    assert_same_weights(_state(view_target), src)


def _sharded(weights: dict[str, torch.Tensor], dims: dict[str, int]) -> tuple[Manifest, dict[int, list]]:
    """A version of 2 ranks, each holding a ``torch.chunk`` of the tensors in ``dims`` (rank 0 the
    others whole), laid out and packed as each rank does; merged as the hub merges them. Returns
    the merged manifest and the packed rank buckets by rank-bucket index."""
    world, parts, rank_arrays = 2, [], {}
    for rank in range(world):
        local, boxes, specs = {}, {}, []
        for key, t in weights.items():
            dim = dims.get(key)
            specs.append(
                TensorSpec(
                    key, tuple(t.shape), str(t.dtype)[6:], t.element_size(), "plain" if dim is None else "S"
                )
            )
            if dim is None:
                if rank == 0:
                    local[key], boxes[key] = t, ((0,) * t.dim(), tuple(t.shape))
                continue
            piece = torch.chunk(t, world, dim=dim)[rank].contiguous()
            start = rank * math.ceil(t.shape[dim] / world)
            local[key] = piece
            boxes[key] = (tuple(start if d == dim else 0 for d in range(t.dim())), tuple(piece.shape))
        manifest = plan_layout(local)
        pieces = tuple(
            ShardPiece(e.key, rank, e.bucket, e.index, e.nbytes, *boxes[e.key]) for e in manifest.entries
        )
        for arrays in pack(local, manifest):
            rank_arrays[len(rank_arrays)] = arrays
        part = ShardPart(1, rank, world, tuple(sorted(specs, key=lambda s: s.key)), manifest, pieces)
        parts.append((part, [object()] * manifest.num_buckets))
    merged, _ = merge(parts)
    return merged, rank_arrays


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_dtype_applies_bit_exactly_from_a_sharded_version_whole_or_in_parts(dtype: torch.dtype) -> None:
    """A sharded trainer's version (each rank lays out its own pieces, the hub the whole tensors)
    goes into a module bit for bit: whole, and as a receiver's own tensor-parallel parts
    (laid out again for its placement)."""
    src = _state(_module(dtype, seed=1))
    dims = {"b_small": 0, "c_large": 0}
    manifest, rank_arrays = _sharded(src, dims)
    for placement, want in (
        (None, src),
        (
            TensorParallel(1, 2, dims),
            {k: _copy(torch.chunk(t, 2)[1]) if k in dims else t for k, t in src.items()},
        ),
    ):
        module = torch.nn.Module()
        for key, t in want.items():
            module.register_buffer(key, _zeros(t))
        target = ModuleTarget(module, placement=placement)
        ids = [f"v1-{b}" for b in range(manifest.num_buckets)]
        needed = pipeline.plan(target, 1, manifest, ids, held=None)
        laid = fetch.view(target, manifest)
        pipeline.commit(target, 1, manifest, ids, {b: Assembly(laid, b, rank_arrays) for b in needed})
        assert_same_weights(_state(module), want)
