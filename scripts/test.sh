#!/usr/bin/env bash
# Set up (if needed) and run the default test suite on the CPU. Fails when any test fails or none ran.
# NOTE: the profiler's tests run in a pytest process of their own: torch.profiler, started after hundreds
# of other tests (their thread pools, compiled graphs and process groups) in one process, once aborted the
# whole run when it stopped.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
run() {
  set +e
  python -m pytest -q "$@"
  local status=$?
  set -e
  if [ "$status" -eq 5 ]; then
    echo "test.sh: pytest collected no tests" >&2
    return 1
  fi
  return "$status"
}
if [ $# -gt 0 ]; then
  run "$@"
  exit $?
fi
status=0
run --ignore=tests/profiler --durations=20 || status=$?
run tests/profiler || status=$?
exit "$status"
