#!/usr/bin/env bash
# Install kdray, then run the built-in default model (SmolLM2-135M-Instruct with its shipped DFlash
# drafter, DDTree) on one prompt, on the GPU when there is one.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec "${PYTHON:-python3}" -m kdray.cli generate "${1:-Explain in two sentences what a Python list comprehension is.}" \
  --max-tokens "${MAX_TOKENS:-96}"
