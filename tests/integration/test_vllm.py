"""A vLLM engine follows the hub (``raysync.follow_engine``): skipped where vLLM is absent.

One engine for the module (a tiny Llama built from a ``transformers`` config, no download,
in this process, ~10-20 s to start), shared by the tests; each test follows a hub of its
own with it. What a user of the engine would notice: after each push its greedy tokens are
those of ``transformers`` with the pushed weights and its version is the hub's; every
output says the version that made it; a version that does not fit is refused naming the
tensor and the engine keeps its version; a load that fails part-way leaves the engine on
its previous version (``rollback=True``) or torn and refusing to serve, reported to the hub
either way; an engine that starts following serves nothing before it holds the newest; a
``keys=`` push reaches it; an engine in a Ray actor, killed while a version is pushed, serves
the newest version first once restarted, beside a second engine in this process; a sharded
trainer (every rank pushing its own ``DTensor`` shards) feeds it whole tensors.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from typing import Any

import pytest

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine core in this process
vllm = pytest.importorskip("vllm")
transformers = pytest.importorskip("transformers")

import torch  # noqa: E402

import raysync  # noqa: E402
from raysync.engines.vllm import VLLMEngine, follow_engine, start_following  # noqa: E402

TIMEOUT = 60.0
PROMPTS = [[1, 5, 9, 13], [7, 3, 100, 42, 8]]
NEW_TOKENS = 6


def _config() -> Any:
    return transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,  # q/k/v of different sizes: the fused qkv layout matters
        head_dim=64,  # 16 is refused by vLLM's CPU attention
        max_position_embeddings=256,
        tie_word_embeddings=True,  # vLLM skips lm_head.weight: the tied layout matters too
    )


def hf_model(seed: int, scale: float = 2.0) -> Any:
    """A random tiny Llama; weights scaled so that versions give different tokens."""
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(_config()).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(scale)
    return model


def hf_tokens(model: Any) -> list[list[int]]:
    """Greedy tokens of ``transformers`` itself for PROMPTS (no EOS stop)."""
    out = []
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = list(prompt)
            for _ in range(NEW_TOKENS):
                logits = model(torch.tensor([ids])).logits[0, -1]
                ids.append(int(logits.argmax()))
            out.append(ids[len(prompt) :])
    return out


def engine_tokens(engine: VLLMEngine) -> tuple[list[list[int]], int]:
    params = vllm.SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    gen = engine.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    return [list(o.outputs[0].token_ids) for o in gen.outputs], gen.version


def stop_following(follower: raysync.Follower | None) -> None:
    """Stop a follower before its test's hub goes: a call into Ray still under way in a thread
    when the session's ``ray.shutdown()`` runs would end the test process (Ray's core worker)."""
    if follower is not None:
        follower.stop()


def make_llm(path: str, **options: Any) -> Any:
    """The tiny engine, in this process (also what the engine actor runs); ``options`` for vLLM."""
    from raysync.engines.vllm_transfer import BACKEND, register

    register()  # where raysync is not pip-installed (no vllm.general_plugins entry point)
    return vllm.LLM(
        model=path,
        skip_tokenizer_init=True,
        dtype="float32",
        kv_cache_memory_bytes=32 * 2**20,  # on the CPU backend, RAM: keep it small
        max_model_len=64,
        block_size=32,  # the CPU backend's least: a prompt of 32 tokens or more fills a cached block
        max_num_seqs=4,
        enforce_eager=True,
        weight_transfer_config={"backend": BACKEND},
        **options,
    )


def async_engine_args(path: str, **options: Any) -> Any:
    """``make_llm``'s engine as an ``AsyncLLM``'s arguments (its core in a process of its own)."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    from raysync.engines.vllm_transfer import BACKEND

    return AsyncEngineArgs(
        model=path,
        skip_tokenizer_init=True,
        dtype="float32",
        kv_cache_memory_bytes=32 * 2**20,
        max_model_len=64,
        block_size=32,  # the CPU backend's least: a prompt of 32 tokens or more fills a cached block
        max_num_seqs=4,
        enforce_eager=True,
        weight_transfer_config={"backend": BACKEND},
        **options,
    )


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("tiny-llama")
    hf_model(0).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def llm(model_path: str) -> Iterator[Any]:
    engine = make_llm(model_path)
    yield engine
    del engine


