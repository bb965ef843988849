#!/usr/bin/env bash
# The GPU tuning run in one device call: CUDA fault demonstration, a full tune of the six ops,
# export, report, and the dispatcher against the vendor kernels through the exported table.
#   carry [".whl"]; bash benchmarks/gpu_tune_run.sh OUTDIR [TRIALS] [TIMEOUT_S]
# A database from an earlier call at .gpu/h200-tuning.db (carried) is resumed.
set -u
OUT=${1:?output folder}; TRIALS=${2:-12}; TIMEOUT=${3:-360}
export PYTHONUNBUFFERED=1 RAY_DISABLE_USAGE_STATS=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD:$PWD/tests
mkdir -p "$OUT"
DB=/tmp/h200-tuning.db
[ -f .gpu/h200-tuning.db ] && cp .gpu/h200-tuning.db $DB
echo "== CUDA faults: out-of-bounds and spinning kernels"
python3 -m tuner tune --device h200 --ops gemm --shapes benchmarks/shapes/cuda_faults.yaml --impls fault_oob,fault_spin \
  --sampler grid --plugin plugins.faulty_cuda --trial-timeout 20 --db sqlite:////tmp/faults.db 2>&1 | grep -v "^\s*$" | tail -12
python3 - <<'PY' | tee "$OUT/cuda-faults.txt"
import sqlite3
con = sqlite3.connect("/tmp/faults.db")
for row in con.execute("select impl, status, substr(error, 1, 140) from opsadv_trials order by id"):
    print(" | ".join(str(x) for x in row))
PY
echo "== tune six ops"
time python3 -m tuner tune --device h200 --ops gemm,attention,layer_norm,rms_norm,softmax,conv2d --trials "$TRIALS" \
  --timeout "$TIMEOUT" --db sqlite:///$DB > /tmp/tune-table.txt 2> "$OUT/tune.log"; echo "tune rc=$?"
tail -5 "$OUT/tune.log"
cp $DB "$OUT/h200-tuning.db"
python3 -m tuner export --device h200 --out /tmp/export --db sqlite:///$DB && cp /tmp/export/opsadv-table.json "$OUT/"
python3 -m tuner report --device h200 --db sqlite:///$DB --plot "$OUT/h200-speedup.png" --markdown "$OUT/h200-report.md" > /dev/null
OPS_ADV_TABLE="$OUT/opsadv-table.json" python3 benchmarks/verify_dispatch.py --out "$OUT/h200-dispatch.md" | tail -4
cat /tmp/tune-table.txt
