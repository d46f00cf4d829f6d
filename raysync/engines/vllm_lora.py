"""LoRA adapters served by a vLLM engine from memory: each adapter version a model of its own.

A trainer pushes an adapter as a model of its own (``hub.push(raysync.lora_adapter(peft_model),
"math")``); an engine started with LoRA on (``enable_lora=True``, ``max_lora_rank``,
``max_loras``) follows it beside its base model (``follow_engine(llm, "policy",
adapters=["math"])``), and ``engine.generate(prompts, params, adapter="math")`` runs the
requests with the adapter version it holds, stamped on the result.

**How a version goes in, and why this way.** vLLM 0.32 loads an adapter only from a path
(``LoRARequest.lora_path``: ``adapter_config.json`` and ``adapter_model.safetensors``), so
the public route is to write each version to a file (in ``/dev/shm``: about 35 ms a version
for the tests' adapter, measured) and have vLLM read it back. raysync builds the adapter in
the engine's workers from the tensors it fetched instead (about 2-3 ms): vLLM's own
``PEFTHelper.from_dict`` and ``validate_legal`` check the config,
``LoRAModel.from_lora_tensors`` builds the adapter as vLLM's own loader does from a file,
and the worker's adapter manager takes it under an id of its own, pinned (never evicted,
so vLLM never looks for a file behind it). Adding it to the manager is the one step that
uses a part of vLLM that is not public (the worker's ``_adapter_manager``); it is here alone.

**Old or new, never half.** Each adapter version gets a new adapter id: the version is
built whole in the workers first, then, while no request names the adapter (the engine's
``_swapping``: the offline engine's lock, so no ``generate`` runs; the async engine's
hold on that adapter's requests, :mod:`raysync.engines.vllm_async`), the previous id is
removed and the new one added. A request names the id of the version the engine held
when it started, so it runs with that version whole; prompts cached for an older version
are never reused (vLLM keys its prefix cache by adapter id). After a base version (vLLM
drops every adapter) the held version goes back under the same id (the async engine's
pause clears vLLM's prefix cache).

**Checks before bytes.** Every version carries its config (rank, alpha, target modules)
in its manifest: a rank over the engine's ``max_lora_rank``, a target module the model
lacks, a tensor whose shape misfits its module, or a name that is no LoRA tensor is refused
before any byte is fetched, naming it; the engine keeps serving the version it had.

**The engine's workers get one method from raysync.** The build runs in each worker, through
``LLM.collective_rpc`` by method name (vLLM sends no functions to an engine core in another
process), so the engine is created with ``worker_extension_cls=WORKER_EXTENSION``
(:class:`AdapterWorker`, one method; a class of your own there may derive from it).

The async engine (``AsyncLLM``) serves adapters the same way:
``await follow_async_engine(async_llm, "policy", adapters=["math"])``, then
``await synced.generate(prompt, params, adapter="math")``.

Example:
    >>> llm = vllm.LLM(path, enable_lora=True, max_lora_rank=8, max_loras=2,
    ...                weight_transfer_config={"backend": "raysync"},
    ...                worker_extension_cls=WORKER_EXTENSION)                  # doctest: +SKIP
    >>> engine = follow_engine(llm, "policy", adapters=["math"])              # doctest: +SKIP
    >>> gen = engine.generate(prompts, params, adapter="math")                # doctest: +SKIP
    >>> gen.version, gen.adapter_version                                      # doctest: +SKIP
    (1, 7)
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from raysync.core.layout import Manifest, validate
from raysync.core.lora import PREFIX, AdapterConfig, adapter_config, unpaired
from raysync.errors import EngineNotReadyError, RaySyncError, SyncTimeoutError, WeightMismatchError
from raysync.receivers.follower import Follower, wait_for_first
from raysync.receivers.target import Incoming

if TYPE_CHECKING:
    from raysync.engines.vllm import VLLMEngine

__all__ = [
    "WORKER_EXTENSION",
    "AdapterWorker",
    "VLLMAdapter",
    "adapter_targets",
    "follow_adapters",
    "install_adapter",
    "lora_request",
]

logger = logging.getLogger(__name__)

_IDS = itertools.count(1)  # vLLM's adapter ids: one per adapter version, unique in this process
_IDS_LOCK = threading.Lock()


class VLLMAdapter:
    """One adapter of a :class:`~raysync.engines.vllm.VLLMEngine`, as a raysync target.

    Args:
        engine: the engine (created with ``enable_lora=True``).
        adapter_id: the adapter's model id on the hub; requests name it.

    Attributes:
        version: the adapter version the engine holds (``None`` before one).
        lora_id: vLLM's id of that version in the engine (``None`` before one).

    Raises:
        RaySyncError: the engine was created without LoRA.
    """

    def __init__(self, engine: VLLMEngine, adapter_id: str) -> None:
        config = getattr(engine.llm, "llm_engine", engine.llm).vllm_config
        self.lora_config = config.lora_config
        if self.lora_config is None or not _extends(config.parallel_config.worker_extension_cls):
            raise RaySyncError(
                f"{engine.name}: serving adapter {adapter_id!r} needs an engine created with LoRA on and "
                "raysync's worker method: vllm.LLM(..., enable_lora=True, max_lora_rank=<the adapters' "
                f"rank>, max_loras=<how many>, worker_extension_cls={WORKER_EXTENSION!r})"
            )
        self.engine = engine
        self.adapter_id = adapter_id
        self.name = f"{engine.name} adapter {adapter_id!r}"
        self.version: int | None = None
        self.lora_id: int | None = None
        self._held: tuple[list[tuple[str, torch.Tensor]], AdapterConfig] | None = None  # to load again
        # {module path: (out, in)} of every 2-D weight the model has: what an adapter may target
        self._linear = {
            name.removesuffix(".weight"): shape
            for name, shape in engine._schema.items()
            if name.endswith(".weight") and len(shape) == 2
        }

    def __repr__(self) -> str:
        return f"VLLMAdapter({self.name}, version={self.version})"

    # ------------------------------------------------------------------ Target
    def check(self, manifest: Manifest) -> None:
        """Refuse an adapter version the engine cannot serve, before any byte is fetched.

        Raises:
            RaySyncError: no adapter config, or a rank over ``max_lora_rank``, or target
                modules the model lacks.
            WeightMismatchError: a tensor that is no LoRA tensor of the model's modules,
                or whose shape misfits.
        """
        config = adapter_config(manifest)
        limit = int(self.lora_config.max_lora_rank)
        if config.r > limit:
            raise RaySyncError(
                f"{self.name}: the adapter's rank {config.r} exceeds the engine's max_lora_rank {limit}"
            )
        modules = {m.rpartition(".")[2] for m in self._linear}
        lacking = [t for t in config.target_modules if t not in modules]
        if lacking:
            raise RaySyncError(
                f"{self.name}: the model has no modules named {lacking} (the adapter's targets)"
            )
        schema: dict[str, tuple[tuple[int, ...], str | None]] = {}
        for module, (out_features, in_features) in self._linear.items():
            if module.rpartition(".")[2] in config.target_modules:
                schema[f"{PREFIX}{module}.lora_A.weight"] = ((config.r, in_features), None)
                schema[f"{PREFIX}{module}.lora_B.weight"] = ((out_features, config.r), None)
        validate(manifest, schema, who=self.name, partial=True, floating=True)
        halves = unpaired(e.key for e in manifest.entries)
        if halves:
            raise WeightMismatchError(f"{self.name}: modules with lora_A or lora_B alone: {halves[:5]}")

    def needed(self, manifest: Manifest, ids: Sequence[str | None]) -> list[int]:
        """Every bucket: an adapter version goes in whole."""
        return list(range(manifest.num_buckets))

    def commit(self, incoming: Incoming) -> None:
        """Build the version in the engine's workers, then swap it for the previous one.

        Raises:
            RaySyncError: vLLM refused or failed to build it; the engine keeps the version it had.
        """
        # copies of the fetched bytes, kept to load again (plain views to copy from: no read-only
        # wrapper's dispatch per tensor, and nothing here writes to them)
        copies = [(name, t.clone()) for name, t in incoming.tensors(read_only=False)]
        held = (copies, adapter_config(incoming.manifest))
        with self.engine._swapping(self.adapter_id):  # no request names the old id or the new one
            try:
                self._install(*held, replaces=self.lora_id)
            except Exception as err:
                raise RaySyncError(
                    f"{self.name}: version {incoming.version} was not loaded ({type(err).__name__}: "
                    f"{str(err)[:300]}); it serves version {self.version}"
                ) from err
            self.version, self._held = incoming.version, held
            self.engine._adapters[self.adapter_id] = self

    def _install(
        self,
        tensors: list[tuple[str, torch.Tensor]],
        config: AdapterConfig,
        *,
        replaces: int | None,
        new_id: int | None = None,
    ) -> None:
        """Build the version in every worker under ``new_id`` (default: a new id), then
        remove ``replaces`` and add it; ``lora_id`` is ``new_id`` after."""
        from raysync.engines.vllm_transfer import wire

        # vLLM scales lora_B in place (LoRALayerWeights.optimize): it gets copies of those, never
        # the bytes kept to load again; lora_A it only reads, and keeps: the held tensors themselves
        payload = (
            {"weights": [(n, t if ".lora_A." in n else t.clone()) for n, t in tensors]}
            if self.engine._in_process
            else wire(tensors)
        )
        if new_id is None:
            with _IDS_LOCK:
                new_id = next(_IDS)
        self.engine._rpc(_METHOD, args=(payload, config.as_peft(), new_id, replaces))
        self.lora_id = new_id

    def load_again(self) -> None:
        """After the base weights changed (vLLM then drops every adapter): the version held, again,
        under the same id, so a request that named it before the base changed runs with it
        (an async engine's requests queued in vLLM while it was paused).

        Under the engine's lock (and the async engine's pause). If it fails, the adapter
        holds no version until its next one.
        """
        if self._held is None:
            return
        try:
            self._install(*self._held, replaces=self.lora_id, new_id=self.lora_id)
        except Exception as err:
            logger.warning(
                "%s: loading version %s again on the new base failed: %r", self.name, self.version, err
            )
            self.version, self.lora_id, self._held = None, None, None
            self.engine._adapters.pop(self.adapter_id, None)

    def intact(self) -> bool:
        """Always: a version that fails leaves the previous one in place."""
        return True

    def forget(self) -> None:
        """Nothing to forget: every version goes in whole."""


def lora_request(engine: VLLMEngine, adapter: str) -> tuple[Any, int]:
    """vLLM's ``LoRARequest`` for the version of ``adapter`` the engine holds, and that version.

    Under the engine's lock (:meth:`~raysync.engines.vllm.VLLMEngine.generate`).

    Raises:
        EngineNotReadyError: no version of the adapter yet.
        KeyError: the engine follows no adapter ``adapter``.
    """
    from vllm.lora.request import LoRARequest

    held = engine._adapters.get(adapter)
    if held is None or held.version is None or held.lora_id is None:
        followed = sorted(str(f.model_id) for f in engine.adapter_followers)
        if adapter in followed:
            raise EngineNotReadyError(f"{engine.name} holds no version of adapter {adapter!r} yet")
        raise KeyError(f"{engine.name} follows no adapter {adapter!r} (it follows {followed})")
    # The adapter is in the workers already, pinned: vLLM never reads the path.
    return LoRARequest(adapter, held.lora_id, f"raysync://{adapter}"), held.version


def adapter_targets(engine: VLLMEngine, adapters: Sequence[str]) -> list[VLLMAdapter]:
    """A :class:`VLLMAdapter` for each adapter, once the engine can keep them all.

    Raises:
        RaySyncError: an engine without LoRA, or more adapters than it keeps (``max_cpu_loras``).
    """
    targets = [VLLMAdapter(engine, adapter) for adapter in adapters]
    if targets:
        config = targets[0].lora_config
        capacity = config.max_cpu_loras or config.max_loras
        if len(targets) > capacity:
            raise RaySyncError(
                f"{engine.name}: {len(targets)} adapters, more than the engine keeps (max_cpu_loras "
                f"{capacity}): create it with max_loras (or max_cpu_loras) >= {len(targets)}"
            )
    return targets


def follow_adapters(
    engine: VLLMEngine, targets: Sequence[VLLMAdapter], *, hub: str, namespace: str | None, timeout: float
) -> None:
    """Have ``engine`` follow each adapter, after its base model; returns once it holds a
    version of each (what :func:`~raysync.engines.vllm.follow_engine` does with ``adapters``).

    Raises:
        SyncTimeoutError: an adapter without a version within ``timeout`` (the engine stops following).
    """
    base = engine.follower.sub_id if engine.follower is not None else engine.name
    for target in targets:
        follower = Follower(
            target=target,
            model_id=target.adapter_id,
            hub=hub,
            namespace=namespace,
            sub_id=f"{base}/lora:{target.adapter_id}",
            label=target.name,
            timeout=timeout,
        ).start()
        engine.adapter_followers.append(follower)
        try:
            wait_for_first(follower, timeout)
        except SyncTimeoutError:
            engine.stop()
            raise


class AdapterWorker:
    """vLLM worker extension (``worker_extension_cls=WORKER_EXTENSION``): the method raysync calls
    in each of the engine's workers to put an adapter version in (:func:`install_adapter`)."""

    def raysync_install_adapter(
        self, payload: Mapping[str, Any], config: Mapping[str, Any], new_id: int, old_id: int | None
    ) -> None:
        install_adapter(self, payload, config, new_id, old_id)