@pytest.fixture(scope="module", autouse=True)
def _no_process_group_left() -> Iterator[None]:
    """In-process engines set up torch.distributed in the test process: taken down after the module."""
    yield
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    cleanup_dist_env_and_memory()
    assert not torch.distributed.is_initialized()


def test_the_engine_follows_every_push(llm: Any, hub: raysync.HubClient, hub_name: str) -> None:
    # start_following: an engine that starts before any push (follow_engine waits for a first one)
    engine = start_following(VLLMEngine(llm, name="vllm-test"), "policy", hub=hub_name, label="vllm-test")
    try:
        with pytest.raises(raysync.EngineNotReadyError, match="no whole version yet"):
            engine.generate([{"prompt_token_ids": PROMPTS[0]}])  # the hub has none yet
        seen = set()
        for i in range(20):
            model = hf_model(100 + i)
            v = hub.push(model)
            hub.wait(v, timeout=TIMEOUT, subscribers=1)
            tokens, version = engine_tokens(engine)
            assert version == v == engine.version == hub.latest()
            assert engine.weight_version() == str(v)  # vLLM's own stamp
            assert tokens == hf_tokens(model), f"version {v}"
            seen.add(str(tokens))
        assert len(seen) > 10  # versions do differ: the test would see a stale engine
        (row,) = hub.status()["subscribers"]  # raysync status shows the engine like any subscriber
        assert row["class_name"] == "vllm-test" and row["applied"] == v
    finally:
        stop_following(engine.follower)


def test_no_request_runs_during_an_update(llm: Any, hub: raysync.HubClient, hub_name: str) -> None:
    engine = start_following(VLLMEngine(llm), "policy", hub=hub_name)  # before any push
    stop = threading.Event()
    served: list[tuple[list[list[int]], int]] = []
    errors: list[BaseException] = []

    def client() -> None:
        while not stop.is_set():
            try:
                served.append(engine_tokens(engine))
            except raysync.EngineNotReadyError:
                pass
            except BaseException as err:  # pragma: no cover - reported below
                errors.append(err)
                return

    models = {}
    thread = threading.Thread(target=client)
    try:
        models[hub.push(hf_model(200), wait=True, timeout=TIMEOUT)] = hf_model(200)
        thread.start()
        for i in range(1, 6):
            v = hub.push(hf_model(200 + i))
            models[v] = hf_model(200 + i)
            hub.wait(v, timeout=TIMEOUT)
        stop.set()
        thread.join(TIMEOUT)
        assert not errors, errors
        assert len({version for _, version in served}) >= 2  # requests ran across updates
        expected = {v: hf_tokens(m) for v, m in models.items()}
        for tokens, version in served:  # each output made by the version it is stamped with
            assert tokens == expected[version], f"output stamped {version}"
    finally:
        stop.set()
        stop_following(engine.follower)


def test_a_prompt_cached_under_one_version_is_computed_again_under_the_next(
    llm: Any, hub: raysync.HubClient, hub_name: str
) -> None:
    """vLLM keeps the keys and values of a prompt's full blocks (prefix caching, on by default)
    and reuses them for the next request with that prefix: after a version went in, they were
    computed with the old weights, so the engine drops them; each output is the version's own."""
    prompt = [(7 * i + 3) % 128 for i in range(40)]  # one full block of 32, cached
    params = vllm.SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)

    def answer(engine: VLLMEngine) -> tuple[list[int], int]:
        gen = engine.generate([{"prompt_token_ids": prompt}], params)
        return list(gen.outputs[0].outputs[0].token_ids), gen.version

    def reference(model: Any) -> list[int]:
        ids = list(prompt)
        with torch.no_grad():
            for _ in range(NEW_TOKENS):
                ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
        return ids[len(prompt) :]

    first = hub.push(hf_model(60))
    engine = follow_engine(llm, "policy", hub=hub_name)
    try:
        assert answer(engine) == (reference(hf_model(60)), first)
        assert answer(engine) == (reference(hf_model(60)), first)  # the cached prefix, same version
        second = hub.push(hf_model(61), wait=True, timeout=60)
        expected = reference(hf_model(61))
        assert expected != reference(hf_model(60))  # a stale prefix would show
        assert answer(engine) == (expected, second)
    finally:
        stop_following(engine.follower)


