#!/usr/bin/env bash
# One-shot GPU check of the CUDA path: tests/gpu/gpu_check.sh [OUT_DIR [gpu_check.py options]]  (make gpu-check OUT=dir)
# Uses the machine's own python3 with its torch and triton (installs nothing: GPU machines may
# have no network). Writes OUT_DIR/gpu_check.json and OUT_DIR/gpu_check.log.
# Exit: 0 = every check ran and passed, 1 = a check failed or was not run, 3 = no CUDA (nothing
# checked), 124 / 137 = killed at the time limit (SIGTERM / SIGKILL; the partial report stays).
# Time limit: GPU_CHECK_LIMIT_S (default 280 s) for the whole process tree: `timeout` signals its
# own process group (gpu_check.py, its pytest, its spawned ranks), SIGKILL 10 s after SIGTERM,
# and whatever of that group outlives it is killed here too; so the run ends within 290 s.
# gpu_check.py gets a budget 15 s under the limit, so it normally finishes (and reports) first.
set -uo pipefail
out="${1:-bench/results/gpu_check}"
limit="${GPU_CHECK_LIMIT_S:-280}"
mkdir -p "$out" && out="$(cd "$out" && pwd)" || exit 2   # absolute: we cd to the repository next
cd "$(dirname "$0")/../.." || exit 2
log="$out/gpu_check.log"
: >"$log"
budget=$((limit > 30 ? limit - 15 : limit))
PYTHONUNBUFFERED=1 timeout --kill-after=10 "$limit" "${PY:-python3}" tests/gpu/gpu_check.py --out "$out" \
    --budget-s "$budget" "${@:2}" >"$log" 2>&1 </dev/null &
pid=$!  # timeout's pid = its process group (it calls setpgid(0, 0)): every process of the check
stop() {
    kill -TERM -- "-$pid" 2>/dev/null
    sleep 2
    kill -KILL -- "-$pid" 2>/dev/null
    exit 130
}
trap stop INT TERM HUP
tail -n +1 -f --pid="$pid" "$log" &
tailer=$!
wait "$pid"
rc=$?
kill -KILL -- "-$pid" 2>/dev/null  # anything of the group that outlived timeout (ignored SIGTERM)
wait "$tailer" 2>/dev/null
if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then
    echo "gpu-check: TIMED OUT after $limit s (exit $rc); the partial report is $out/gpu_check.json" | tee -a "$log"
fi
exit "$rc"
