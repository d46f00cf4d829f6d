"""vLLM's async engine (``AsyncLLM``) as a raysync receiver: versions go in between requests.

:class:`VLLMAsyncEngine` is :class:`~raysync.engines.vllm.VLLMEngine` for an ``AsyncLLM``
(what vLLM's server and most RL frameworks run): the same check, the same whole-or-nothing
load through the ``raysync`` weight-transfer backend, the same rollback. What differs is
how requests are held while a version goes in: with vLLM's own pause
(``pause_generation(mode=...)`` before the update, ``resume_generation`` after it, and after
a failed one and its rollback), so requests keep arriving and wait in the engine's queue;
and the version is set (``update_weight_version``, as ``finish_weight_update(weight_version=...)``
does) before requests resume; vLLM stamps it on every output.

The follower's thread runs each update as a coroutine on the engine's event loop (the
loop the ``AsyncLLM`` was made on), so the loop must keep running while versions arrive;
:func:`follow_async_engine` is awaited on that loop and starts the follower off it.

Pause modes: ``"wait"`` (the default: running requests finish on the version they began
with, then the update) and ``"abort"`` (running requests are aborted). vLLM's ``"keep"``
would resume frozen requests on the new version, so one output would come from two
versions: refused.

Example:
    >>> args = AsyncEngineArgs(path, weight_transfer_config={"backend": "raysync"})
    >>> engine = AsyncLLM.from_engine_args(args)                       # doctest: +SKIP
    >>> synced = await follow_async_engine(engine, "policy")           # doctest: +SKIP
    >>> gen = await synced.generate({"prompt_token_ids": [1, 2]}, params)  # doctest: +SKIP
    >>> gen.version                                                    # doctest: +SKIP
    3
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from raysync import _protocol as proto
from raysync.channels.base import DEFAULT_TIMEOUT
from raysync.engines.vllm import Generation, VLLMEngine, start_following
from raysync.errors import EngineNotReadyError, RaySyncError

__all__ = ["TORN", "VLLMAsyncEngine", "follow_async_engine"]

TORN = "torn"
"""vLLM's weight version while a failed update left the engine torn (no output is served under it)."""


