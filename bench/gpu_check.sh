#!/usr/bin/env bash
# One-shot GPU check of the CUDA path: bench/gpu_check.sh [OUT_DIR [gpu_check.py options]]  (make gpu-check OUT=dir)
# Uses the machine's own python3 with its torch and triton (installs nothing: GPU machines may
# have no network). Writes OUT_DIR/gpu_check.json and OUT_DIR/gpu_check.log; exit 0 = every
# check passed, 1 = a check failed, 3 = no CUDA (nothing checked), 124 = cut at 290 s.
set -uo pipefail
out="${1:-bench/results/gpu_check}"
cd "$(dirname "$0")/.." || exit 2
mkdir -p "$out"
PYTHONUNBUFFERED=1 timeout 290 "${PY:-python3}" bench/gpu_check.py --out "$out" "${@:2}" 2>&1 | tee "$out/gpu_check.log"
rc=${PIPESTATUS[0]}
if [ "$rc" = 124 ]; then
    echo "gpu-check: TIMED OUT after 290 s; the partial report is $out/gpu_check.json" | tee -a "$out/gpu_check.log"
fi
exit "$rc"