def test_a_keys_push_reaches_the_engine(llm: Any, hub: raysync.HubClient, hub_name: str) -> None:
    engine = start_following(VLLMEngine(llm), "policy", hub=hub_name)  # before any push
    try:
        base, other = hf_model(700), hf_model(701)
        hub.push(base, wait=True, timeout=TIMEOUT)
        mlp = [k for k in base.state_dict() if ".mlp." in k]  # gate/up: one fused tensor in vLLM
        v = hub.push(other, keys=mlp, wait=True, timeout=TIMEOUT)
        mixed = hf_model(700)
        mixed.load_state_dict({k: other.state_dict()[k] for k in mlp}, strict=False)
        assert engine_tokens(engine) == (hf_tokens(mixed), v)
    finally:
        stop_following(engine.follower)


def test_a_misfit_is_refused_naming_the_tensor(llm: Any, hub: raysync.HubClient, hub_name: str) -> None:
    engine = start_following(VLLMEngine(llm), "policy", hub=hub_name)  # before any push
    try:
        good = hf_model(300)
        v1 = hub.push(good, wait=True, timeout=TIMEOUT)
        before = engine_tokens(engine)
        # Versions that do not fit the layout v1 established: the hub refuses them, naming the
        # tensor (the engine's own check of a first version: test_targets, WeightsLoader).
        extra = {**good.state_dict(), "model.layers.0.mlp.extra_proj.weight": torch.ones(4, 4)}
        with pytest.raises(
            raysync.WeightMismatchError, match=r"unexpected.*model\.layers\.0\.mlp\.extra_proj"
        ):
            hub.push(extra)
        wide = {k: v for k, v in good.state_dict().items()}
        wide["model.layers.1.mlp.down_proj.weight"] = torch.ones(128, 300)
        with pytest.raises(
            raysync.WeightMismatchError, match=r"shape mismatch model\.layers\.1\.mlp\.down_proj"
        ):
            hub.push(wide)
        assert hub.latest() == v1
        assert engine.version == v1 and engine.weight_version() == str(v1)
        assert engine_tokens(engine) == before
    finally:
        stop_following(engine.follower)


class FailingEngine(VLLMEngine):
    """Hands vLLM a misfit for one tensor of the last layer while ``fail`` is set: vLLM's own
    loader then fails part-way through the version (raysync's check saw the right shape)."""

    fail = False
    wrong = "model.layers.1.mlp.down_proj.weight"

    def _weights(self, incoming: Any) -> list[tuple[str, torch.Tensor]]:
        pairs = super()._weights(incoming)
        if self.fail:
            pairs = [(n, torch.zeros(128, 128) if n == self.wrong else t) for n, t in pairs]
        return pairs


@pytest.mark.parametrize("rollback", [True, False])
def test_an_update_failing_midway(llm: Any, hub: raysync.HubClient, hub_name: str, rollback: bool) -> None:
    engine = FailingEngine(llm, rollback=rollback)
    follower = raysync.Follower(target=engine, model_id="policy", hub=hub_name).start()
    try:
        first = hf_model(400)
        v1 = hub.push(first, wait=True, timeout=TIMEOUT)
        assert engine_tokens(engine) == (hf_tokens(first), v1)
        engine.fail = True
        v2 = hub.push(hf_model(401))
        why = "rolled back to version" if rollback else "the engine is torn"
        with pytest.raises(raysync.ApplyError, match=why):
            hub.wait(v2, timeout=TIMEOUT)
        if rollback:  # still serving the previous version, whole
            assert engine.version == follower.version == v1 and engine.intact()
            assert engine_tokens(engine) == (hf_tokens(first), v1)
            assert engine.weight_version() == str(v1)
        else:  # torn: serves nothing, and says so to the hub
            assert engine.version is None and follower.version is None and not engine.intact()
            with pytest.raises(raysync.EngineNotReadyError, match="tore"):
                engine_tokens(engine)
        engine.fail = False
        third = hf_model(402)
        v3 = hub.push(third, wait=True, timeout=TIMEOUT)
        assert engine_tokens(engine) == (hf_tokens(third), v3)
    finally:
        stop_following(follower)


