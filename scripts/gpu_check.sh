#!/usr/bin/env bash
# On a CUDA machine, from the repository root: install the package, then the GPU tests
# (`pytest -m gpu`), the kernel benchmark, what loading a chunk costs the GPU (bench_loads.py),
# the end-to-end benchmark, the index benchmark and the store's read benchmark, and a first pass
# in fresh processes (bench_first_pass.py).
# Each step has its own time limit in seconds (a limit of 'skip' skips the step) so that a
# slow step cannot take the others' time; each step's output lands in $OUT/<step>.log.
# The install takes no dependencies: the machine must have them already (a machine with no
# registry can take the missing ones as wheels, see shared/tools/gpu-wheels.sh).
# Usage:
#   KERNEL_ARGS=--quick E2E_LIMIT=240 bash scripts/gpu_check.sh random:llama3.2-1b [bench_e2e args...]
# INDEX_DTYPE lists the index benchmark's runs by KV dtype ("fp8 fp8 fp8 bf16": four runs, default one bf16),
# each optionally with its writer threads ("fp8/4 fp8/8"); INDEX_ARGS adds options to each (--trace).
# TESTS narrows the test run to some files (default: every test marked gpu).
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
models=${1:-random:llama3.2-1b}; shift || true
step() { local name=$1 limit=$2; shift 2; [ "$limit" = skip ] && return; echo "== $name"; timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; echo "   exit $?"; tail -n "${TAIL:-25}" "$OUT/$name.log"; }
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv
# editable, so that the scripts and tests import this working tree's code
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . > "$OUT/install.log" 2>&1 \
  || { echo "install failed:"; tail -n 20 "$OUT/install.log"; exit 1; }
step gpu_tests "${TEST_LIMIT:-420}" python3 -m pytest -q -m gpu -p no:cacheprovider ${TESTS:-}
step bench_kernels "${KERNEL_LIMIT:-150}" python3 scripts/bench_kernels.py ${KERNEL_ARGS:---quick}
step bench_loads "${LOADS_LIMIT:-60}" python3 scripts/bench_loads.py
step bench_e2e "${E2E_LIMIT:-240}" python3 scripts/bench_e2e.py --models "$models" "$@"
run=0
for spec in ${INDEX_DTYPE:-bf16}; do
  run=$((run + 1)); dtype=${spec%%/*}; writers=()
  [ "$spec" != "$dtype" ] && writers=(--writers "${spec#*/}")
  step "bench_index-$run-$dtype${writers[1]:+-w${writers[1]}}" "${INDEX_LIMIT:-100}" python3 scripts/bench_index.py \
    --model random:llama3-8b --kv-dtype "$dtype" "${writers[@]}" --docs 12 --doc-tokens 2048 --chunk-tokens 2048 \
    --dir /tmp/bench-index ${INDEX_ARGS:-}
  rm -rf /tmp/bench-index  # an 8B store is tens of GB; the machine's disk holds a few
done
step bench_store "${STORE_LIMIT:-180}" python3 scripts/bench_store.py --gib 4 --chunk-tokens 2048 --page 64 \
  --chunks-per-segment 4 --bounds
step bench_first_pass "${FIRST_LIMIT:-240}" python3 scripts/bench_first_pass.py --model random:llama3-8b \
  --requests 200 --repeats 2 --under-reads-too
rm -rf /tmp/lazyrag-e2e-first-*
