#!/usr/bin/env bash
# One device call: every GPU test suite, side by side in nine pytest processes (spread over the machine's
# GPUs), each with its own Triton cache: the GPU matrix (tests/gpu/test_gpu_matrix.py) in four slices
# (KVFUSE_MATRIX_SLICE; its GQA section in the first), the Gluon fast paths against the portable kernel
# (test_gpu_fast_paths.py), and
# the grouped launch with the read side and engine allocations, PDL and the bench's GQA peers
# (test_gpu_group.py, test_gpu_read_and_alloc.py, test_gpu_pdl.py, test_gpu_bench_peers.py), the engine adapters
# and the engines' own test grids (test_gpu_engines.py, test_gpu_engine_grids.py); then, when
# BENCH_SECONDS > 0, benchmark points of BENCH_WL (fused peer).
#   [SUITES="matrix2 group ..."] [TRITON_SHARED_CACHE=DIR] bash scripts/device_run.sh [LIMIT_SECONDS] [BENCH_SECONDS]
# (TRITON_SHARED_CACHE: one Triton cache for every suite, each variant compiled once)
# LIMIT_SECONDS (default 480) bounds each process. On one H200 with 16 cores they do not all finish within
# one call's limit (run them in parts with SUITES); nvidia-h200-x2 (two GPUs, 32 cores) spreads them.
# Keep LIMIT + BENCH inside one call's limit.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 KVFUSE_TEST_GPU=1
OUT=${OUT:-/tmp/kvfuse_out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
limit=${1:-480}
t0=$(date +%s)
ngpu=$(nvidia-smi -L | wc -l)
k=0
suite() {   # name, matrix slice (or -), pytest arguments...; the suites take the GPUs in turn
  case " ${SUITES:-$1} " in *" $1 "*) ;; *) return ;; esac        # SUITES="a b": only those
  local name=$1 slice=$2 gpu=$(( k % ngpu ))
  k=$(( k + 1 ))
  shift 2
  ( [ "$slice" != - ] && export KVFUSE_MATRIX_SLICE=$slice
    mkdir -p "$OUT/$name"      # the matrix's summary JSON, one per slice
    CUDA_VISIBLE_DEVICES=$gpu OUT=$OUT/$name TRITON_CACHE_DIR=${TRITON_SHARED_CACHE:-/tmp/kvfuse_triton_$name} \
      timeout -s INT "$limit" \
      python3 -m pytest -q -rf -p no:cacheprovider "$@" > "$OUT/gpu_$name.log" 2>&1
    echo "$name rc=$? in $(( $(date +%s) - t0 )) s" ) &
}
M=tests/gpu/test_gpu_matrix.py
suite matrix1 0:100 $M                                    # the GQA section runs in this slice only
suite matrix2 100:200 $M -k test_matrix_case
suite matrix3 200:300 $M -k test_matrix_case
suite matrix4 300: $M -k test_matrix_case
suite fast_paths - tests/gpu/test_gpu_fast_paths.py
suite group - tests/gpu/test_gpu_group.py
suite read_pdl - tests/gpu/test_gpu_read_and_alloc.py tests/gpu/test_gpu_pdl.py tests/gpu/test_gpu_bench_peers.py
suite engines - tests/gpu/test_gpu_engines.py
suite engine_grids - tests/gpu/test_gpu_engine_grids.py
wait
for name in ${SUITES:-matrix1 matrix2 matrix3 matrix4 fast_paths group read_pdl engines engine_grids}; do
  echo "== $name: $(grep -E "passed|failed|error|skipped" "$OUT/gpu_$name.log" | tail -n 1 | cut -c1-300)"
  grep -E "^FAILED|^ERROR" "$OUT/gpu_$name.log" | cut -c1-300 | head -n 20
done
if [ "${2:-0}" -gt 0 ]; then
  timeout $(( ${2} + 60 )) python3 -m kvfuse.cli bench --out "$OUT" --budget-s "$2" --peers fused --no-plot --no-progress \
    --workloads ${BENCH_WL:-main_fp8,main_fp8_gptj} --n ${BENCH_N:-1,256,4096,65536} > "$OUT/bench.log" 2>&1
  echo "bench rc=$?"; grep -E "^\s*(main|flash|index|q_|llama|qwen|gemma)" "$OUT/bench.log" | head -n 60
fi
