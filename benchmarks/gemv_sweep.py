#!/usr/bin/env python
"""Decode gemm (M <= 8, x @ W.T) at the HBM bound: how close can one launch get, and with which layout?

Issue 29 wants small gemms at >= 90% of copy bandwidth on 4096x4096 and 6144x4096 with no separate reduce
kernel. The tuned `triton_splitk_decode` interleaves its K tiles over the splits (program s reads tiles s,
s+S, s+2S, ...). This sweep sets against cuBLAS, in one process, L2 cold (weights rotate over 200 MiB):
- `splitk`: `triton_splitk_decode` over a wide grid (the tuner's space, grids of 1-8 waves);
- `chunk`: a prototype whose split s reads one contiguous K range (each weight row a sequential stream),
  weight loads marked evict-first, the same in-kernel last-program reduction; with tl.dot or, for M = 1,
  a multiply-add over a [BLOCK_N, BLOCK_K] accumulator reduced once at the end.
Every call is a CUDA graph of REPS calls; figures are median us per call and % of measured copy bandwidth.

    python benchmarks/gemv_sweep.py --out /tmp/gemv.json                 # GPU, ~2-3 minutes
    TRITON_INTERPRET=1 python benchmarks/gemv_sweep.py --device cpu --quick  # correctness of the prototype
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
import time
from pathlib import Path

import torch
import triton
import triton.language as tl

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from gemm_decode import L2_FLUSH_BYTES, Timer, copy_bandwidth, log  # noqa: E402
from kernel_space._capture import persistent_zeros  # noqa: E402

SHAPES = [("o_proj", 4096, 4096), ("qkv", 6144, 4096), ("down", 4096, 14336)]  # (name, N, K)


@triton.jit
def _tile(acc, w, x_ptr, x_ptrs, kk, K, USE_DOT: tl.constexpr):
    """One K tile's product: tl.dot into [BLOCK_M, BLOCK_N], or multiply-adds into [BLOCK_N, BLOCK_K] (one row)."""
    if USE_DOT:
        x = tl.load(x_ptrs, mask=kk[None, :] < K, other=0.0)
        acc = tl.dot(x, tl.trans(w), acc)
    else:
        x = tl.load(x_ptr + kk, mask=kk < K, other=0.0)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    return acc


@triton.jit
def _chunk_kernel(x_ptr, w_ptr, out_ptr, ws_ptr, cnt_ptr, M, N, K, TILES_PER_SPLIT,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
                  USE_DOT: tl.constexpr, PDL: tl.constexpr = 0):
    # PDL 1: launched early under programmatic dependent launch, wait for the kernel before first;
    # PDL 2: load the first weight tile (nobody writes weights), then wait, then everything else
    if PDL == 1:
        tl.extra.cuda.gdc_wait()
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rn = offs_n % N
    offs_m = tl.arange(0, BLOCK_M)
    rm = offs_m % M
    offs_k = tl.arange(0, BLOCK_K)
    k0 = pid_k * TILES_PER_SPLIT * BLOCK_K
    w_ptrs = w_ptr + rn[:, None] * K + (k0 + offs_k)[None, :]
    x_ptrs = x_ptr + rm[:, None] * K + (k0 + offs_k)[None, :]
    if USE_DOT:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    kk = k0 + offs_k
    w = tl.load(w_ptrs, mask=kk[None, :] < K, other=0.0, eviction_policy="evict_first")  # the first tile, peeled
    if PDL == 2:
        tl.extra.cuda.gdc_wait()
    acc = _tile(acc, w, x_ptr, x_ptrs, kk, K, USE_DOT)
    for t in range(1, TILES_PER_SPLIT):
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
        kk = k0 + t * BLOCK_K + offs_k
        w = tl.load(w_ptrs, mask=kk[None, :] < K, other=0.0, eviction_policy="evict_first")
        acc = _tile(acc, w, x_ptr, x_ptrs, kk, K, USE_DOT)
    if PDL:  # the next kernel may start launching: its programs wait in gdc_wait
        tl.extra.cuda.gdc_launch_dependents()
    if not USE_DOT:
        acc = tl.reshape(tl.sum(acc, axis=1), (1, BLOCK_N))
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    out_ptrs = out_ptr + offs_m[:, None] * N + offs_n[None, :]
    if SPLIT_K == 1:
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        ws_tile = ws_ptr + offs_m[:, None] * N + offs_n[None, :]
        tl.store(ws_tile + pid_k * M * N, acc, mask=mask)
        tl.debug_barrier()
        done = tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel")
        if done == SPLIT_K - 1:
            tl.debug_barrier()
            acc = tl.load(ws_tile, mask=mask, other=0.0, cache_modifier=".cg")
            for s in tl.static_range(1, SPLIT_K):
                acc += tl.load(ws_tile + s * M * N, mask=mask, other=0.0, cache_modifier=".cg")
            tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)
            tl.atomic_xchg(cnt_ptr + pid_n, 0)


