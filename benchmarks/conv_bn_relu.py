#!/usr/bin/env python
"""conv2d_bn_relu at ResNet-50's layers, and the whole ResNet-50, eager against fused (H200, < 4 min).

Layers: every distinct conv of torchvision's ResNet-50 (random weights, 224x224), at --batch in
--dtype, with NCHW and channels_last callers. Each layer runs what the model runs after it (BN,
and ReLU where one follows the BN directly). Candidates, side by side:
- eager:     conv -> BatchNorm2d (eval) -> ReLU(inplace) modules, unfolded: what the model does today;
- cudnn:     our vendor candidate in the caller's layout: F.conv2d with the folded weight and bias, relu_;
- cudnn_oth: the same in the other layout, the conversion of x and weight timed with it;
- fused:     torch.cudnn_convolution_relu (cuDNN's conv + bias + ReLU in one call), layers with a ReLU;
- triton:    our implicit-GEMM kernel with the bias + ReLU epilogue, best of a small sweep (caller's layout);
- compile:   torch.compile of the eager trio (default mode, dynamic=False).
Every candidate is captured in a torch.cuda.CUDAGraph (the small layers are launch-bound at batch 32:
graphs time the GPU work, not Python), the L2 is flushed before each repetition, and candidates run in
interleaved rounds (median of medians). Speed-ups are eager time / candidate time.

Whole model: ResNet-50 inference at --batch, eager vs convert_model (conv+BN+ReLU fused), NCHW and
channels_last: launched from Python ("eager", "fused": default dispatch, no tuned table) and under a
CUDA graph ("eager+graph", "fused+graph", and "best+graph": each layer dispatched to the candidate
this run measured fastest for it, as a tuned table would). Speed-ups: graph against graph.

    python benchmarks/conv_bn_relu.py --out results/conv_bn_relu.json         # the H200 run
    python benchmarks/conv_bn_relu.py --device cpu --quick --out /tmp/cbr.json   # smoke test (CPU times: noise)
"""
from __future__ import annotations

import argparse
import copy
import importlib.util
import os
import tempfile
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != ROOT / "benchmarks"]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

import ops_adv  # noqa: E402
from kernel_space import get_impl, get_op, relative_error  # noqa: E402
from workers.timing import interleaved, time_fn  # noqa: E402

_tf = importlib.util.spec_from_file_location("table_file", ROOT / "benchmarks" / "table_file.py")
table_file = importlib.util.module_from_spec(_tf)
_tf.loader.exec_module(table_file)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) tried per layer; the check drops what a shape cannot use.
# Kept small: each (layer, config) is a fresh Triton compile (~1 s), the bulk of the run's time.
SWEEP = {
    "nhwc": [(128, 128, 64, 8, 3), (128, 64, 64, 4, 4), (64, 64, 64, 4, 3), (128, 64, 16, 4, 3)],
    "nchw": [(128, 64, 32, 4, 3), (128, 128, 32, 8, 3), (64, 64, 32, 4, 3), (128, 64, 16, 4, 3)],
}
T0 = time.perf_counter()


def log(*a: Any) -> None:
    print(f"[{time.perf_counter() - T0:6.1f}s]", *a, flush=True)


def resnet50_layers(res: int) -> list[dict]:
    """Distinct (conv shape, relu) of ResNet-50 as convert_model fuses it, with how often each occurs
    (the conv2d_bn_relu calls of one converted forward)."""
    import torchvision

    model = ops_adv.convert_model(torchvision.models.resnet50().eval())
    ops_adv.load_table("")
    seen: dict[tuple, dict] = {}
    with torch.no_grad(), ops_adv.profiler.ProfileContext() as prof:
        model(torch.randn(1, 3, res, res))
    for c in prof.calls:
        if c["op"] != "conv2d_bn_relu":
            continue
        p = c["problem"]
        key = (p["C"], p["H"], p["W"], p["K"], p["R"], p["stride"], p["padding"], p["relu"])
        seen.setdefault(key, {"C": p["C"], "H": p["H"], "W": p["W"], "K": p["K"], "R": p["R"], "stride": p["stride"],
                              "padding": p["padding"], "relu": p["relu"], "count": 0})["count"] += 1
    if not seen:
        raise SystemExit("convert_model fused no conv+BN site of ResNet-50: nothing to measure")
    return list(seen.values())


