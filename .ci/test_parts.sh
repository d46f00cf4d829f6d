#!/usr/bin/env bash
# `make test`: every part runs, whatever the one before it did, and a summary says what ran.
#
#   .ci/test_parts.sh lint typecheck pytest pytest-vllm
#
# Each argument is a make target. A part that fails does not hide the parts after it (a lint
# error still lets the tests run, a failed test file still lets the vLLM tests run); the exit
# status is 1 if any part failed. The summary gives each part's status, its seconds, and the
# last line pytest printed (how many passed, failed, skipped).
set -uo pipefail
cd "$(dirname "$0")/.."
logs=$(mktemp -d)
trap 'rm -rf "$logs"' EXIT
status=0
summary=()
for part in "$@"; do
  started=$SECONDS
  ${MAKE:-make} --no-print-directory "$part" 2>&1 | tee "$logs/$part.log"
  rc=${PIPESTATUS[0]}
  took=$((SECONDS - started))
  result=$(grep -E '^(=+ )?[0-9]+ (passed|failed|error|skipped|deselected)' "$logs/$part.log" | tail -n 1 | sed 's/=//g; s/^ *//; s/ *$//')
  if [ "$rc" -eq 0 ]; then state=ok; else state="FAILED (exit $rc)"; status=1; fi
  summary+=("$(printf '  %-14s %-16s %5d s  %s' "$part" "$state" "$took" "$result")")
done
echo
echo "make test: what ran"
printf '%s\n' "${summary[@]}"
exit $status