_counters: dict = {}


def chunk_gemm(x, w, BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages, USE_DOT, PDL=0):
    """x (M, K) @ w (N, K).T, contiguous K chunk per split."""
    M, K = x.shape
    N = w.shape[0]
    out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    tiles = triton.cdiv(N, BLOCK_N)
    per = triton.cdiv(triton.cdiv(K, BLOCK_K), SPLIT_K)
    ws = torch.empty((SPLIT_K, M, N), dtype=torch.float32, device=x.device) if SPLIT_K > 1 else out
    cnt = _counters.get(x.device)
    if cnt is None:
        cnt = _counters[x.device] = persistent_zeros(4096, torch.int32, x.device)
    _chunk_kernel[(tiles, SPLIT_K)](x, w, out, ws, cnt, M, N, K, per, BLOCK_M=16 if USE_DOT else 1,
                                   BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, SPLIT_K=SPLIT_K, USE_DOT=USE_DOT, PDL=PDL,
                                   num_warps=num_warps, num_stages=num_stages, **({"launch_pdl": True} if PDL else {}))
    return out


def configs(N: int, K: int, M: int, quick: bool):
    from kernel_space import get_impl
    from kernel_space.gemm import GemmProblem

    check = get_impl("gemm", "triton_splitk_decode").check
    p = GemmProblem(M, N, K, "bf16", False, True)
    sms = torch.cuda.get_device_properties(0).multi_processor_count if torch.cuda.is_available() else 132
    bns, bks, sks, wps, sts = ((32, 64), (64,), (1, 2), (4,), (2,)) if quick else \
        ((32, 64, 128), (128, 256), (1, 2, 4, 8, 16), (4,), (4,))  # ~150 compiles for M 1 and 8
    out = []
    for bn, bk, sk, wp, st in itertools.product(bns, bks, sks, wps, sts):
        ctas = triton.cdiv(N, bn) * sk
        if not quick and not sms <= ctas <= 8 * sms:
            continue
        if bn * bk > 32768:
            continue
        c = {"BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": sk, "num_warps": wp, "num_stages": st}
        if sk * bk <= K and check(p, c) is None:
            out.append(("splitk", c))
        if sk * bk <= K:
            out.append(("chunk-dot", {**c, "USE_DOT": True}))
            if M == 1:
                out.append(("chunk-fma", {**c, "USE_DOT": False}))
    return out


