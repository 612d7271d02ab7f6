#!/usr/bin/env bash
# One device call: every GPU test suite, side by side in six pytest processes, each with its own Triton
# cache: the GPU matrix (tests/gpu/test_gpu_matrix.py) in three slices (KVFUSE_MATRIX_SLICE; its GQA
# section runs in each), the Gluon fast paths against the portable kernel (test_gpu_fast_paths.py), and
# the grouped launch with the read side and engine allocations, PDL and the bench's GQA peers
# (test_gpu_group.py, test_gpu_read_and_alloc.py, test_gpu_pdl.py, test_gpu_bench_peers.py), the engine adapters
# and the engines' own test grids (test_gpu_engines.py, test_gpu_engine_grids.py); then, when
# BENCH_SECONDS > 0, benchmark points of BENCH_WL (fused peer).
#   bash scripts/device_run.sh [LIMIT_SECONDS] [BENCH_SECONDS]
# LIMIT_SECONDS (default 480) bounds each process; on an H200 (2026-12-01) the five took 430 s together,
# the grouped-launch process the longest. Keep LIMIT + BENCH inside one call's limit.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 KVFUSE_TEST_GPU=1
OUT=${OUT:-/tmp/kvfuse_out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
limit=${1:-480}
t0=$(date +%s)
suite() {   # name, matrix slice (or -), test files...
  local name=$1 slice=$2
  shift 2
  ( [ "$slice" != - ] && export KVFUSE_MATRIX_SLICE=$slice
    mkdir -p "$OUT/$name"      # the matrix's summary JSON, one per slice
    OUT=$OUT/$name TRITON_CACHE_DIR=/tmp/kvfuse_triton_$name timeout -s INT "$limit" \
      python3 -m pytest -q -rf -p no:cacheprovider "$@" > "$OUT/gpu_$name.log" 2>&1
    echo "$name rc=$? in $(( $(date +%s) - t0 )) s" )
}
suite matrix1 0:130 tests/gpu/test_gpu_matrix.py &
suite matrix2 130:260 tests/gpu/test_gpu_matrix.py &
suite matrix3 260: tests/gpu/test_gpu_matrix.py &
suite fast_paths - tests/gpu/test_gpu_fast_paths.py &
suite group_read_pdl - tests/gpu/test_gpu_group.py tests/gpu/test_gpu_read_and_alloc.py tests/gpu/test_gpu_pdl.py \
  tests/gpu/test_gpu_bench_peers.py &
suite engines - tests/gpu/test_gpu_engines.py tests/gpu/test_gpu_engine_grids.py &
wait
for name in matrix1 matrix2 matrix3 fast_paths group_read_pdl engines; do
  echo "== $name: $(grep -E "passed|failed|error|skipped" "$OUT/gpu_$name.log" | tail -n 1 | cut -c1-300)"
  grep -E "^FAILED|^ERROR" "$OUT/gpu_$name.log" | cut -c1-300 | head -n 20
done
if [ "${2:-0}" -gt 0 ]; then
  timeout $(( ${2} + 60 )) python3 -m kvfuse.cli bench --out "$OUT" --budget-s "$2" --peers fused --no-plot --no-progress \
    --workloads ${BENCH_WL:-main_fp8,main_fp8_gptj} --n ${BENCH_N:-1,256,4096,65536} > "$OUT/bench.log" 2>&1
  echo "bench rc=$?"; grep -E "^\s*(main|flash|index|q_|llama|qwen|gemma)" "$OUT/bench.log" | head -n 60
fi
