"""Sharded versions without Ray: the hub's merge of the ranks' parts, and the receivers' assembly.

Each rank's pieces are cut as DTensor cuts them (``torch.chunk``), laid out and packed as a
rank does; the merged version's whole buckets, assembled from those packed buckets, must hold
every tensor bit for bit, and bad parts are refused naming the tensor.
"""

from __future__ import annotations

import dataclasses
import pickle
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from raysync.core.assembly import Spares, assemble, bucket_plan, fill
from raysync.core.codec import bucket_checksums, copy_into, pack, unpack
from raysync.core.kept import Kept
from raysync.core.layout import Manifest, plan_layout
from raysync.core.placement import TensorParallel, one_writer, reshard
from raysync.core.shards import ShardPart, ShardPiece, TensorSpec, merge
from raysync.errors import ChecksumError, InvalidWeightsError, WeightMismatchError
from raysync.receivers import pipeline
from raysync.receivers.target import ModuleTarget
from raysync.transports import fetch
from raysync.transports.sharded import Assembly, verify_fetched
from tests._support import assert_same_weights


class _Ref:
    def __init__(self, name: str) -> None:
        self.name = name

    def hex(self) -> str:
        return self.name


def _weights() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "rows": torch.randn(6, 4, generator=g),  # Shard(0), even
        "cols": torch.randn(3, 5, generator=g).to(torch.bfloat16),  # Shard(1), uneven (3 + 2)
        "odd": torch.randn(3, generator=g),  # Shard(0), uneven over 4 ranks would leave one empty
        "rep": torch.randn(2, 2, generator=g).to(torch.float64),  # Replicate
        "count": torch.tensor(7, dtype=torch.int64),  # a plain tensor (rank 0's)
    }


PLACE = {"rows": 0, "cols": 1, "odd": 0, "rep": None, "count": None}


def _parts(
    world: int, weights: dict[str, torch.Tensor], *, checksum: bool = False
) -> list[tuple[ShardPart, list[_Ref]]]:
    """Each rank's part, as a DTensor trainer's rank makes it (pieces cut by torch.chunk); with
    ``checksum``, its buckets' CRC32s as ``hub.push(..., checksum=True)`` adds them."""
    out = []
    for rank in range(world):
        local: dict[str, torch.Tensor] = {}
        boxes = {}
        specs = []
        for key, t in weights.items():
            dim = PLACE[key]
            placement = "plain" if dim is None else f"Shard({dim})"
            specs.append(TensorSpec(key, tuple(t.shape), str(t.dtype)[6:], t.element_size(), placement))
            if dim is None:
                if rank == 0:
                    local[key], boxes[key] = t, ((0,) * t.dim(), tuple(t.shape))
                continue
            chunks = torch.chunk(t, world, dim=dim)
            if rank >= len(chunks) or chunks[rank].numel() == 0:
                continue
            start = sum(c.shape[dim] for c in chunks[:rank])
            offsets = tuple(start if d == dim else 0 for d in range(t.dim()))
            local[key], boxes[key] = chunks[rank].contiguous(), (offsets, tuple(chunks[rank].shape))
        manifest = plan_layout(local, bucket_bytes=64)
        pieces = tuple(
            ShardPiece(e.key, rank, e.bucket, e.index, e.nbytes, *boxes[e.key]) for e in manifest.entries
        )
        packed = pack(local, manifest)
        if checksum:
            manifest = manifest.with_checksums(bucket_checksums(packed))
        part = ShardPart(1, rank, world, tuple(sorted(specs, key=lambda s: s.key)), manifest, pieces, 64)
        refs = [_Ref(f"r{rank}b{b}") for b in range(manifest.num_buckets)]
        _PACKED.update({r.name: bucket for r, bucket in zip(refs, packed, strict=True)})
        out.append((part, refs))
    return out


_PACKED: dict[str, list] = {}


def _rank_arrays(manifest: Manifest) -> dict[int, list]:
    """The packed rank buckets of a merged version, by its rank-bucket index (rank 0's first)."""
    assert manifest.shards is not None
    ranks = manifest.shards.bucket_ranks
    return {i: _PACKED[f"r{rank}b{ranks[:i].count(rank)}"] for i, rank in enumerate(ranks)}


