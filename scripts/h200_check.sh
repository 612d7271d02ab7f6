#!/usr/bin/env bash
# Device checks (see docs/performance.md, "How these figures were measured"). On the device, from the repo root:
#   bash scripts/h200_check.sh tests [SECONDS]   GPU test modules + a compute-sanitizer memcheck sample
#   bash scripts/h200_check.sh bench [SECONDS]   host overhead + the full benchmark
#   bash scripts/h200_check.sh quick [SECONDS]   launcher / streams / compile GPU tests, real eager host
#                                                cost (direct launch on and off), the fused peer only
#   bash scripts/h200_check.sh gluon [SECONDS]   the Gluon fast paths against the portable kernel, byte for byte
#                                                (tests/gpu/test_gpu_fast_paths.py, test_gpu_gluon.py); their
#                                                timing is benchmarks/tune.py --kernel fast
# (two calls: together they exceed one call's 10 minutes). Results and logs go under $OUT.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/kvfuse_out}
mkdir -p "$OUT"
part=${1:-tests}
budget=${2:-230}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
if [ "$part" = tests ]; then
  # pytest under SIGINT-on-timeout still prints its summary
  KVFUSE_TEST_GPU=1 KVFUSE_GPU_STRESS=${KVFUSE_GPU_STRESS:-400} timeout -s INT "$budget" \
    python3 -m pytest -q -s -rf -p no:cacheprovider tests/gpu/test_gpu_numerics.py tests/gpu/test_gpu_gluon.py tests/gpu/test_gpu_launcher.py tests/gpu/test_gpu_streams.py \
    tests/gpu/test_gpu_compile_graphs.py tests/gpu/test_gpu_kernel.py > "$OUT/gpu_tests.log" 2>&1
  echo "gpu tests rc=$?"
  grep -E "GPU summary|stress:|passed|failed|AssertionError" "$OUT/gpu_tests.log" | cut -c1-600 | tail -n 12
  timeout -s INT 150 compute-sanitizer --tool memcheck --error-exitcode 3 \
    python3 tests/gpu/sanitize_cases.py --quick --no-large > "$OUT/memcheck.log" 2>&1
  echo "memcheck rc=$?"; tail -n 2 "$OUT/memcheck.log"
elif [ "$part" = gluon ]; then
  KVFUSE_TEST_GPU=1 timeout -s INT "${2:-540}" python3 -m pytest -q -rf -p no:cacheprovider \
    tests/gpu/test_gpu_fast_paths.py tests/gpu/test_gpu_gluon.py > "$OUT/gpu_fast_paths.log" 2>&1
  echo "gpu fast-path tests rc=$?"; grep -E "passed|failed" "$OUT/gpu_fast_paths.log" | cut -c1-400 | tail -n 4
  grep -E "^FAILED" "$OUT/gpu_fast_paths.log" | cut -c1-300 | head -n 20
elif [ "$part" = quick ]; then
  KVFUSE_TEST_GPU=1 timeout -s INT 200 python3 -m pytest -q -s -rf -p no:cacheprovider \
    tests/gpu/test_gpu_gluon.py tests/gpu/test_gpu_launcher.py tests/gpu/test_gpu_streams.py tests/gpu/test_gpu_compile_graphs.py \
    > "$OUT/gpu_quick.log" 2>&1
  echo "gpu quick tests rc=$?"; grep -E "passed|failed|Error" "$OUT/gpu_quick.log" | cut -c1-400 | tail -n 8
  for d in 1 0; do
    KVFUSE_DIRECT_LAUNCH=$d timeout 60 python3 benchmarks/host_overhead.py --real-only > "$OUT/host_real_direct$d.log" 2>&1
    echo "host overhead (direct $d) rc=$?"; tail -n 8 "$OUT/host_real_direct$d.log"
  done
  timeout $((budget + 60)) python3 -m kvfuse.cli bench --out "$OUT" --budget-s "$budget" --peers fused --no-plot --no-progress \
    --n ${BENCH_N:-1,256,4096,65536,262144} > "$OUT/bench.log" 2>&1
  echo "bench rc=$?"; grep -vE "^\s*$" "$OUT/bench.log" | tail -n 75
else
  timeout 45 python3 benchmarks/host_overhead.py > "$OUT/host_overhead.log" 2>&1
  echo "host overhead rc=$?"; tail -n 20 "$OUT/host_overhead.log"
  timeout $((budget + 60)) python3 -m kvfuse.cli bench --out "$OUT" --budget-s "$budget" --compile-budget-s 40 \
    --n ${BENCH_N:-1,256,4096,65536,262144} --peer-max-n 65536 > "$OUT/bench.log" 2>&1
  echo "bench rc=$?"; grep -E "PASS|MISS|N/A|copy bandwidth" "$OUT/bench.log"
fi
