#!/usr/bin/env bash
# One device call (H200): GPU tests, kernel benchmark, end-to-end on one model, index
# benchmark. Each step has its own time limit (the call has 600 s; a limit of 'skip' skips
# the step); logs land in $OUT.
# TESTS: the test files (default: the kernel and GPU engine tests).
# Usage (after the wheel install line of shared/tools/gpu-wheels.sh):
#   KERNEL_ARGS=--quick E2E_LIMIT=240 bash scripts/gpu_check.sh random:llama3.2-1b [bench_e2e args...]
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
models=${1:-random:llama3.2-1b}; shift || true
step() { local name=$1 limit=$2; shift 2; [ "$limit" = skip ] && return; echo "== $name"; timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; echo "   exit $?"; tail -n "${TAIL:-25}" "$OUT/$name.log"; }
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv
step gpu_tests "${TEST_LIMIT:-150}" python3 -m pytest -q -m gpu -p no:cacheprovider ${TESTS:-tests/test_kernels.py tests/test_gpu.py}
step bench_kernels "${KERNEL_LIMIT:-150}" python3 scripts/bench_kernels.py ${KERNEL_ARGS:---quick}
step bench_e2e "${E2E_LIMIT:-240}" python3 scripts/bench_e2e.py --models "$models" "$@"
step bench_index "${INDEX_LIMIT:-100}" python3 scripts/bench_index.py --model random:llama3-8b --dtype bf16 \
  --docs 12 --doc-tokens 2048 --chunk-tokens 2048 --batch-tokens 16384 --dir /tmp/bench-index
