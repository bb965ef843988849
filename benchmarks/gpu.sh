#!/usr/bin/env bash
# The GPU runs of this repository, as named stages. Each step runs in its own process under `timeout`,
# writes under $OUT/<stage>/ as it goes, and the whole call stops by --budget seconds (default 570:
# one 10-minute call), so a call cut short still leaves what it measured.
#
#   bash benchmarks/gpu.sh [--wheels DIR] [--out DIR] [--budget S] STAGE [STAGE ...]
#   bash benchmarks/gpu.sh            # lists the stages
#
# --wheels DIR (or WHEELS=DIR): wheels installed once per call (pip --no-index --find-links DIR) into
# a private site folder; the tuner's stages need the tuning stack (ray, optuna, sqlalchemy, alembic).
# --out DIR (or OUT=DIR): results (default ./gpu-out). Stage settings come from the environment:
#   TABLE=path       tuned table for e2e, dispatch, sanitize (default: $OUT/e2e-tune/opsadv-table.json if there)
#   E2E_CASES=...    e2e_model.py --cases (e2e, e2e-tune; default llama-decode; E2E_TUNE_CASES, E2E_TUNE_ARGS for e2e-tune alone)
#   E2E_ARGS="..."   more e2e_model.py flags (e.g. "--decode-batch 1,8 --contexts 1024 --layers 2")
#   DECODE_STEP_ARGS="..."   more decode_step.py flags (e.g. "--parts bandwidth,layer", then "--parts generate" in a
#                    second call, and decode_step.py --merge of the two decode_step.json)
#   TUNE_S=120 TRIALS=8   seconds and counted trials per problem of the tune stages
set -u
STAGES=(  # name | limit s | what it runs
  "tests-gpu      | 200 | GPU tests, part 1: the decode kernels, linear, fused row-wise ops, rope"
  "tests-gpu-2    | 220 | GPU tests, part 2: Triton gemm/attention/norm/conv kernels, the ops under compile/graphs/autograd, converted models"
  "capture        | 420 | CUDA graph captures (issue 25): the gate's capture tests, the benchmarks' capture, decode_step.py's graph variants under compute-sanitizer (TABLE)"
  "sanitize       | 420 | compute-sanitizer memcheck: a converted Llama B=8 decode step in a CUDA graph, the decode kernels' tests"
  "decode         | 350 | benchmarks: decode_attention.py, gemm_decode.py (kernels vs vendor under CUDA graphs)"
  "fused          | 520 | benchmarks: fused_ops.py, rope.py, conv_bn_relu.py"
  "kernels        | 400 | benchmarks/kernels.py: every op's Triton candidates against the vendor kernels"
  "dispatch       | 120 | benchmarks/dispatch_overhead.py: eager dispatch over the direct torch call, empty and vendor tables"
  "tune           | 450 | tune the six ops' default problems, export, check, dispatch vs vendor through the table, report"
  "e2e-tune       | 330 | record the e2e models' problems (E2E_TUNE_CASES), tune them (TUNE_S), export \$OUT/e2e-tune/opsadv-table.json"
  "generate-tune  | 420 | issue 28: model.tune_for_hardware(max_new_tokens=...) on Llama-3-8B dims (GEN_BATCHES, GEN_PROMPTS, TUNE_S, TRIALS), census before/after, export \$OUT/generate-tune/opsadv-table.json"
  "generate-graphs | 570 | issue 28: tests/test_decode_graphs.py, test_passthrough.py and the split-K counters' pool test on the GPU, generate-tune (GEN_PROMPTS default 512,4096, TUNE_S 90, TRIALS 5), then generate at prompt 512 with that table: compile, compile(converted) (ops-adv's decode graphs with a table), compile-dynamo(converted)"
  "generate-graphs-2 | 570 | issue 28: the same variants at prompt 4096 with TABLE (default: \$OUT/generate-tune's), prompt 512 with no table, then ttft at B=1 with TABLE"
  "ttft           | 300 | issue 28: benchmarks/ttft_profile.py (TTFT_ARGS) with TABLE: generate(max_new_tokens=1) and its prefill, original against converted, kernels and host profile; B=1 and B=8, prompt 512"
  "borrowed       | 200 | issue 28: benchmarks/borrowed_decode.py (decode_attention winners fitted to other batches and caches against a sweep's best)"
  "profile        | 400 | benchmarks/step_profile.py (PROFILE_ARGS) with TABLE: the CUDA kernels of one decode step per variant (ours, compiled, graphed)"
  "e2e            | 560 | benchmarks/e2e_model.py (E2E_CASES, E2E_ARGS) with TABLE: each case in its own process"
  "decode-step    | 500 | benchmarks/decode_step.py (DECODE_STEP_ARGS) with TABLE: Llama-3-8B decode per layer against the HBM bound, generate() tok/s"
  "recompiles     | 420 | why compile(converted) recompiles in decode (TORCH_LOGS=recompiles), original and converted"
  "convert-checks | 200 | benchmarks/convert_checks.py: graph breaks and gradients of converted Llama and ResNet-50"
  "faults         | 120 | a kernel out of bounds and a spinning one, recorded by the tuner as errors; the run goes on"
  "sweep          | 280 | exhaustive gemm sweep for benchmarks/search_efficiency.py (replayed on any machine later)"
  "compile-ahead  | 400 | tuning wall time with compile-ahead off and on, an empty Triton cache each"
  "moe            | 400 | issue 31: benchmarks/moe.py, ops_adv.moe vs transformers' experts implementations and torch.compile (TABLE, or tune first when TUNE_S is set; MOE_ARGS, MOE_COMPILE_MODE)"
)