@pytest.mark.parametrize("world", [2, 4])
def test_merge_then_assemble_gives_whole_tensors(world: int) -> None:
    weights = _weights()
    manifest, refs = merge(_parts(world, weights))
    assert manifest.transport == "sharded" and manifest.schema() == {
        k: (tuple(t.shape), str(t.dtype)[6:]) for k, t in weights.items()
    }
    assert manifest.shards is not None
    # a replicated (plain) tensor is taken once, from rank 0; a Shard(d) one from every rank holding elements
    assert [p.rank for p in manifest.shards.pieces_of("count")] == [0]
    # 5 columns: chunks of 3 and 2 over 2 ranks; of 2, 2 and 1 over 4 (rank 3's is empty: no piece)
    assert [p.rank for p in manifest.shards.pieces_of("cols")] == ([0, 1] if world == 2 else [0, 1, 2])
    rank_arrays = _rank_arrays(manifest)
    buckets = [assemble(manifest, b, rank_arrays) for b in range(manifest.num_buckets)]
    # a module's copy (apply="copy") writes each piece straight into its own buffers: the same bytes
    for b, arrays in enumerate(buckets):
        flat = torch.full((manifest.bucket_nbytes[b],), 0xAB, dtype=torch.uint8)
        lazy = Assembly(manifest, b, rank_arrays)
        copy_into([flat], manifest, {0: lazy} if b == 0 else {})
        if b == 0:
            expected = torch.zeros(manifest.bucket_nbytes[0], dtype=torch.uint8)
            for e, arr in zip(manifest.bucket_entries(0), arrays, strict=True):
                expected[e.offset : e.offset + e.nbytes] = torch.from_numpy(arr.copy())
            assert torch.equal(flat, expected)
        assert len(lazy) == len(arrays) and all(  # its views, or the bucket assembled: the same bytes
            x.tobytes() == y.tobytes() for x, y in zip(lazy, arrays, strict=True)
        )
    got = unpack(manifest, buckets)
    for key, t in weights.items():
        assert got[key].dtype == t.dtype and got[key].shape == t.shape, key
        assert torch.equal(got[key].reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)), key
    # each whole bucket names exactly the rank buckets its tensors' pieces are in
    for b, ref in enumerate(refs):
        keys = [e.key for e in manifest.bucket_entries(b)]
        assert list(ref.buckets) == manifest.shards.buckets_of(keys)
    assert sum(manifest.shards.bucket_nbytes) >= manifest.total_nbytes
    assert sum(p.nbytes for p in manifest.shards.pieces) == manifest.total_nbytes  # each byte once


def test_a_bucket_plan_is_worked_out_once_per_layout_and_never_serves_another() -> None:
    weights = _weights()
    first, _ = merge(_parts(2, weights))
    plans = [bucket_plan(first, b) for b in range(first.num_buckets)]
    # the next version of the same layout (new objects, as a receiver deserializes each) reuses them
    nxt = pickle.loads(pickle.dumps(merge(_parts(2, {k: t + 1 for k, t in weights.items()}))[0]))
    assert nxt.shards is not first.shards
    assert all(bucket_plan(nxt, b) is plans[b] for b in range(nxt.num_buckets))
    # Shard(0) and replicated pieces are one run of bytes each (one flat copy); the Shard(1)
    # pieces of a whole tensor go box by box
    assert {p.key for plan in plans for _, _, p in plan.boxed} == {"cols"}
    assert sum(len(plan.runs) for plan in plans) == len(first.shards.pieces) - 2
    # another layout, or the same tensors with their pieces elsewhere, gets a plan of its own
    four, _ = merge(_parts(4, weights))
    assert all(bucket_plan(four, b) not in plans for b in range(four.num_buckets))
    moved = dataclasses.replace(
        first,
        shards=dataclasses.replace(
            first.shards,
            pieces=tuple(dataclasses.replace(p, nbytes=p.nbytes + 1) for p in first.shards.pieces),
        ),
    )
    assert all(bucket_plan(moved, b) is not plans[b] for b in range(moved.num_buckets))
    with pytest.raises(ValueError, match="arrived with"):
        flat = torch.empty(first.bucket_nbytes[0], dtype=torch.uint8)
        Assembly(moved, 0, _rank_arrays(first)).write_into(flat)


