#!/usr/bin/env bash
# Set up (if needed) and answer a question with the default model. Extra arguments go to
# `kvforge generate`, e.g.: bash scripts/run.sh "Write a haiku about GPUs" --max-tokens 64
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
if [ $# -eq 0 ]; then set -- "What is the capital of France?"; fi
exec kvforge generate "$@"