usage() {
  awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"
  echo; echo "stages:"
  local s n l w; for s in "${STAGES[@]}"; do IFS='|' read -r n l w <<< "$s"; printf '  %-15s %4ss  %s\n' "$(echo $n)" "$(echo $l)" "$(echo $w)"; done
}

WHEELS=${WHEELS:-}; OUT=${OUT:-$PWD/gpu-out}; BUDGET=${BUDGET:-570}; RUN=()
while [ $# -gt 0 ]; do
  case "$1" in
    --wheels) WHEELS=${2:?--wheels DIR}; shift 2 ;;
    --out) OUT=${2:?--out DIR}; shift 2 ;;
    --budget) BUDGET=${2:?--budget SECONDS}; shift 2 ;;
    -h|--help) usage; exit 0 ;;
    -*) echo "gpu.sh: unknown option $1 (see: bash benchmarks/gpu.sh --help)" >&2; exit 2 ;;
    *) RUN+=("$1"); shift ;;
  esac
done
[ ${#RUN[@]} -eq 0 ] && { usage; exit 0; }
limit_of() { local s n l; for s in "${STAGES[@]}"; do IFS='|' read -r n l _ <<< "$s"; [ "$(echo $n)" = "$1" ] && { echo $l; return 0; }; done; return 1; }
for s in "${RUN[@]}"; do limit_of "$s" > /dev/null || { echo "gpu.sh: unknown stage '$s' (bash benchmarks/gpu.sh lists them)" >&2; exit 2; }; done

export PYTHONUNBUFFERED=1 RAY_DISABLE_USAGE_STATS=1 TOKENIZERS_PARALLELISM=false
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
SITE=${SITE:-/tmp/opsadv-site}
if [ -n "$WHEELS" ]; then
  ls "$WHEELS"/*.whl > /dev/null 2>&1 || { echo "gpu.sh: no wheels in $WHEELS" >&2; exit 2; }
  python3 -m pip install -q --no-index --find-links "$WHEELS" --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$SITE" "$WHEELS"/*.whl > "$OUT/pip.log" 2>&1 || { echo "gpu.sh: wheel install failed: see $OUT/pip.log" >&2; exit 1; }
fi
export PYTHONPATH=$SITE:$PWD:$PWD/tests${PYTHONPATH:+:$PYTHONPATH}
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,power.limit,temperature.gpu,memory.used --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
  git log -1 --format='commit %h %s' 2>/dev/null; } 2>&1 | tee "$OUT/machine.txt"

left() { echo $((BUDGET - SECONDS)); }
# [TSIG=INT] step NAME LIMIT CMD...: one process under timeout (TERM, or TSIG; KILL 10 s later), output in
# $D/NAME.txt, cut to what is left of the call's budget; prints its exit code and its tail.
step() {
  local name=$1 limit=$2; shift 2
  local l; l=$(left); [ "$l" -lt "$limit" ] && limit=$((l - 12))
  if [ "$limit" -lt 15 ]; then echo "== $name: skipped, ${l}s left of the budget"; return 124; fi
  echo "== $name ($(date +%T), limit ${limit}s)"
  timeout -s "${TSIG:-TERM}" -k 10 "$limit" "$@" > "$D/$name.txt" 2>&1 < /dev/null
  local rc=$?; echo "$name rc=$rc"; tail -n "${TAIL:-15}" "$D/$name.txt"; return $rc
}
needs_tuner() {
  python3 -c "import optuna, sqlalchemy, alembic, ray" 2> /dev/null \
    || { echo "== $1: needs the tuning stack (ray, optuna, sqlalchemy, alembic): pass --wheels DIR"; return 1; }
}
device_class() { python3 -c "import torch; from kernel_space._device import device_class_of; print(device_class_of(torch.cuda.get_device_name(0)))"; }
find_sanitizer() {
  command -v compute-sanitizer 2> /dev/null && return
  ls /usr/local/cuda*/bin/compute-sanitizer /usr/local/cuda*/compute-sanitizer/compute-sanitizer /opt/nvidia/*/compute-sanitizer 2> /dev/null | head -n 1
}
table_or_none() {
  if [ -n "${TABLE:-}" ]; then echo "$TABLE"; elif [ -f "$OUT/generate-tune/opsadv-table.json" ]; then echo "$OUT/generate-tune/opsadv-table.json"
  elif [ -f "$OUT/e2e-tune/opsadv-table.json" ]; then echo "$OUT/e2e-tune/opsadv-table.json"; fi
}

stage() {
  case "$1" in
  tests-gpu)
    # SIGINT: pytest stops as after ^C and still prints its failures and durations
    # one stage ran 323 tests in its 195 s and was cut (H200, 2026-12-04): two stages, each finishing
    TSIG=INT step tests 195 python3 -m pytest -q -p no:cacheprovider --durations=15 tests/test_decode_attention.py \
      tests/test_gemm_decode.py tests/test_linear.py tests/test_fused_rowwise.py tests/test_rope.py ;;
  tests-gpu-2)
    TSIG=INT step tests-2 215 python3 -m pytest -q -p no:cacheprovider --durations=15 tests/test_conv_bn_relu.py \
      tests/test_gpu_ops.py tests/test_e2e_decode.py tests/test_merge.py tests/test_triton_gemm_attention.py \
      tests/test_triton_norm_softmax_conv.py ;;
  capture)
    TSIG=INT step capture-tests 200 python3 -m pytest -q -p no:cacheprovider tests/test_bench_capture.py \
      tests/test_capture_safety.py tests/test_measure.py -k "capture or graph"
    local san tbl; san=$(find_sanitizer); tbl=$(table_or_none)
    [ -z "$san" ] && { echo "== capture: compute-sanitizer not found (PATH, /usr/local/cuda*/bin)"; return 2; }
    # the case that asserted on the H200 (B=8, 8k), both graph variants, each model captured once: one process
    TAIL=8 step decode-step-graphs 200 "$san" --tool memcheck --error-exitcode 9 --print-limit 50 \
      --log-file "$D/memcheck-decode-step.%p.txt" python3 benchmarks/decode_step.py --parts layer --batches 8 \
      --contexts 8192 --layers 2 --layer-variants eager+graph,converted+graph --rounds 1 --reps 2 --warmup 1 \
      --in-process ${tbl:+--table "$tbl"} --out "$D"
    grep -H "ERROR SUMMARY" "$D"/memcheck-*.txt | sed "s|$D/||" | tee "$D/summary.txt" ;;
  sanitize)
    local san; san=$(find_sanitizer)
    [ -z "$san" ] && { echo "== sanitize: compute-sanitizer not found (PATH, /usr/local/cuda*/bin)"; return 2; }
    local tbl; tbl=$(table_or_none)
    # --error-exitcode: a report with errors fails the step; one log file per process
    local S=("$san" --tool memcheck --error-exitcode 9 --print-limit 200 --target-processes all)
    TAIL=6 OPS_ADV_TABLE=$tbl step decode-graph 170 "${S[@]}" --log-file "$D/memcheck-decode-graph.%p.txt" \
      python3 benchmarks/sanitize_decode.py --batch 8 --out "$D/decode-graph.json"
    # The kernels' tests with torch's caching allocator off (memcheck then sees every allocation's bounds);
    # the CUDA-graph test needs the allocator (a capture cannot cudaMalloc) and runs on its own.
    TAIL=6 PYTORCH_NO_CUDA_MEMORY_CACHING=1 TSIG=INT step kernel-tests 210 "${S[@]}" --log-file "$D/memcheck-kernel-tests.%p.txt" \
      python3 -m pytest -q -p no:cacheprovider tests/test_decode_attention.py tests/test_gemm_decode.py -k "not cuda_graph and not sm90"
    TAIL=6 TSIG=INT step graph-tests 60 "${S[@]}" --log-file "$D/memcheck-graph-tests.%p.txt" \
      python3 -m pytest -q -p no:cacheprovider tests/test_gemm_decode.py -k cuda_graph
    echo "== memcheck summaries"; grep -H "ERROR SUMMARY" "$D"/memcheck-*.txt | sed "s|$D/||" | tee "$D/summary.txt" ;;
  decode)
    step decode-attention 180 python3 benchmarks/decode_attention.py --deadline-s 150 --out "$D/decode_attention.json"
    step gemm-decode 165 python3 benchmarks/gemm_decode.py --deadline-s 135 --out "$D/gemm_decode.json" ;;
  fused)
    step fused-ops 200 python3 benchmarks/fused_ops.py --deadline-s 165 --out "$D/fused_ops.json"
    step rope 150 python3 benchmarks/rope.py --deadline-s 115 --out "$D/rope.json"
    # layers until 105 s, then the whole ResNet-50 (~30-40 s)
    step conv-bn-relu 165 python3 benchmarks/conv_bn_relu.py --deadline-s 105 --out "$D/conv_bn_relu.json" ;;
  kernels)
    step kernels 395 python3 benchmarks/kernels.py --out "$D" ;;
  dispatch)
    local tbl; tbl=$(table_or_none)
    step dispatch-overhead 115 python3 benchmarks/dispatch_overhead.py --device cuda ${tbl:+--table "$tbl"} --out "$D/dispatch_overhead.json" ;;
  tune)
    needs_tuner tune || return 2
    local dev db=$D/tuning.db; dev=$(device_class)
    TAIL=8 step tune $((${TUNE_S:-230} + 80)) python3 -m tuner tune --device "$dev" --ops gemm,attention,layer_norm,rms_norm,softmax,conv2d \
      --trials "${TRIALS:-10}" --timeout "${TUNE_S:-230}" --progress plain --db "sqlite:///$db"
    step export 60 python3 -m tuner export --device "$dev" --out "$D" --db "sqlite:///$db"
    step check 30 python3 -m ops_adv check "$D/opsadv-table.json"
    OPS_ADV_TABLE=$D/opsadv-table.json step dispatch-vs-vendor 120 python3 benchmarks/verify_dispatch.py --out "$D/dispatch.md"
    step report 40 python3 -m tuner report --device "$dev" --db "sqlite:///$db" --plot "$D/speedup.png" --markdown "$D/report.md" ;;
  e2e-tune)
    needs_tuner e2e-tune || return 2
    local dev db=$D/e2e-tuning.db ops; dev=$(device_class)
    step record 150 python3 benchmarks/e2e_model.py --device cuda --cases "${E2E_TUNE_CASES:-${E2E_CASES:-llama-decode}}" ${E2E_TUNE_ARGS:-${E2E_ARGS:-}} \
      --record-shapes "$D/e2e-shapes.json" || return 1
    ops=$(python3 -c "import json; print(','.join(sorted(json.load(open('$D/e2e-shapes.json')))))")
    echo "problems of $ops"
    TAIL=8 step tune $((${TUNE_S:-120} + 45)) python3 -m tuner tune --device "$dev" --ops "$ops" --shapes "$D/e2e-shapes.json" \
      --trials "${TRIALS:-8}" --timeout "${TUNE_S:-120}" --db "sqlite:///$db"
    case $? in 124|137) timeout 30 python3 -m ray.scripts.scripts stop --force > /dev/null 2>&1 ;; esac  # Ray's workers may hold the GPU
    step export 60 python3 -m tuner export --device "$dev" --out "$D" --db "sqlite:///$db" \
      && step check 30 python3 -m ops_adv check "$D/opsadv-table.json" ;;
  generate-tune)
    needs_tuner generate-tune || return 2
    local dev db=$D/generate-tuning.db; dev=$(device_class)
    TAIL=25 step generate-tune $((${TUNE_S:-200} + 150)) python3 benchmarks/generate_tune.py --batches "${GEN_BATCHES:-1,8}" \
      --prompts "${GEN_PROMPTS:-512}" --new-tokens "${GEN_NEW:-128}" --layers 4 --trials "${TRIALS:-6}" --timeout "${TUNE_S:-200}" \
      --db "sqlite:///$db" --out "$D"
    timeout 30 python3 -m ray.scripts.scripts stop --force > /dev/null 2>&1  # Ray's workers may hold the GPU
    step export 60 python3 -m tuner export --device "$dev" --out "$D" --db "sqlite:///$db" \
      && step check 30 python3 -m ops_adv check "$D/opsadv-table.json" ;;
  generate-graphs|generate-graphs-2)
    local D0=$D v="compile,compile(converted),compile-dynamo(converted)" g="--parts generate --gen-batches 1,8 --gen-warmup 1 --gen-reps 3"
    if [ "$1" = generate-graphs ]; then
      TSIG=INT step graphs-tests 110 python3 -m pytest -q -p no:cacheprovider tests/test_decode_graphs.py tests/test_passthrough.py \
        tests/test_gemm_decode.py::test_counters_first_made_under_reduce_overhead_or_a_capture_belong_to_no_pool
      D=$OUT/generate-tune; mkdir -p "$D"
      GEN_PROMPTS=${GEN_PROMPTS:-512,4096} TUNE_S=${TUNE_S:-90} TRIALS=${TRIALS:-5} stage generate-tune
      D=$OUT/generate-p512; mkdir -p "$D"
      DECODE_STEP_ARGS="$g --gen-variants $v --prompt-tokens 512" stage decode-step
    else
      D=$OUT/generate-p4096; mkdir -p "$D"
      DECODE_STEP_LIMIT=$(($(left) / 2 + 10)) DECODE_STEP_ARGS="$g --gen-variants $v --prompt-tokens 4096" stage decode-step
      D=$OUT/generate-p512-no-table; mkdir -p "$D"
      TABLE= OUT=$D DECODE_STEP_LIMIT=$(($(left) - 170)) DECODE_STEP_ARGS="$g --gen-variants compile,compile(converted),compile-graphs(converted) --prompt-tokens 512" stage decode-step
      D=$OUT/ttft; mkdir -p "$D"
      TTFT_BATCHES=1 stage ttft
    fi
    D=$D0 ;;
  profile)
    local tbl; tbl=$(table_or_none)
    echo "table: ${tbl:-none (every op runs its default)}"
    TAIL=60 step profile 390 python3 benchmarks/step_profile.py ${tbl:+--table "$tbl"} ${PROFILE_ARGS:-} --out "$D" ;;
  ttft)
    local tbl b; tbl=$(table_or_none)
    echo "table: ${tbl:-none (every op runs its default)}"
    for b in ${TTFT_BATCHES:-1 8}; do
      TAIL=90 step "ttft-B$b" 150 python3 benchmarks/ttft_profile.py --batch "$b" --prompt "${TTFT_PROMPT:-512}" ${tbl:+--table "$tbl"} \
        ${TTFT_ARGS:---new 32} --out "$D"
    done ;;
  borrowed)
    TAIL=30 step borrowed 190 python3 benchmarks/borrowed_decode.py --out "$D" ;;
  e2e)
    local tbl; tbl=$(table_or_none)
    echo "table: ${tbl:-none (every op runs its default)}"
    # the run starts no case past its deadline and stops the one running there; 20 s to write the report
    OPS_ADV_TABLE=$tbl TAIL=40 step e2e 560 python3 benchmarks/e2e_model.py --device cuda --cases "${E2E_CASES:-llama-decode}" \
      --deadline-s $(($(left) - 35)) ${E2E_ARGS:-} --out "$D"
    sed -n '/^## Targets/,/^## Impl/p' "$D/e2e.md" 2> /dev/null ;;
  decode-step)
    local tbl lim=${DECODE_STEP_LIMIT:-500}; tbl=$(table_or_none)
    echo "table: ${tbl:-none (every op runs its default)}"
    [ "$(left)" -lt $((lim + 12)) ] && lim=$(($(left) - 12))
    # the run starts no job past its deadline and cuts the one running there; 30 s to write the report and plot
    TAIL=45 step decode-step "$lim" python3 benchmarks/decode_step.py --device cuda ${tbl:+--table "$tbl"} \
      --deadline-s $((lim - 30)) ${DECODE_STEP_ARGS:-} --out "$D" ;;
  recompiles)
    local tbl; tbl=$(table_or_none)
    local v
    for v in original converted; do
      OPS_ADV_TABLE=$tbl TORCH_LOGS=recompiles TAIL=3 step "recompiles-$v" 200 python3 benchmarks/recompiles_llama.py --size 8b \
        $([ $v = converted ] && echo --converted)
      grep -E "\[__recompiles\]" "$D/recompiles-$v.txt" 2> /dev/null | sed 's/^.*__recompiles\]//' | head -n 14
    done ;;
  convert-checks)
    step convert-checks 195 python3 benchmarks/convert_checks.py ;;
  faults)
    needs_tuner faults || return 2
    step faults 110 python3 -m tuner tune --device "$(device_class)" --ops gemm --shapes benchmarks/shapes/cuda_faults.yaml \
      --impls fault_oob,fault_spin --sampler grid --plugin plugins.faulty_cuda --trial-timeout 20 --db "sqlite:///$D/faults.db"
    python3 - "$D/faults.db" <<'PY' | tee "$D/faults-trials.txt"