def fold_bn(conv: nn.Conv2d, bn: nn.BatchNorm2d) -> tuple[torch.Tensor, torch.Tensor]:
    """The conv's weight and bias with an eval-mode BatchNorm folded in (float64, cast back)."""
    scale = bn.weight.double() / (bn.running_var.double() + bn.eps).sqrt()
    w = conv.weight.double() * scale.reshape(-1, 1, 1, 1)
    b0 = conv.bias.double() if conv.bias is not None else torch.zeros_like(scale)
    b = bn.bias.double() + (b0 - bn.running_mean.double()) * scale
    return w.to(conv.weight.dtype), b.to(conv.weight.dtype)  # elementwise ops keep the weight's memory format


def graphed(fn: Callable[[], Any], device: torch.device, use_graph: bool) -> Callable[[], Any]:
    """`fn` replayed from a CUDA graph (after warm-up on a side stream), or `fn` itself off CUDA."""
    if device.type != "cuda" or not use_graph:
        return fn
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g.replay


def _bn(K: int, dtype, device) -> nn.BatchNorm2d:
    bn = nn.BatchNorm2d(K)
    with torch.no_grad():
        bn.running_mean.uniform_(-0.2, 0.2)
        bn.running_var.uniform_(0.5, 2.0)
        bn.weight.uniform_(0.5, 1.5)
        bn.bias.uniform_(-0.2, 0.2)
    return bn.eval().to(device=device, dtype=dtype)


@torch.no_grad()
def bench_layer(L: dict, layout: str, args, device: torch.device) -> dict:
    dtype = DTYPES[args.dtype]
    fmt = torch.channels_last if layout == "nhwc" else torch.contiguous_format
    conv = nn.Conv2d(L["C"], L["K"], L["R"], L["stride"], L["padding"], bias=False).eval().to(device, dtype)
    bn = _bn(L["K"], dtype, device)
    conv, bn = conv.to(memory_format=fmt), bn.to(memory_format=fmt)
    relu = nn.ReLU(inplace=True)
    w, b = fold_bn(conv, bn)
    x = torch.randn(args.batch, L["C"], L["H"], L["W"], device=device, dtype=dtype).contiguous(memory_format=fmt)
    attrs = dict(stride=L["stride"], padding=L["padding"], dilation=1, relu=L["relu"])
    spec = get_op("conv2d_bn_relu")
    problem = spec.problem._make(spec.signature(x, w, b, **attrs))
    ref = spec.reference(x, w, b, **attrs)

    def eager():
        y = bn(conv(x))
        return relu(y) if L["relu"] else y

    other = "cudnn_nchw" if layout == "nhwc" else "cudnn_nhwc"
    cands: dict[str, Callable[[], Any]] = {
        "eager": eager,
        "cudnn": lambda: get_impl("conv2d_bn_relu", f"cudnn_{layout}").fn(x, w, b, **attrs),
        "cudnn_oth": lambda: get_impl("conv2d_bn_relu", other).fn(x, w, b, **attrs),
    }
    if device.type == "cuda" and L["relu"]:  # cuDNN's fused conv + bias + ReLU, where the layer has a ReLU
        fused_fn = get_impl("conv2d_bn_relu", f"cudnn_fused_{layout}").fn
        try:
            row_err = relative_error(fused_fn(x, w, b, **attrs), ref)
            if row_err <= spec.tolerance(args.dtype):
                cands["cudnn_fused"] = lambda: fused_fn(x, w, b, **attrs)
            else:
                log(f"  cudnn_fused wrong: {row_err:.2e}")
        except Exception as e:  # not every cuDNN build has an engine for this graph
            log(f"  cudnn_fused failed: {type(e).__name__}: {str(e)[:100]}")
    row: dict[str, Any] = {"layer": L, "layout": layout, "problem": problem._asdict()}
    # Past 40% of --deadline-s: one Triton config and no torch.compile (each costs ~1-5 s a layer)
    late = time.perf_counter() - T0 > 0.4 * args.deadline_s
    row["late"] = late
    if device.type == "cuda":
        impl = get_impl("conv2d_bn_relu", "triton_implicit_gemm")
        best, best_ms = None, float("inf")
        for bm, bn_, bk, warps, stages in SWEEP[layout]:
            if late and best is not None:
                break
            params = dict(layout=layout, BLOCK_M=bm, BLOCK_N=bn_, BLOCK_K=bk, num_warps=warps, num_stages=stages)
            if impl.check(problem, params) is not None:
                continue
            try:
                fn = impl.bind(params)
                err = relative_error(fn(x, w, b, **attrs), ref)
                if err > spec.tolerance(args.dtype):
                    log(f"  triton {params} wrong: {err:.2e}")
                    continue
                ms = time_fn(lambda: fn(x, w, b, **attrs), device=device, reps=10, budget_s=0.2).median_ms
            except Exception as e:  # a config that does not compile or run is skipped
                log(f"  triton {params} failed: {type(e).__name__}: {str(e)[:100]}")
                continue
            if ms < best_ms:
                best, best_ms = params, ms
        if best is not None:
            fn_best = impl.bind(best)
            cands["triton"] = lambda: fn_best(x, w, b, **attrs)
            row["triton_params"] = best
            row["triton_err"] = relative_error(fn_best(x, w, b, **attrs), ref)
    if args.compile and not late:
        torch._dynamo.reset()  # one compile per layer; the same code object would hit the recompile limit
        comp = torch.compile(eager, dynamic=False)
        comp()
        cands["compile"] = comp
    row["vendor_err"] = relative_error(cands["cudnn"](), ref)
    row["eager_err"] = relative_error(eager(), ref)
    fns = {k: graphed(f, device, args.graphs) for k, f in cands.items()}
    t = interleaved(fns, device=device, rounds=args.rounds, reps=args.reps, budget_s=0.3)
    row["ms"] = {k: v.median_ms for k, v in t.items()}
    row["speedup"] = {k: t["eager"].median_ms / v.median_ms for k, v in t.items() if k != "eager"}
    del fns
    return row


