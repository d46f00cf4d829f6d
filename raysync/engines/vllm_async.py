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
versions: refused. In mode ``"wait"`` vLLM holds only the requests it has not begun:
those it queued (before the pause or during it) stay queued and run after the resume,
with the ``LoRARequest`` they named.

**LoRA adapters** (``follow_async_engine(..., adapters=["math"])``,
``await synced.generate(prompt, params, adapter="math")``): the same
:class:`~raysync.engines.vllm_lora.VLLMAdapter` targets as the offline engine's, built in
the workers the same way through the engine's ``collective_rpc``. What differs is what a
swap holds (:meth:`VLLMAsyncEngine._swapping`): not the whole engine but the adapter's
own requests. New requests naming the adapter wait; the swap waits for the ones running
(or queued in vLLM) to finish, so they finish with the version they began with; then the
new version replaces the old id and the waiting requests run with it. A request naming an
id vLLM no longer holds is no error of that request alone: vLLM looks for the adapter at
its path and, finding none, its engine core dies (vLLM 0.32, ``LoRAAdapterNotFoundError``
then ``EngineDeadError`` for every request), which is why the swap never removes an id a
request names, and why a base version (under vLLM's pause, after which vLLM drops every
adapter) puts each adapter back under the same id (``VLLMAdapter.load_again``).

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
import contextlib
import uuid
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Literal

from raysync import _protocol as proto
from raysync.channels.base import DEFAULT_TIMEOUT
from raysync.engines.vllm import Generation, VLLMEngine, start_following
from raysync.engines.vllm_lora import adapter_targets, follow_adapters, lora_request
from raysync.errors import EngineNotReadyError, RaySyncError

__all__ = ["SWAP_WAIT_S", "TORN", "VLLMAsyncEngine", "follow_async_engine"]

SWAP_WAIT_S = 60.0
"""The longest an adapter's new version waits for the requests running with its old one; after
that it is not loaded this time (the follower tries again, backing off), and requests go on."""

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
        self._naming: dict[str, int] = {}  # adapter -> requests running that named it
        self._swapped: set[str] = set()  # adapters whose version is being replaced
        self._changed = asyncio.Condition()  # either of those changed (on the engine's loop)
        super().__init__(llm, expected=expected, rollback=rollback, name=name)

    # ------------------------------------------------------------------ serving
    async def generate(  # type: ignore[override]
        self,
        prompt: Any,
        sampling_params: Any = None,
        request_id: str | None = None,
        *,
        adapter: str | None = None,
        **kwargs: Any,
    ) -> Generation:
        """One request through ``AsyncLLM.generate``: its final output, and the versions that made it.

        ``adapter``: run it with the version of that LoRA adapter the engine holds (one it
        follows: :func:`follow_async_engine`'s ``adapters``); while a new version of it goes
        in, the request waits and runs with the new one.

        Raises:
            EngineNotReadyError: the engine holds no whole version (none yet, or torn), or no
                version of ``adapter`` yet.
            KeyError: the engine follows no adapter ``adapter``.
        """
        self._ready()
        adapter_version = None
        if adapter is not None:
            async with self._changed:
                await self._changed.wait_for(lambda: adapter not in self._swapped)
                kwargs["lora_request"], adapter_version = lora_request(self, adapter)
                self._naming[adapter] = self._naming.get(adapter, 0) + 1
        try:
            final = None
            async for out in self.llm.generate(
                prompt, sampling_params, request_id or uuid.uuid4().hex, **kwargs
            ):
                final = out
        finally:
            if adapter is not None:
                async with self._changed:
                    self._naming[adapter] -= 1
                    self._changed.notify_all()
        assert final is not None, "AsyncLLM.generate yielded nothing"
        stamps = {s.version for c in final.outputs for s in (getattr(c, "weight_versions", None) or [])}
        if TORN in stamps:
            raise EngineNotReadyError(
                f"{self.name}: the output was made while a failed update tore the engine"
            )
        assert len(stamps) <= 1, f"{self.name}: one output stamped by several versions {sorted(stamps)}"
        return Generation([final], int(stamps.pop()) if stamps else self._ready(), adapter_version)

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

    @contextlib.contextmanager
    def _swapping(self, adapter: str) -> Iterator[None]:
        """While a version of ``adapter`` replaces the previous one (the follower's thread):
        new requests naming it wait, and the swap waits for the running ones to finish, so
        no request names an id while it is removed; other requests run on.

        vLLM's pause would not do: in mode ``"wait"`` it drains the requests running, but
        those still queued stay queued, with the id they named, and run after the resume.
        The drain goes before the lock: a base version takes the lock once vLLM paused, and
        requests queued in the pause run only after it.
        """
        try:
            try:
                self._run(asyncio.wait_for(self._hold(adapter), SWAP_WAIT_S))
            except asyncio.TimeoutError:
                raise RaySyncError(
                    f"{self.name}: requests with adapter {adapter!r} still running after {SWAP_WAIT_S:g} s; "
                    "its new version waits for them (tried again later)"
                ) from None
            with self._lock:
                yield
        finally:
            self._run(self._release(adapter))

    async def _hold(self, adapter: str) -> None:
        async with self._changed:
            self._swapped.add(adapter)
            await self._changed.wait_for(lambda: not self._naming.get(adapter))

    async def _release(self, adapter: str) -> None:
        async with self._changed:
            self._swapped.discard(adapter)
            self._changed.notify_all()

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

    def _forget_prefixes(self) -> None:
        """Done already: the pause cleared vLLM's prefix cache, and nothing ran since."""


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
    adapters: Sequence[str] = (),
) -> VLLMAsyncEngine:
    """Have an ``AsyncLLM`` follow ``model_id`` on the hub (awaited on the engine's loop).

    See :func:`~raysync.engines.vllm.follow_engine`, ``adapters`` too (LoRA adapters served
    from memory; the ``AsyncLLM`` made with ``enable_lora=True`` and
    ``worker_extension_cls=raysync.engines.vllm_lora.WORKER_EXTENSION``); the engine holds
    the hub's newest version (and one of each adapter) when this returns (it waits up to
    ``timeout`` for a first one).

    Raises:
        SyncTimeoutError: no version of ``model_id`` (or of an adapter) within ``timeout``.
        RaySyncError: ``adapters`` for an engine without LoRA or that worker method, or
            more than it keeps.

    Example:
        >>> synced = await follow_async_engine(async_llm, "policy", adapters=["math"])  # doctest: +SKIP
        >>> gen = await synced.generate(prompt, params, adapter="math")             # doctest: +SKIP
        >>> gen.version, gen.adapter_version                                        # doctest: +SKIP
        (3, 7)
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
    targets = await asyncio.to_thread(adapter_targets, engine, adapters)  # refused before following
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
    await asyncio.to_thread(follow_adapters, engine, targets, hub=hub, namespace=namespace, timeout=timeout)
    return engine
