#!/usr/bin/env bash
# One device call: record the problems the end-to-end models hit, tune them for this GPU (what
# model.tune_for_hardware does: record, then the tuner), export the table, and run
# benchmarks/e2e_model.py with it.
#   carry [".whl"]; bash benchmarks/gpu_e2e.sh OUT [CASES] [TUNE_S] [TRIALS]
# CASES: all (default) or a comma-separated subset of llama-prefill,llama-decode,qwen,resnet.
# TUNE_S: seconds of tuning (default 120; 0 skips tuning). E2E_TABLE=path runs e2e with a table made
# earlier (no tuning); E2E_S caps the e2e step (default: what is left of 555 s); E2E_ARGS adds flags
# (e.g. "--layers 2").
# The whole default e2e run is sized for ~8 min: with tuning, split it, e.g. call 1:
#   bash benchmarks/gpu_e2e.sh OUT1 llama-decode 120     (copy OUT1/opsadv-table.json into the tree)
# call 2: E2E_TABLE=<that table> bash benchmarks/gpu_e2e.sh OUT2 llama-prefill,qwen,resnet 0
# then here: python benchmarks/e2e_model.py --merge OUT1/e2e.json OUT2/e2e.json --out DIR
set -u
OUT=${1:?output folder}; CASES=${2:-all}; TUNE_S=${3:-120}; TRIALS=${4:-8}
export PYTHONUNBUFFERED=1 RAY_DISABLE_USAGE_STATS=1
mkdir -p "$OUT"
if [ "${WHEELS_INSTALLED:-}" = 1 ]; then
  :  # gpu_next.sh installed them into /tmp/site
elif ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    > "$OUT/pip.log" 2>&1 || { echo "wheel bundle install failed: see pip.log"; exit 1; }
elif [ "${E2E_TABLE:-}" = "" ] && [ "$TUNE_S" != 0 ]; then
  echo "no .whl/ bundle: build it with ../shared/tools/device-bundle and carry [\".whl\"], or pass TUNE_S=0"; exit 1
fi
export PYTHONPATH=/tmp/site:$PWD:$PWD/tests
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
python3 -c "import torch, transformers, torchvision; print('torch', torch.__version__, 'transformers', transformers.__version__, 'torchvision', torchvision.__version__)"
TABLE=${E2E_TABLE:-}
DEV=$(python3 -c "import torch; from kernel_space._device import device_class_of; print(device_class_of(torch.cuda.get_device_name(0)))")
if [ -z "$TABLE" ] && [ "$TUNE_S" != 0 ]; then
  echo "== record problems ($CASES)"
  timeout -k 5 120 python3 benchmarks/e2e_model.py --device cuda --cases "$CASES" ${E2E_ARGS:-} \
    --record-shapes "$OUT/e2e-shapes.json" 2> "$OUT/record.log" < /dev/null; echo "record rc=$?"; tail -n 3 "$OUT/record.log"
  OPS=$(python3 -c "import json; print(','.join(sorted(json.load(open('$OUT/e2e-shapes.json')))))")
  echo "== tune $OPS on $DEV for ${TUNE_S}s"
  timeout -k 10 $((TUNE_S + 45)) python3 -m tuner tune --device "$DEV" --ops "$OPS" --shapes "$OUT/e2e-shapes.json" \
    --trials "$TRIALS" --timeout "$TUNE_S" --db sqlite:////tmp/e2e-tuning.db > "$OUT/tune.txt" 2> "$OUT/tune.log" < /dev/null
  rc=$?; echo "tune rc=$rc"; tail -n 5 "$OUT/tune.log"
  if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then  # killed: Ray's workers may still hold the GPU
    timeout 30 python3 -m ray.scripts.scripts stop --force > /dev/null 2>&1
  fi
  python3 -m tuner export --device "$DEV" --out /tmp/e2e-export --db sqlite:////tmp/e2e-tuning.db > /dev/null \
    && cp /tmp/e2e-export/opsadv-table.json "$OUT/opsadv-table.json" && TABLE=$OUT/opsadv-table.json
  [ -n "$TABLE" ] && python3 -m ops_adv check "$TABLE" | tail -n 12
fi
# e2e ends by E2E_END (default 555) s from this script's start (SIGTERM: it writes the cases done;
# KILL 15 s later)
LEFT=${E2E_S:-$((${E2E_END:-555} - SECONDS))}
if [ "$LEFT" -lt 30 ]; then
  echo "== e2e skipped: only ${LEFT}s left of this call"
else
  echo "== e2e ($CASES) with table: ${TABLE:-none}, ${LEFT}s"
  OPS_ADV_TABLE=$TABLE timeout -k 15 "$LEFT" python3 benchmarks/e2e_model.py --device cuda --cases "$CASES" \
    ${E2E_ARGS:-} --out "$OUT" 2> "$OUT/e2e.log" > /dev/null < /dev/null
  echo "e2e rc=$?"; grep -E "^\[|Error|error" "$OUT/e2e.log" | tail -n 25
fi
sed -n '/^## Targets/,$p' "$OUT/e2e.md" 2>/dev/null
