"""Legitimate pushes while a hostile local process floods every raysync socket, beside pushes without.

Three phases of ``--seconds`` each, in one run, on one hub with ``--actors``
``@synced_model`` actors (256 KiB in 8 tensors: small versions go by doorbell):

``quiet``
    push + wait for every actor, back to back.
``busy``
    the same while a process burns one core (no datagrams): what the attacker's
    CPU alone costs on this machine, the floor of any flood.
``churn``
    the same while the attacker's very loop runs against a socket of its own that
    nobody serves (its backlog full): the kernel work of its connection attempts,
    without raysync on the other end.
``flood``
    the same while ``tests/_attacker.py junk`` sends random bytes, ring- and
    ack-shaped records with made-up MACs and descriptors to every raysync socket
    it can see, as fast as it can (as the same user by default, the worst case:
    another user's datagrams are refused by the kernel before raysync sees them).

After each phase every actor must hold the last version bit for bit, and report it.
Then the costs of the checks themselves: a ring's encode + MAC + decode, an ack's,
and what hashing a version's bytes would cost per MiB (raysync does not: segments
are sealed).

Run::

    python benchmarks/doorbell_flood.py                  # 60 s per phase
    python benchmarks/doorbell_flood.py --seconds 10 --as-user nobody
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import ray
import torch

import raysync

ATTACKER = Path(__file__).resolve().parents[1] / "tests" / "_attacker.py"


def policy(seed: int) -> torch.nn.Module:
    """256 KiB of float32 in 8 tensors."""
    torch.manual_seed(seed)
    m = torch.nn.Module()
    for i in range(8):
        m.register_parameter(f"w{i}", torch.nn.Parameter(torch.randn(8192)))
    return m


@ray.remote(num_cpus=0)
@raysync.synced_model("policy", hub="flood-bench")
class Collector:
    def __init__(self) -> None:
        self.policy = policy(0)

    def weights(self) -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in self.policy.state_dict().items()}


def phase(hub: raysync.HubClient, actors: list[Any], seconds: float, seed0: int) -> dict[str, Any]:
    times = []
    seed = seed0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        seed += 1
        model = policy(seed)
        t0 = time.perf_counter()
        v = hub.push(model)
        hub.wait(v, timeout=60)
        times.append(time.perf_counter() - t0)
    expected = model.state_dict()
    for a in actors:
        assert ray.get(a.raysync_version.remote()) == v
        got = ray.get(a.weights.remote())
        assert all(torch.equal(got[k].view(torch.uint8), expected[k].view(torch.uint8)) for k in expected)
    times.sort()
    return {
        "pushes": len(times),
        "median_ms": statistics.median(times) * 1e3,
        "p90_ms": times[int(0.9 * (len(times) - 1))] * 1e3,
        "last_version": v,
        "seed": seed,
    }


def wire_costs() -> dict[str, float]:
    from raysync._protocol import ApplyReport, RelayAck, Ring, compact
    from raysync.transports.doorbell import wire

    key = os.urandom(wire.KEY_BYTES)
    ring = Ring(1, "policy", 3, tuple(f"{i:032x}:policy" for i in range(8)), 4096, 7, 9)
    reply = compact(3, [RelayAck(s, ApplyReport(applied=3, apply_s=1e-3)) for s in ring.sub_ids])
    n = 20000
    t0 = time.perf_counter()
    for _ in range(n):
        wire.decode_ring(key, wire.encode_ring(key, ring))
    ring_us = (time.perf_counter() - t0) / n * 1e6
    t0 = time.perf_counter()
    for _ in range(n):
        wire.decode_ack(key, wire.encode_ack(key, 1, 3, reply))
    ack_us = (time.perf_counter() - t0) / n * 1e6
    data = os.urandom(1 << 20)
    t0 = time.perf_counter()
    for _ in range(50):
        hashlib.blake2b(data, digest_size=32).digest()
    hash_ms = (time.perf_counter() - t0) / 50 * 1e3
    bad = wire.encode_ring(os.urandom(wire.KEY_BYTES), ring)
    t0 = time.perf_counter()
    for _ in range(n):
        try:
            wire.decode_ring(key, bad)
        except wire.WireError:
            pass
    drop_us = (time.perf_counter() - t0) / n * 1e6
    return {
        "ring_encode_mac_decode_us": ring_us,
        "ack_encode_mac_decode_us": ack_us,
        "forged_ring_refused_us": drop_us,
        "blake2b_ms_per_mib": hash_ms,
    }


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--seconds", type=float, default=60.0, help="length of each phase")
    p.add_argument("--actors", type=int, default=8)
    p.add_argument("--as-user", default=None, help="run the attacker as this user (needs root and setpriv)")
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args(argv)
    ray.init(num_cpus=4, object_store_memory=512 * 2**20, include_dashboard=False, log_to_driver=False)
    hub = raysync.connect("flood-bench")
    actors = [Collector.remote() for _ in range(args.actors)]  # type: ignore[attr-defined]
    ray.get([a.raysync_version.remote() for a in actors])
    phase(hub, actors, 3.0, 0)  # warm-up
    attacker = [sys.executable, str(ATTACKER)]
    if args.as_user:
        attacker = [
            "setpriv",
            f"--reuid={args.as_user}",
            "--regid=nogroup",
            "--clear-groups",
            "/usr/bin/python3",
            str(ATTACKER),
        ]
    rows: dict[str, Any] = {}
    seed = 1000
    rows["quiet"] = phase(hub, actors, args.seconds, seed)
    seed = rows["quiet"]["seed"]
    burner = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import time\nend=time.time()+%f\nwhile time.time()<end: pass" % (args.seconds + 5),
        ]
    )
    rows["busy"] = phase(hub, actors, args.seconds, seed)
    burner.kill()
    seed = rows["busy"]["seed"]
    dummy = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    dummy_path = os.path.join(tempfile.mkdtemp(prefix="flood-"), "nobody-serves")
    dummy.bind(dummy_path)
    dummy.listen(16)
    os.chmod(os.path.dirname(dummy_path), 0o755)
    os.chmod(dummy_path, 0o777)
    churn = subprocess.Popen(
        [*attacker, "junk", json.dumps({"seconds": args.seconds + 2, "targets": [dummy_path]})],
        stdout=subprocess.PIPE,
        text=True,
    )
    time.sleep(1.0)
    rows["churn"] = phase(hub, actors, args.seconds, seed)
    churn.communicate(timeout=120)
    dummy.close()
    seed = rows["churn"]["seed"]
    flood = subprocess.Popen(
        [*attacker, "junk", json.dumps({"seconds": args.seconds + 2})], stdout=subprocess.PIPE, text=True
    )
    time.sleep(1.0)  # the flood is under way
    rows["flood"] = phase(hub, actors, args.seconds, seed)
    out, _ = flood.communicate(timeout=120)
    sent = json.loads(out.strip().splitlines()[-1])
    here = hub.status()["here"]
    rows["attacker"] = {
        "connections_taken": sent["sent"],
        "refused": sent["refused"],
        "per_s": sent["sent"] / sent["seconds"],
    }
    rows["hub_rings"] = {
        "rung": here["rung"],
        "delivered_by_ray_call": here["delivered"],
        "refused_at_the_hub": here.get("dropped"),
    }
    rows["wire"] = wire_costs()
    ray.shutdown()
    q = rows["quiet"]["median_ms"]
    print("| phase | pushes | median push+wait ms | p90 ms | x quiet |\n|---|---|---|---|---|")
    for name in ("quiet", "busy", "churn", "flood"):
        r = rows[name]
        ms, p90, ratio = r["median_ms"], r["p90_ms"], r["median_ms"] / q
        cells = [name, r["pushes"], f"{ms:.2f}", f"{p90:.2f}", f"{ratio:.2f}"]
        print("| " + " | ".join(str(c) for c in cells) + " |")
    print(json.dumps({k: rows[k] for k in ("attacker", "hub_rings", "wire")}, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
