#!/usr/bin/env bash
# One device call (H200): GPU tests, kernel benchmark, index benchmark, end-to-end on one
# model. Each step has its own time limit; logs and tables land in $OUT.
# Usage (after the wheel install line of shared/tools/gpu-wheels.sh):
#   bash scripts/gpu_check.sh [e2e models] [extra bench_e2e args...]
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
models=${1:-random:llama3.2-1b}; shift || true
step() { local name=$1 limit=$2; shift 2; echo "== $name"; timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; echo "   exit $?"; tail -n 25 "$OUT/$name.log"; }
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv
step gpu_tests 170 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_kernels.py tests/test_gpu.py
[ -n "${SKIP_KERNELS:-}" ] || step bench_kernels 150 python3 scripts/bench_kernels.py --quick
[ -n "${SKIP_INDEX:-}" ] || step bench_index 100 python3 scripts/bench_index.py --model random:llama3-8b --dtype bf16 \
  --docs 12 --doc-tokens 2048 --chunk-tokens 2048 --batch-tokens 16384 --dir /tmp/bench-index
rm -rf /tmp/bench-index
step bench_e2e "${E2E_LIMIT:-240}" python3 scripts/bench_e2e.py --models "$models" "$@"
