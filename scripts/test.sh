#!/usr/bin/env bash
# Set up (if needed) and run the default test suite on the CPU. Fails when any test fails or none ran.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
set +e
python -m pytest -q "$@"
status=$?
set -e
if [ "$status" -eq 5 ]; then
  echo "test.sh: pytest collected no tests" >&2
  exit 1
fi
exit "$status"
