#!/usr/bin/env bash
# One device call: the model-runtime GPU tests, then the end-to-end Llama comparison (eager,
# converted, compiled, compiled-converted) with the committed H200 table.
#   bash benchmarks/gpu_models_e2e.sh OUT
set -u
OUT=${1:?output folder}
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PWD/tests
mkdir -p "$OUT"
echo "== GPU tests"
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_ops.py > "$OUT/gpu-tests.txt" 2>&1 < /dev/null
tail -n 3 "$OUT/gpu-tests.txt"
echo "== e2e"
OPS_ADV_TABLE=benchmarks/results/2026-12-03-h200-layout-opsadv-table.json OPS_ADV_NEAREST=2 \
  timeout 400 python3 benchmarks/e2e_model.py --device cuda --models llama --size 8b --prefill 1:2048,8:512 \
  --decode-batch 1 --prompt-len 512 --new-tokens 32 --rounds 5 --out "$OUT" 2> "$OUT/e2e.log" < /dev/null
echo "e2e rc=$?"; tail -n 12 "$OUT/e2e.log"; cat "$OUT/e2e.md" 2>/dev/null