@pytest.mark.parametrize("world", [2, 4])
def test_a_bucket_copied_by_torch_equals_the_one_copied_by_numpy(world: int) -> None:
    """A CPU buffer is written with numpy's copies (the C library's memcpy); a GPU one takes torch's
    (``fill`` with ``torch.from_numpy``): the same bytes, every byte written, gaps zeroed."""
    manifest, _ = merge(_parts(world, _weights()))
    arrays = _rank_arrays(manifest)
    for b in range(manifest.num_buckets):
        by_numpy = torch.full((manifest.bucket_nbytes[b],), 0xAB, dtype=torch.uint8)
        by_torch = torch.full((manifest.bucket_nbytes[b],), 0xCD, dtype=torch.uint8)
        Assembly(manifest, b, arrays).write_into(by_numpy)
        fill(bucket_plan(manifest, b), arrays, by_torch, torch.from_numpy)
        assert torch.equal(by_numpy, by_torch)
        for entry, whole in zip(manifest.bucket_entries(b), assemble(manifest, b, arrays), strict=True):
            assert by_numpy[entry.offset : entry.offset + entry.nbytes].numpy().tobytes() == whole.tobytes()


def test_a_shard_map_is_pickled_once_and_unpickled_once_per_layout() -> None:
    """The hub sends a version's shard map to every receiver (the same map for each version of a
    layout): its bytes are made once, and a receiver unpickles each layout's map once."""
    weights = _weights()
    first, _ = merge(_parts(2, weights))
    second, _ = merge(_parts(2, {k: t + 1 for k, t in weights.items()}))
    assert first.shards is second.shards  # the hub's merge keeps the map per layout
    sent = [pickle.dumps(m) for m in (first, second)]
    assert first.shards is not None and first.shards.__dict__["_pickled"] in sent[0]  # made once, kept
    got = [pickle.loads(b) for b in sent]
    assert got[0] == first and got[1] == second  # every field as sent
    assert got[0].shards is got[1].shards  # the receiver's second version reuses the first's map
    # another layout, or the same one with each version's checksums, is a map of its own
    four, _ = merge(_parts(4, weights))
    assert pickle.loads(pickle.dumps(four)).shards == four.shards != got[0].shards
    checked = [merge(_parts(2, {k: t + i for k, t in weights.items()}, checksum=True))[0] for i in (0, 1)]
    received = [pickle.loads(pickle.dumps(m)) for m in checked]
    assert [m.shards.checksums for m in received] == [m.shards.checksums for m in checked]  # type: ignore[union-attr]
    assert received[0].shards.checksums != received[1].shards.checksums  # type: ignore[union-attr]


def test_ranks_that_disagree_are_refused_naming_the_tensor() -> None:
    weights = _weights()
    parts = _parts(2, weights)
    p1, r1 = parts[1]
    bad_specs = tuple(
        s if s.key != "rows" else TensorSpec("rows", (7, 4), s.dtype, 4, s.placement) for s in p1.specs
    )
    with pytest.raises(InvalidWeightsError, match="disagree on tensor 'rows'"):
        merge([parts[0], (ShardPart(1, 1, 2, bad_specs, p1.manifest, p1.pieces), r1)])
    fewer = tuple(s for s in p1.specs if s.key != "rep")
    with pytest.raises(InvalidWeightsError, match=r"rank 0 has \['rep'\] that rank 1 lacks"):
        merge([parts[0], (ShardPart(1, 1, 2, fewer, p1.manifest, p1.pieces), r1)])
    # keys= on one rank only: the ranks would lay the whole tensors out differently
    with pytest.raises(InvalidWeightsError, match="disagree on the keys pushed apart"):
        merge([parts[0], (dataclasses.replace(p1, separate=("rows",)), r1)])
    # the same keys= on every rank: those keys get whole buckets of their own
    for separate, alone in (((), False), (("odd",), True)):
        laid = [(dataclasses.replace(p, separate=separate, bucket_bytes=2**20), r) for p, r in parts]
        manifest, _ = merge(laid)
        (odd,) = [e for e in manifest.entries if e.key == "odd"]
        assert ([e.key for e in manifest.bucket_entries(odd.bucket)] == ["odd"]) is alone


