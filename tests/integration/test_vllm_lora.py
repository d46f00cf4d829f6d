"""LoRA adapters served by a vLLM engine from memory (``follow_engine(..., adapters=[...])``).

What a user would notice: after each adapter push the engine's greedy tokens with the
adapter are those of ``transformers`` with the adapter merged into the weights
(``W + alpha/r * B @ A``), without the adapter those of the base model, and every result
says both versions; an adapter the engine cannot serve (rank over ``max_lora_rank``, a target
module the model lacks, a misfit shape, no adapter config) is refused naming why, and the
engine keeps serving the version it had. Skipped where vLLM is absent.
"""

from __future__ import annotations

import asyncio
import gc
import os
import threading
from collections.abc import Coroutine, Iterator
from typing import Any, TypeVar

import pytest

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine core in this process
vllm = pytest.importorskip("vllm")
transformers = pytest.importorskip("transformers")

import torch  # noqa: E402

import raysync  # noqa: E402
from raysync.engines.vllm import VLLMEngine, follow_engine  # noqa: E402
from raysync.engines.vllm_async import VLLMAsyncEngine, follow_async_engine  # noqa: E402
from raysync.engines.vllm_lora import WORKER_EXTENSION, VLLMAdapter  # noqa: E402
from tests.integration.test_vllm import (  # noqa: E402
    NEW_TOKENS,
    PROMPTS,
    async_engine_args,
    hf_model,
    hf_tokens,
    make_llm,
)

TIMEOUT = 60.0
RANK, ALPHA, MAX_RANK = 4, 8.0, 8
TARGETS = ("q_proj", "v_proj")
T = TypeVar("T")


def adapter_tensors(
    seed: int, rank: int = RANK, targets: tuple[str, ...] = TARGETS
) -> dict[str, torch.Tensor]:
    """A random adapter in PEFT's saved layout for the tiny Llama, large enough to change tokens."""
    model = hf_model(0)
    g = torch.Generator().manual_seed(seed)
    out = {}
    for i, layer in enumerate(model.model.layers):
        for name in targets:
            lin = getattr(layer.self_attn, name)
            prefix = f"base_model.model.model.layers.{i}.self_attn.{name}"
            out[f"{prefix}.lora_A.weight"] = torch.randn(rank, lin.in_features, generator=g) * 0.5
            out[f"{prefix}.lora_B.weight"] = torch.randn(lin.out_features, rank, generator=g) * 0.5
    return out


def merged_tokens(base_seed: int, tensors: dict[str, torch.Tensor] | None) -> list[list[int]]:
    """``transformers``' greedy tokens with the adapter merged into the base weights."""
    model = hf_model(base_seed)
    with torch.no_grad():
        for key, a in (tensors or {}).items():
            if ".lora_A." not in key:
                continue
            module = key.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
            b = tensors[key.replace(".lora_A.", ".lora_B.")]  # type: ignore[index]
            model.get_submodule(module).weight += (ALPHA / a.shape[0]) * b @ a
    return hf_tokens(model)


def push_base_and_adapter(
    hub: raysync.HubClient, base_seed: int, adapter_seed: int
) -> tuple[int, dict[str, torch.Tensor], int]:
    """A base version and a first version of adapter "math": their numbers, and the adapter's tensors."""
    base = hub.push(hf_model(base_seed))
    tensors = adapter_tensors(adapter_seed)
    return base, tensors, hub.push(raysync.lora_adapter(tensors, alpha=ALPHA), "math")


def tokens(engine: VLLMEngine, adapter: str | None = None) -> tuple[list[list[int]], int, int | None]:
    params = vllm.SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    gen = engine.generate([{"prompt_token_ids": p} for p in PROMPTS], params, adapter=adapter)
    return [list(o.outputs[0].token_ids) for o in gen.outputs], gen.version, gen.adapter_version


def make_lora_llm(path: str) -> Any:
    return make_llm(
        path, enable_lora=True, max_lora_rank=MAX_RANK, max_loras=2, worker_extension_cls=WORKER_EXTENSION
    )


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("tiny-llama-lora")
    hf_model(0).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def llm(model_path: str) -> Iterator[Any]:
    engine = make_lora_llm(model_path)
    yield engine
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    del engine
    cleanup_dist_env_and_memory()


def stop_following(engine: VLLMEngine) -> None:
    """Stop the engine's followers before the test's hub goes (see ``test_vllm.stop_following``)."""
    engine.stop()


