#!/usr/bin/env bash
# Issue 12 on one GPU: parity tests of the fused ops (and the K2-shard CUDA-graph test), then benchmarks/k2_step.py
# on this tree (after), on ALT's kdray (after without one change, to measure it) and on BASE's (before).
#   OUT=DIR bash scripts/k2_kernels_gpu.sh [BASE [ALT]]   (folders holding another commit's kdray/)
# The w4a16_moe GEMM-family sweep: python3 benchmarks/bench_moe.py [--tokens N ...]
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${OUT:-/tmp/k2-kernels}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$ROOT
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.used,memory.total --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, cupy; print('torch', torch.__version__, 'cupy', cupy.__version__)" | tee -a "$OUT/gpu.txt"
timeout 100 python3 -m pytest -q -m gpu -p no:cacheprovider -n 4 --dist loadfile tests/test_kernel_rmsnorm.py \
  tests/test_kernel_mla_rope_cache.py tests/test_kernel_moe_route.py tests/test_kernel_silu_mul.py \
  tests/test_kernel_w4a16_moe.py tests/test_kernel_k2_layers.py tests/test_gpu_engine.py 2>&1 | tee "$OUT/tests.txt"
timeout 80 python3 benchmarks/k2_step.py --label after --md "$OUT/k2-after.md" 2>&1 | tee "$OUT/k2-after.txt"
run_other() {  # label, folder holding kdray/
  (cd "$2" && PYTHONPATH=$2:$ROOT timeout 85 python3 "$ROOT/benchmarks/k2_step.py" --label "$1" \
    --md "$OUT/k2-$1.md" 2>&1 | tee "$OUT/k2-$1.txt")
}
[ -n "${2:-}" ] && run_other alt "$2"
[ -n "${1:-}" ] && run_other before "$1"
echo "== summary"
grep -E "passed|failed|error" "$OUT/tests.txt" | tail -3
cat "$OUT"/k2-*.md 2>/dev/null