def test_a_missing_or_doubled_shard_is_refused_naming_the_tensor() -> None:
    parts = _parts(2, _weights())
    p1, r1 = parts[1]
    no_rows = tuple(p for p in p1.pieces if p.key != "rows")
    with pytest.raises(InvalidWeightsError, match="tensor 'rows' is missing a shard"):
        merge([parts[0], (ShardPart(1, 1, 2, p1.specs, p1.manifest, no_rows), r1)])
    p0 = parts[0][0]
    twice = p1.pieces + tuple(
        ShardPiece(p.key, 1, p.bucket, p.index, p.nbytes, p.offsets, p.lengths)
        for p in p0.pieces
        if p.key == "count"
    )
    with pytest.raises(InvalidWeightsError, match="tensor 'count' is pushed twice"):
        merge([parts[0], (ShardPart(1, 1, 2, p1.specs, p1.manifest, twice), r1)])
    with pytest.raises(InvalidWeightsError, match="missing"):
        merge([parts[0]])


@pytest.mark.parametrize("tp_rank", [0, 1])
def test_a_receiver_with_its_own_placement_takes_only_its_parts(tp_rank: int) -> None:
    """Trainer: rows Shard(0), cols Shard(1); receiver: rows Shard(1), cols Shard(0), odd Shard(0)."""
    weights = _weights()
    manifest, _ = merge(_parts(2, weights))
    tp = TensorParallel(tp_rank, 2, {"rows": 1, "cols": 0, "odd": 0})
    view = reshard(manifest, tp)
    assert view.num_buckets == manifest.num_buckets and view.shards is not None
    want = {
        "rows": torch.chunk(weights["rows"], 2, dim=1)[tp_rank],
        "cols": torch.chunk(weights["cols"], 2, dim=0)[tp_rank],
        "odd": torch.chunk(weights["odd"], 2, dim=0)[tp_rank],
        "rep": weights["rep"],
        "count": weights["count"],
    }
    assert view.schema() == {k: (tuple(t.shape), str(t.dtype)[6:]) for k, t in want.items()}
    rank_arrays = _rank_arrays(manifest)
    got_buckets = []
    fetched = set()
    for b in range(view.num_buckets):
        wanted = view.shards.buckets_of([e.key for e in view.bucket_entries(b)])
        fetched |= set(wanted)
        got_buckets.append(assemble(view, b, {r: rank_arrays[r] for r in wanted}))  # only those
    got = unpack(view, got_buckets)
    for key, t in want.items():
        assert torch.equal(
            got[key].contiguous().reshape(-1).view(torch.uint8), t.contiguous().reshape(-1).view(torch.uint8)
        )
    # bytes copied: exactly its parts plus the replicated tensors
    assert view.total_nbytes == sum(t.numel() * t.element_size() for t in want.values())
    # odd's trainer shards line up with the receiver's (3 + 2 both ways): the other rank's is not needed
    odd_pieces = manifest.shards.pieces_of("odd")
    other = odd_pieces[1 - tp_rank].bucket
    mine = odd_pieces[tp_rank].bucket
    assert mine in view.shards.buckets_of(["odd"]) and other not in view.shards.buckets_of(["odd"])
    assert len(fetched) <= len(manifest.shards.bucket_ranks)


def test_a_placement_that_takes_everything_whole_leaves_the_version_as_it_is() -> None:
    manifest, _ = merge(_parts(2, _weights()))
    assert reshard(manifest, TensorParallel(0, 1, {"rows": 0})) is manifest
    with pytest.raises(ValueError, match="rank must be in"):
        TensorParallel(2, 2, {})


