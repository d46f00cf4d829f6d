"""apply="view" weights on pages mapped read-only: no route writes them (issue 41, case 3), without Ray.

A shared mapping stands in for Ray's object store (every Ray process maps it writable); a
child process plays the view actor for the writes, since a write must stop it (SIGSEGV).
"""

from __future__ import annotations

import gc
import mmap
import os
import resource
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from raysync.core import readonly_pages
from raysync.core.bound import BoundModel
from raysync.core.codec import pack
from raysync.core.extract import extract_tensors
from raysync.core.layout import plan_layout
from raysync.core.readonly_pages import read_only_buckets
from tests._support import assert_same_weights, in_shared_memory, mapping_of

ROOT = Path(__file__).resolve().parents[2]

# What the view actor's code tries, on a parameter of its view (p).
ROUTES = {
    "as_subclass": "p.as_subclass(torch.Tensor).add_(1)",
    "from_dlpack": "torch.from_dlpack(p).add_(1)",
    "frombuffer": "torch.frombuffer(p.numpy(), dtype=p.dtype).add_(1)",
    "untyped_storage": "p.untyped_storage().fill_(7)",
    "memset": "ctypes.memset(p.data_ptr(), 0, 16)",
}

# The child: maps the "store" file shared and writable (as Ray does), puts a version there,
# applies it as a view, says so, waits for the go, then writes through one route.
_CHILD = """
import ctypes, mmap, sys, warnings
import numpy as np, torch
from raysync.core.bound import BoundModel
from raysync.core.codec import pack
from raysync.core.extract import extract_tensors
from raysync.core.layout import plan_layout

warnings.simplefilter("ignore")
path, source, route = sys.argv[1:4]
torch.manual_seed(0)
model = torch.nn.Linear(64, 64)
tensors = extract_tensors(model)
manifest = plan_layout(tensors)
buckets = pack(tensors, manifest)
if source == "store":
    with open(path, "r+b") as f:
        store = mmap.mmap(f.fileno(), 0)  # MAP_SHARED, read and write
    flat = np.frombuffer(store, dtype=np.uint8)
    at, held = 0, []
    for bucket in buckets:
        arrays = []
        for a in bucket:
            flat[at : at + a.nbytes] = a
            arrays.append(flat[at : at + a.nbytes])
            at += (a.nbytes + 63) // 64 * 64
        held.append(arrays)
    buckets = held
BoundModel(model, manifest, view=True).apply(buckets)
print("applied", flush=True)
sys.stdin.readline()
p = model.weight
with torch.no_grad():
    exec(sys.argv[4], {"torch": torch, "p": p, "ctypes": ctypes})
print("written", flush=True)
"""


