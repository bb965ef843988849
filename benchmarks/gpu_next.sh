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
    > "$OUT/pip.log" 2>&1 && export WHEELS_INSTALLED=1 || echo "wheel bundle install failed: see pip.log"
fi
export PYTHONPATH=/tmp/site:$PWD:$PWD/tests
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,memory.used --format=csv,noheader | tee "$OUT/gpu.txt"
# Step limits per stage sum to <= 520 s (+ 10 s a step if it must be killed, + the wheel install):
# under the 600 s of a device call. Every benchmark stops starting problems at its --deadline-s and
# rewrites its JSON as it goes, so a step that hits its limit still leaves what it measured.
step() {  # [TSIG=INT] step NAME SECONDS CMD...: run with a limit (TSIG, default TERM; KILL 10 s later)
  local name=$1 limit=$2; shift 2
  echo "== $name ($(date +%T), limit ${limit}s)"
  timeout -s "${TSIG:-TERM}" -k 10 "$limit" "$@" > "$OUT/$name.txt" 2>&1 < /dev/null
  echo "$name rc=$?"; tail -n 25 "$OUT/$name.txt"
}
case "$STAGE" in
  kernels-a)
    # SIGINT: pytest stops as after ^C and still prints its failures and durations
    TSIG=INT step gpu-tests 170 python3 -m pytest -q -p no:cacheprovider --durations=15 tests/test_decode_attention.py \
      tests/test_gemm_decode.py tests/test_linear.py tests/test_fused_rowwise.py tests/test_rope.py tests/test_conv_bn_relu.py \
      tests/test_gpu_ops.py
    step decode-attention 180 python3 benchmarks/decode_attention.py --deadline-s 150 --out "$OUT/decode_attention.json"
    step gemm-decode 165 python3 benchmarks/gemm_decode.py --deadline-s 135 --out "$OUT/gemm_decode.json"
    ;;
  kernels-b)
    step fused-ops 200 python3 benchmarks/fused_ops.py --deadline-s 165 --out "$OUT/fused_ops.json"
    step rope 150 python3 benchmarks/rope.py --deadline-s 115 --out "$OUT/rope.json"
    # layers until 105 s, then the whole ResNet-50 (~30-40 s)
    step conv-bn-relu 170 python3 benchmarks/conv_bn_relu.py --deadline-s 105 --out "$OUT/conv_bn_relu.json"
    ;;
  e2e-decode)
    # B 1 and 8 only (the targets are at B <= 8): each case compiles two reduce-overhead models (~30-60 s)
    : "${E2E_ARGS=--decode-batch 1,8}"; export E2E_ARGS
    E2E_END=$((555 - SECONDS)) bash benchmarks/gpu_e2e.sh "$OUT" llama-decode 120
    ;;
  e2e-rest)
    E2E_END=$((555 - SECONDS)) bash benchmarks/gpu_e2e.sh "$OUT" llama-prefill,qwen,resnet 0
    ;;
  *) echo "unknown stage $STAGE"; exit 2 ;;
esac
