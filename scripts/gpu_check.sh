#!/usr/bin/env bash
# GPU check for the fp4jax kernels: device info, the `gpu` tests (kernels compiled by Triton and
# compared with the reference), then bench/kernels.py. Logs go to $OUT when set (the device tool
# brings that folder back), else to /tmp/fp4jax_gpu_check. Budget: under 6 minutes on one H100/H200.
#   bash scripts/gpu_check.sh
set -u
cd "$(dirname "$0")/.."
LOG_DIR="${OUT:-/tmp/fp4jax_gpu_check}"
mkdir -p "$LOG_DIR"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
status=0

{
  echo "== nvidia-smi"; nvidia-smi || echo "nvidia-smi not available"
  echo "== jax"
  python -c 'import jax, jaxlib; print("jax", jax.__version__, "jaxlib", jaxlib.__version__); print(jax.devices())'
  python -c 'import triton; print("triton", triton.__version__)' 2>/dev/null || echo "triton python package: not installed (Pallas uses the one bundled in jaxlib)"
} 2>&1 | tee "$LOG_DIR/env.txt"

echo "== pytest -m 'gpu and not slow'" | tee "$LOG_DIR/pytest_gpu.txt"
timeout 240 python -m pytest -p no:cacheprovider -m "gpu and not slow" -q -x --no-header -rs \
    --durations=10 tests/test_kernels_gpu.py 2>&1 | tee -a "$LOG_DIR/pytest_gpu.txt"
status=$((status | ${PIPESTATUS[0]}))

echo "== bench/kernels.py" | tee "$LOG_DIR/bench_kernels.txt"
timeout 150 python bench/kernels.py 2>&1 | tee -a "$LOG_DIR/bench_kernels.txt"
status=$((status | ${PIPESTATUS[0]}))

echo "== gpu_check exit status $status" | tee -a "$LOG_DIR/bench_kernels.txt"
exit $status
