#!/usr/bin/env bash
# Tuning wall time with compile-ahead off and on, each with an empty Triton cache (one device call).
#   carry [".whl"]; bash benchmarks/compile_ahead.sh [TRIALS] ["0 4" compile-worker counts]
set -u
TRIALS=${1:-12}
CWS=${2:-"0 4"}
export PYTHONUNBUFFERED=1 RAY_DISABLE_USAGE_STATS=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
for cw in $CWS; do
  export TRITON_CACHE_DIR=/tmp/triton-cache-$cw
  s=$(date +%s.%N)
  python3 -m tuner tune --device h200 --ops gemm,softmax --shapes benchmarks/shapes/compile_ahead.yaml --trials "$TRIALS" \
    --compile-workers $cw --db sqlite:////tmp/ca$cw.db > /tmp/ca$cw.txt 2>/tmp/ca$cw.log
  rc=$?
  e=$(date +%s.%N)
  echo "compile-workers=$cw rc=$rc wall=$(python3 -c "print(round($e-$s,1))") s; $(grep -c '  done' /tmp/ca$cw.log) problems done"
  python3 - "$cw" <<'PY'
import sqlite3, sys
con = sqlite3.connect(f"/tmp/ca{sys.argv[1]}.db")
n = con.execute("select count(*) from opsadv_trials where status != 'pruned'").fetchone()[0]
t0, t1 = con.execute("select min(created_at), max(created_at) from opsadv_trials").fetchone()
print(f"  measured trials {n}, first to last trial stored: {t0} .. {t1}")
PY
  cat /tmp/ca$cw.txt; grep -i "compile" /tmp/ca$cw.log | tail -3
done
