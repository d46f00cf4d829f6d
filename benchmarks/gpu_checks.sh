#!/bin/bash
# The GPU checks, on a lent GPU machine (../shared/gpu/README.md), from the project's root:
#   echo /.device/ >> .git/info/exclude; bash ../shared/gpu/make_device_payload.sh
#   (and pytest, pluggy, iniconfig, packaging, pytest-timeout, rich, markdown-it-py, mdurl,
#   pygments and psutil wheels for Python 3.12 into .device/deps: the image has no pytest)
# then, in the device tool: carry [".device"], command `bash benchmarks/gpu_checks.sh`.
# Writes the tests' output and benchmarks/gpu_push.py's JSON under $OUT (about 4 minutes), then
# benchmarks/sharded_push.py on the machine's CPUs (CPU ranks and receivers, 16 cores: the
# 2-core machine's sharded rows with cores to spare; about 2 minutes).
source .device/setup.sh
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout -k 10 150 python3 -m pytest -q -p no:cacheprovider --durations=8 -rA tests/integration/test_gpu.py \
  > "$OUT/gpu_tests.txt" 2>&1
echo "pytest rc=$?" >> "$OUT/gpu_tests.txt"
grep -E "PASSED|FAILED|ERROR|passed|failed|rc=|^E  " "$OUT/gpu_tests.txt" | head -30
(cd benchmarks && timeout -k 10 240 python3 gpu_push.py --repeats 2 --timeout 60 --json "$OUT/gpu_push.json") \
  > "$OUT/gpu_push_full.txt" 2>&1
echo "bench rc=$?" >> "$OUT/gpu_push_full.txt"
grep -v "UCX  WARN\|NIXL INFO\|global_worker\|token\|NIXL backend" "$OUT/gpu_push_full.txt" | tail -30
(cd benchmarks && timeout -k 10 150 python3 sharded_push.py --mib 256 --actors 8 --writers 1,2,4 --repeats 5) \
  > "$OUT/sharded_push_cpu.txt" 2>&1
echo "sharded rc=$?" >> "$OUT/sharded_push_cpu.txt"
grep -v "UCX  WARN\|NIXL INFO\|global_worker\|token\|NIXL backend" "$OUT/sharded_push_cpu.txt" | tail -12
