#!/usr/bin/env bash
# CI as CI runs it -- a fresh clone of the committed HEAD, `bash .ci/run` -- while BUSY (default
# 6) CPU-bound processes keep this machine busy, as other jobs on a shared runner, a hub or a
# Binder pod do. The verdicts must not change: tests wait for states and checkers count work,
# so a busy machine is slower, never different. Prints the wall time at the end.
#   scripts/ci-under-load.sh            # six busy processes
#   BUSY=0 scripts/ci-under-load.sh     # the same from a fresh clone on a quiet machine
set -euo pipefail
src=$(cd "$(dirname "$0")/.." && pwd)
busy=${BUSY:-6}
work=$(mktemp -d /tmp/kvlab-ci-XXXXXX)
pids=()
cleanup() {
  if [ ${#pids[@]} -gt 0 ]; then kill "${pids[@]}" 2>/dev/null || true; fi
  rm -rf "$work"
}
trap cleanup EXIT
git clone -q "$src" "$work/kvlab"
for _ in $(seq 1 "$busy"); do
  python3 -c 'while True: pass' &
  pids+=($!)
done
start=$(date +%s)
status=0
(cd "$work/kvlab" && bash .ci/run) || status=$?
took=$(( $(date +%s) - start ))
echo "ci-under-load: .ci/run exited $status with $busy busy processes beside it, in $((took / 60)) min $((took % 60)) s"
exit "$status"