import sqlite3, sys
for row in sqlite3.connect(sys.argv[1]).execute("select impl, status, substr(error, 1, 140) from opsadv_trials order by id"):
    print(" | ".join(str(x) for x in row))
PY
    ;;
  sweep)
    needs_tuner sweep || return 2
    step sweep 270 python3 benchmarks/search_efficiency.py sweep --out "$D/sweep" --ops gemm --budget-s 235
    rm -f "$D"/sweep/*.jsonl.gz; gzip -f "$D"/sweep/*.jsonl 2> /dev/null ;;
  compile-ahead)
    needs_tuner compile-ahead || return 2
    local dev cw; dev=$(device_class)
    for cw in ${COMPILE_WORKERS:-0 4}; do  # an empty Triton cache each: the compile cost is measured, not reused
      TRITON_CACHE_DIR=$D/triton-cache-$cw step "compile-workers-$cw" 190 python3 -m tuner tune --device "$dev" --ops gemm,softmax \
        --shapes benchmarks/shapes/compile_ahead.yaml --trials "${TRIALS:-12}" --compile-workers "$cw" --db "sqlite:///$D/ca$cw.db"
      python3 - "$D/ca$cw.db" <<'PY'
import sqlite3, sys
con = sqlite3.connect(sys.argv[1])
n = con.execute("select count(*) from opsadv_trials where status != 'pruned'").fetchone()[0]
t0, t1 = con.execute("select min(created_at), max(created_at) from opsadv_trials").fetchone()
print(f"  measured trials {n}, first to last trial stored: {t0} .. {t1}")
PY
      rm -rf "$D/triton-cache-$cw"
    done ;;
  moe)
    local tbl dev lim=390; tbl=$(table_or_none)
    if [ -n "${TUNE_S:-}" ]; then  # tune the moe problems first (TUNE_S s in all, TRIALS per problem); bench that table
      needs_tuner moe || return 2
      dev=$(device_class)
      TAIL=8 step tune $((TUNE_S + 60)) python3 -m tuner tune --device "$dev" --ops moe --trials "${TRIALS:-8}" \
        --timeout "$TUNE_S" --progress plain --db "sqlite:///$D/moe-tuning.db"
      case $? in 124|137) timeout 30 python3 -m ray.scripts.scripts stop --force > /dev/null 2>&1 ;; esac  # Ray's workers may hold the GPU
      step export 60 python3 -m tuner export --device "$dev" --out "$D" --db "sqlite:///$D/moe-tuning.db" \
        && step check 30 python3 -m ops_adv check "$D/opsadv-table.json" && tbl=$D/opsadv-table.json
    fi
    echo "table: ${tbl:-none (ops_adv.moe runs its vendor default)}"
    [ "$(left)" -lt $((lim + 12)) ] && lim=$(($(left) - 12))
    # no case starts past the deadline; one running there is cut by lim - 15; moe.md is rewritten after every case
    TAIL=40 step moe "$lim" python3 benchmarks/moe.py --device cuda ${tbl:+--table "$tbl"} \
      --compile-mode "${MOE_COMPILE_MODE:-default}" --case-timeout 180 --deadline-s $((lim > 105 ? lim - 75 : 30)) ${MOE_ARGS:-} --out "$D" ;;
  esac
}

for s in "${RUN[@]}"; do
  D=$OUT/$s; mkdir -p "$D"
  echo "#### $s ($(date +%T), $(left)s of the budget left)"
  stage "$s"
  echo "#### $s rc=$?"
done
