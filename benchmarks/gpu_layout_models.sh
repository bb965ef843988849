#!/usr/bin/env bash
# One device call for the per-op layout and the model runtime: GPU tests (Triton kernels, the
# ops under torch.compile / CUDA graphs / autograd, a converted bf16 Llama), the 2026-12-02
# table under the new version rule, and a fresh tune of the 46 default problems with its export.
#   carry [".whl"]; bash benchmarks/gpu_layout_models.sh OUT [TRIALS] [TIMEOUT_S]
set -u
OUT=${1:?output folder}; TRIALS=${2:-10}; TIMEOUT=${3:-230}
export PYTHONUNBUFFERED=1 RAY_DISABLE_USAGE_STATS=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1 || exit 1
export PYTHONPATH=/tmp/site:$PWD:$PWD/tests
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.limit --format=csv,noheader
echo "== GPU tests"
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_ops.py tests/test_ops.py tests/test_versions.py \
  tests/test_triton_gemm_attention.py tests/test_triton_norm_softmax_conv.py > "$OUT/gpu-tests.txt" 2>&1 < /dev/null
tail -n 15 "$OUT/gpu-tests.txt"
echo "== the 2026-12-02 run-2 table under this code"
python3 -m ops_adv check benchmarks/results/2026-12-02-run2-opsadv-table.json 2>&1 | tee "$OUT/old-table-check.txt"
echo "== tune six ops"
DB=/tmp/h200-tuning.db
time timeout $((TIMEOUT + 80)) python3 -m tuner tune --device h200 --ops gemm,attention,layer_norm,rms_norm,softmax,conv2d \
  --trials "$TRIALS" --timeout "$TIMEOUT" --progress plain --db sqlite:///$DB > "$OUT/tune-table.txt" 2> "$OUT/tune.log" < /dev/null
echo "tune rc=$?"; tail -n 4 "$OUT/tune.log"
python3 -m tuner export --device h200 --out /tmp/export --db sqlite:///$DB && cp /tmp/export/opsadv-table.json "$OUT/"
echo "== the new table"
python3 -m ops_adv check "$OUT/opsadv-table.json" 2>&1 | tee "$OUT/new-table-check.txt"
OPS_ADV_TABLE="$OUT/opsadv-table.json" timeout 120 python3 benchmarks/verify_dispatch.py --out "$OUT/h200-dispatch.md" 2>&1 | tail -n 4
cat "$OUT/tune-table.txt" | tail -n 50
