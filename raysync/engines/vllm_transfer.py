"""The vLLM side: a weight-transfer engine named ``raysync``, registered with vLLM's factory.

vLLM 0.32 updates a running engine's weights through its weight-transfer API: the engine
is created with ``weight_transfer_config={"backend": <name>}``, and each update is
``init_weight_transfer_engine`` (once), then ``start_weight_update``, ``update_weights``
(one or more chunks), ``finish_weight_update``, each run on every worker. Backends are
classes registered by name with ``WeightTransferEngineFactory``; this module is the one
registered as ``raysync`` (by :func:`register`, which vLLM also calls in each of its
processes as a ``vllm.general_plugins`` entry point once raysync is installed).

What the backend does per version (each step is vLLM's own, as its IPC backend does it):

- ``start_weight_update``: vLLM's ``initialize_layerwise_reload`` (each layer waits for
  all its weights, then is processed: fused, repacked for the CPU's kernels, ...).
- ``update_weights({"weights": [(name, tensor), ...]})``: the model's own
  ``load_weights``, which maps a ``transformers`` state dict's names into vLLM's fused
  layout (q/k/v, gate/up, tied embeddings). The pairs are raysync's verified views of
  the version's bytes (in the engine's process: no copy); to an engine core in another
  process they go as plain bytes (:func:`wire`) through vLLM's own messages.
  Then vLLM's ``finalize_layerwise_reload``, in the same call (see
  :meth:`RaySyncTransferEngine.receive_weights`).
- ``finish_weight_update``: nothing left to do.

A load that raises part-way is finished at once: the layers that got all their weights
hold the new ones, every other layer gets its own tensors back (vLLM's path for a layer
that got nothing), so no layer is left on the meta device, and the error says the engine
is torn (:data:`TORN`). Copying parameters back is no rollback: vLLM's CPU kernels (and
others) work from weights repacked when a layer is processed, so
:class:`~raysync.engines.vllm.VLLMEngine` rolls back by loading its previous version again.

Example:
    >>> from raysync.engines.vllm_transfer import register  # doctest: +SKIP
    >>> register()                                          # before vllm.LLM(...)
    >>> llm = vllm.LLM(model, weight_transfer_config={"backend": "raysync"})  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import WeightTransferEngine

__all__ = [
    "BACKEND",
    "TORN",
    "RaySyncInitInfo",
    "RaySyncTransferEngine",
    "RaySyncUpdateInfo",
    "in_process",
    "register",
    "wire",
]

logger = logging.getLogger(__name__)

BACKEND = "raysync"
"""The name the backend is registered under (``weight_transfer_config={"backend": BACKEND}``)."""

TORN = "[raysync: the engine holds part of the failed version]"
"""In the message of a failed update after which the engine is torn."""


@dataclasses.dataclass
class RaySyncInitInfo:
    """``init_weight_transfer_engine``'s info: nothing to set up (the bytes come through Ray)."""


@dataclasses.dataclass
class RaySyncUpdateInfo:
    """One ``update_weights`` chunk, names as in the trainer's state dict.

    Either ``weights``, ``(name, tensor)`` pairs (the engine core in the caller's process:
    passed as they are), or ``names``, ``dtypes``, ``shapes`` and ``data`` (each tensor's
    bytes), plain values that vLLM's messages between processes carry (they do not carry
    tensors inside an untyped dict).
    """

    weights: Any = None
    names: list[str] | None = None
    dtypes: list[str] | None = None
    shapes: list[list[int]] | None = None
    data: list[bytes] | None = None

    def pairs(self) -> Iterable[tuple[str, torch.Tensor]]:
        """The ``(name, tensor)`` pairs, read-only views of the bytes received."""
        if self.weights is not None:
            return ((str(n), t) for n, t in self.weights)
        names, dtypes, shapes, data = self.names, self.dtypes, self.shapes, self.data
        if names is None or dtypes is None or shapes is None or data is None:
            raise ValueError("a raysync update carries weights=, or names, dtypes, shapes and data")
        if not len(names) == len(dtypes) == len(shapes) == len(data):
            raise ValueError("a raysync update's names, dtypes, shapes and data differ in length")
        return (
            (str(name), _tensor(blob, dtype, shape))
            for name, dtype, shape, blob in zip(names, dtypes, shapes, data, strict=True)
        )


