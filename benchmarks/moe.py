#!/usr/bin/env python
"""moe (issue 31): ops_adv.moe against every experts implementation of the installed transformers and torch.compile.

Per (dims, T): the REAL transformers experts module (MixtralExperts, Qwen3MoeExperts) built from a config, one
instance per experts implementation (`config._experts_implementation`: "eager", and every key of
transformers.integrations.moe.ALL_EXPERTS_FUNCTIONS: grouped_mm, batched_mm, deepgemm, sonicmoe, ...), all sharing
one set of random weights; torch.compile of the module with transformers' default implementation (the one a model
built without `experts_implementation` picks: grouped_mm in transformers 5.x); and ours: `ops_adv.moe` with the
given table (--table), plus the Triton kernel `triton_fused_moe` called directly with its default configuration.

Every candidate starts from the same router logits: the peers run the model's router from its logits on (softmax in
fp32, top-k, renormalised; Qwen3 casts the weights to the logits' dtype) and then the experts module; ops_adv.moe
does its own routing. The router's gate linear is left out of every side. Outputs are checked against an fp32
reference (float64 on the CPU) before timing; a candidate off by more than the bf16 tolerance is reported, not timed.

Timing: CUDA graphs of `reps` calls, rotating over 4 input sets (different experts each), median of interleaved
rounds; a candidate whose capture fails (the eager loop syncs on .nonzero()/.tolist()) is timed as plain calls
with CUDA events and marked "no graph". Each case runs in its own process (a crash or a --case-timeout loses
that case only), its row appended to moe.jsonl as it finishes; moe.md is rewritten after every case.

Targets (issue 31): ops_adv.moe >= 1.5x transformers' default implementation and >= 1.2x the fastest of the
others and of torch.compile, Mixtral-8x7B and Qwen3-30B-A3B dims, T 1, 8, 64, 512, 4096.

    python benchmarks/moe.py --table TABLE.json --out results/moe            # H200/H100, all 10 cases
    python benchmarks/moe.py --dims qwen3-30b-a3b --tokens 1,64 --out /tmp/moe
    python benchmarks/moe.py --device cpu --tiny --out /tmp/moe              # smoke run, tiny dims
"""
from __future__ import annotations

import argparse
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
# `python benchmarks/moe.py` puts benchmarks/ first on sys.path, where kernels.py would shadow the `kernels`
# package transformers' hub kernels import (deepgemm, sonicmoe): this folder is left off the path.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or os.getcwd()).resolve() != _HERE]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

TARGET_DEFAULT, TARGET_OTHERS = 1.5, 1.2
# name: (model family, E, top_k, N (intermediate of one expert), K (hidden))
DIMS = {
    "mixtral-8x7b": ("mixtral", 8, 2, 14336, 4096),
    "qwen3-30b-a3b": ("qwen3", 128, 8, 768, 2048),
}
TINY_DIMS = {
    "mixtral-tiny": ("mixtral", 4, 2, 64, 32),
    "qwen3-tiny": ("qwen3", 8, 4, 32, 64),
}
TOKENS, TINY_TOKENS = (1, 8, 64, 512, 4096), (1, 8)
OURS, TRITON_DIRECT = "ops_adv.moe", "triton (default cfg)"
SETS = 4  # input sets a graph rotates over: each routes to other experts, so L2 holds no expert's weights
T0 = time.perf_counter()


def log(*a: Any) -> None:
    print(*a, flush=True)


# --------------------------------------------------------------------------- one case (child process)


def _config(family: str, E: int, top_k: int, N: int, K: int, impl: str | None):
    if family == "mixtral":
        from transformers import MixtralConfig

        return MixtralConfig(hidden_size=K, intermediate_size=N, num_local_experts=E, num_experts_per_tok=top_k,
                             hidden_act="silu", num_hidden_layers=1, num_attention_heads=1, num_key_value_heads=1,
                             vocab_size=32, experts_implementation=impl)
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(hidden_size=K, moe_intermediate_size=N, intermediate_size=N, num_experts=E,
                          num_experts_per_tok=top_k, norm_topk_prob=True, hidden_act="silu", num_hidden_layers=1,
                          num_attention_heads=1, num_key_value_heads=1, head_dim=8, vocab_size=32,
                          experts_implementation=impl)


