#!/usr/bin/env bash
# kvforge against llama.cpp on GGUF files of real model sizes (scripts/make_gguf_models.py writes them: public models'
# shapes, random weights, quantized by llama-quantize), one file after another in one run, 2 threads:
#   decode      tg128 (llama-bench) against `kvforge bench latency` 128 + 128, one stream; and the rate the weights
#               stream at against a 1 GiB copy timed in the same run
#   prompt      pp512 against the time to the first token of a 512-token prompt
#   batched     llama-batched-bench 16 x (128 + 128) against `kvforge bench throughput` 16 x (128 + 128)
#   memory      peak resident memory of each process (GNU time), and kvforge's load time
# Usage: bash scripts/bench_gguf_sizes_vs_llamacpp.sh LLAMA_CPP_BIN_DIR MODEL_DIR [OUT_DIR] [TYPES...]
#   e.g. bash scripts/bench_gguf_sizes_vs_llamacpp.sh "$(bash ../shared/peers/llama-cpp.sh)" /work/models \
#        results/sizes Q4_0 Q4_K_M           (files MODEL_DIR/llama-1b-TYPE.gguf; PREFIX=llama-8b for the 8B file)
# SKIP_BATCHED=1 leaves out the batched runs (the 8B file). NATIVE_BIN=DIR also times tg128 (and its peak memory) with
# a second llama.cpp build: on a VM that reports AMX but does not enable it, the native build decodes (faster, with its
# repacked AMX/AVX-512 kernels) but dies on prompts, so LLAMA_CPP_BIN_DIR is then a build with AMX off
# (its cmake line is in benchmarks/history/decode-vs-llamacpp.md) and NATIVE_BIN the native one.
set -euo pipefail
cd "$(dirname "$0")/.."
. .venv/bin/activate
bin=${1:?give the llama.cpp bin folder (bash ../shared/peers/llama-cpp.sh prints it)}
models=${2:?give the folder of the GGUF files}
out=${3:-results/sizes}
shift $(( $# < 3 ? $# : 3 ))
types=("$@")
[ ${#types[@]} -gt 0 ] || types=(Q4_0 Q4_K_M Q5_K_M Q6_K Q8_0)
prefix=${PREFIX:-llama-1b}
mkdir -p "$out"
lscpu | grep -E "Model name|^CPU\(s\)|Flags" > "$out/machine.txt"
peak() { /usr/bin/time -f "%M" -o "$1" "${@:2}"; }  # peak resident KiB of the command into file $1
python - > "$out/copy.json" <<'PY'
import json, time, torch
torch.set_num_threads(2)
source, target = torch.ones(1 << 30, dtype=torch.uint8), torch.empty(1 << 30, dtype=torch.uint8)
times = []
for _ in range(7):
    start = time.perf_counter(); target.copy_(source); times.append(time.perf_counter() - start)
print(json.dumps({"copy_gbs": round(2 * (1 << 30) / min(times) / 1e9, 1)}))
PY
for type in "${types[@]}"; do
  model="$models/$prefix-$type.gguf"
  name="$prefix-$type"
  peak "$out/$name.llama_bench.rss" "$bin/llama-bench" -m "$model" -t 2 -p 512 -n 128 -r 3 -o json \
    > "$out/$name.llama_bench.json"
  if [ -n "${NATIVE_BIN:-}" ]; then
    peak "$out/$name.native.rss" "$NATIVE_BIN/llama-bench" -m "$model" -t 2 -p 0 -n 128 -r 3 -o json \
      > "$out/$name.native_tg.json"
  fi
  peak "$out/$name.kvforge_decode.rss" kvforge bench latency --model "$model" --input-len 128 --output-len 128 \
    --num-requests 3 --kv-cache-memory 256MiB --json "$out/$name.kvforge_decode.json" > /dev/null
  kvforge bench latency --model "$model" --input-len 512 --output-len 2 --num-requests 3 --kv-cache-memory 256MiB \
    --json "$out/$name.kvforge_pp512.json" > /dev/null
  if [ -z "${SKIP_BATCHED:-}" ]; then
    "$bin/llama-batched-bench" -m "$model" -t 2 -c 4608 -b 2048 -ub 512 -npp 128 -ntg 128 -npl 16 -fa off \
      > "$out/$name.llama_batched.txt" 2>&1
    kvforge bench throughput --model "$model" --num-prompts 16 --input-len 128 128 --output-len 128 \
      --json "$out/$name.kvforge_batched16.json" > /dev/null
  fi
done
python - "$out" "$prefix" "${types[@]}" <<'PY'
import json, math, os, re, sys
out, prefix, types = sys.argv[1], sys.argv[2], sys.argv[3:]
load = lambda path: json.load(open(os.path.join(out, path)))  # noqa: E731
rss = lambda path: int(open(os.path.join(out, path)).read().split()[-1]) / 1024  # noqa: E731  MiB
copy = load("copy.json")["copy_gbs"]
print(f"copy {copy} GB/s; llama.cpp / kvforge per file, 2 threads")
print("| file | tg128 | native tg128 | kvforge decode | x | x native | weights GB/s (of copy) | pp512 | kvforge 512 | x "
      "| 16 streams | kvforge | x | peak RSS llama.cpp | kvforge | x | kvforge load s |")
for t in types:
    name = f"{prefix}-{t}"
    bench = {("pp" if r["n_prompt"] else "tg"): r["avg_ts"] for r in load(f"{name}.llama_bench.json")}
    decode = load(f"{name}.kvforge_decode.json")
    tokens_s = decode["median_decode_tokens_per_s"]
    read_gbs = tokens_s * decode["weight_mib"] * 2**20 / 1e9
    pp = 512 / load(f"{name}.kvforge_pp512.json")["median_ttft_s"]
    batched = ours = math.nan
    if os.path.exists(os.path.join(out, f"{name}.kvforge_batched16.json")):
        rows = [line for line in open(os.path.join(out, f"{name}.llama_batched.txt"))
                if re.match(r"\|\s+128 \|\s+128 \|\s+16 \|", line)]
        batched = float(rows[0].split("|")[10]) if rows else math.nan
        ours = load(f"{name}.kvforge_batched16.json")["total_tokens_per_s"]
    peer_rss, our_rss = rss(f"{name}.llama_bench.rss"), rss(f"{name}.kvforge_decode.rss")
    native = math.nan
    if os.path.exists(os.path.join(out, f"{name}.native_tg.json")):
        native = load(f"{name}.native_tg.json")[0]["avg_ts"]
    print(f"| {t} | {bench['tg']:.1f} | {native:.1f} | {tokens_s:.1f} | {tokens_s / bench['tg']:.2f} | "
          f"{tokens_s / native:.2f} | {read_gbs:.1f} "
          f"({read_gbs / copy:.0%}) | {bench['pp']:.1f} | {pp:.1f} | {pp / bench['pp']:.2f} | {batched:.1f} | "
          f"{ours:.1f} | {ours / batched:.2f} | {peer_rss:.0f} MiB | {our_rss:.0f} MiB | {our_rss / peer_rss:.2f} | "
          f"{decode['load_s']} |")
PY