def test_an_engine_serves_each_adapter_version_from_memory_stamped_with_both_versions(
    llm: Any, hub: raysync.HubClient, hub_name: str
) -> None:
    base, first, a1 = push_base_and_adapter(hub, 10, 1)
    engine = follow_engine(llm, "policy", hub=hub_name, adapters=["math"], label="lora-test")
    try:
        assert tokens(engine, "math") == (merged_tokens(10, first), base, a1)
        assert tokens(engine) == (merged_tokens(10, None), base, None)  # no adapter: the base alone
        seen = {str(merged_tokens(10, first))}
        for seed in range(2, 6):  # each version replaces the last, in place
            adapter = adapter_tensors(seed)
            v = hub.push(raysync.lora_adapter(adapter, alpha=ALPHA), "math", wait=True, timeout=TIMEOUT)
            expected = merged_tokens(10, adapter)
            assert tokens(engine, "math") == (expected, base, v)
            seen.add(str(expected))
        assert len(seen) > 2  # adapter versions do give other tokens: a stale one would show
        with pytest.raises(raysync.WeightMismatchError, match=r"shape mismatch .*lora_A"):  # another rank
            hub.push(raysync.lora_adapter(adapter_tensors(9, rank=2), alpha=ALPHA), "math")
        assert tokens(engine, "math") == (expected, base, v)  # the adapter it had, still served
        new_base = hub.push(hf_model(11), wait=True, timeout=TIMEOUT)  # the adapter stays on the new base
        assert tokens(engine, "math") == (merged_tokens(11, adapter), new_base, v)
        rows = {row["model_id"]: row for row in hub.status()["subscribers"]}
        assert rows["math"]["applied"] == v and rows["policy"]["applied"] == new_base
        with pytest.raises(KeyError, match="follows no adapter 'code'"):
            tokens(engine, "code")
    finally:
        stop_following(engine)


def test_two_adapters_on_one_engine_each_newest_with_base_pushes_between(
    llm: Any, hub: raysync.HubClient, hub_name: str
) -> None:
    """Two adapters (one of rank 2 on other modules), each with its own versions, pushed
    interleaved with base versions: every request runs with the newest of the adapter it names."""
    base = hub.push(hf_model(50))
    held = {"math": adapter_tensors(51), "code": adapter_tensors(52, rank=2, targets=("k_proj", "o_proj"))}
    versions = {name: hub.push(raysync.lora_adapter(t, alpha=ALPHA), name) for name, t in held.items()}
    engine = follow_engine(llm, "policy", hub=hub_name, adapters=["math", "code"])
    try:
        for step in range(3):
            for name in ("math", "code"):
                if step:  # a new version of each adapter, and a new base after the first
                    ranked = {"math": (RANK, TARGETS), "code": (2, ("k_proj", "o_proj"))}[name]
                    held[name] = adapter_tensors(60 + 2 * step + len(name), *ranked)
                    versions[name] = hub.push(
                        raysync.lora_adapter(held[name], alpha=ALPHA), name, wait=True, timeout=TIMEOUT
                    )
                assert tokens(engine, name) == (merged_tokens(50 + step, held[name]), base, versions[name])
            base = hub.push(hf_model(51 + step), wait=True, timeout=TIMEOUT)
        assert tokens(engine, "math")[0] != tokens(engine, "code")[0]  # two adapters, two answers
    finally:
        stop_following(engine)


