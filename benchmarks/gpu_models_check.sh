#!/usr/bin/env bash
# One device call: the model-runtime GPU tests, and why compile(converted) recompiles in decode.
set -u
OUT=${1:?output folder}
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PWD/tests
mkdir -p "$OUT"
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_ops.py > "$OUT/gpu-tests.txt" 2>&1 < /dev/null
tail -n 3 "$OUT/gpu-tests.txt"
for v in "" --converted; do
  echo "== recompiles $v"
  OPS_ADV_TABLE=benchmarks/results/2026-12-03-h200-layout-opsadv-table.json OPS_ADV_NEAREST=2 TORCH_LOGS=recompiles \
    timeout 200 python3 benchmarks/recompiles_llama.py --size 8b $v > "$OUT/recompiles$v.txt" 2>&1 < /dev/null
  grep -E "^\S+ \S+ \S+ \S+\] \[\S+\] \[__recompiles\]     - " "$OUT/recompiles$v.txt" | sed 's/^.*__recompiles\]//' | head -n 14
done
