#!/usr/bin/env bash
# One device call that checks and measures everything (see DEVICE_NOTES.md). On the device, from the
# repo root: bash scripts/h200_check.sh [SECONDS_FOR_TESTS]. Results and logs go under $OUT.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/kvfuse_out}
mkdir -p "$OUT"
budget=${1:-240}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
# pytest under SIGINT-on-timeout still prints its summary
KVFUSE_TEST_GPU=1 KVFUSE_GPU_STRESS=${KVFUSE_GPU_STRESS:-800} timeout -s INT "$budget" \
  python3 -m pytest -q -s -rf -p no:cacheprovider tests/gpu > "$OUT/gpu_tests.log" 2>&1
grep -E "GPU summary|stress:|passed|failed|AssertionError" "$OUT/gpu_tests.log" | cut -c1-600
timeout -s INT 120 compute-sanitizer --tool memcheck --error-exitcode 3 \
  python3 tests/gpu/sanitize_cases.py --quick > "$OUT/memcheck.log" 2>&1
echo "memcheck rc=$?"; tail -n 2 "$OUT/memcheck.log"
timeout 330 python3 -m kvfuse.cli bench --out "$OUT" --budget-s 280 --compile-budget-s 80 > "$OUT/bench.log" 2>&1
echo "bench rc=$?"; grep -E "PASS|MISS|N/A|copy bandwidth" "$OUT/bench.log"
