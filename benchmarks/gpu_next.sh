#!/usr/bin/env bash
# The H200 measurements issues 11, 12 and 13 wait for, as four device calls of under 10 minutes:
#   carry [".whl"] (built by ../shared/tools/device-bundle, plus the tqdm wheel), then
#   bash benchmarks/gpu_next.sh kernels-a   GPU tests of the new ops (bf16), decode attention, decode gemm
#   bash benchmarks/gpu_next.sh kernels-b   fused row-wise ops, rope, conv2d_bn_relu
#   bash benchmarks/gpu_next.sh e2e-decode  tune the Llama decode problems, export, e2e decode rows
#   E2E_TABLE=benchmarks/results/<that table> bash benchmarks/gpu_next.sh e2e-rest   prefill, Qwen2, ResNet-50
# Everything lands under $OUT/<stage>/; commit the .json/.md/.txt files under benchmarks/results/.
set -u
STAGE=${1:?stage: kernels-a, kernels-b, e2e-decode or e2e-rest}
OUT=${OUT:-/tmp/out}/$STAGE
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 RAY_DISABLE_USAGE_STATS=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    > "$OUT/pip.log" 2>&1 || echo "wheel bundle install failed: see pip.log"
fi
export PYTHONPATH=/tmp/site:$PWD:$PWD/tests
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,memory.used --format=csv,noheader | tee "$OUT/gpu.txt"
step() {  # step NAME SECONDS CMD...: run with a limit, keep its output, say how it ended
  local name=$1 limit=$2; shift 2
  echo "== $name ($(date +%T), limit ${limit}s)"
  timeout "$limit" "$@" > "$OUT/$name.txt" 2>&1 < /dev/null
  echo "$name rc=$?"; tail -n 25 "$OUT/$name.txt"
}
case "$STAGE" in
  kernels-a)
    step gpu-tests 200 python3 -m pytest -q -p no:cacheprovider tests/test_decode_attention.py tests/test_gemm_decode.py \
      tests/test_linear.py tests/test_fused_rowwise.py tests/test_rope.py tests/test_conv_bn_relu.py tests/test_gpu_ops.py
    step decode-attention 200 python3 benchmarks/decode_attention.py --out "$OUT/decode_attention.json"
    step gemm-decode 170 python3 benchmarks/gemm_decode.py --deadline-s 150 --out "$OUT/gemm_decode.json"
    ;;
  kernels-b)
    step fused-ops 220 python3 benchmarks/fused_ops.py --deadline-s 190 --out "$OUT/fused_ops.json"
    step rope 170 python3 benchmarks/rope.py --out "$OUT/rope.json"
    step conv-bn-relu 170 python3 benchmarks/conv_bn_relu.py --deadline-s 130 --out "$OUT/conv_bn_relu.json"
    ;;
  e2e-decode)
    bash benchmarks/gpu_e2e.sh "$OUT" llama-decode 120
    ;;
  e2e-rest)
    bash benchmarks/gpu_e2e.sh "$OUT" llama-prefill,qwen,resnet 0
    ;;
  *) echo "unknown stage $STAGE"; exit 2 ;;
esac