def test_a_new_follower_serves_only_the_newest(llm: Any, hub: raysync.HubClient, hub_name: str) -> None:
    models = [hf_model(500 + i) for i in range(3)]
    for m in models:
        v = hub.push(m)
    engine = follow_engine(llm, "policy", hub=hub_name)  # an engine (re)starting to follow
    try:
        assert engine.version == v  # held before follow_engine returned
        tokens, version = engine_tokens(engine)
        assert version == v and tokens == hf_tokens(models[-1])
    finally:
        stop_following(engine.follower)


def test_follow_engine_waits_for_a_first_version_and_names_the_models_there(
    llm: Any, hub: raysync.HubClient, hub_name: str
) -> None:
    """``follow_engine`` returns holding a version: it waits ``timeout`` for a first one, then raises."""
    import time
    from concurrent.futures import ThreadPoolExecutor

    from tests._support import wait_for_condition

    hub.push(hf_model(950))
    t0 = time.monotonic()
    with pytest.raises(
        raysync.SyncTimeoutError, match=r"no version of model 'polcy' within 3 s \(models there: 'policy'\)"
    ):
        follow_engine(llm, "polcy", hub=hub_name, timeout=3)  # a typo'd model id
    assert time.monotonic() - t0 < 3 + 30  # bounded by timeout (generous: a loaded machine)
    # An engine that starts before its trainer returns once the first version is in.
    with ThreadPoolExecutor(1) as pool:
        starting = pool.submit(follow_engine, llm, "late", hub=hub_name, timeout=TIMEOUT)
        wait_for_condition(
            lambda: any(row["model_id"] == "late" for row in hub.status()["subscribers"]),
            timeout=TIMEOUT,
            what="the engine registered",
        )
        assert not starting.done()  # holding nothing yet: still waiting
        model = hf_model(951)
        v = hub.push(model, "late")
        engine = starting.result(timeout=TIMEOUT)
    try:
        assert engine.version == v
        assert engine_tokens(engine) == (hf_tokens(model), v)
    finally:
        stop_following(engine.follower)


class WritingEngine(VLLMEngine):
    """Writes into the tensors handed to vLLM's loader while ``write`` is set, as a loader
    that changed its input would."""

    write = False

    def _load(self, pairs: list[tuple[str, torch.Tensor]], *, version: str | None = None) -> None:
        if self.write:
            pairs[0][1].mul_(0)
        super()._load(pairs, version=version)


def test_a_load_writing_into_the_shared_bytes_is_refused(
    llm: Any, hub: raysync.HubClient, hub_name: str
) -> None:
    """The bytes an in-process engine loads from are the node's object store's, read by every
    receiver there: a first version whose load writes into them fails, naming the write, and
    the version's bytes stay those pushed (what ``hub.pull()`` and other engines read)."""
    engine = start_following(WritingEngine(llm), "policy", hub=hub_name)
    try:
        engine.write = True
        model = hf_model(1100)
        v1 = hub.push(model)
        with pytest.raises(raysync.ApplyError, match="would write into weights shared read-only"):
            hub.wait(v1, timeout=TIMEOUT)
        pulled = hub.pull().flatten_keys(".")
        for name, tensor in model.state_dict().items():
            assert torch.equal(pulled[name], tensor), name
        assert engine.version is None
        engine.write = False
        v2 = hub.push(model, wait=True, timeout=TIMEOUT)
        assert engine_tokens(engine) == (hf_tokens(model), v2)
    finally:
        stop_following(engine.follower)