def wire(pairs: Iterable[tuple[str, torch.Tensor]]) -> dict[str, Any]:
    """``(name, tensor)`` pairs as an update for an engine core in another process (copies the bytes)."""
    names, dtypes, shapes, data = [], [], [], []
    for name, t in pairs:
        t = t.detach().contiguous().cpu()
        names.append(name)
        dtypes.append(str(t.dtype).removeprefix("torch."))
        shapes.append(list(t.shape))
        data.append(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return {"names": names, "dtypes": dtypes, "shapes": shapes, "data": data}


def in_process(llm: Any) -> bool:
    """Whether the engine core and its one worker run in this process (tensors then go as they are).

    Anything else (an engine-core process, several workers, another executor) gets plain
    bytes: vLLM's messages between processes do not carry tensors inside an untyped dict.
    """
    try:
        from vllm.v1.engine.core_client import InprocClient
    except ImportError:
        return False
    engine = getattr(llm, "llm_engine", None)  # an AsyncLLM has none: its core is another process
    if engine is None:
        return False
    parallel = engine.vllm_config.parallel_config
    return (
        isinstance(getattr(engine, "engine_core", None), InprocClient)
        and parallel.world_size == 1
        and parallel.distributed_executor_backend in (None, "uni")
    )


def _tensor(blob: bytes, dtype: str, shape: list[int]) -> torch.Tensor:
    torch_dtype = getattr(torch, dtype, None)
    if not isinstance(torch_dtype, torch.dtype):
        raise ValueError(f"unknown dtype {dtype!r} in a raysync update")
    if not blob:
        return torch.empty(shape, dtype=torch_dtype)
    flat = torch.frombuffer(bytearray(blob) if not isinstance(blob, bytearray) else blob, dtype=torch.uint8)
    return flat.view(torch_dtype).reshape(shape)


class RaySyncTransferEngine(WeightTransferEngine):  # type: ignore[misc]
    """vLLM's side of raysync: loads each version through the model's own ``load_weights``.

    Example:
        >>> llm.collective_rpc("init_weight_transfer_engine", kwargs={"init_info": {}})
        >>> llm.collective_rpc("start_weight_update")  # doctest: +SKIP
        >>> llm.collective_rpc("update_weights", kwargs={"update_info": {"weights": pairs}})  # doctest: +SKIP
        >>> llm.collective_rpc("finish_weight_update")  # doctest: +SKIP
    """

    init_info_cls = RaySyncInitInfo
    update_info_cls = RaySyncUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._started = False

    def init_transfer_engine(self, init_info: RaySyncInitInfo) -> None:
        pass

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)
        self._started = True

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # vLLM's default ends with torch.accelerator.synchronize(); on the CPU backend (and
        # for this in-place load) there is nothing asynchronous to wait for.
        info = self.parse_update_info(update_info)
        self.receive_weights(info)
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    def receive_weights(self, update_info: RaySyncUpdateInfo) -> None:
        """Load the version and finish vLLM's layerwise reload, here rather than in
        ``finish_weight_update``: a failure there would leave vLLM's worker in its update
        (it resets its state only when ``update_weights`` raises)."""
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        try:
            self.model.load_weights(update_info.pairs())
            self._started = False
            finalize_layerwise_reload(self.model, self.model_config)
        except BaseException as err:
            self._abort()
            raise RuntimeError(f"{type(err).__name__}: {err} {TORN}") from err
        finally:
            self._started = False

    def finish_weight_update(self) -> None:
        """Nothing left to do: the version was finished in ``update_weights``."""
        self._started = False

    def shutdown(self) -> None:
        pass

    def _abort(self) -> None:
        """After a load that raised: no layer left on the meta device, none built from part of its weights."""
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload
        from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

        if not self._started:
            return
        self._started = False
        # A layer still waiting for some of its weights drops what it got, so that
        # finishing puts its own tensors back (vLLM's path for a layer that got
        # nothing) instead of building it from part of a version, or failing on
        # the tensor that made the load fail.
        for layer in self.model.modules():
            info = get_layerwise_info(layer)
            if info.can_load():
                info.loaded_weights = []
                info.load_numel = 0
        try:
            finalize_layerwise_reload(self.model, self.model_config)
        except Exception as err:
            logger.warning("raysync: finishing vLLM's reload after a failed update failed: %s", err)


def register() -> None:
    """Register the ``raysync`` backend with vLLM's weight-transfer factory (again: no-op).

    Called by vLLM in each of its processes (a ``vllm.general_plugins`` entry point);
    call it yourself before creating the engine where raysync is not installed as a package.
    """
    try:
        from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    except ImportError as err:  # a vLLM without the weight-transfer API: never break its start
        logger.warning("raysync: this vLLM has no weight-transfer factory (%s); backend not registered", err)
        return
    try:
        WeightTransferEngineFactory.register_engine(BACKEND, RaySyncTransferEngine)
    except ValueError:  # registered already (vLLM loads plugins once per process; users may too)
        pass
