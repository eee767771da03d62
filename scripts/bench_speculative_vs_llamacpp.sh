#!/usr/bin/env bash
# Speculative decoding against llama.cpp: `kvforge bench speculative` (off, ngram, suffix) and llama.cpp's
# llama-server without and with its n-gram speculation, on the same shipped workloads
# (kvforge/data/workloads: grounded, chat), the default model's Q4_1 GGUF file, greedy, 2 threads, one
# engine after the other in one run. Prints each method's speed-up over its own engine without speculation,
# side by side (single stream: decode tokens/s after the first token; N streams: output tokens over the wall).
#
# Usage: bash scripts/bench_speculative_vs_llamacpp.sh [LLAMA_CPP_BIN_DIR] [OUT_DIR]
#   NUM_PROMPTS=16 OUTPUT_LEN=128 STREAMS=1,16 WORKLOADS=grounded,chat THREADS=2 PORT=8124
#   KVFORGE_ARGS="--quantization gguf"     (kvforge's engine flags)
#   LLAMA_SPEC="--spec-type ngram-simple --spec-ngram-simple-size-n 3 --spec-ngram-simple-size-m 4"
#                                          (llama.cpp's n-gram lookup: a 3-token key, 4 drafts, like kvforge's
#                                           ngram with 2-5 token keys and 4 drafts; llama.cpp's own defaults
#                                           are a 12-token key and 48 drafts)
# A tiny end-to-end check: NUM_PROMPTS=2 OUTPUT_LEN=16 STREAMS=1,2 KVFORGE_ARGS="--quantization gguf --enforce-eager"
set -euo pipefail
cd "$(dirname "$0")/.."
. .venv/bin/activate
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # this checkout's kvforge, for the client script too
bin=${1:-$HOME/.cache/kvforge-peers/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin}
out=${2:-results/speculative}
NUM_PROMPTS=${NUM_PROMPTS:-16}
OUTPUT_LEN=${OUTPUT_LEN:-128}
STREAMS=${STREAMS:-1,16}
WORKLOADS=${WORKLOADS:-grounded,chat}
THREADS=${THREADS:-2}
PORT=${PORT:-8124}
KVFORGE_ARGS=${KVFORGE_ARGS:---quantization gguf}
LLAMA_SPEC=${LLAMA_SPEC:---spec-type ngram-simple --spec-ngram-simple-size-n 3 --spec-ngram-simple-size-m 4}
mkdir -p "$out"
model=$(python -c "from kvforge.loader.default_model import default_model_path; print(default_model_path())")
"$bin/llama-server" --help 2>&1 | grep -q -- "--spec-type" || { echo "this llama-server has no --spec-type" >&2; exit 1; }
echo "commit $(git rev-parse --short HEAD)$(git diff --quiet HEAD -- kvforge || echo '+local changes'), $(nproc) CPUs," \
     "load average $(cut -d' ' -f1-3 /proc/loadavg)"
common=(--workloads "$WORKLOADS" --streams "$STREAMS" --num-prompts "$NUM_PROMPTS" --output-len "$OUTPUT_LEN")

# shellcheck disable=SC2086  # KVFORGE_ARGS and LLAMA_SPEC are lists of flags
kvforge bench speculative --methods off,ngram,suffix "${common[@]}" $KVFORGE_ARGS --json "$out/kvforge.json"

server_pid=""
stop_server() {
    if [[ -n "$server_pid" ]]; then
        kill "$server_pid" 2>/dev/null || true
        wait "$server_pid" 2>/dev/null || true
        server_pid=""
    fi
}
trap stop_server EXIT
max_streams=$(tr ',' '\n' <<< "$STREAMS" | sort -n | tail -1)
run_llama() {  # $1: label, then llama-server's speculation flags
    local label=$1
    shift
    "$bin/llama-server" -m "$model" -t "$THREADS" -tb "$THREADS" --port "$PORT" -np "$max_streams" \
        -c $((1024 * max_streams)) "$@" > "$out/llama_server_$label.log" 2>&1 &
    server_pid=$!
    for _ in $(seq 300); do
        curl -sf "http://127.0.0.1:$PORT/health" > /dev/null && break
        kill -0 "$server_pid" 2>/dev/null || { echo "llama-server exited: $out/llama_server_$label.log" >&2; exit 1; }
        sleep 1
    done
    python scripts/speculative_peer_client.py --url "http://127.0.0.1:$PORT" --label "$label" "${common[@]}" \
        --json "$out/llama_$label.json"
    stop_server
}
run_llama off
# shellcheck disable=SC2086
run_llama ngram $LLAMA_SPEC

python - "$out" "$LLAMA_SPEC" <<'PY'
import json, sys
d, spec = sys.argv[1], sys.argv[2]
rows = json.load(open(f"{d}/kvforge.json"))["rows"]
ours = {(r["workload"], r["streams"], r["method"]): r for r in rows}
peer = {(r["workload"], r["streams"], r["method"]): r for name in ("off", "ngram")
        for r in json.load(open(f"{d}/llama_{name}.json"))["rows"]}
print(f"\nllama.cpp speculation: {spec}")
print(f"{'workload':<9} {'streams':>7}  {'kvforge tok/s off':>17} {'ngram':>7} {'suffix':>7} {'mean':>5}"
      f"   {'llama.cpp tok/s off':>19} {'ngram':>7} {'accept':>6}")
for (workload, streams, method), r in ours.items():
    if method != "off":
        continue
    ngram, suffix = ours[workload, streams, "ngram"], ours[workload, streams, "suffix"]
    p_off, p_ngram = peer[workload, streams, "off"], peer[workload, streams, "ngram"]
    print(f"{workload:<9} {streams:>7}  {r['tokens_per_s']:>17.1f} {ngram['vs_off']:>6.2f}x {suffix['vs_off']:>6.2f}x"
          f" {ngram['mean_accepted_length']:>5.2f}   {p_off['tokens_per_s']:>19.1f} {p_ngram['tokens_per_s'] / p_off['tokens_per_s']:>6.2f}x"
          f" {p_ngram['acceptance']:>6.2f}")
print("mean: kvforge ngram's tokens per verifying request-step (accepted drafts + 1); "
      "accept: llama.cpp's accepted over drafted tokens")
PY