@pytest.fixture(scope="module")
def llm_core_elsewhere(model_path: str, llm: Any) -> Iterator[Any]:
    """An engine whose core runs in a process of its own, kept until the module ends: vLLM
    collecting it tears down this process's parallel state, which ``llm`` (set up before it,
    torn down after it) still uses."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
        # The module's engine made vLLM cache its environment ("0" too): read it again, else
        # this engine's core runs here as well
        vllm.envs.disable_envs_cache()
        engine = make_lora_llm(model_path)
    yield engine


def test_an_engine_core_in_another_process_gets_each_adapter_version_as_bytes(
    llm_core_elsewhere: Any, hub: raysync.HubClient, hub_name: str
) -> None:
    """vLLM's default: the engine core in a process of its own (the tensors go as plain bytes
    through vLLM's messages, to raysync's worker method)."""
    llm = llm_core_elsewhere
    base, adapter, a1 = push_base_and_adapter(hub, 40, 41)
    engine = follow_engine(llm, "policy", hub=hub_name, adapters=["math"])
    try:
        assert not engine._in_process
        assert tokens(engine, "math") == (merged_tokens(40, adapter), base, a1)
        new_base = hub.push(hf_model(42), wait=True, timeout=TIMEOUT)  # vLLM drops adapters: loaded again
        assert tokens(engine, "math") == (merged_tokens(42, adapter), new_base, a1)
    finally:
        stop_following(engine)


def test_a_peft_model_trained_on_its_adapter_alone_is_served_as_peft_runs_it(
    llm: Any, hub: raysync.HubClient, hub_name: str
) -> None:
    """What a trainer writes: a PEFT model, an optimizer over the adapter, one push per step
    of the adapter alone; the engine's tokens are PEFT's own with the same weights."""
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(
        hf_model(30), peft.LoraConfig(r=RANK, lora_alpha=16, target_modules=list(TARGETS), lora_dropout=0.0)
    ).eval()
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n, p in model.named_parameters() if p.requires_grad)
    optimizer = torch.optim.Adam(trainable, lr=0.05, foreach=True)
    hub.push(hf_model(30), "policy")  # the base, once
    adapter = raysync.lora_adapter(model)
    assert set(adapter["_extra_state"]) >= {"r", "lora_alpha", "target_modules"}
    assert all(".lora_" in k for k in adapter if k != "_extra_state")  # the adapter alone
    hub.push(adapter, "math")
    engine = follow_engine(llm, "policy", hub=hub_name, adapters=["math"])
    base_tokens, seen = hf_tokens(hf_model(30)), []
    try:
        for step in range(3):
            loss = -model(torch.tensor([PROMPTS[0]])).logits[0, -1].log_softmax(-1)[step + 7]
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            v = hub.push(raysync.lora_adapter(model), "math", wait=True, timeout=TIMEOUT)
            got, _, adapter_version = tokens(engine, "math")
            assert adapter_version == v
            assert got == hf_tokens(model), f"step {step}: loss {float(loss):.3f}"
            seen.append(got)
        assert any(got != base_tokens for got in seen)  # the adapter changed what the engine says
    finally:
        stop_following(engine)


def test_an_actor_with_a_peft_model_follows_base_and_adapter_versions_bit_for_bit(
    hub: raysync.HubClient, hub_name: str
) -> None:
    """An actor holding a PEFT model syncs its base and its adapter as two models
    (``raysync.peft_views``): after each adapter push it holds the trainer's adapter exactly,
    says which version, and its tokens are the trainer's PEFT model's."""
    import ray

    peft = pytest.importorskip("peft")
    config = {"r": RANK, "lora_alpha": 16, "target_modules": list(TARGETS), "lora_dropout": 0.0}

    @ray.remote(num_cpus=0)
    @raysync.synced_model("base", model_id="policy", hub=hub_name)
    @raysync.synced_model("adapter", model_id="math", hub=hub_name)
    class Rollout:
        def __init__(self) -> None:
            import peft

            self.policy = peft.get_peft_model(hf_model(0), peft.LoraConfig(**config)).eval()
            self.base, self.adapter = raysync.peft_views(self.policy)

        def held(self) -> tuple[dict[str, torch.Tensor], list[list[int]], int | None, int | None]:
            lora = {k: v.detach().clone() for k, v in self.policy.state_dict().items() if "lora_" in k}
            versions = (self.raysync_version(model_id="policy"), self.raysync_version(model_id="math"))  # type: ignore[attr-defined]
            return lora, hf_tokens(self.policy), *versions

    trainer = peft.get_peft_model(hf_model(70), peft.LoraConfig(**config)).eval()
    optimizer = torch.optim.Adam([p for p in trainer.parameters() if p.requires_grad], lr=0.05, foreach=True)
    base = hub.push(hf_model(70))
    actor = Rollout.remote()  # type: ignore[attr-defined]
    for step in range(3):
        loss = -trainer(torch.tensor([PROMPTS[0]])).logits[0, -1].log_softmax(-1)[step + 7]
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        v = hub.push(raysync.lora_adapter(trainer), "math")
        hub.wait(v, "math", timeout=TIMEOUT, subscribers=1)  # the actor holds it (and registered)
        lora, got, base_version, adapter_version = ray.get(actor.held.remote(), timeout=TIMEOUT)
        mine = {k: t.detach() for k, t in trainer.state_dict().items() if "lora_" in k}
        assert sorted(lora) == sorted(mine) and all(torch.equal(lora[k], mine[k]) for k in mine), (
            f"step {step}"
        )
        assert (base_version, adapter_version) == (base, v)
        assert got == hf_tokens(trainer)
    ray.kill(actor)


def test_a_peft_model_extracts_merged_as_torchrl_extracts_it() -> None:
    """torchrl 0.14's ``WeightStrategy("state_dict")`` gives a PEFT model merged, leaving the live
    module untouched; raysync's same-named strategy gives the same tensors."""
    peft = pytest.importorskip("peft")
    torchrl_strategy = pytest.importorskip("torchrl.weight_update.weight_sync_schemes").WeightStrategy
    from raysync.torchrl import WeightStrategy

    config = peft.LoraConfig(r=RANK, lora_alpha=16, target_modules=list(TARGETS))
    model = peft.get_peft_model(hf_model(80), config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_()  # PEFT starts B at zero: a merge would change nothing
    ours = WeightStrategy("state_dict").extract_weights(model)
    theirs = torchrl_strategy("state_dict").extract_weights(model)
    assert sorted(ours) == sorted(theirs) == sorted(hf_model(80).state_dict())
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(ours[q], hf_model(80).state_dict()[q])  # merged: the adapter is in it
    assert any("lora_A" in n for n, _ in model.named_parameters())  # the live model keeps its adapter


@pytest.mark.parametrize(
    ("bad", "why"),
    [
        (
            lambda: raysync.lora_adapter(adapter_tensors(7, rank=16), alpha=ALPHA),
            "rank 16 exceeds .* max_lora_rank 8",
        ),
        (
            lambda: raysync.lora_adapter(
                {k.replace("q_proj", "x_proj"): t for k, t in adapter_tensors(7).items()}, alpha=ALPHA
            ),
            r"no modules named \['x_proj'\]",
        ),
        (
            lambda: raysync.lora_adapter(
                {
                    k: (t[:, :64] if k.endswith("layers.1.self_attn.q_proj.lora_A.weight") else t)
                    for k, t in adapter_tensors(7).items()
                },
                alpha=ALPHA,
            ),
            r"shape mismatch .*layers\.1\.self_attn\.q_proj\.lora_A",
        ),
        (lambda: adapter_tensors(7), "carries no adapter config"),
    ],
    ids=["rank", "target", "shape", "no-config"],
)
def test_an_adapter_the_engine_cannot_serve_is_refused_and_the_engine_keeps_its_version(
    llm: Any, hub: raysync.HubClient, hub_name: str, bad: Any, why: str
) -> None:
    _, _, a1 = push_base_and_adapter(hub, 20, 8)
    engine = follow_engine(llm, "policy", hub=hub_name, adapters=["math"])
    # A second adapter the engine follows from before its first version, which is a misfit
    # (the hub checks a model's later versions against its first; the engine checks each).
    code = raysync.Follower(target=VLLMAdapter(engine, "code"), model_id="code", hub=hub_name).start()
    engine.adapter_followers.append(code)
    try:
        before = tokens(engine, "math")
        with pytest.raises(raysync.RaySyncError, match=why):
            hub.push(bad(), "code", wait=True, timeout=TIMEOUT)
        assert tokens(engine, "math") == before and before[2] == a1  # it serves what it had
        with pytest.raises(raysync.EngineNotReadyError, match="no version of adapter 'code'"):
            tokens(engine, "code")
    finally:
        stop_following(engine)


def test_a_version_vllm_refuses_at_the_swap_leaves_the_old_one_served(
    llm: Any, hub: raysync.HubClient, hub_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM's adapter manager refuses the new version after the old one was taken out (a
    full cache, a failed activation): the old one goes back, and requests keep running on it."""
    from vllm.lora.model_manager import LRUCacheLoRAModelManager

    _, good, a1 = push_base_and_adapter(hub, 50, 51)
    engine = follow_engine(llm, "policy", hub=hub_name, adapters=["math"])
    try:
        before = tokens(engine, "math")
        assert before == (merged_tokens(50, good), before[1], a1)
        held = engine._adapters["math"].lora_id
        pin = LRUCacheLoRAModelManager.pin_adapter

        def refuse_new(manager: Any, lora_id: int) -> bool:
            if lora_id != held:
                raise RuntimeError("no free adapter slots (injected)")
            return pin(manager, lora_id)

        monkeypatch.setattr(LRUCacheLoRAModelManager, "pin_adapter", refuse_new)
        with pytest.raises(raysync.RaySyncError, match="injected"):
            hub.push(
                raysync.lora_adapter(adapter_tensors(52), alpha=ALPHA), "math", wait=True, timeout=TIMEOUT
            )
        assert tokens(engine, "math") == before  # the old version, whole, still served
        monkeypatch.undo()
        newer = adapter_tensors(53)
        v = hub.push(raysync.lora_adapter(newer, alpha=ALPHA), "math", wait=True, timeout=TIMEOUT)
        assert tokens(engine, "math") == (merged_tokens(50, newer), before[1], v)  # and the next goes in
    finally:
        stop_following(engine)


def test_more_adapters_than_the_engine_keeps_are_refused_before_it_follows_anything(
    llm: Any, hub: raysync.HubClient, hub_name: str
) -> None:
    with pytest.raises(raysync.RaySyncError, match="3 adapters, more than the engine keeps"):
        follow_engine(llm, "policy", hub=hub_name, adapters=["a", "b", "c"], timeout=5)
    assert hub.status()["subscribers"] == []


# ---------------------------------------------------------------- the async engine (AsyncLLM)
@pytest.fixture(scope="module")
def async_llm(model_path: str) -> Iterator[tuple[Any, asyncio.AbstractEventLoop]]:
    """One ``AsyncLLM`` with LoRA on for the module (its engine core in a process of its own),
    on an event loop of its own that runs until the module ends; the tests run on that loop."""
    from vllm.v1.engine.async_llm import AsyncLLM

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="async-llm-loop")
    thread.start()

    async def start() -> Any:
        options = {"max_lora_rank": MAX_RANK, "max_loras": 2, "worker_extension_cls": WORKER_EXTENSION}
        return AsyncLLM.from_engine_args(async_engine_args(model_path, enable_lora=True, **options))

    try:
        llm = asyncio.run_coroutine_threadsafe(start(), loop).result(timeout=300)
        yield llm, loop

        async def shutdown(engine: Any) -> None:
            engine.shutdown()

        asyncio.run_coroutine_threadsafe(shutdown(llm), loop).result(timeout=60)
        del llm
        gc.collect()  # not at the interpreter's exit, where vLLM's __del__ finds its modules gone
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=60)
        loop.close()


def on_loop(loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run_coroutine_threadsafe(coro, loop).result(timeout=300)


async def async_tokens(
    engine: VLLMAsyncEngine, prompt: int, adapter: str | None = "math"
) -> tuple[list[int], int, int | None]:
    params = vllm.SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    gen = await engine.generate({"prompt_token_ids": PROMPTS[prompt]}, params, adapter=adapter)
    return list(gen.outputs[0].outputs[0].token_ids), gen.version, gen.adapter_version


def test_an_async_engine_swaps_adapter_versions_under_requests_each_made_by_the_version_stamped(
    async_llm: tuple[Any, asyncio.AbstractEventLoop], hub: raysync.HubClient, hub_name: str
) -> None:
    """Six clients ask for the adapter without a pause (more than the engine's ``max_num_seqs``
    of 4, so some wait in vLLM's queue) while adapter versions and base versions go in: no
    request fails, and each one's tokens are ``transformers``' with the base and the adapter
    version it is stamped with, merged (a request running when a version went in finished
    with the one it began with; one that came meanwhile ran with the new one)."""
    llm, loop = async_llm
    bases = {hub.push(hf_model(100)): 100}
    adapters = {hub.push(raysync.lora_adapter(adapter_tensors(101), alpha=ALPHA), "math"): 101}

    async def run() -> list[tuple[int, list[int], int, int | None]]:
        engine = await follow_async_engine(llm, "policy", hub=hub_name, adapters=["math"])
        served: list[tuple[int, list[int], int, int | None]] = []
        pushed = asyncio.Event()
        try:

            async def client(k: int) -> None:
                while not pushed.is_set():
                    served.append((k % 2, *await async_tokens(engine, k % 2)))

            async def pusher() -> None:
                try:
                    for i in range(1, 6):
                        if i in (2, 4):  # a base version between adapter versions: the adapter stays
                            v = await asyncio.to_thread(hub.push, hf_model(100 + i))
                            bases[v] = 100 + i
                            await asyncio.to_thread(hub.wait, v, timeout=TIMEOUT)
                        adapter = raysync.lora_adapter(adapter_tensors(101 + i), alpha=ALPHA)
                        v = await asyncio.to_thread(hub.push, adapter, "math")
                        adapters[v] = 101 + i
                        await asyncio.to_thread(hub.wait, v, "math", timeout=TIMEOUT)
                finally:
                    pushed.set()

            await asyncio.gather(pusher(), *(client(k) for k in range(6)))
            last = await async_tokens(engine, 0)  # after the last push: the newest of both
            assert last[1:] == (max(bases), max(adapters))
            served.append((0, *last))
            return served
        finally:
            await asyncio.to_thread(engine.stop)

    served = on_loop(loop, run())
    assert {a for *_, a in served} >= set(list(adapters)[-2:])  # requests ran across the swaps
    assert len({b for *_, b, _ in served}) == 3
    expected: dict[tuple[int, int | None], list[list[int]]] = {}
    for prompt, got, base, adapter in served:
        assert adapter is not None
        if (base, adapter) not in expected:
            seeds = (bases[base], adapters[adapter])
            expected[base, adapter] = merged_tokens(seeds[0], adapter_tensors(seeds[1]))
        assert got == expected[base, adapter][prompt], f"stamped base {base}, adapter {adapter}"
    assert len({str(t) for t in expected.values()}) > 3  # the versions do give other tokens


def test_an_async_engine_refuses_a_misfit_adapter_and_serves_the_one_it_had(
    async_llm: tuple[Any, asyncio.AbstractEventLoop], hub: raysync.HubClient, hub_name: str
) -> None:
    llm, loop = async_llm
    base, good, a1 = push_base_and_adapter(hub, 120, 121)

    async def run() -> None:
        engine = await follow_async_engine(llm, "policy", hub=hub_name, adapters=["math"])
        # a second adapter followed from before its first version, which is a misfit (as in
        # test_an_adapter_the_engine_cannot_serve_is_refused_and_the_engine_keeps_its_version)
        code = await asyncio.to_thread(VLLMAdapter, engine, "code")
        follower = raysync.Follower(target=code, model_id="code", hub=hub_name)
        engine.adapter_followers.append(await asyncio.to_thread(follower.start))
        try:
            assert [await async_tokens(engine, p) for p in (0, 1)] == [
                (t, base, a1) for t in merged_tokens(120, good)
            ]
            bad = raysync.lora_adapter(adapter_tensors(122, rank=16), alpha=ALPHA)
            with pytest.raises(raysync.RaySyncError, match=r"rank 16 exceeds .* max_lora_rank 8"):
                await asyncio.to_thread(hub.push, bad, "code", wait=True, timeout=TIMEOUT)
            assert [await async_tokens(engine, p) for p in (0, 1)] == [
                (t, base, a1) for t in merged_tokens(120, good)
            ]
            assert (await async_tokens(engine, 0, adapter=None))[0] == merged_tokens(120, None)[0]
            with pytest.raises(raysync.EngineNotReadyError, match="no version of adapter 'code'"):
                await async_tokens(engine, 0, "code")
        finally:
            await asyncio.to_thread(engine.stop)

    on_loop(loop, run())


def test_an_async_adapter_swap_waits_for_its_requests_within_a_bound(
    async_llm: tuple[Any, asyncio.AbstractEventLoop],
    hub: raysync.HubClient,
    hub_name: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A request with the adapter that does not end (a client that stopped reading a stream):
    the new version waits for it at most ``SWAP_WAIT_S``, is refused saying why, and the engine
    serves the old one meanwhile; once the request is gone, the follower's next try puts it in."""
    from raysync.engines import vllm_async

    monkeypatch.setattr(vllm_async, "SWAP_WAIT_S", 0.5)
    llm, loop = async_llm
    base, old, a1 = push_base_and_adapter(hub, 130, 131)

    async def run() -> None:
        engine = await follow_async_engine(llm, "policy", hub=hub_name, adapters=["math"])
        try:
            async with engine._changed:
                engine._naming["math"] = engine._naming.get("math", 0) + 1  # a request that never ends
            new = adapter_tensors(132)
            with pytest.raises(raysync.RaySyncError, match=r"adapter 'math' still running after 0.5 s"):
                await asyncio.to_thread(
                    hub.push, raysync.lora_adapter(new, alpha=ALPHA), "math", wait=True, timeout=TIMEOUT
                )
            assert await async_tokens(engine, 0) == (merged_tokens(130, old)[0], base, a1)  # the old one
            async with engine._changed:
                engine._naming["math"] -= 1  # it ended
                engine._changed.notify_all()
            for _ in range(200):  # the follower tries again (backing off from 0.05 s)
                got = await async_tokens(engine, 0)
                if got[2] != a1:
                    break
                await asyncio.sleep(0.05)
            assert got == (merged_tokens(130, new)[0], base, a1 + 1)
        finally:
            await asyncio.to_thread(engine.stop)

    on_loop(loop, run())