def _write_in_a_child(
    tmp_path: Path, source: str, route: str
) -> tuple[subprocess.CompletedProcess[str], bytes, bytes]:
    """Run the child; the store's bytes once the version is in (before the write) and after it."""
    path = tmp_path / "store"
    path.write_bytes(bytes(2**20))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-X", "faulthandler", "-c", _CHILD, str(path), source, route, ROUTES[route]]
    child = subprocess.Popen(
        cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    assert child.stdout is not None and child.stdin is not None
    assert child.stdout.readline().strip() == "applied", child.communicate(timeout=60)
    before = path.read_bytes()
    out, err = child.communicate("go\n", timeout=120)
    return subprocess.CompletedProcess(cmd, child.returncode, out, err), before, path.read_bytes()


@pytest.mark.parametrize(
    ("source", "route"), [*(("store", r) for r in sorted(ROUTES)), ("private", "as_subclass")]
)
def test_case3_a_write_through_any_route_faults_and_the_shared_bytes_stay(
    tmp_path: Path, source: str, route: str
) -> None:
    """Over the "store": every route faults and the shared bytes stay; over private memory too."""
    done, before, after = _write_in_a_child(tmp_path, source, route)
    assert done.returncode == -signal.SIGSEGV, (done.returncode, done.stdout, done.stderr[-2000:])
    assert "written" not in done.stdout
    assert "Fatal Python error: Segmentation fault" in done.stderr  # faulthandler names the write...
    assert "<string>" in done.stderr  # ... the code that made it (here the child's script)
    assert after == before  # nothing reached the shared bytes


def test_case3_view_weights_are_the_stores_pages_mapped_read_only() -> None:
    """No copy: the view reads the store's own pages, through a mapping of them no write gets through."""
    src, dst = torch.nn.Linear(256, 256), torch.nn.Linear(256, 256)
    tensors = extract_tensors(src)
    manifest = plan_layout(tensors)
    store, buckets = in_shared_memory(pack(tensors, manifest))
    BoundModel(dst, manifest, view=True).apply(buckets)
    perms, device, inode = mapping_of(dst.weight.data_ptr())
    assert "w" not in perms  # read-only here
    assert (device, inode) == mapping_of(buckets[0][0].ctypes.data)[1:]  # the store's file
    base = np.frombuffer(store, np.uint8).ctypes.data
    entry = next(e for e in manifest.entries if e.key == "weight")
    at = buckets[entry.bucket][entry.index].ctypes.data - base
    store[at] ^= 0xFF  # a change of the store (its writer's) shows in the view: the same pages
    assert not torch.equal(dst.weight, src.weight)
    store[at] ^= 0xFF
    assert_same_weights(dst.state_dict(), src.state_dict())


def test_weights_on_a_read_only_mapping_stay_there(tmp_path: Path) -> None:
    """A doorbell's sealed segment is mapped read-only already: the view reads it in place."""
    data = np.arange(4096, dtype=np.uint8)
    path = tmp_path / "segment"
    path.write_bytes(data.tobytes())
    with open(path, "rb") as f:
        segment = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
    arrays = [np.frombuffer(segment, dtype=np.uint8, count=1024, offset=1024)]
    [[held]] = read_only_buckets([arrays])
    assert held.ctypes.data == arrays[0].ctypes.data  # no copy, no second mapping
    assert not held.flags.writeable


def test_private_memory_is_copied_read_only() -> None:
    """Memory only this process has (small objects, assembled buckets): a read-only copy."""
    arrays = [np.arange(100, dtype=np.uint8), np.arange(7, dtype=np.uint8), np.empty(0, dtype=np.uint8)]
    [held] = read_only_buckets([arrays])
    assert [a.tobytes() for a in held] == [a.tobytes() for a in arrays]
    assert held[0].ctypes.data != arrays[0].ctypes.data
    assert "w" not in mapping_of(held[0].ctypes.data)[0]
    assert not any(a.flags.writeable for a in held)


def _read_only_mappings_of(inode: int) -> int:
    with open("/proc/self/maps") as maps:
        return sum(1 for line in maps if int(line.split()[4]) == inode and "w" not in line.split()[1])


def test_one_read_only_mapping_per_store_gone_with_the_store() -> None:
    """Versions over one store share one read-only mapping of it; it goes once nothing uses it."""
    tensors = extract_tensors(torch.nn.Linear(64, 64))
    manifest = plan_layout(tensors)
    store, buckets = in_shared_memory(pack(tensors, manifest) * 2)  # two "versions" in one store
    inode = mapping_of(buckets[0][0].ctypes.data)[2]
    first = read_only_buckets(buckets[:1])
    second = read_only_buckets(buckets[1:])
    assert _read_only_mappings_of(inode) == 1
    assert first[0][0].tobytes() == second[0][0].tobytes() == buckets[0][0].tobytes()
    del first, second, buckets
    gc.collect()
    store.close()  # the store is gone (Ray unmapped it) and no view reads it
    read_only_buckets([])
    assert _read_only_mappings_of(inode) == 0


def test_a_store_no_second_mapping_can_be_made_of_is_copied_read_only(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """No mremap (another OS, huge pages): each version is copied into read-only memory, with a warning."""
    monkeypatch.setattr(readonly_pages._libc(), "mremap", lambda *args: readonly_pages._MAP_FAILED)
    monkeypatch.setattr(readonly_pages, "_no_alias", set())
    _store, buckets = in_shared_memory([[np.arange(5000, dtype=np.int32).view(np.uint8)]])
    with caplog.at_level("WARNING", logger=readonly_pages.__name__):
        [[held]] = read_only_buckets(buckets)
    assert "copied into read-only memory" in caplog.text
    assert held.tobytes() == buckets[0][0].tobytes()
    perms, device, inode = mapping_of(held.ctypes.data)
    assert "w" not in perms and (device, inode) != mapping_of(buckets[0][0].ctypes.data)[1:]


@pytest.mark.parametrize("cap_mib", ["", "0"])
def test_a_large_view_fills_its_page_tables_once_unless_turned_off(
    monkeypatch: pytest.MonkeyPatch, cap_mib: str
) -> None:
    """As the store's own mapping (RAYSYNC_PREFAULT_STORE_MIB): a forward pass then takes no page faults."""
    monkeypatch.setenv("RAYSYNC_PREFAULT_STORE_MIB", cap_mib)
    nbytes = 32 * 2**20
    _store, buckets = in_shared_memory([[np.ones(nbytes, dtype=np.uint8)]])
    [[held]] = read_only_buckets(buckets)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    assert int(held[:: mmap.PAGESIZE].sum()) == nbytes // mmap.PAGESIZE  # a read of every page
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    if cap_mib == "0":
        assert faults >= nbytes // (64 * 2**10) // 2, faults  # a fault per 64 KiB (the kernel's fault-around)
    else:
        assert faults < 32, faults