def _experts_class(family: str):
    if family == "mixtral":
        from transformers.models.mixtral.modeling_mixtral import MixtralExperts

        return MixtralExperts
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    return Qwen3MoeExperts


def default_impl(family: str) -> str:
    """The experts implementation transformers gives a model built without `experts_implementation`."""
    import torch

    if family == "mixtral":
        from transformers import MixtralModel as Model
    else:
        from transformers import Qwen3MoeModel as Model
    with torch.device("meta"):  # a one-layer model of tiny dims: only its config's resolution matters
        m = Model(_config(family, 4, 2, 16, 16, None))
    return m.config._experts_implementation


def router(family: str, top_k: int) -> Callable:
    """The model's router from its logits on: (top_k_index, top_k_weights) as the experts module takes them."""
    import torch

    def mixtral(logits):  # MixtralTopKRouter.forward after its gate linear
        probs = torch.nn.functional.softmax(logits.float(), dim=-1)
        top, idx = torch.topk(probs, top_k, dim=-1)
        top /= top.sum(dim=-1, keepdim=True)
        return idx, top

    def qwen3(logits):  # Qwen3MoeTopKRouter.forward after its gate linear (norm_topk_prob=True)
        probs = torch.nn.functional.softmax(logits, dtype=torch.float, dim=-1)
        top, idx = torch.topk(probs, top_k, dim=-1)
        top /= top.sum(dim=-1, keepdim=True)
        return idx, top.to(logits.dtype)

    return mixtral if family == "mixtral" else qwen3


def make_inputs(T: int, E: int, N: int, K: int, dtype, device, sets: int):
    """Input sets [(x [T, K], logits [T, E])] and weights (w13 [E, 2N, K], w2 [E, K, N]) drawn on `device`.
    Logits: each token's E values a distinct bf16 step apart (kernel_space.moe.make_inputs' scheme), so every
    implementation picks the same experts."""
    import torch

    g = torch.Generator(device=device)
    g.manual_seed(1000)
    w13 = torch.empty(E, 2 * N, K, device=device, dtype=dtype)
    w2 = torch.empty(E, K, N, device=device, dtype=dtype)
    for e in range(E):  # per expert: no fp32 copy of all weights at once
        w13[e] = torch.randn(2 * N, K, generator=g, device=device) * K ** -0.5
        w2[e] = torch.randn(K, N, generator=g, device=device) * N ** -0.5
    out = []
    for s in range(sets):
        g.manual_seed(s)
        x = torch.randn(T, K, generator=g, device=device).to(dtype)
        ranks = torch.argsort(torch.rand(T, E, generator=g, device=device), dim=-1).float()
        out.append((x, (ranks * (4.0 / E) - 2.0).to(dtype)))
    return out, w13, w2


def _short(e: BaseException, n: int = 160) -> str:
    s = str(e).strip().splitlines()
    return f"{type(e).__name__}: {s[0][:n] if s else ''}".rstrip(": ")


class Runner:
    """One candidate over the input sets: a CUDA graph of `reps` calls where capture works, else plain calls."""

    def __init__(self, fn: Callable, sets: list, reps: int, cuda: bool, try_graph: bool, why_not: str = "") -> None:
        import torch

        self.torch, self.fn, self.sets, self.reps, self.cuda = torch, fn, sets, reps, cuda
        self.graph = None
        self.timing = "cpu" if not cuda else f"no graph ({why_not})" if why_not else "no graph"
        if not cuda:
            return
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for a in sets:  # compile, autotune, allocate outside the capture
                fn(*a)
        torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()
        if not try_graph:
            return
        g = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(g):
                for i in range(reps):
                    fn(*sets[i % len(sets)])
            torch.cuda.synchronize()
            g.replay()  # a graph that captured but cannot replay is no graph either
            torch.cuda.synchronize()
            self.graph, self.timing = g, "graph"
        except Exception as e:  # e.g. a sync (.tolist(), .nonzero()) inside the capture
            del g
            try:
                torch.cuda.synchronize()
            except Exception:
                pass
            self.timing = f"no graph (capture failed: {_short(e, 80)})"

    def once(self) -> float:
        """Seconds per call, from one replay (or one loop of `reps` plain calls)."""
        torch = self.torch
        if not self.cuda:
            t = time.perf_counter()
            for i in range(self.reps):
                self.fn(*self.sets[i % len(self.sets)])
            return (time.perf_counter() - t) / self.reps
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        if self.graph is not None:
            self.graph.replay()
        else:
            for i in range(self.reps):
                self.fn(*self.sets[i % len(self.sets)])
        b.record()
        b.synchronize()
        return a.elapsed_time(b) / 1e3 / self.reps