class VLLMAsyncEngine(VLLMEngine):
    """A vLLM ``AsyncLLM`` as a raysync :class:`~raysync.receivers.target.Target`.

    Args:
        llm: an ``AsyncLLM`` made with ``weight_transfer_config={"backend": "raysync"}``.
        loop: the event loop it runs on (default: the running loop; make it there).
        pause_mode: ``"wait"`` or ``"abort"``: what vLLM does with running requests while a
            version goes in (see the module's notes).
        expected, rollback, name: as for :class:`~raysync.engines.vllm.VLLMEngine`.

    Example:
        >>> synced = VLLMAsyncEngine(async_llm, rollback=True)  # doctest: +SKIP
    """

    def __init__(
        self,
        llm: Any,
        *,
        loop: asyncio.AbstractEventLoop | None = None,
        pause_mode: Literal["wait", "abort"] = "wait",
        expected: Mapping[str, Sequence[int]] | None = None,
        rollback: bool = False,
        name: str = "vLLM async engine",
    ) -> None:
        if pause_mode not in ("wait", "abort"):
            raise ValueError(
                f"pause_mode must be 'wait' or 'abort', got {pause_mode!r} ('keep' would resume "
                "requests on the new version: one output from two versions)"
            )
        try:
            self.loop = loop or asyncio.get_running_loop()
        except RuntimeError:
            raise RaySyncError(f"{name}: pass loop=, the event loop the AsyncLLM runs on") from None
        self.pause_mode = pause_mode
        super().__init__(llm, expected=expected, rollback=rollback, name=name)

    # ------------------------------------------------------------------ serving
    async def generate(  # type: ignore[override]
        self, prompt: Any, sampling_params: Any = None, request_id: str | None = None, **kwargs: Any
    ) -> Generation:
        """One request through ``AsyncLLM.generate``: its final output, and the version that made it.

        Raises:
            EngineNotReadyError: the engine holds no whole version (none yet, or torn).
        """
        self._ready()
        final = None
        async for out in self.llm.generate(prompt, sampling_params, request_id or uuid.uuid4().hex, **kwargs):
            final = out
        assert final is not None, "AsyncLLM.generate yielded nothing"
        stamps = {s.version for c in final.outputs for s in (getattr(c, "weight_versions", None) or [])}
        if TORN in stamps:
            raise EngineNotReadyError(
                f"{self.name}: the output was made while a failed update tore the engine"
            )
        assert len(stamps) <= 1, f"{self.name}: one output stamped by several versions {sorted(stamps)}"
        return Generation([final], int(stamps.pop()) if stamps else self._ready())

    def weight_version(self) -> str:
        return str(self._run(self.llm.get_weight_version()))

    # ------------------------------------------------------------------ vLLM calls
    def _run(self, coro: Any) -> Any:
        """Run ``coro`` on the engine's loop from the follower's thread; its result."""
        try:
            on_loop = asyncio.get_running_loop() is self.loop
        except RuntimeError:
            on_loop = False
        if on_loop:
            coro.close()
            raise RaySyncError(f"{self.name}: called on the engine's own event loop; use a thread")
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def _rpc(self, method: str, **kwargs: Any) -> Any:
        return self._run(self.llm.collective_rpc(method, **kwargs))

    def commit(self, incoming: Any) -> None:
        """The version goes in while vLLM holds requests: paused before, resumed after, also
        after a failure and its rollback (requests never run between the two)."""
        self._run(self.llm.pause_generation(mode=self.pause_mode, clear_cache=True))
        try:
            super().commit(incoming)
        finally:
            self._run(self.llm.resume_generation())

    def _load(self, pairs: list[Any], *, version: str | None = None) -> None:
        try:
            super()._load(pairs)
        except BaseException:
            # Until a version goes in whole (the held one again, with rollback), what the
            # engine makes is stamped TORN, and generate() refuses it.
            self._run(self.llm.update_weight_version(TORN))
            raise
        if version is not None:  # before requests resume: outputs are stamped right
            self._run(self.llm.update_weight_version(version))

    def _set_version(self, version: str) -> None:
        """Set already, before requests resume (:meth:`_load`)."""


async def follow_async_engine(
    llm: Any,
    model_id: str = "policy",
    *,
    hub: str = proto.DEFAULT_HUB,
    namespace: str | None = None,
    label: str | None = None,
    timeout: float = DEFAULT_TIMEOUT,
    pause_mode: Literal["wait", "abort"] = "wait",
    rollback: bool = False,
    expected: Mapping[str, Sequence[int]] | None = None,
    sub_id: str | None = None,
) -> VLLMAsyncEngine:
    """Have an ``AsyncLLM`` follow ``model_id`` on the hub (awaited on the engine's loop).

    See :func:`~raysync.engines.vllm.follow_engine`; the engine holds the hub's newest
    version when this returns (it waits up to ``timeout`` for a first one).

    Raises:
        SyncTimeoutError: no version of ``model_id`` within ``timeout``.

    Example:
        >>> synced = await follow_async_engine(async_llm, "policy", rollback=True)  # doctest: +SKIP
    """
    loop = asyncio.get_running_loop()
    engine = await asyncio.to_thread(
        VLLMAsyncEngine,
        llm,
        loop=loop,
        pause_mode=pause_mode,
        expected=expected,
        rollback=rollback,
        name=label or "vLLM async engine",
    )
    await asyncio.to_thread(
        start_following,
        engine,
        model_id,
        hub=hub,
        namespace=namespace,
        label=label,
        timeout=timeout,
        sub_id=sub_id,
        first=True,
    )
    return engine