class GatedEngine(VLLMEngine):
    """Loads a version only once ``gate`` is open: an engine slower than its trainer."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.gate, self.loading = threading.Event(), threading.Event()
        self.gate.set()

    def _load(self, pairs: list[tuple[str, torch.Tensor]], *, version: str | None = None) -> None:
        self.loading.set()
        assert self.gate.wait(TIMEOUT), "the test never opened the gate"
        super()._load(pairs, version=version)


def test_max_lag_wait_and_status_count_a_slow_engine(llm: Any, hub: raysync.HubClient, hub_name: str) -> None:
    """An engine still loading version 2 holds the trainer back: ``hub.wait`` and
    ``push(max_lag=1)`` time out naming it (nothing is pushed), ``raysync status`` shows it one
    version behind; once it loads, ``push(max_lag=1)`` goes on and ``push(wait=True)`` returns
    with the engine serving the version pushed."""
    import io

    from raysync.ops.cli import render_status

    slow = GatedEngine(llm, name="slow engine")
    engine = start_following(slow, "policy", hub=hub_name, label="slow engine")

    def open_soon() -> None:
        engine.gate.clear()
        threading.Timer(0.2, engine.gate.set).start()

    try:
        models = [hf_model(1000 + i) for i in range(4)]
        v1 = hub.push(models[0], wait=True, timeout=TIMEOUT)
        engine.gate.clear()
        engine.loading.clear()
        v2 = hub.push(models[1])
        assert engine.loading.wait(TIMEOUT)  # the engine is on it, held
        with pytest.raises(raysync.SyncTimeoutError, match="slow engine"):
            hub.wait(v2, timeout=0.2)
        with pytest.raises(raysync.SyncTimeoutError, match="slow engine"):
            hub.push(models[2], max_lag=1, timeout=0.2)  # the engine is 1 behind v2: wait first
        assert hub.latest() == v2  # nothing was pushed
        (row,) = hub.status()["subscribers"]
        assert (row["class_name"], row["applied"], row["lag"]) == ("slow engine", v1, 1)
        out = io.StringIO()
        render_status(hub.status(), file=out)  # what `raysync status` prints
        (line,) = [ln for ln in out.getvalue().splitlines() if "slow engine" in ln]
        assert [cell.strip() for cell in line.split("│")][6:8] == [str(v1), "1"], line  # applied, lag
        open_soon()  # the engine finishes loading v2 in 0.2 s: the push waits for that, then goes out
        v3 = hub.push(models[2], max_lag=1, timeout=TIMEOUT)
        assert engine.version is not None and engine.version >= v2 and v3 == v2 + 1
        hub.wait(v3, timeout=TIMEOUT)
        assert engine_tokens(engine) == (hf_tokens(models[2]), v3)
        open_soon()  # push(wait=True) returns once the slow engine serves the version pushed
        v4 = hub.push(models[3], wait=True, timeout=TIMEOUT)
        assert engine.version == v4 and engine_tokens(engine) == (hf_tokens(models[3]), v4)
        assert hub.status()["subscribers"][0]["lag"] == 0
    finally:
        engine.gate.set()
        stop_following(engine.follower)


class RecordingEngine(VLLMEngine):
    """Records the objects each version was read from (their ids, as the follower got them)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.read: dict[int, list[str | None]] = {}

    def commit(self, incoming: Any) -> None:
        super().commit(incoming)
        self.read[incoming.version] = list(incoming.ids)


class EngineHost:
    """A vLLM engine in a Ray actor, following the hub from its constructor."""

    def __init__(self, path: str, hub_name: str) -> None:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        engine = RecordingEngine(make_llm(path), name="engine actor")
        self.engine = start_following(engine, "policy", hub=hub_name, label="engine actor")

    def generate(self) -> tuple[list[list[int]], int]:
        return engine_tokens(self.engine)

    def read(self, version: int) -> list[str | None] | None:
        return self.engine.read.get(version)