def winners(rows: list[dict]) -> dict[tuple, tuple[str, dict]]:
    """Per layer problem, the fastest of our candidates this run measured: (implementation, params)."""
    names = {"cudnn": lambda r: f"cudnn_{r['layout']}", "cudnn_oth": lambda r: "cudnn_" + ("nchw" if r["layout"] == "nhwc" else "nhwc"),
             "cudnn_fused": lambda r: f"cudnn_fused_{r['layout']}", "triton": lambda r: "triton_implicit_gemm"}
    out = {}
    for r in rows:
        k = min((k for k in r["ms"] if k in names), key=lambda k: r["ms"][k])
        out[tuple(r["problem"].values())] = (names[k](r), r.get("triton_params", {}) if k == "triton" else {})
    return out


def use_table(table: dict[tuple, tuple[str, dict]], device: torch.device) -> None:
    """Load `table` (problem -> (impl, params)) as a tuned table file; {} loads none."""
    if not table:
        ops_adv.load_table("")
        return
    fields = get_op("conv2d_bn_relu").problem._fields
    winners = [table_file.winner("conv2d_bn_relu", dict(zip(fields, problem)), impl, params)
               for problem, (impl, params) in table.items()]
    path = os.path.join(tempfile.mkdtemp(), "conv_bn_relu.json")
    ops_adv.load_table(table_file.write(path, winners, table_file.device_class(device)))