WORKER_EXTENSION = f"{__name__}.{AdapterWorker.__qualname__}"
"""What an engine serving adapters is created with (``vllm.LLM(..., worker_extension_cls=...)``)."""
_METHOD = "raysync_install_adapter"


def _extends(qualname: str) -> bool:
    """Whether vLLM's ``worker_extension_cls`` gives the workers :class:`AdapterWorker`'s method."""
    if qualname == WORKER_EXTENSION:
        return True
    module, _, name = qualname.rpartition(".")
    try:
        import importlib

        return issubclass(getattr(importlib.import_module(module), name), AdapterWorker)
    except (ImportError, AttributeError, TypeError, ValueError):
        return False


def install_adapter(
    worker: Any, payload: Mapping[str, Any], config: Mapping[str, Any], new_id: int, old_id: int | None
) -> None:
    """In each of the engine's workers: build adapter ``new_id`` from its tensors, then
    replace ``old_id`` with it (pinned). Run through ``LLM.collective_rpc``.

    The adapter is built (and vLLM's checks run) before anything changes: if that raises,
    the worker still serves ``old_id``; if vLLM's manager refuses the new one after that, the
    old one is put back before the error goes on.
    """
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.peft_helper import PEFTHelper

    from raysync.engines.vllm_transfer import RaySyncUpdateInfo

    tensors = dict(RaySyncUpdateInfo(**payload).pairs())  # pairs here, or bytes from another process
    manager = worker.model_runner.lora_manager
    helper = PEFTHelper.from_dict(dict(config))
    helper.validate_legal(manager.lora_config)
    adapters = manager._adapter_manager  # the one non-public step (see the module's notes)
    model = adapters.model
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    lora = LoRAModel.from_lora_tensors(
        new_id,
        tensors,
        helper,
        device="cpu",
        dtype=manager.lora_config.lora_dtype,
        model_vocab_size=manager.vocab_size,
        weights_mapper=None if mapper is None else mapper.get_rename_mapper(),
        skip_prefixes=getattr(model, "lora_skip_prefixes", None),
    )
    old = None if old_id is None else adapters.get_adapter(old_id)
    if old_id is not None:
        adapters.remove_adapter(old_id)
    try:
        adapters.add_adapter(lora)
        adapters.pin_adapter(new_id)
    except BaseException:  # the old version back in its place: requests keep running on it
        adapters.remove_adapter(new_id)
        if old is not None:
            adapters.add_adapter(old)
            adapters.pin_adapter(old.id)
        raise
