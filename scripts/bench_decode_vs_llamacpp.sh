#!/usr/bin/env bash
# kvforge against llama.cpp (built natively: bash ../shared/peers/llama-cpp.sh prints its bin folder) and
# transformers on the default model's Q4_1 GGUF file, one after another in one run, 2 threads:
#   single stream: 128-token prompt, 128 new tokens (llama-bench tg128 / pp512; kvforge bench latency with
#                  the GGUF weights kept, compiled and eager; float32 compiled and eager; transformers float32);
#                  a 512-token prompt (its time to first token against pp512), GGUF kept and float32
#   batched:       64 x (128 prompt + 128 new), then 16 x (llama-batched-bench -npl 16,64; kvforge bench throughput)
# Usage: bash scripts/bench_decode_vs_llamacpp.sh LLAMA_CPP_BIN_DIR [OUT_DIR]
# Where the native build dies on prompts (a VM that reports AMX but does not enable its tiles: "Illegal
# instruction"), build the same sources with the CPU's flags and AMX off and give that folder (benchmarks/RESULTS.md
# has the cmake line), and time the native build's decode apart: "$native_bin/llama-bench" -m MODEL -t 2 -p 0 -n 128
set -euo pipefail
cd "$(dirname "$0")/.."
. .venv/bin/activate
bin=${1:?give the llama.cpp bin folder (bash ../shared/peers/llama-cpp.sh prints it)}
out=${2:-results/decode}
mkdir -p "$out"
model=$(python -c "from kvforge.loader.default_model import default_model_path; print(default_model_path())")
lscpu | grep -E "Model name|^CPU\(s\)|Flags" > "$out/machine.txt"
"$bin/llama-bench" -m "$model" -t 2 -p 512 -n 128 -r 3 -o json > "$out/llama_bench.json"
latency=(kvforge bench latency --input-len 128 --output-len 128 --num-requests 3 --kv-cache-memory 256MiB)
"${latency[@]}" --quantization gguf --json "$out/kvforge_gguf.json"
"${latency[@]}" --quantization gguf --enforce-eager --json "$out/kvforge_gguf_eager.json"
"${latency[@]}" --dtype float32 --json "$out/kvforge_fp32.json"
"${latency[@]}" --dtype float32 --enforce-eager --json "$out/kvforge_fp32_eager.json"
"${latency[@]}" --dtype float32 --backend hf --json "$out/hf_fp32.json"
prompt=(kvforge bench latency --input-len 512 --output-len 2 --num-requests 3 --kv-cache-memory 256MiB)
"${prompt[@]}" --quantization gguf --json "$out/kvforge_pp512_gguf.json"
"${prompt[@]}" --dtype float32 --json "$out/kvforge_pp512_fp32.json"
"$bin/llama-batched-bench" -m "$model" -t 2 -c 20000 -b 2048 -ub 512 -npp 128 -ntg 128 -npl 16,64 -fa off \
  > "$out/llama_batched.txt" 2>&1
for streams in 64 16; do
  batched=(kvforge bench throughput --num-prompts "$streams" --input-len 128 128 --output-len 128)
  "${batched[@]}" --quantization gguf --json "$out/kvforge_batched${streams}_gguf.json"
  "${batched[@]}" --dtype float32 --json "$out/kvforge_batched${streams}_fp32.json"
done
python - "$out" <<'PY'
import json, re, sys
d = sys.argv[1]
load = lambda name: json.load(open(f"{d}/{name}.json"))  # noqa: E731
bench = {("pp" if r["n_prompt"] else "tg"): r["avg_ts"] for r in load("llama_bench")}
tg = bench["tg"]
print(f"llama.cpp tg128 {tg:.1f} tokens/s, pp512 {bench['pp']:.1f} tokens/s")
for name in ("kvforge_gguf", "kvforge_gguf_eager", "kvforge_fp32", "kvforge_fp32_eager", "hf_fp32"):
    r = load(name)
    print(f"{name:<20} decode {r['median_decode_tokens_per_s']:7.1f} tokens/s ({r['median_decode_tokens_per_s'] / tg:.2f}x "
          f"llama.cpp), 128-token TTFT {r['median_ttft_s']:.3f} s")
for name in ("kvforge_pp512_gguf", "kvforge_pp512_fp32"):
    pp = 512 / load(name)["median_ttft_s"]
    print(f"{name:<20} 512-token prompt {pp:7.1f} tokens/s ({pp / bench['pp']:.2f}x llama.cpp pp512)")
for streams in (64, 16):
    rows = [line for line in open(f"{d}/llama_batched.txt") if re.match(rf"\|\s+128 \|\s+128 \|\s+{streams} \|", line)]
    cells = rows[0].split("|") if rows else [""] * 11
    total, decode = (float(cells[i]) if cells[i].strip() else float("nan") for i in (10, 8))
    print(f"llama-batched-bench {streams} x (128 + 128): {total:.1f} total tokens/s ({decode:.1f} decode)")
    for name in (f"kvforge_batched{streams}_gguf", f"kvforge_batched{streams}_fp32"):
        r = load(name)
        print(f"{name:<22} {r['total_tokens_per_s']:7.1f} total tokens/s ({r['total_tokens_per_s'] / total:.2f}x), "
              f"compiled before {r.get('compile_s', float('nan')):.0f} s")
PY