def test_a_part_one_trainer_piece_holds_is_read_without_a_copy() -> None:
    """What a WeightsLoader (or ``apply="view"``) reads: the rank bucket's own bytes where one piece
    holds the receiver's part as one run (no assembly, no copy); the bucket assembled elsewhere."""
    weights = _weights()
    manifest, _ = merge(_parts(2, weights))
    assert manifest.shards is not None
    rank_arrays = _rank_arrays(manifest)
    tp = TensorParallel(1, 2, {"rows": 0, "cols": 0, "odd": 0})  # rows, odd: as the trainer; cols not
    view = reshard(manifest, tp)
    assert view.shards is not None
    want = {
        "rows": torch.chunk(weights["rows"], 2, dim=0)[1],
        "cols": torch.chunk(weights["cols"], 2, dim=0)[1],
        "odd": torch.chunk(weights["odd"], 2, dim=0)[1],
        "rep": weights["rep"],
        "count": weights["count"],
    }
    shared = {}
    for b in range(view.num_buckets):
        bucket = Assembly(view, b, rank_arrays)
        for entry, array in zip(view.bucket_entries(b), bucket, strict=True):
            t = want[entry.key]
            assert bytes(array) == t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
            shared[entry.key] = any(
                np.shares_memory(array, np.asarray(a)) for arrays in rank_arrays.values() for a in arrays
            )
    # one trainer piece holds each of these whole: read in place; cols' rows span both ranks' pieces
    assert shared == {"rows": True, "odd": True, "rep": True, "count": True, "cols": False}


def _read_assembled(weights: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], list[Any]]:
    """A 2-rank version's tensors as a receiver reads them (``Assembly`` arrays, viewed as
    tensors, no copy), and weak refs to the buffers the assembled ones (``cols``) are in."""
    manifest, _ = merge(_parts(2, weights))
    rank_arrays = _rank_arrays(manifest)
    views: dict[str, torch.Tensor] = {}
    buffers = []
    for b in range(manifest.num_buckets):
        for entry, array in zip(manifest.bucket_entries(b), Assembly(manifest, b, rank_arrays), strict=True):
            views[entry.key] = torch.from_numpy(array).view(getattr(torch, entry.dtype)).reshape(entry.shape)
            if not any(np.shares_memory(array, a) for arrays in rank_arrays.values() for a in arrays):
                buffers.append(weakref.ref(array.base))
    return views, buffers


def test_assembled_reads_reuse_a_buffer_nothing_holds_and_never_one_a_reader_keeps() -> None:
    """A receiver reading assembled tensors (a ``WeightsLoader``'s callback, ``apply="view"``): a
    version it let go of lends its buffer to the next (no fresh pages to fault in); tensors it
    still holds (an ``apply="view"`` module's weights, a callback that kept them) keep their bytes
    through later versions, bit for bit."""
    one = _weights()
    two = {k: (v * 3 if v.is_floating_point() else v + 1) for k, v in one.items()}
    held, held_buffers = _read_assembled(one)  # kept, as an apply="view" module keeps its weights
    assert held_buffers  # cols spans both ranks' pieces: assembled
    got, buffers = _read_assembled(two)
    assert_same_weights(got, two)
    assert not {id(r()) for r in buffers} & {id(r()) for r in held_buffers}  # version 1's is still read
    assert_same_weights(held, one)  # never written over
    del got
    assert all(r() is not None for r in buffers)  # let go by its reader: kept to serve again
    again, buffers_again = _read_assembled(one)
    assert [r() for r in buffers_again] == [r() for r in buffers]  # the same buffers, warm
    assert_same_weights(again, one)
    assert_same_weights(held, one)


def test_spare_buffers_kept_stay_within_their_sizes_and_bytes() -> None:
    # (no buffer is compared inside an assert: pytest's rewriting keeps its operands alive)
    spares = Spares(2, max_bytes=100)
    first = weakref.ref(spares.take(60))
    again = id(spares.take(60))
    assert again == id(first())  # let go of: kept, handed out again
    big = weakref.ref(spares.take(200))
    assert big() is None  # over max_bytes: never kept
    other = weakref.ref(spares.take(50))  # 60 + 50 > 100: the older size goes
    assert first() is None
    assert other() is not None
    for n in (10, 20, 30):
        spares.take(n)
    assert other() is None  # 2 sizes at most: 50 went first