def chain(a, dev, rows, bw) -> dict:
    """8 dependent o_proj-shaped calls (x_{i+1} = x_i @ W_i.T) in one graph: cuBLAS, the best chunk config (the
    multiply-add kind at M=1), and that config launched with programmatic dependent launch: `pdl-wait` waits
    first, `pdl-prefetch` loads its first weight tile before waiting (weights do not depend on the kernel
    before); both let the next kernel launch once their loop is done. Per call us; against the single-call
    time it prices a kernel boundary. (H100, wait first: 16.0 us against 15.3 without PDL.)"""
    res: dict = {"chain": {}}
    for r in (r for r in rows if r.get("shape") == "o_proj" and "chunk-dot" in r):
        M = r["M"]
        cfg = dict(r.get("chunk-fma", r["chunk-dot"])["config"])
        n, K = 8, r["K"]
        copies = max(n, math.ceil(L2_FLUSH_BYTES / (K * K * 2)))
        ws = [torch.randn(K, K, device=dev, dtype=torch.bfloat16) * K ** -0.5 for _ in range(copies)]
        x0 = torch.randn(M, K, device=dev, dtype=torch.bfloat16)

        def run(f):
            def go(x):
                for i in range(n):
                    x = f(x, ws[i % len(ws)])
                return x
            return go

        def gemm(pdl):
            return run(lambda x, w: chunk_gemm(x, w, **cfg, PDL=pdl))
        timer = Timer(dev, a.reps, a.rounds)
        cands = {"cublas": timer.build(run(lambda x, w: x @ w.t()), [(x0,)]), "chunk": timer.build(gemm(0), [(x0,)])}
        ref, same = gemm(0)(x0), {}
        for name, pdl in (("pdl-wait", 1), ("pdl-prefetch", 2)):
            try:
                got = gemm(pdl)(x0)
                torch.cuda.synchronize()
                same[name] = bool(torch.equal(ref, got))
                cands[name] = timer.build(gemm(pdl), [(x0,)])
            except Exception as e:
                same[name] = f"{type(e).__name__}: {str(e)[:160]}"
        t = timer.compare(cands)
        per = {k: v * 1e3 / n for k, v in t.items()}
        res["chain"][f"M={M}"] = {"us_per_call": per, "pdl_equal_results": same, "config": cfg}
        log(f"chain o_proj M={M} x{n}: " + ", ".join(f"{k} {v:.1f} us/call" for k, v in per.items())
            + f"; results identical: {same}")
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--ms", default="1,8")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--top", type=int, default=40, help="configs per kind kept for the final interleaved round")
    ap.add_argument("--deadline-s", type=float, default=300)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)
    dev = torch.device(a.device)
    cuda = dev.type == "cuda"
    dt = torch.bfloat16 if cuda else torch.float32
    bw = copy_bandwidth(torch, dev)
    log(f"device {torch.cuda.get_device_name() if cuda else 'cpu'}; torch {torch.__version__}, triton {triton.__version__}; "
        f"copy bandwidth {bw / 1e12:.2f} TB/s")
    from kernel_space import get_impl

    splitk = get_impl("gemm", "triton_splitk_decode")
    t0, rows = time.perf_counter(), []
    shapes = [("tiny", 96, 200)] if a.quick else SHAPES
    for (name, N, K), M in itertools.product(shapes, [int(m) for m in a.ms.split(",")]):
        if time.perf_counter() - t0 > a.deadline_s:
            log(f"{name} M={M}: skipped (deadline)")
            continue
        copies = max(2, math.ceil(L2_FLUSH_BYTES / (N * K * 2))) if cuda else 2
        ws = [torch.randn(N, K, device=dev, dtype=dt) * K ** -0.5 for _ in range(copies)]
        x = torch.randn(M, K, device=dev, dtype=dt)
        sets = [(x, w) for w in ws]
        ref = (x.double() @ ws[0].double().t())
        timer = Timer(dev, a.reps if cuda else 1, a.rounds if cuda else 1)
        cands, kinds, bad = {"cublas": timer.build(lambda x, w: x @ w.t(), sets)}, {}, 0
        for i, (kind, c) in enumerate(configs(N, K, M, a.quick)):
            if kind == "splitk":
                fn = (lambda c: lambda x, w: splitk.fn(x, w.t(), **c))(c)
            else:
                fn = (lambda c: lambda x, w: chunk_gemm(x, w, **c))(c)
            try:
                got = fn(*sets[0]).double()
                err = float((got - ref).norm() / ref.norm())
                if not err < (2e-2 if cuda else 1e-4):
                    bad += 1
                    log(f"  {kind} {c}: wrong (rel err {err:.2e})")
                    continue
                cands[f"{kind}#{i}"] = timer.build(fn, sets)
                kinds[f"{kind}#{i}"] = (kind, c)
            except Exception as e:  # a config that fails to compile or launch is reported, not fatal
                log(f"  {kind} {c}: {type(e).__name__}: {str(e).splitlines()[0][:140] if str(e) else ''}")
        if not cuda:
            log(f"{name} M={M}: {len(kinds)} configs correct, {bad} wrong")
            rows.append({"shape": name, "M": M, "correct": len(kinds), "wrong": bad})
            continue
        first = timer.compare(cands)  # a coarse pass, then the best of each kind again side by side
        keep = {"cublas": cands["cublas"]}
        for kind in ("splitk", "chunk-dot", "chunk-fma"):
            best = sorted((k for k in kinds if kinds[k][0] == kind), key=first.get)[:max(1, a.top // 10)]
            keep.update({k: cands[k] for k in best})
        t = timer.compare(keep)
        byt = N * K * 2 + 2 * M * (N + K)
        row = {"shape": name, "N": N, "K": K, "M": M, "configs": len(kinds), "wrong": bad,
               "cublas_us": t["cublas"] * 1e3, "cublas_pct": 100 * byt / (t["cublas"] * 1e-3) / bw}
        line = f"{name} M={M} ({len(kinds)} configs): cuBLAS {t['cublas'] * 1e3:.1f} us {row['cublas_pct']:.0f}%"
        for kind in ("splitk", "chunk-dot", "chunk-fma"):
            ks = [k for k in t if k in kinds and kinds[k][0] == kind]
            if not ks:
                continue
            b = min(ks, key=t.get)
            row[kind] = {"us": t[b] * 1e3, "pct": 100 * byt / (t[b] * 1e-3) / bw, "config": kinds[b][1],
                         "x_cublas": t["cublas"] / t[b]}
            line += f"; {kind} {t[b] * 1e3:.1f} us {row[kind]['pct']:.0f}% ({t['cublas'] / t[b]:.2f}x) {kinds[b][1]}"
        log(line)
        rows.append(row)
        if a.out:  # as they come: a cut run keeps its rows
            a.out.parent.mkdir(parents=True, exist_ok=True)
            a.out.write_text(json.dumps({"copy_bw": bw, "rows": rows}, indent=1))
        del ws, sets, cands, keep
        torch.cuda.empty_cache()
    if cuda and rows:
        rows.append(chain(a, dev, rows, bw))
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps({"copy_bw": bw, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
