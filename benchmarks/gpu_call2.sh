#!/usr/bin/env bash
# One device call: compile-ahead on/off, the gemm full-space sweep, the GPU kernel tests.
#   carry [".whl"]; bash benchmarks/gpu_call2.sh OUT
set -u
OUT=$1
export PYTHONUNBUFFERED=1 RAY_DISABLE_USAGE_STATS=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD
timeout 180 bash benchmarks/compile_ahead.sh 12 > "$OUT/compile_ahead.txt" 2>&1
echo "== compile-ahead"; tail -n 30 "$OUT/compile_ahead.txt"
timeout 265 python3 benchmarks/search_efficiency.py sweep --out "$OUT/sweep" --ops gemm --budget-s 235 > "$OUT/sweep.log" 2>&1 < /dev/null
echo "== sweep"; grep -v -i warn "$OUT/sweep.log" | tail -n 12
rm -f "$OUT"/sweep/*.jsonl.gz; gzip -f "$OUT"/sweep/*.jsonl 2>/dev/null
timeout 95 python3 -m pytest -q -p no:cacheprovider tests/test_triton_gemm_attention.py tests/test_triton_norm_softmax_conv.py > "$OUT/gpu-tests.txt" 2>&1 < /dev/null
echo "== tests"; tail -n 8 "$OUT/gpu-tests.txt"