def test_two_engines_on_one_node_read_each_version_once_and_a_restarted_one_the_newest(
    llm: Any, model_path: str, hub: raysync.HubClient, hub_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two engines on one node (one in this process, one in a Ray actor) get each version's
    bytes once: the trainer writes each bucket into the node's object store once per version
    (its puts are counted), and both engines load the version from those very objects (the
    ids each engine's commit got are the ids of the trainer's puts). A copy per engine, by
    the hub or a node's relay, would be a new object with a new id (and its bytes twice in
    the store): the ids would differ. Both serve the pushed weights (``transformers``'
    greedy tokens) under the hub's version. Then the actor is killed while a version is
    pushed: restarted, it serves the newest version first."""
    import ray

    from raysync import _compat
    from tests._support import kill_until_gone, wait_for_condition

    puts: list[str] = []
    real_put = _compat.put_no_start  # the object-store transport's one put per bucket
    monkeypatch.setattr(_compat, "put_no_start", lambda value: _record(puts, real_put(value)))
    here = start_following(RecordingEngine(llm), "policy", hub=hub_name)  # two engines on one node
    host = ray.remote(num_cpus=0, max_restarts=1)(EngineHost).remote(model_path, hub_name)
    try:
        for i in range(3):
            model, before = hf_model(600 + i), len(puts)
            v = hub.push(model)
            hub.wait(v, timeout=120, subscribers=2)
            written = puts[before:]
            assert len(written) == hub.last_push["buckets"] >= 1  # once per version, not per engine
            assert here.read[v] == written, f"version {v}: the engine here read other objects"
            assert ray.get(host.read.remote(v), timeout=TIMEOUT) == written, f"version {v}: the actor"
            assert ray.get(host.generate.remote(), timeout=TIMEOUT) == (hf_tokens(model), v)
            assert engine_tokens(here) == (hf_tokens(model), v) and v == hub.latest()
        kill_until_gone(host, no_restart=False)
        newest = hf_model(610)
        v2 = hub.push(newest)  # while the actor is down or starting again
        # the restarted actor's first output is the newest version's: it held it before serving
        first_served = wait_for_condition(lambda: _served(host), timeout=120, what="the restarted actor")
        assert first_served == (hf_tokens(newest), v2)
        hub.wait(v2, timeout=TIMEOUT, subscribers=2)
        assert engine_tokens(here) == (hf_tokens(newest), v2)
    finally:
        stop_following(here.follower)
        ray.kill(host)


def _record(puts: list[str], ref: Any) -> Any:
    puts.append(ref.hex())
    return ref


def _served(host: Any) -> tuple[list[list[int]], int] | None:
    """The actor's output, or None while it restarts."""
    import ray

    try:
        return ray.get(host.generate.remote(), timeout=TIMEOUT)  # type: ignore[no-any-return]
    except ray.exceptions.ActorUnavailableError:
        return None


class LlamaRank:
    """One rank of a sharded trainer (2 gloo ranks, Ray actors) holding the tiny Llama as
    ``DTensor``\\ s: matrices Shard(0) and Shard(1) in turn (uneven where the rows or columns
    are odd), vectors replicated, the tied embedding shared with the head as in ``transformers``."""

    def __init__(self, rank: int, world: int, port: int) -> None:
        from torch.distributed.device_mesh import init_device_mesh

        from benchmarks._harness import join_gloo

        join_gloo(rank, world, port, timeout_s=60.0)
        self.mesh = init_device_mesh("cpu", (world,))
        self.model: Any = None

    def make(self, seed: int) -> None:
        from torch.distributed.tensor import Replicate, Shard, distribute_tensor

        model = hf_model(seed)
        for i, (name, p) in enumerate(list(model.named_parameters())):
            place = Replicate() if p.dim() == 1 else Shard(i % 2)
            owner, _, leaf = name.rpartition(".")
            dt = torch.nn.Parameter(distribute_tensor(p.detach(), self.mesh, [place]))
            setattr(model.get_submodule(owner), leaf, dt)
        model.tie_weights()
        self.model = model

    def push(self, hub_name: str) -> tuple[int, int, int]:
        """``hub.push(model)`` on this rank: the version, the group's size and the bytes this rank put."""
        client = raysync.connect(hub_name)
        version = client.push(self.model, timeout=TIMEOUT)
        return version, client.last_push["world"], client.last_push["bytes_put"]


def test_an_engine_follows_a_sharded_trainer(llm: Any, hub: raysync.HubClient, hub_name: str) -> None:
    """Every rank pushes only its own shards; the engine loads each version whole (each tensor
    assembled from the ranks' pieces) and serves what ``transformers`` serves with the full weights."""
    import ray

    from benchmarks._ports import free_port

    port = free_port()
    ranks = [ray.remote(num_cpus=0)(LlamaRank).remote(r, 2, port) for r in range(2)]
    engine = start_following(
        VLLMEngine(llm, name="vllm-sharded"), "policy", hub=hub_name, label="vllm-sharded"
    )
    try:
        seen = set()
        for seed in (900, 901, 902, 903):
            ray.get([r.make.remote(seed) for r in ranks], timeout=120)
            pushed = ray.get([r.push.remote(hub_name) for r in ranks], timeout=TIMEOUT)
            assert len({v for v, _, _ in pushed}) == 1, pushed  # one version, one number on both ranks
            v = pushed[0][0]
            whole = sum(t.nbytes for t in hf_model(seed).state_dict().values())
            assert all(world == 2 and put < 0.75 * whole for _, world, put in pushed), pushed  # no gather
            hub.wait(v, timeout=TIMEOUT, subscribers=1)
            tokens, version = engine_tokens(engine)
            assert version == v == engine.version == hub.latest()
            assert tokens == hf_tokens(hf_model(seed)), f"version {v}"
            seen.add(str(tokens))
        assert len(seen) > 1  # versions do differ: the test would see a stale engine
        (row,) = hub.status()["subscribers"]
        assert row["applied"] == v and row["last_error"] is None
    finally:
        stop_following(engine.follower)
        for r in ranks:
            ray.kill(r)


