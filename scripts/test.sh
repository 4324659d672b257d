#!/usr/bin/env bash
# The test suite (CPU; GPU tests are marked `gpu` and skip without CUDA).
set -euo pipefail
cd "$(dirname "$0")/.."
exec "${PYTHON:-python3}" -m pytest -q -p no:cacheprovider "$@" tests
