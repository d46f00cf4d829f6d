"""Worker loops for tests/test_adapters.py and examples (spawned by adapters; imports torch only).

``record`` applies versions as they come and writes the worker's whole state
after each one to ``<out_dir>/<tag>-<pid>-<count>.pt`` (written then renamed,
so a reader never sees half a file).
"""

from __future__ import annotations

import os
from typing import Any

import torch


def make_policy() -> torch.nn.Module:
    """The receivers' model (same structure as tests._support.small_policy)."""
    torch.manual_seed(1234)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def record(receiver: Any, out_dir: str, tag: str) -> None:
    """Apply versions in a loop; save the state after each applied one."""
    model = receiver.model
    while True:
        if receiver.receive(timeout=0.05):
            state = {k: v.detach().clone() for k, v in model.state_dict().items()}
            path = os.path.join(out_dir, f"{tag}-{os.getpid()}-{receiver.version_count}.pt")
            torch.save(state, path + ".tmp")
            os.replace(path + ".tmp", path)