def run_case(case: dict, args) -> dict:
    """Build, check and time every candidate of one (dims, T); the JSONL row."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # deepgemm/sonicmoe fetch hub kernels: fail fast offline
    import torch
    import transformers
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    import ops_adv
    from kernel_space import get_impl
    from kernel_space._common import relative_error, tolerance
    from kernel_space.moe import MoeProblem, reference

    family, E, top_k, N, K = case["family"], case["E"], case["top_k"], case["N"], case["K"]
    T, dt_code = case["T"], case["dtype"]
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dt_code]
    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    torch.manual_seed(0)
    row: dict[str, Any] = {"dims": case["dims"], "T": T, "E": E, "top_k": top_k, "N": N, "K": K, "dtype": dt_code,
                           "device": torch.cuda.get_device_name(dev) if cuda else "cpu", "torch": torch.__version__,
                           "transformers": transformers.__version__, "table": args.table or None, "peers": {}}
    peers = row["peers"]
    if args.table:
        ops_adv.load_table(args.table)
    else:
        ops_adv.load_table("")  # no OPS_ADV_TABLE from the environment: the run says what it measured
    impls = ["eager"] + [k for k in ALL_EXPERTS_FUNCTIONS.valid_keys() if k != "eager"]
    row["impls"] = impls
    default = default_impl(family) if args.default == "auto" else args.default
    if default not in impls:
        raise SystemExit(f"--default {default}: not an experts implementation of transformers {transformers.__version__} "
                         f"({', '.join(impls)})")
    row["default_impl"] = default
    row["default_from"] = ("transformers: what a model built without experts_implementation gets"
                           if args.default == "auto" else "--default")

    sets, w13, w2 = make_inputs(T, E, N, K, dtype, dev, SETS)
    route = router(family, top_k)
    cls = _experts_class(family)
    mods = {}
    for impl in impls:
        with torch.device("meta"):
            m = cls(_config(family, E, top_k, N, K, impl))
        # transformers' layout is ours: gate_up_proj [E, 2N, K] (gate rows, then up rows), down_proj [E, K, N]
        assert tuple(m.gate_up_proj.shape) == tuple(w13.shape) and tuple(m.down_proj.shape) == tuple(w2.shape), \
            (m.gate_up_proj.shape, m.down_proj.shape, w13.shape, w2.shape)
        assert getattr(m, "is_transposed", False) is False and getattr(m, "is_concatenated", True) is True
        m.gate_up_proj = torch.nn.Parameter(w13, requires_grad=False)
        m.down_proj = torch.nn.Parameter(w2, requires_grad=False)
        mods[impl] = m.eval()

    def peer_fn(impl: str) -> Callable:
        m = mods[impl]
        return lambda x, logits: m(x, *route(logits))

    cands: dict[str, Callable] = {}
    graphable: dict[str, tuple[bool, str]] = {}
    for impl in impls:
        label = f"{impl} (default)" if impl == default else impl
        peers[label] = {"role": "default" if impl == default else "peer", "impl": impl}
        if impl == "batched_mm":  # gathers every slot's expert weights: T * top_k copies of an expert
            need = T * top_k * 3 * N * K * w13.element_size()
            room = torch.cuda.mem_get_info(dev)[0] * 0.4 if cuda else 2e9
            if need > room:
                peers[label].update(status="n/a", note=f"skipped: would gather {need / 1e9:.0f} GB of expert weights "
                                                       f"(T*top_k={T * top_k} copies; room {room / 1e9:.0f} GB)")
                continue
        cands[label] = peer_fn(impl)
        graphable[label] = (impl != "eager", "eager syncs: .nonzero() and a loop over the hit experts")
    if not args.no_compile:
        label = f"compile({default})"
        peers[label] = {"role": "peer", "impl": default, "compile": {"mode": args.compile_mode, "backend": args.compile_backend}}
        cands[label] = torch.compile(peer_fn(default), mode=None if args.compile_mode == "default" else args.compile_mode,
                                     backend=args.compile_backend, dynamic=False)
        graphable[label] = (True, "")
    # ours: the op through the table, and the Triton kernel with its default configuration
    peers[OURS] = {"role": "ours"}
    cands[OURS] = lambda x, logits: ops_adv.moe(x, logits, w13, w2, top_k, renormalize=True)
    try:
        pick = ops_adv.explain("moe", sets[0][0], sets[0][1], w13, w2, top_k, renormalize=True)
        peers[OURS]["dispatch"] = {k: pick.get(k) for k in ("impl", "params", "source")}
        loop = pick.get("impl") == "torch_experts_loop"
    except Exception as e:
        peers[OURS]["dispatch"] = {"error": _short(e)}
        loop = False
    graphable[OURS] = (not loop, "the table's pick is transformers' expert loop (syncs)")
    timpl = get_impl("moe", "triton_fused_moe")
    peers[TRITON_DIRECT] = {"role": "ours-direct", "params": timpl.default_params()}
    problem = MoeProblem(T, E, top_k, N, K, dt_code)
    remark = timpl.check(problem, timpl.default_params())
    if remark:
        peers[TRITON_DIRECT]["check"] = remark  # the tuner would not try it; run anyway, as labelled
    if timpl.unavailable:
        peers[TRITON_DIRECT].update(status="n/a", note=timpl.unavailable)
    elif not cuda and os.environ.get("TRITON_INTERPRET") != "1":
        peers[TRITON_DIRECT].update(status="n/a", note="Triton needs a GPU (TRITON_INTERPRET=1 interprets it on the CPU)")
    elif not cuda and dtype is torch.bfloat16:  # triton 3.x's interpreter: tl.dot of bf16 tiles returns garbage
        peers[TRITON_DIRECT].update(status="n/a", note="Triton's CPU interpreter computes bf16 dots wrongly; use --dtype fp32 or fp16")
    else:
        cands[TRITON_DIRECT] = lambda x, logits: timpl.fn(x, logits, w13, w2, top_k=top_k, renormalize=True)
        graphable[TRITON_DIRECT] = (True, "")

    # correctness: against the fp32 reference (float64 on the CPU) of input set 0, and against the default
    x0, l0 = sets[0]
    with torch.no_grad():
        ref = reference(x0, l0, w13, w2, top_k=top_k, renormalize=True).float()
    tol = tolerance(dt_code)
    row["tolerance"] = {"rel_err": tol, "what": "‖out − ref‖ / ‖ref‖ against the fp32 reference"}
    outs = {}
    for label in list(cands):
        t = time.perf_counter()
        try:
            with torch.no_grad():
                out = cands[label](x0, l0)
            if cuda:
                torch.cuda.synchronize()
        except Exception as e:
            peers[label].update(status="error", note=_short(e))
            log(f"  {label}: {peers[label]['note']}")
            del cands[label]
            if cuda:
                try:
                    torch.cuda.synchronize()
                except Exception:
                    pass
            continue
        first_s = time.perf_counter() - t
        err = relative_error(out, ref)
        mad = float((out.float() - ref).abs().max()) if out.shape == ref.shape else float("inf")
        peers[label].update(rel_err=err, max_abs_diff=mad, first_call_s=round(first_s, 2))
        outs[label] = out
        if not err <= tol:
            peers[label].update(status="wrong", note=f"rel err {err:.2g} > {tol:g} (max abs diff {mad:.3g})")
            log(f"  {label}: WRONG, {peers[label]['note']}")
            del cands[label]
    dlabel = f"{default} (default)"
    if dlabel in outs:
        for label, out in outs.items():
            peers[label]["max_abs_diff_vs_default"] = float((out.float() - outs[dlabel].float()).abs().max())
    outs = out = ref = None
    if cuda:
        torch.cuda.empty_cache()  # batched_mm's gathers: cached blocks a graph's private pool cannot reuse

    # timing
    reps = args.reps or (20 if T <= 64 else 10 if T <= 512 else 5)
    if not cuda:
        reps = args.reps or 3
    rounds = args.rounds if cuda else max(1, min(args.rounds, 3))
    row["timing"] = {"reps": reps, "rounds": rounds, "sets": SETS,
                     "how": ("CUDA graph of reps calls, CUDA events; plain calls where capture fails" if cuda
                             else "perf_counter over plain calls")}
    runners: dict[str, Runner] = {}
    with torch.no_grad():
        for label, fn in cands.items():
            ok, why = graphable.get(label, (True, ""))
            try:
                runners[label] = Runner(fn, sets, reps, cuda, try_graph=ok, why_not="" if ok else why)
                if cuda:
                    torch.cuda.empty_cache()
            except Exception as e:
                peers[label].update(status="error", note=f"timing setup: {_short(e)}")
                log(f"  {label}: {peers[label]['note']}")
                if cuda:
                    torch.cuda.synchronize()
        samples: dict[str, list[float]] = {k: [] for k in runners}
        for r in runners.values():
            r.once()  # warm
        for _ in range(rounds):
            for k, r in runners.items():
                samples[k].append(r.once())
    for k, r in runners.items():
        peers[k].update(status="ok", us=statistics.median(samples[k]) * 1e6, timing=r.timing)

    summarize(row)
    return row


def summarize(row: dict) -> None:
    """Ratios of ours against the default and against the fastest other peer; PASS/MISS."""
    peers = row["peers"]
    us = {k: v["us"] for k, v in peers.items() if v.get("status") == "ok"}
    dflt = next((k for k, v in peers.items() if v.get("role") == "default"), None)
    others = {k: t for k, t in us.items() if peers[k].get("role") == "peer"}
    ours = us.get(OURS)
    row["ratio_vs_default"] = us[dflt] / ours if ours and dflt in us else None
    eager = next((k for k, v in peers.items() if v.get("impl") == "eager" and v.get("role") in ("peer", "default")), None)
    row["ratio_vs_eager"] = us[eager] / ours if ours and eager in us else None
    if others:
        best = min(others, key=others.get)
        row["fastest_other"] = best
        row["ratio_vs_fastest_other"] = others[best] / ours if ours else None
    else:
        row["fastest_other"], row["ratio_vs_fastest_other"] = None, None
    rd, ro = row["ratio_vs_default"], row["ratio_vs_fastest_other"]
    row["targets"] = {"vs_default": TARGET_DEFAULT, "vs_fastest_other": TARGET_OTHERS}
    row["pass"] = bool(rd is not None and rd >= TARGET_DEFAULT and (ro is None or ro >= TARGET_OTHERS))


# --------------------------------------------------------------------------- report


def fmt_us(p: dict | None) -> str:
    if p is None:
        return "-"
    st = p.get("status")
    if st == "ok":
        return f"{p['us']:.1f}" + ("" if p.get("timing") in ("graph", "cpu") else "¹")
    return {"wrong": "WRONG", "error": "err", "n/a": "n/a"}.get(st, "-")


def columns(rows: list[dict]) -> list[str]:
    """Peer columns in a stable order: eager, the other implementations, compile, then ours."""
    cols: list[str] = []
    for r in rows:
        for k in r.get("peers", {}):
            if k not in cols:
                cols.append(k)
    rank = {"peer": 0, "default": 0, "ours-direct": 2, "ours": 3}

    def key(k):
        role = next((r["peers"][k].get("role") for r in rows if k in r.get("peers", {})), "peer")
        return (rank.get(role, 0) + (1 if k.startswith("compile(") else 0), cols.index(k))

    return sorted(cols, key=key)


def markdown(rows: list[dict], info: dict) -> str:
    cols = columns(rows)
    lines = [f"# moe benchmark (issue 31)", ""]
    for k, v in info.items():
        lines.append(f"- {k}: {v}")
    lines += ["", "Times in µs per call (median). Targets: ops_adv.moe >= "
              f"{TARGET_DEFAULT}x the default implementation and >= {TARGET_OTHERS}x the fastest other peer "
              "(the other implementations and torch.compile).", ""]
    head = ["dims", "T"] + cols + ["vs default", "vs fastest other", "vs eager", "result"]
    lines.append("| " + " | ".join(head) + " |")
    lines.append("|" + "---|" * len(head))
    for r in rows:
        if "peers" not in r:
            lines.append("| " + " | ".join([r["dims"], str(r["T"])] + ["-"] * len(cols) +
                                           ["-", "-", "-", f"{r.get('status', 'failed')}"]) + " |")
            continue
        rd, ro = r.get("ratio_vs_default"), r.get("ratio_vs_fastest_other")
        cells = [r["dims"], str(r["T"])] + [fmt_us(r["peers"].get(c)) for c in cols]
        re_ = r.get("ratio_vs_eager")
        cells += [f"{rd:.2f}x" if rd else "-",
                  f"{ro:.2f}x ({r['fastest_other']})" if ro else "-",
                  f"{re_:.2f}x" if re_ else "-",
                  "PASS" if r.get("pass") else "MISS"]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "¹ no CUDA graph: plain calls timed with CUDA events (capture failed or the candidate syncs).",
              "n/a: not run here; err: raised; WRONG: outside the tolerance (not timed). Notes below.", ""]
    notes, agree = [], []
    for r in rows:
        if "peers" not in r:
            notes.append(f"- {r['dims']} T={r['T']}: {r.get('status')}: {r.get('error', '')}")
            continue
        for k, p in r["peers"].items():
            if p.get("status") != "ok" and p.get("note"):
                notes.append(f"- {r['dims']} T={r['T']} {k}: {p.get('status')}: {p['note']}")
            elif p.get("status") == "ok" and p.get("timing") not in ("graph", "cpu"):
                notes.append(f"- {r['dims']} T={r['T']} {k}: {p['timing']}")
        d = r["peers"].get(OURS, {}).get("dispatch")
        if d:
            notes.append(f"- {r['dims']} T={r['T']} ops_adv.moe dispatch: {json.dumps(d, default=str)}")
        agree.append(f"| {r['dims']} | {r['T']} | " + " | ".join(
            f"{r['peers'][c]['max_abs_diff']:.2e}" if "max_abs_diff" in r["peers"].get(c, {}) else "-" for c in cols) + " |")
    if agree:
        lines += ["## Agreement: max abs diff against the fp32 reference", "",
                  "| dims | T | " + " | ".join(cols) + " |", "|" + "---|" * (len(cols) + 2)] + agree + [""]
    if notes:
        lines += ["## Notes", ""] + notes + [""]
    return "\n".join(lines)


# --------------------------------------------------------------------------- driver (parent process)


def _child_argv(args, case: dict, jsonl: Path) -> list[str]:
    argv = [sys.executable, str(Path(__file__).resolve()), "--case", json.dumps(case), "--jsonl", str(jsonl),
            "--device", args.device, "--rounds", str(args.rounds), "--compile-mode", args.compile_mode,
            "--compile-backend", args.compile_backend, "--default", args.default]
    if args.reps:
        argv += ["--reps", str(args.reps)]
    if args.table:
        argv += ["--table", args.table]
    if args.no_compile:
        argv.append("--no-compile")
    return argv


def run_child(args, case: dict, jsonl: Path, timeout: float) -> tuple[int | None, list[str]]:
    """The case in its own process, its output streamed here; (exit code or None on timeout, last lines)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []))}
    p = subprocess.Popen(_child_argv(args, case, jsonl), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         env=env, start_new_session=True)
    tail: list[str] = []

    def pump():
        for line in p.stdout:
            line = line.rstrip("\n")
            tail.append(line)
            del tail[:-30]
            log("  | " + line)

    th = threading.Thread(target=pump, daemon=True)
    th.start()
    rc = None
    try:
        rc = p.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        pass
    finally:  # a timeout, or this run ended (SIGTERM from `timeout`): end the case's process group, which we started
        if p.poll() is None:
            for sig in (signal.SIGTERM, signal.SIGKILL):
                try:
                    os.killpg(p.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    p.wait(timeout=10)
                    break
                except subprocess.TimeoutExpired:
                    continue
    th.join(timeout=5)
    return rc, tail


def read_rows(jsonl: Path) -> list[dict]:
    rows = []
    if jsonl.exists():
        for line in jsonl.read_text().splitlines():
            line = line.strip()
            if line:
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError:
                    pass
    return rows


def append_row(jsonl: Path, row: dict) -> None:
    with open(jsonl, "a") as f:
        f.write(json.dumps(row, default=str) + "\n")


def console_table(rows: list[dict]) -> str:
    cols = columns(rows)
    head = ["dims", "T"] + cols + ["vs default", "vs fastest", "result"]
    body = []
    for r in rows:
        if "peers" not in r:
            body.append([r["dims"], str(r["T"])] + ["-"] * len(cols) + ["-", "-", str(r.get("status"))])
            continue
        rd, ro = r.get("ratio_vs_default"), r.get("ratio_vs_fastest_other")
        body.append([r["dims"], str(r["T"])] + [fmt_us(r["peers"].get(c)) for c in cols] +
                    [f"{rd:.2f}x" if rd else "-", f"{ro:.2f}x" if ro else "-", "PASS" if r.get("pass") else "MISS"])
    w = [max(len(x) for x in col) for col in zip(head, *body)]
    return "\n".join("  ".join(c.rjust(n) for c, n in zip(line, w)) for line in [head] + body)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--tiny", action="store_true", help=f"tiny dims (mixtral-tiny: E=4 top-2 N=64 K=32), T {TINY_TOKENS} (smoke test)")
    ap.add_argument("--dims", help=f"comma-separated dims (default {', '.join(DIMS)}; with --tiny mixtral-tiny; also "
                                   f"{', '.join(n for n in TINY_DIMS if n != 'mixtral-tiny')})")
    ap.add_argument("--tokens", help=f"comma-separated token counts (default {','.join(map(str, TOKENS))})")
    ap.add_argument("--dtype", default=None, help="bf16 (default on cuda), fp16 or fp32 (default on cpu)")
    ap.add_argument("--table", help="tuned table for ops_adv.moe (default: none, the op runs its vendor default)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "moe"), help="folder of moe.md and moe.jsonl")
    ap.add_argument("--reps", type=int, default=0, help="calls per timed graph (default by T: 20, 10, 5)")
    ap.add_argument("--rounds", type=int, default=7, help="interleaved rounds per case (median)")
    ap.add_argument("--compile-mode", default="max-autotune-no-cudagraphs",
                    help="torch.compile mode of the default implementation (default max-autotune-no-cudagraphs; "
                         "'default' for torch's default mode)")
    ap.add_argument("--compile-backend", default="inductor")
    ap.add_argument("--default", default="auto",
                    help="the implementation the 1.5x target is against: auto (what transformers gives a model built "
                         "without experts_implementation: grouped_mm in transformers 5.x), or eager, grouped_mm, ...")
    ap.add_argument("--no-compile", action="store_true", help="leave torch.compile out")
    ap.add_argument("--case-timeout", type=float, default=300.0, help="seconds one case's process may take")
    ap.add_argument("--deadline-s", type=float, default=0.0, help="start no case after this many seconds (0: no limit)")
    ap.add_argument("--case", help=argparse.SUPPRESS)  # internal: run one case (JSON) and append its row to --jsonl
    ap.add_argument("--jsonl", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.table:
        args.table = str(Path(args.table).resolve())

    if args.case:  # child: one case
        case = json.loads(args.case)
        row = run_case(case, args)
        append_row(Path(args.jsonl), row)
        log(f"{case['dims']} T={case['T']}: " + ", ".join(
            f"{k} {v['us']:.1f} us" for k, v in row["peers"].items() if v.get("status") == "ok"))
        return 0

    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            log("no CUDA device: run with --device cpu --tiny for a smoke run")
            return 1
        device_name = torch.cuda.get_device_name(0)
    else:
        device_name = "cpu"
    names = args.dims.split(",") if args.dims else ["mixtral-tiny"] if args.tiny else list(DIMS)
    unknown = [n for n in names if n not in {**DIMS, **TINY_DIMS}]
    if unknown:
        ap.error(f"unknown dims {unknown}; choose from {', '.join({**DIMS, **TINY_DIMS})}")
    tokens = [int(t) for t in args.tokens.split(",")] if args.tokens else list(TINY_TOKENS if args.tiny else TOKENS)
    dtype = args.dtype or ("fp32" if args.device == "cpu" else "bf16")  # Triton's interpreter gets bf16 dots wrong
    cases = []  # token count first: a run cut by --deadline-s still has every dims' small counts
    for t in tokens:
        for n in names:
            family, E, k, N, K = {**DIMS, **TINY_DIMS}[n]
            cases.append({"dims": n, "family": family, "E": E, "top_k": k, "N": N, "K": K, "T": t, "dtype": dtype})

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    jsonl, md = out / "moe.jsonl", out / "moe.md"
    jsonl.write_text("")
    compile_s = "left out" if args.no_compile else f"torch.compile(mode={args.compile_mode!r}, backend={args.compile_backend!r}, dynamic=False) of the default implementation's module"
    info = {"device": device_name, "table": args.table or "none (ops_adv.moe runs its vendor default)",
            "default implementation": ("transformers' own choice for a model built without experts_implementation "
                                       "(marked '(default)')" if args.default == "auto" else f"{args.default} (--default)"),
            "compile": compile_s,
            "timing": ("CUDA graphs of reps calls over 4 input sets, median of interleaved rounds; candidates that "
                       "cannot be captured: plain calls, CUDA events" if args.device == "cuda" else "CPU perf_counter, plain calls"),
            "routing": "every candidate from the same router logits (peers: the model's router softmax/top-k/renorm, "
                       "then the experts module; ours routes itself)",
            "ours": f"{OURS} (through the table); {TRITON_DIRECT}: triton_fused_moe with its default parameters"}
    log(f"moe benchmark on {device_name}: {len(cases)} cases, table {args.table or 'none'}, compile "
        f"{'off' if args.no_compile else args.compile_mode}; out {out}")

    order = {(c["dims"], c["T"]): i for i, c in enumerate(sorted(cases, key=lambda c: (names.index(c["dims"]), c["T"])))}

    def report() -> list[dict]:
        rows = sorted(read_rows(jsonl), key=lambda r: order.get((r.get("dims"), r.get("T")), len(order)))
        info["seconds"] = round(time.perf_counter() - T0, 1)
        md.write_text(markdown(rows, info))
        return rows

    # `timeout` ends the run with SIGTERM: exit through run_child's finally (which ends the running case)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(124))
    for case in cases:
        if args.deadline_s and time.perf_counter() - T0 > args.deadline_s:
            log(f"== {case['dims']} T={case['T']}: skipped, past --deadline-s {args.deadline_s:g}")
            append_row(jsonl, {**{k: case[k] for k in ("dims", "T", "E", "top_k", "N", "K", "dtype")},
                               "status": "skipped", "error": f"past --deadline-s {args.deadline_s:g}"})
            continue
        left = args.case_timeout
        if args.deadline_s:
            left = max(30.0, min(left, args.deadline_s + 60 - (time.perf_counter() - T0)))
        log(f"== {case['dims']} T={case['T']} (E={case['E']} top-{case['top_k']} N={case['N']} K={case['K']} {dtype})")
        before = len(read_rows(jsonl))
        t = time.perf_counter()
        rc, tail = run_child(args, case, jsonl, left)
        if len(read_rows(jsonl)) == before:  # the child wrote no row: record why
            status = "timeout" if rc is None else f"crashed (rc {rc})"
            err = " / ".join(x for x in tail[-3:] if x.strip())[-400:]
            append_row(jsonl, {**{k: case[k] for k in ("dims", "T", "E", "top_k", "N", "K", "dtype")},
                               "status": status, "error": err or f"after {time.perf_counter() - t:.0f} s"})
            log(f"   {status} after {time.perf_counter() - t:.0f} s")
        report()
    rows = report()
    log("")
    log(console_table(rows))
    done = [r for r in rows if "peers" in r]
    log(f"\n{sum(bool(r.get('pass')) for r in done)}/{len(done)} cases PASS "
        f"(>= {TARGET_DEFAULT}x default, >= {TARGET_OTHERS}x fastest other); "
        f"{len(rows) - len(done)} not measured; {info['seconds']:.0f} s; wrote {md} and {jsonl}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
