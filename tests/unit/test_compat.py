"""raysync's private uses of other libraries (raysync/_compat.py), probed on the installed versions.

Each test names the use it probes: if a new torch changes it, the failure says which.
"""

from __future__ import annotations

import logging

import pytest
import torch

from raysync import _compat

USE = _compat.TORCH_VERSION_COUNTER


def _bumped(t: torch.Tensor, write: object) -> bool:
    before = _compat.tensor_version(t)
    write()  # type: ignore[operator]
    return _compat.tensor_version(t) > before


def test_torch_version_counter_is_an_int_that_every_in_place_write_bumps() -> None:
    t = torch.zeros(8)
    assert hasattr(t, "_version"), f"{USE} is gone in torch {torch.__version__}"
    assert isinstance(_compat.tensor_version(t), int), f"{USE} is no longer an int"
    assert _compat.version_counters([t, t[:2]]) == [_compat.tensor_version(t)] * 2
    writes = {
        "add_": lambda: t.add_(1),
        "copy_": lambda: t.copy_(torch.ones(8)),
        "+=": lambda: t.__iadd__(1),
        "indexed assignment": lambda: t.__setitem__(slice(0, 2), 5.0),
        "torch._foreach_add_": lambda: torch._foreach_add_([t], 1.0),
    }
    for name, write in writes.items():
        assert _bumped(t, write), f"{USE}: {name} no longer bumps it"
        with torch.no_grad():
            assert _bumped(t, write), f"{USE}: {name} under no_grad no longer bumps it"
        with torch.inference_mode():
            assert _bumped(t, write), f"{USE}: {name} under inference_mode no longer bumps it"


def test_torch_version_counter_is_left_alone_by_reads_and_shared_by_views() -> None:
    t = torch.zeros(8)
    before = _compat.tensor_version(t)
    _ = t + 1, t.sum(), t.clone(), t[2:4].tolist()
    assert _compat.tensor_version(t) == before, f"{USE}: reads or out-of-place ops bump it"
    assert _bumped(t, lambda: t[2:4].add_(1)), f"{USE}: a write through a view no longer bumps its base's"
    view = t[:4]
    assert _bumped(view, lambda: t.add_(1)), f"{USE}: a write to the base no longer bumps its views'"


def test_torch_version_counter_sees_a_batch_norm_forward_in_training_mode() -> None:
    """What tells raysync a BatchNorm left in training mode changed the weights: its
    ``num_batches_tracked += 1`` (its ``running_mean`` update declares no write)."""
    bn = torch.nn.BatchNorm1d(4)
    with torch.inference_mode():
        assert _bumped(bn.num_batches_tracked, lambda: bn(torch.randn(3, 4))), (
            f"{USE}: a BatchNorm forward in training mode no longer bumps num_batches_tracked's"
        )
    bn.eval()
    assert not _bumped(bn.num_batches_tracked, lambda: bn(torch.randn(3, 4)))


def test_torch_outside_the_checked_versions_is_named_at_import(caplog: pytest.LogCaptureFixture) -> None:
    assert _compat.check_versions(torch.__version__) == [], (
        f"torch {torch.__version__} is outside _compat.TORCH_CHECKED {_compat.TORCH_CHECKED}: "
        f"probe {USE} (this file) and widen it"
    )
    assert _compat.check_versions("2.4.0") == [] and _compat.check_versions("2.13.1+cu128") == []
    with caplog.at_level(logging.WARNING, logger="raysync._compat"):
        lines = _compat.check_versions("3.0.0")
    assert len(lines) == 1 and USE in lines[0] and "torch 3.0.0" in lines[0]
    assert USE in caplog.text
    assert len(_compat.check_versions("2.3.1")) == 1


def test_ray_outside_the_checked_versions_is_named_at_import(caplog: pytest.LogCaptureFixture) -> None:
    import ray

    assert _compat.check_versions(torch.__version__, ray.__version__) == [], (
        f"Ray {ray.__version__} is outside _compat.RAY_CHECKED {_compat.RAY_CHECKED}: probe its private "
        "uses (tests/integration/test_compat_ray.py) and widen it"
    )
    with caplog.at_level(logging.WARNING, logger="raysync._compat"):
        lines = _compat.check_versions(torch.__version__, "2.70.0")
    assert len(lines) == 1 and "Ray 2.70.0" in lines[0]
    assert all(use in lines[0] for use in _compat.RAY_USES)


def test_private_torch_dispatch_pieces_are_there() -> None:
    assert isinstance(torch.ops.aten.add_, _compat.OP_OVERLOAD_PACKET), "torch._ops.OpOverloadPacket"
    overload = torch.ops.aten.add_.Tensor
    assert not isinstance(overload, _compat.OP_OVERLOAD_PACKET), "torch._ops.OpOverloadPacket"
    with _compat.plain_tensors():  # torch._C.DisableTorchFunctionSubclass
        pass


def test_ray_calls_without_auto_init_are_there() -> None:
    """raysync's client calls Ray through the functions under its auto-init wrapper (_compat.py):
    this names the use if a Ray release drops the wrapper's ``__wrapped__``."""
    import ray
    from ray.actor import ActorMethod

    wrapped = {
        "ray.get": ray.get,
        "ray.put": ray.put,
        "ray.get_runtime_context": ray.get_runtime_context,
        "ray.get_actor": ray.get_actor,
        "ActorMethod._remote": ActorMethod._remote,
    }
    for name, fn in wrapped.items():
        inner = getattr(fn, "__wrapped__", None)
        assert inner is not None, f"{name} has no __wrapped__: see raysync/_compat.py (call_no_start and kin)"
        assert "auto_init_ray" in fn.__code__.co_names, f"{name}: the outer function is no auto-init wrapper"
        assert "auto_init_ray" not in inner.__code__.co_names, f"{name}: the inner one still auto-inits"


def test_ray_shutdown_waits_for_its_lock() -> None:
    """raysync's threads hold ``ray._private.worker._connect_or_shutdown_lock`` around their calls
    into Ray (_compat.shutdown_lock): this names the use if ``ray.shutdown()`` stops taking it."""
    import threading

    import ray

    lock = _compat.shutdown_lock()
    assert lock.acquire(blocking=False), "ray._private.worker._connect_or_shutdown_lock"
    lock.release()
    ended = threading.Event()
    shutdown = threading.Thread(target=lambda: (ray.shutdown(), ended.set()), daemon=True)
    with lock:
        shutdown.start()
        assert not ended.wait(0.5), "ray.shutdown() ran while raysync held its lock (_compat.shutdown_lock)"
    assert ended.wait(60), "ray.shutdown() did not end once the lock was released"
