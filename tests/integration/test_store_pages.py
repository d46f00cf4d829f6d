"""A pusher maps the object store once: a later push into memory it never touched takes no page faults."""

from __future__ import annotations

import ctypes
import mmap
import resource
import sys
from typing import Any

import pytest
import ray
import torch

import raysync


def _kernel_populates() -> bool:
    """Whether this kernel knows MADV_POPULATE_WRITE (Linux 5.14+)."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    region = mmap.mmap(-1, 4 * 4096)
    address = ctypes.addressof(ctypes.c_char.from_buffer(region))
    ok = libc.madvise(address, 4 * 4096, 23) == 0
    return ok


pytestmark = pytest.mark.skipif(
    not _kernel_populates(), reason="needs madvise(MADV_POPULATE_WRITE), Linux 5.14+"
)

VERSION_BYTES = 32 * 2**20
PAGE = 4096


@ray.remote(num_cpus=0)
class Pusher:
    """A trainer in its own process (so 'first push in this process' is really the first)."""

    def second_push_faults(self, hub_name: str) -> dict[str, int]:
        hub = raysync.connect(hub_name, keep=2)
        sd = {f"w{i}": torch.full((VERSION_BYTES // 4 // 4,), float(i)) for i in range(4)}
        hub.push(sd)  # version 1 stays alive (keep=2): version 2 must land in other store memory
        sd["w0"][0] = 7.0
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        hub.push(sd)
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
        ray.kill(hub.actor)
        return {"faults": faults, "pages": VERSION_BYTES // PAGE}


def _faults(hub_name: str, env: dict[str, str]) -> dict[str, int]:
    actor: Any = Pusher.options(runtime_env={"env_vars": env}).remote()
    try:
        return ray.get(actor.second_push_faults.remote(hub_name), timeout=120)
    finally:
        ray.kill(actor)


def test_second_push_takes_no_page_faults_unless_turned_off(hub_name: str) -> None:
    populated = _faults(hub_name + "-on", {})
    off = _faults(hub_name + "-off", {"RAYSYNC_PREFAULT_STORE_MIB": "0"})
    # Without populating, every 4 KiB page of the new version faults once in the pusher.
    assert off["faults"] >= off["pages"] * 0.9, off
    assert populated["faults"] < populated["pages"] * 0.1, populated