@pytest.mark.parametrize("writers", [2, 1])
def test_a_module_holding_its_parts_takes_only_them_whoever_pushed(writers: int) -> None:
    """``ModuleTarget(placement=...)`` (``@synced_model`` and ``follow`` with ``placement=``): its
    module's parameters are its parts, cut from a sharded version (2 writers) or from one writer's
    buckets (``one_writer``); a version over NIXL (whole buffers received in place) is refused."""
    weights = _weights()
    if writers == 2:
        manifest, _ = merge(_parts(2, weights))
        assert manifest.shards is not None
        rank_arrays = _rank_arrays(manifest)
    else:
        manifest = plan_layout(weights, bucket_bytes=64)
        rank_arrays = dict(enumerate(pack(weights, manifest)))  # a rank bucket per bucket of the version
    tp = TensorParallel(1, 2, {"rows": 1, "cols": 0})
    want = {
        "rows": torch.chunk(weights["rows"], 2, dim=1)[1],
        "cols": torch.chunk(weights["cols"], 2, dim=0)[1],
        **{k: weights[k] for k in ("odd", "rep", "count")},
    }
    module = torch.nn.Module()
    for key, t in want.items():
        module.register_buffer(key, torch.zeros_like(t))
    target = ModuleTarget(module, placement=tp, label="rank 1's module")
    ids = [f"v1-{b}" for b in range(manifest.num_buckets)]
    needed = pipeline.plan(target, 1, manifest, ids, held=None)
    assert needed == list(range(manifest.num_buckets))
    view = fetch.view(target, manifest)
    assert view.shards is not None and view.shards.world == writers
    pipeline.commit(target, 1, manifest, ids, {b: Assembly(view, b, rank_arrays) for b in needed})
    assert_same_weights(dict(module.state_dict()), want)
    # what it took: exactly its parts and the whole replicated tensors (plus Ray's buffer alignment)
    own = sum(t.numel() * t.element_size() for t in want.values())
    assert own <= fetch.nbytes(manifest, needed, target) <= own + 8 * len(want)
    if writers == 1:
        nixl = dataclasses.replace(manifest, transport="nixl")
        with pytest.raises(WeightMismatchError, match=r"module .* \('nixl'\) hands out whole") as info:
            pipeline.plan(target, 2, nixl, ids, held=1)
        assert info.value.shape_mismatch == {"rows": ((6, 4), (6, 2)), "cols": ((3, 5), (1, 5))}
    with pytest.raises(ValueError, match="copies only"):
        ModuleTarget(module, placement=tp, view=True)
    with pytest.raises(TypeError, match="TensorParallel"):
        ModuleTarget(module, placement={"rows": 1})  # type: ignore[arg-type]


@pytest.mark.parametrize("writers", [2, 1])
def test_a_verifying_receiver_checks_each_rank_bucket_it_reads(writers: int) -> None:
    """``checksum=True`` on every rank: the merged version carries one CRC32 per rank bucket, and a
    receiver that verifies checks the rank buckets it fetched (a receiver's parts of one writer's
    version: that writer's buckets) before anything is assembled; a flipped byte is named."""
    weights = _weights()
    if writers == 2:
        manifest, _ = merge(_parts(2, weights, checksum=True))
        rank_arrays = _rank_arrays(manifest)
    else:
        whole = plan_layout(weights, bucket_bytes=64)
        packed = pack(weights, whole)
        manifest = one_writer(whole.with_checksums(bucket_checksums(packed)))
        rank_arrays = dict(enumerate(packed))
    assert manifest.shards is not None and manifest.shards.checksums is not None
    assert len(manifest.shards.checksums) == len(manifest.shards.bucket_ranks)
    view = reshard(manifest, TensorParallel(1, 2, {"rows": 1, "cols": 0}))
    for m in (manifest, view):
        fetched = {b: Assembly(m, b, rank_arrays) for b in range(m.num_buckets)}
        assert fetch.checked(m, fetched, verify=True) is fetched
    corrupt = {i: [a.copy() for a in arrays] for i, arrays in rank_arrays.items()}
    last = max(corrupt)
    corrupt[last][-1].reshape(-1).view(np.uint8)[0] ^= 0xFF
    fetched = {b: Assembly(manifest, b, corrupt) for b in range(manifest.num_buckets)}
    rank = manifest.shards.bucket_ranks[last]
    with pytest.raises(ChecksumError, match=rf"rank bucket\(s\) \[{last}\] \(of rank\(s\) \[{rank}\]\)"):
        fetch.checked(manifest, fetched, verify="if_present")
    fetch.checked(manifest, fetched, verify=False)  # not asked: not checked


