"""raysync.schemes registers with torchrl's WeightSyncScheme ABC without importing torchrl.

Each case runs in a fresh interpreter: what is imported, and in which order, is the point.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest


def _run(code: str) -> str:
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip()


def test_schemes_work_without_torchrl() -> None:
    # torchrl absent: importing it fails, as in an install without the extra
    out = _run(
        """
        import sys
        sys.modules["torchrl"] = None  # `import torchrl` now raises ImportError
        import torch
        from raysync import schemes
        from raysync.torchrl.base import register_with_torchrl
        s = schemes.MultiProcessWeightSyncScheme(timeout=5)
        assert register_with_torchrl() is False
        assert register_with_torchrl(import_torchrl=True) is False
        w = schemes.WeightStrategy()
        td = w.extract_weights(torch.nn.Linear(2, 1))
        assert sorted(td.keys()) == ["bias", "weight"]
        print(s.strategy_str, type(schemes.WeightSyncScheme.from_backend("none")).__name__)
        """
    )
    assert out == "tensordict NoWeightSyncScheme"


@pytest.mark.parametrize("raysync_first", [True, False], ids=["raysync-first", "torchrl-first"])
def test_torchrl_accepts_every_scheme_in_either_import_order(raysync_first: bool) -> None:
    pytest.importorskip("torchrl")
    first, second = (
        (
            "import sys, raysync; from raysync import schemes; s = schemes.NoWeightSyncScheme(); "
            "assert not [m for m in sys.modules if m.split('.')[0] == 'torchrl'], 'torchrl imported'",
            "import torchrl.weight_update as tw",
        )
        if raysync_first
        else (
            "import torchrl.weight_update as tw",
            "from raysync import schemes; s = schemes.NoWeightSyncScheme()",
        )
    )
    out = _run(
        f"""
        {first}
        {second}
        names = ["MultiProcessWeightSyncScheme", "SharedMemWeightSyncScheme", "NoWeightSyncScheme",
                 "RayWeightSyncScheme", "RayModuleTransformScheme", "RPCWeightSyncScheme",
                 "DistributedWeightSyncScheme"]
        print(all(isinstance(getattr(schemes, n)(), tw.WeightSyncScheme) for n in names))
        # torchrl's own module still loads from its file (the hook only wraps its loader)
        import torchrl.weight_update.weight_sync_schemes as m, inspect
        print(inspect.getsource(m).count("class WeightSyncScheme") == 1)
        """
    )
    assert out == "True\nTrue"