@torch.no_grad()
def bench_model(layout: str, args, device: torch.device, table: dict) -> dict:
    import torchvision

    dtype = DTYPES[args.dtype]
    fmt = torch.channels_last if layout == "nhwc" else torch.contiguous_format
    torch.manual_seed(0)
    model = torchvision.models.resnet50().eval()
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            with torch.no_grad():
                m.running_var.uniform_(0.5, 2.0)
    model = model.to(device=device, dtype=dtype, memory_format=fmt)
    fused = copy.deepcopy(model)
    ops_adv.load_table("")
    fused = ops_adv.convert_model(fused)
    report = [r for r in ops_adv.explain_model(fused) if r["type"] == "Conv2d+BatchNorm2d"]
    x = torch.randn(args.batch, 3, args.res, args.res, device=device, dtype=dtype).contiguous(memory_format=fmt)
    with torch.no_grad():
        want, got = model(x).float(), fused(x).float()
        err = relative_error(got, want)
        top1 = float((want.argmax(-1) == got.argmax(-1)).float().mean())
        fns = {"eager": lambda: model(x), "fused": lambda: fused(x)}
        if device.type == "cuda" and args.graphs:
            fns["eager+graph"] = graphed(fns["eager"], device, True)
            fns["fused+graph"] = graphed(fns["fused"], device, True)
        # A graph freezes each call's kernel: capture again with this run's per-layer winners dispatched.
        use_table(table, device)
        best_err = relative_error(fused(x).float(), want)
        if device.type == "cuda" and args.graphs:
            fns["best+graph"] = graphed(fns["fused"], device, True)
        use_table({}, device)
        t = interleaved(fns, device=device, rounds=args.rounds, reps=args.reps, budget_s=1.0)
    ms = {k: v.median_ms for k, v in t.items()}
    speedup = {"fused": ms["eager"] / ms["fused"]}
    for k in ("fused+graph", "best+graph"):
        if k in ms:
            speedup[k] = ms["eager+graph"] / ms[k]
    return {"layout": layout, "fused_sites": sum(r["converted"] == "yes" for r in report), "rel_err": err,
            "best_rel_err": best_err, "top1_agree": top1, "ms": ms, "speedup": speedup}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="JSON path for all results")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--quick", action="store_true", help="a few layers, small batch and resolution (smoke test)")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--res", type=int, default=224)
    ap.add_argument("--dtype", default="bf16", choices=list(DTYPES))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--deadline-s", type=float, default=150.0,
                    help="layers end here (past 40%% of it: one Triton config, no torch.compile); the whole-model "
                         "runs follow (~30 s)")
    ap.add_argument("--no-compile", dest="compile", action="store_false", help="skip the torch.compile column")
    ap.add_argument("--no-graphs", dest="graphs", action="store_false", help="time Python launches, not graphs")
    ap.add_argument("--no-model", dest="model", action="store_false", help="skip the whole-model runs")
    args = ap.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("no CUDA device: run with --device cpu --quick for a smoke test")
    if args.quick:
        args.batch, args.res, args.rounds, args.reps = 2, 64, 1, 3
        if device.type == "cpu":
            args.dtype, args.compile = "fp32", False
    torch.backends.cudnn.benchmark = True  # what a conv model sets; each candidate gets cuDNN's best algorithm
    layers = resnet50_layers(args.res)
    if args.quick:
        layers = layers[:3]
    log(f"{len(layers)} distinct conv layers of ResNet-50 at {args.res}x{args.res}, batch {args.batch}, {args.dtype}")
    rows = []
    head = f"{'layer (C,HxW,K,RxR,s,relu) x count':40} {'lay':4} {'eager ms':>9}  " \
           f"{'cudnn':>6} {'oth':>6} {'fused':>6} {'triton':>6} {'compile':>7}   (speed-up over eager)"
    out: dict[str, Any] = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor(),
                           "torch": torch.__version__, "batch": args.batch, "res": args.res, "dtype": args.dtype,
                           "graphs": args.graphs, "l2_flushed": True, "layers": rows, "model": []}
    lines = [head]
    log(head)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    skipped = out["skipped_layers"] = []
    for L in layers:  # both layouts of a layer together: a deadline leaves whole layers out
        for layout in ("nchw", "nhwc"):
            if time.perf_counter() - T0 > args.deadline_s:
                skipped.append({**L, "layout": layout})
                continue
            try:
                row = bench_layer(L, layout, args, device)
            except Exception as e:  # one layer's failure is reported; the others still run
                log(f"{L} {layout}: {type(e).__name__}: {str(e)[:200]}")
                out.setdefault("errors", []).append({**L, "layout": layout, "error": f"{type(e).__name__}: {str(e)[:200]}"})
                continue
            rows.append(row)
            s = row["speedup"]
            name = f"{L['C']},{L['H']}x{L['W']},{L['K']},{L['R']}x{L['R']},s{L['stride']},{'relu' if L['relu'] else '-'} x{L['count']}"
            line = f"{name:40} {layout:4} {row['ms']['eager']:9.4f}  " + " ".join(
                f"{s[k]:{w}.2f}" if k in s else f"{'-':>{w}}" for k, w in (("cudnn", 6), ("cudnn_oth", 6),
                                                                         ("cudnn_fused", 6), ("triton", 6), ("compile", 7)))
            lines.append(line)
            log(line)
            Path(args.out).write_text(json.dumps(out, indent=1, default=str))
    for layout in ("nchw", "nhwc"):
        # count-weighted totals: the time of all ResNet-50 convs + BN + ReLU, each candidate alone
        sel = [r for r in rows if r["layout"] == layout]
        if not sel:
            continue
        keys = list(dict.fromkeys(k for r in sel for k in r["ms"]))
        # A layer without a candidate counts what would run there: cuDNN's plain conv for cudnn_fused
        # (layers without a ReLU), eager for triton/compile (skipped past the deadline).
        tot = {k: sum(r["ms"].get(k, r["ms"]["cudnn" if k == "cudnn_fused" else "eager"]) * r["layer"]["count"]
                      for r in sel) for k in keys}
        best = sum(min(r["ms"][k] for k in r["ms"] if k in ("cudnn", "cudnn_oth", "cudnn_fused", "triton")) * r["layer"]["count"]
                   for r in sel)
        geo = {k: statistics.geometric_mean([r["speedup"][k] for r in sel if k in r["speedup"]])
               for k in keys if k != "eager"}
        summary = {"layout": layout, "layers_measured": f"{len(sel)}/{len(layers)}", "total_ms": tot, "best_of_ours_ms": best,
                   "total_speedup": {k: tot["eager"] / v for k, v in tot.items() if k != "eager"},
                   "best_of_ours_speedup": tot["eager"] / best, "geomean_speedup": geo,
                   "target_1.1x_met": tot["eager"] / best >= 1.1}
        out.setdefault("summary", []).append(summary)
        line = (f"{layout}: {len(sel)}/{len(layers)} layers (x count) eager {tot['eager']:.3f} ms; speed-up "
                + ", ".join(f"{k} {v:.2f}x" for k, v in summary["total_speedup"].items())
                + f"; best of ours per layer {summary['best_of_ours_speedup']:.2f}x (target >= 1.1x: "
                + ("met" if summary["target_1.1x_met"] else "NOT met") + "); geomean "
                + ", ".join(f"{k} {v:.2f}x" for k, v in geo.items()))
        lines.append(line)
        log(line)
    out["table"] = lines
    Path(args.out).write_text(json.dumps(out, indent=1, default=str))
    if args.model:
        for layout in ("nchw", "nhwc"):
            # Both layouts' winners: a winner in the other layout hands the next layer that layout's input.
            try:  # the layer rows are already written: a failure here is reported, not fatal
                r = bench_model(layout, args, device, winners(rows))
            except Exception as e:
                log(f"ResNet-50 {layout}: {type(e).__name__}: {str(e)[:200]}")
                out["model"].append({"layout": layout, "error": f"{type(e).__name__}: {str(e)[:200]}"})
                continue
            out["model"].append(r)
            Path(args.out).write_text(json.dumps(out, indent=1, default=str))
            line = (f"ResNet-50 {layout} batch {args.batch}: " + ", ".join(f"{k} {v:.3f} ms" for k, v in r["ms"].items())
                    + "; speed-up " + ", ".join(f"{k} {v:.2f}x" for k, v in r["speedup"].items())
                    + f"; {r['fused_sites']} sites fused, rel err {r['rel_err']:.2e}, top-1 agree {r['top1_agree']:.2f}")
            lines.append(line)
            log(line)
    Path(args.out).write_text(json.dumps(out, indent=1, default=str))
    log(f"wrote {args.out}")


if __name__ == "__main__":
    main()