def test_merge_keeps_a_layout_and_takes_each_versions_refs_checksums_and_extra_state() -> None:
    weights = _weights()
    first, first_refs = merge(_parts(2, weights, checksum=True))
    parts = _parts(2, {k: t + 1 for k, t in weights.items()}, checksum=True)
    extra = parts[0][0].manifest.with_extra_state({"norm._extra_state": {"step": 2}})
    parts[0] = (dataclasses.replace(parts[0][0], manifest=extra), parts[0][1])
    parts = [(part, [_Ref(f"{r.name}-v2") for r in refs]) for part, refs in parts]
    second, second_refs = merge(parts)
    assert first.shards is not None and second.shards is not None
    # the layout's work is kept: the same pieces (objects), layout hash and rank buckets per bucket
    assert second.shards.pieces is first.shards.pieces and second.layout_hash == first.layout_hash
    assert [r.buckets for r in second_refs] == [r.buckets for r in first_refs]
    # what is this version's is this version's: its refs, its ranks' checksums, rank 0's extra state
    assert all(r.hex().endswith("-v2") for ref in second_refs for r in ref.refs)
    assert second.shards.checksums == tuple(c for p, _ in parts for c in p.manifest.checksums or ())
    assert second.shards.checksums != first.shards.checksums
    assert second.extra_states() == {"norm._extra_state": {"step": 2}} and first.extra_state == ()
    # a bad layout is refused every time, never kept
    bad = _parts(2, weights)
    bad[1] = (dataclasses.replace(bad[1][0], pieces=bad[1][0].pieces[1:]), bad[1][1])
    for _ in range(2):
        with pytest.raises(InvalidWeightsError, match="missing a shard"):
            merge(bad)


def test_ranks_disagreeing_on_checksums_are_refused_and_none_refuses_verifying_receivers() -> None:
    with_sums, without = _parts(2, _weights(), checksum=True), _parts(2, _weights())
    with pytest.raises(InvalidWeightsError, match=r"disagree on checksum=: ranks \[1\] pushed none"):
        merge([with_sums[0], without[1]])
    manifest, _ = merge(without)
    fetched = {b: Assembly(manifest, b, _rank_arrays(manifest)) for b in range(manifest.num_buckets)}
    assert fetch.checked(manifest, fetched, verify="if_present") is fetched  # none to check
    with pytest.raises(ChecksumError, match=r"carries no checksums.*checksum=True\) on every rank"):
        verify_fetched(manifest, fetched)
    with pytest.raises(ChecksumError, match="carries no checksums"):
        fetch.checked(manifest, fetched, verify=True)


def test_kept_keeps_the_newest_layouts_and_never_a_failed_one() -> None:
    kept: Kept[int] = Kept(2)
    made: list[str] = []

    def make(key: str, value: int) -> Callable[[], int]:
        def run() -> int:
            made.append(key)
            return value

        return run

    assert kept.get("a", make("a", 1)) == 1 and kept.get("a", make("a", 9)) == 1  # made once
    kept.get("b", make("b", 2))
    kept.get("c", make("c", 3))  # the oldest ("a") goes
    assert kept.get("a", make("a", 4)) == 4 and kept.get("c", make("c", 9)) == 3
    assert made == ["a", "b", "c", "a"]

    def fails() -> int:
        raise ValueError("bad layout")

    for _ in range(2):  # a layout whose work raises is worked on again each time, never kept
        with pytest.raises(ValueError, match="bad layout"):
            kept.get("d", fails)
