#!/usr/bin/env bash
# The same benchmarks at two commits, side by side on one quiet machine: greedy tokens, single-stream decode (kvforge
# bench latency, 128 + 128 tokens) and 64 streams (kvforge bench throughput, 128 + 128), for the default GGUF file
# kept quantized, float32, and float32 quantized at load time (w8a16, w4a16, w8a8, fp8; FORMATS="gguf" picks some),
# then the host time of a 64-stream decode step (kvforge profile, eager). The two commits take turns, twice, so a
# drift of the machine shows as a difference between the rounds, not between the commits. Prints a table of
# medians at the end.
# Usage: [FORMATS="gguf float32 ..."] bash scripts/bench_before_after.sh [BEFORE_REV (default main)]
#        [AFTER_REV (default HEAD)] [OUT_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
before=${1:-main}
after=${2:-HEAD}
out=${3:-results/before_after}
python=${PYTHON:-$PWD/.venv/bin/python}
mkdir -p "$out"
lscpu | grep -E "Model name|^CPU\(s\)|Flags" > "$out/machine.txt"
for name in before after; do
  rev=$([ "$name" = before ] && echo "$before" || echo "$after")
  dir="$out/tree_$name"
  [ -d "$dir" ] || git worktree add --detach "$dir" "$rev"
  cp kvforge/kernels/cpu/_kernels_*.so "$dir/kvforge/kernels/cpu/" 2>/dev/null || true  # else the first use builds them
  git -C "$dir" rev-parse HEAD > "$out/${name}_commit.txt"
done
greedy='import json, sys
from kvforge import LLM, SamplingParams
kwargs = json.loads(sys.argv[1])
outputs = LLM(kv_cache_memory="256MiB", **kwargs).generate(
    ["Write a short story about a lighthouse keeper.", "List three prime numbers and explain why."],
    SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True))
print(json.dumps([o.outputs[0].token_ids for o in outputs]))'
rm -f "$out"/*_greedy.txt
formats=${FORMATS:-gguf float32 w8a16 w4a16 w8a8 fp8}
for tag in $formats; do
  kwargs=$([ "$tag" = float32 ] && echo '{"dtype": "float32"}' || echo "{\"quantization\": \"$tag\"}")
  for name in before after; do
    (cd "$out/tree_$name" && PYTHONPATH=$PWD "$python" -c "$greedy" "$kwargs") > "$out/${name}_greedy.txt.part"
    echo "$kwargs $(cat "$out/${name}_greedy.txt.part")" >> "$out/${name}_greedy.txt"
  done
done
rm -f "$out"/*_greedy.txt.part
if cmp -s "$out/before_greedy.txt" "$out/after_greedy.txt"; then echo "greedy tokens: the same"; else
  echo "greedy tokens DIFFER:"; diff "$out/before_greedy.txt" "$out/after_greedy.txt" || true; fi
for round in 1 2; do
  for tag in $formats; do
    format=$([ "$tag" = float32 ] && echo "--dtype float32" || echo "--quantization $tag")
    for name in before after; do
      dir="$out/tree_$name"
      # shellcheck disable=SC2086
      (cd "$dir" && PYTHONPATH=$PWD "$python" -m kvforge.cli bench latency --input-len 128 --output-len 128 \
        --num-requests 3 --kv-cache-memory 256MiB $format --json "../${name}_latency_${tag}_${round}.json")
      # shellcheck disable=SC2086
      (cd "$dir" && PYTHONPATH=$PWD "$python" -m kvforge.cli bench throughput --num-prompts 64 --input-len 128 128 \
        --output-len 128 $format --json "../${name}_throughput_${tag}_${round}.json")
    done
  done
done
for round in 1 2; do
  for name in before after; do
    (cd "$out/tree_$name" && PYTHONPATH=$PWD "$python" -m kvforge.cli profile --num-prompts 64 --input-len 16 32 \
      --output-len 8 --concurrency 64 --enforce-eager --no-trace --out "../${name}_profile_${round}" > /dev/null)
  done
done
"$python" - "$out" <<'SUMMARY'
import json, statistics, sys
from pathlib import Path
out = Path(sys.argv[1])
def median(pattern, read):
    values = [read(json.loads(p.read_text())) for p in sorted(out.glob(pattern))]
    return statistics.median(values) if values else float("nan")
print(f"{'benchmark':<40}{'before':>10}{'after':>10}{'after/before':>14}")
tags = sorted({p.name.split("_")[2] for p in out.glob("before_latency_*_1.json")})
rows = [(f"latency {tag}: decode tokens/s", f"latency_{tag}_*.json", lambda d: d["median_decode_tokens_per_s"])
        for tag in tags]
rows += [(f"throughput {tag}: output tokens/s", f"throughput_{tag}_*.json", lambda d: d["output_tokens_per_s"])
         for tag in tags]
def host_ms(profile):  # the whole host time of a 64-sequence decode step, its median over the run
    steps = [s for s in profile["steps"]["0"] if s["kind"] == "decode" and s["num_seqs"] == 64 and not s["compiling"]]
    return statistics.median(s["wall_s"] - s["model_s"] for s in steps) * 1e3
profiles = [("64-stream decode step: host ms", "profile_*/profile.json", host_ms)]
for label, pattern, read in rows + profiles:
    before, after = median("before_" + pattern, read), median("after_" + pattern, read)
    print(f"{label:<40}{before:>10.2f}{after:>10.2f}{after / before:>14.3f}")
SUMMARY
echo "results in $out"
