#!/usr/bin/env bash
# Serving benchmark: kvforge's OpenAI server against llama-cpp-python's, one after the other in the
# same run, on the same workload (default: w64 = 64 requests of 32-256 prompt tokens, 128 new tokens
# each with EOS ignored, 16 in flight), the default model (SmolLM2-135M-Instruct Q4_1 GGUF).
#
#   scripts/bench_serve_vs_llamacpp.sh                 # results under $OUT (default /tmp/kvforge-serve-bench)
#   WORKLOAD=... CONCURRENCY=8 THREADS=2 scripts/bench_serve_vs_llamacpp.sh
#
# llama-cpp-python's server takes text prompts only, so both servers get the workload's token ids
# decoded to text (re-tokenized, the same way by both); kvforge also runs the token-id prompts as given.
# Needs: pip install 'llama-cpp-python[server]'.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PY:-.venv/bin/python}
WORKLOAD=${WORKLOAD:-/work/shared/workloads/w64.json}
CONCURRENCY=${CONCURRENCY:-16}
THREADS=${THREADS:-$(nproc)}
OUT=${OUT:-/tmp/kvforge-serve-bench}
PORT=${PORT:-8123}
MODEL=$($PY -c "from kvforge.loader.default_model import default_model_path as p; print(p())")
mkdir -p "$OUT"

SERVER_PID=""
stop_server() {
    if [[ -n "$SERVER_PID" ]]; then
        kill "$SERVER_PID" 2>/dev/null || true
        wait "$SERVER_PID" 2>/dev/null || true
        SERVER_PID=""
    fi
}
trap stop_server EXIT

wait_ready() {  # $1: a URL that answers 200 once the server is up
    for _ in $(seq 600); do
        curl -sf "$1" >/dev/null && return 0
        kill -0 "$SERVER_PID" 2>/dev/null || { echo "the server exited" >&2; return 1; }
        sleep 1
    done
    echo "the server did not come up" >&2
    return 1
}

bench() {  # $1: label, then extra flags
    local label=$1
    shift
    echo "$label: load average before: $(cut -d' ' -f1-3 /proc/loadavg)"
    $PY -m kvforge.cli bench serve --base-url "http://127.0.0.1:$PORT/v1" --model smol --workload "$WORKLOAD" \
        --max-concurrency "$CONCURRENCY" --label "$label" --out "$OUT/$label.json" --plot "$OUT/$label.png" "$@"
}

echo "commit $(git rev-parse --short HEAD)$(git diff --quiet HEAD -- kvforge || echo '+local changes'), $(nproc) CPUs"

$PY -m kvforge.cli serve --port "$PORT" --dtype float32 --served-model-name smol --uvicorn-log-level warning &
SERVER_PID=$!
wait_ready "http://127.0.0.1:$PORT/health"
bench kvforge-ids
bench kvforge-text --prompt-as text --tokenizer "$MODEL"
stop_server

$PY -m llama_cpp.server --model "$MODEL" --model_alias smol --port "$PORT" --n_ctx 4096 \
    --n_threads "$THREADS" --n_threads_batch "$THREADS" --interrupt_requests False --verbose False &
SERVER_PID=$!
wait_ready "http://127.0.0.1:$PORT/v1/models"
bench llama-cpp-python-text --prompt-as text --tokenizer "$MODEL"
stop_server

$PY - "$OUT" <<'EOF'
import json, sys
out = sys.argv[1]
runs = {name: json.load(open(f"{out}/{name}.json")) for name in ("kvforge-ids", "kvforge-text", "llama-cpp-python-text")}
peer = runs["llama-cpp-python-text"]
print(f"\n{'run':<24}{'out tok/s':>10}{'req/s':>8}{'TTFT med ms':>13}{'TPOT med ms':>13}{'E2E med s':>11}  vs peer")
for name, r in runs.items():
    ratio = r["output_token_throughput"] / peer["output_token_throughput"]
    print(f"{name:<24}{r['output_token_throughput']:>10.1f}{r['request_throughput']:>8.3f}"
          f"{r['ttft_ms']['median']:>13.0f}{r['tpot_ms']['median']:>13.1f}"
          f"{r['e2e_latency_ms']['median'] / 1000:>11.1f}  {ratio:.2f}x")
EOF