def test_torchrl_style_vllm_scheme(llm: Any, hub: raysync.HubClient, hub_name: str) -> None:
    from raysync.engines.vllm_scheme import VLLMWeightSyncScheme, get_model_metadata

    policy = hf_model(800)
    scheme = VLLMWeightSyncScheme(num_replicas=1, hub=hub_name, timeout=TIMEOUT)
    sender, receiver = scheme.create_sender(), scheme.create_receiver(llm)
    sender.register_model(policy)
    receiver.init_all_workers_group(get_model_metadata(policy))  # no rendezvous: any order
    sender.init_all_workers_group(get_model_metadata(policy))
    try:
        v = sender.update_weights()  # returns once the replica holds it
        assert receiver.engine is not None and engine_tokens(receiver.engine) == (hf_tokens(policy), v)
        with torch.no_grad():
            for p in policy.parameters():
                p.mul_(1.5)
        v2 = sender.update_weights()
        assert v2 == v + 1 and engine_tokens(receiver.engine) == (hf_tokens(policy), v2)
        assert receiver.poll_and_apply() is False
    finally:
        stop_following(receiver.engine.follower if receiver.engine is not None else None)


def test_an_async_engine_holds_requests_while_a_version_goes_in(
    model_path: str, hub: raysync.HubClient, hub_name: str
) -> None:
    """vLLM's AsyncLLM (its engine core in a process of its own): versions go in between
    requests (vLLM's pause, mode "wait"), each output stamped with the version that made it."""
    import asyncio

    from vllm.v1.engine.async_llm import AsyncLLM

    from raysync.engines.vllm_async import follow_async_engine

    params = vllm.SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    models = {hub.push(hf_model(900)): hf_model(900)}

    async def run() -> list[tuple[list[int], int]]:
        llm = AsyncLLM.from_engine_args(async_engine_args(model_path))
        try:
            engine = await follow_async_engine(llm, "policy", hub=hub_name, rollback=True)
            assert engine.version == max(models)  # the newest, before it serves

            async def client() -> list[tuple[list[int], int]]:
                out = []
                for _ in range(12):
                    gen = await engine.generate({"prompt_token_ids": PROMPTS[1]}, params)
                    out.append((list(gen.outputs[0].outputs[0].token_ids), gen.version))
                return out

            async def pusher() -> None:
                for i in range(1, 5):
                    v = hub.push(hf_model(900 + i))
                    models[v] = hf_model(900 + i)
                    await asyncio.to_thread(hub.wait, v, timeout=TIMEOUT)

            served, _ = await asyncio.gather(client(), pusher())
            held = max(models)
            assert await asyncio.to_thread(engine.weight_version) == str(held)
            # a load failing part-way (vLLM's loader refuses a misfit): rolled back, and
            # requests resume on the held version, stamped with it
            wrong = FailingEngine.wrong
            engine._weights = lambda incoming: [  # type: ignore[method-assign]
                (n, torch.zeros(128, 128) if n == wrong else t) for n, t in incoming.tensors()
            ]
            bad = hub.push(hf_model(990))
            with pytest.raises(raysync.ApplyError, match="rolled back to version"):
                await asyncio.to_thread(hub.wait, bad, timeout=TIMEOUT)
            gen = await engine.generate({"prompt_token_ids": PROMPTS[1]}, params)
            assert engine.version == gen.version == held
            served.append((list(gen.outputs[0].outputs[0].token_ids), gen.version))
            stop_following(engine.follower)
            return served
        finally:
            llm.shutdown()

    served = asyncio.run(run())
    assert len({version for _, version in served}) >= 2  # requests ran across updates
    for tokens, version in served:  # made by the version it is stamped with (vLLM's stamp too)
        assert tokens == hf_tokens(models[version])[1], f"output stamped {version}"
