#!/usr/bin/env bash
# kvforge against transformers on the anchor workload (64 prompts of 32-256 tokens, 128 new tokens
# each, greedy, EOS ignored), float32, in one run; then single-request latency for both.
# Usage: bash scripts/bench_throughput_vs_hf.sh [WORKLOAD_JSON] [OUT_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
. .venv/bin/activate
workload=${1:-../shared/workloads/w64.json}
out=${2:-results/throughput}
mkdir -p "$out"
kvforge bench throughput --workload "$workload" --dtype float32 --json "$out/kvforge.json"
kvforge bench throughput --workload "$workload" --dtype float32 --backend hf --json "$out/hf.json"
kvforge bench latency --dtype float32 --json "$out/kvforge_latency.json"
kvforge bench latency --dtype float32 --backend hf --json "$out/hf_latency.json"
python - "$out" <<'PY'
import json, sys
d = sys.argv[1]
kv, hf = (json.load(open(f"{d}/{n}.json")) for n in ("kvforge", "hf"))
kvl, hfl = (json.load(open(f"{d}/{n}_latency.json")) for n in ("kvforge", "hf"))
print(f"batched output tokens/s: kvforge {kv['output_tokens_per_s']}, transformers {hf['output_tokens_per_s']}, "
      f"ratio {kv['output_tokens_per_s'] / hf['output_tokens_per_s']:.2f}x")
print(f"batched total tokens/s:  kvforge {kv['total_tokens_per_s']}, transformers {hf['total_tokens_per_s']}")
print(f"single-request decode tokens/s: kvforge {kvl['median_decode_tokens_per_s']}, "
      f"transformers {hfl['median_decode_tokens_per_s']}, "
      f"ratio {kvl['median_decode_tokens_per_s'] / hfl['median_decode_tokens_per_s']:.2f}x")
PY
