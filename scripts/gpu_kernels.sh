#!/usr/bin/env bash
# Kernel checks on a GPU machine: the kernel tests compiled for the device (not interpreted), the
# device-only `gpu` tests (the CUDA/HIP graph replay of compiled decode steps included), the kernel
# benchmark, then single-stream decode with compiled graphs on and off. Everything lands in $1
# (default results/gpu).
# Budget: under 8 minutes on an H100/H200 (tests ~2 min incl. Triton compiles, benchmark ~3 min).
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-results/gpu}"
mkdir -p "$out"

python - <<'PY' 2>&1 | tee "$out/env.txt"
import torch, triton
assert torch.cuda.is_available(), "no CUDA/ROCm device visible"
print("torch", torch.__version__, "hip", torch.version.hip, "triton", triton.__version__)
print(torch.cuda.get_device_name(), torch.cuda.get_device_capability())
PY
[ "${PIPESTATUS[0]}" -eq 0 ] || exit 1

status=0
KVFORGE_TEST_DEVICE=cuda timeout 300 python -m pytest tests/kernels tests/platforms tests/quantization/test_fp8.py \
    tests/quantization/test_gguf_quants.py tests/executor/test_decode_graphs.py -m "gpu or not gpu" -q --ignore tests/tools/test_cross_compile.py \
    -p no:cacheprovider --durations=10 --junitxml="$out/kernel_tests.xml" 2>&1 | tee "$out/kernel_tests.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

timeout 180 python -m kvforge.benchmarks.kernels --out "$out" 2>&1 | tee "$out/kernel_bench.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

for mode in "" "--enforce-eager"; do
  timeout 120 python -m kvforge.cli bench latency --device cuda --dtype bfloat16 --input-len 128 --output-len 128 \
      --num-requests 3 --kv-cache-memory 1GiB $mode --json "$out/decode${mode:+_eager}.json" 2>&1 \
      | tee -a "$out/decode.txt"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
done

echo "results in $out (exit $status)"
exit "$status"
