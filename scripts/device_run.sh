#!/usr/bin/env bash
# One device call: the Gluon fast paths against the portable kernel (tests/gpu/test_gpu_fast_paths.py),
# the GPU matrix (tests/gpu/test_gpu_matrix.py), the read side and engine allocations
# (tests/gpu/test_gpu_read_and_alloc.py), the GQA entry point (tests/gpu/test_gpu_gqa.py), PDL
# (tests/gpu/test_gpu_pdl.py), the bench's GQA peers (tests/gpu/test_gpu_bench_peers.py), the grouped
# launch (tests/gpu/test_gpu_group.py), then benchmark points of BENCH_WL (fused peer).
#   bash scripts/device_run.sh [MATRIX_SECONDS] [BENCH_SECONDS] [FAST_PATH_SECONDS]
# The budgets (default 320, 0, 240) add up: keep their sum inside one call's limit
# (KVFUSE_MATRIX_SLICE splits the matrix over calls).
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/kvfuse_out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
t0=$(date +%s)
KVFUSE_TEST_GPU=1 timeout -s INT "${3:-240}" python3 -m pytest -q -rf -p no:cacheprovider \
  tests/gpu/test_gpu_fast_paths.py > "$OUT/gpu_fast_paths.log" 2>&1
echo "gpu fast paths rc=$? in $(( $(date +%s) - t0 )) s"
grep -E "passed|failed" "$OUT/gpu_fast_paths.log" | cut -c1-400 | tail -n 4
grep -E "^FAILED" "$OUT/gpu_fast_paths.log" | cut -c1-300 | head -n 20
t0=$(date +%s)
KVFUSE_TEST_GPU=1 timeout -s INT "${1:-320}" python3 -m pytest -q -rf -p no:cacheprovider tests/gpu/test_gpu_matrix.py \
  tests/gpu/test_gpu_read_and_alloc.py tests/gpu/test_gpu_gqa.py tests/gpu/test_gpu_pdl.py \
  tests/gpu/test_gpu_bench_peers.py tests/gpu/test_gpu_group.py \
  > "$OUT/gpu_matrix.log" 2>&1
echo "gpu matrix rc=$? in $(( $(date +%s) - t0 )) s"
grep -E "GPU matrix summary|GQA GPU summary|passed|failed" "$OUT/gpu_matrix.log" | cut -c1-400 | tail -n 8
grep -E "^FAILED" "$OUT/gpu_matrix.log" | cut -c1-300 | head -n 20
if [ "${2:-0}" -gt 0 ]; then
  timeout $(( ${2} + 60 )) python3 -m kvfuse.cli bench --out "$OUT" --budget-s "$2" --peers fused --no-plot --no-progress \
    --workloads ${BENCH_WL:-main_fp8,main_fp8_gptj} --n ${BENCH_N:-1,256,4096,65536} > "$OUT/bench.log" 2>&1
  echo "bench rc=$?"; grep -E "^\s*(main|flash|index|q_|llama|qwen|gemma)" "$OUT/bench.log" | head -n 60
fi
