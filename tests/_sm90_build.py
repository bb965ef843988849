"""Offline sm_90 builds of every ops-adv Triton implementation (no GPU needed).

Run as a script, without TRITON_INTERPRET, by tests/test_sm90_build.py:

    python tests/_sm90_build.py [--max-builds 8] [--only gemm/triton_tma ...] > report.json

For each implementation registered with register_triton (CUDA, ours, not a vendor library), it
calls the launch wrapper through the registry on meta tensors (shapes without storage) for the
op's CPU and H200 default problems, with the default parameters and a few seeded random valid
configurations. `kernel[grid](...)` does not launch: it runs Triton's own argument binder with
the CUDA backend (the signature, constexprs, int==1 and divisible-by-16 specialisation, TMA
descriptor types are Triton's, not a copy) and records what `JITFunction.run` would compile.
Each distinct specialisation is then compiled for GPUTarget("cuda", 90, 32), and cuobjdump
reports its registers and stack (spill) bytes. Prints one JSON object on the last line.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time
import traceback
import zlib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SMS = 132  # an H100/H200: what torch.cuda.get_device_properties(...).multi_processor_count would say
RANDOM_CONFIGS = 3  # seeded random valid configurations per problem, besides the default


def tools() -> Path:
    """Where triton's NVIDIA backend keeps ptxas and cuobjdump."""
    import triton

    return Path(triton.__file__).parent / "backends" / "nvidia" / "bin"


def triton_impls(ks):
    """(op, impl) of every Triton implementation of ours: CUDA, requires triton, not a vendor library."""
    return [(op, i) for op in ks.ops() for i in ks.impls(op)
            if "cuda" in i.backends and "triton" in i.requires and not i.vendor]


# ----------------------------------------------------------------------------- recording launches

class Recorder:
    """Replaces JITFunction.run: binds arguments as Triton does for an sm_90 device, records, launches nothing."""

    def __init__(self):
        from triton.backends.compiler import GPUTarget
        from triton.compiler.compiler import make_backend

        self.target = GPUTarget("cuda", 90, 32)
        self.backend = make_backend(self.target)
        self.binders = {}
        self.launches = []

    def run(self, fn, *args, grid, warmup, **kwargs):
        from triton import knobs
        from triton.runtime.jit import create_function_from_signature

        # As JITFunction.run does before binding (both are compile options).
        kwargs["debug"] = kwargs.get("debug", fn.debug) or knobs.runtime.debug
        if hasattr(knobs.compilation, "instrumentation_mode"):  # not in every triton version
            kwargs["instrumentation_mode"] = knobs.compilation.instrumentation_mode
        binder = self.binders.get(fn)
        if binder is None:
            binder = self.binders[fn] = create_function_from_signature(fn.signature, fn.params, self.backend)
        bound_args, specialization, options = binder(*args, **kwargs)
        options, signature, constexprs, attrs = fn._pack_args(self.backend, kwargs, bound_args, specialization, options)
        self.launches.append((fn, signature, constexprs, attrs, options))
        return None


def patch_for_offline(ks, recorder):
    """The few CUDA-only queries the wrappers and checks make, answered as an sm_90 GPU would."""
    import torch
    from triton.runtime.jit import JITFunction

    def run(self, *args, grid, warmup, **kwargs):
        return recorder.run(self, *args, grid=grid, warmup=warmup, **kwargs)

    JITFunction.run = run
    # gemm/linear triton_tma: check_tma refuses TMA without a CUDA device of sm_90+; the target is sm_90.
    from kernel_space.gemm import triton as gemm_triton

    gemm_triton._tma_supported = lambda: None
    # gemm's persistent TMA kernel takes the SM count as the constexpr NUM_SMS (4 off CUDA): use an H200's.
    from kernel_space.gemm import _kernels as gemm_kernels

    gemm_kernels._sm_counts[torch.device("meta")] = SMS
    # make_inputs draws randn on the CPU: the builds need shapes and dtypes only, so inputs are meta
    # tensors (H200 problem sizes cost nothing). _rowwise.grid sizes the grid from 2 "SMs" off CUDA:
    # the grid is not part of the compiled code, so it is left alone.
    from kernel_space._common import DTYPES, randn

    def meta_randn(shape, dtype, device, gen, scale=1.0):
        return torch.empty(shape, dtype=DTYPES[dtype], device="meta")

    for op in ks.ops():
        mod = sys.modules[ks.get_op(op).make_inputs.__module__]
        if getattr(mod, "randn", None) is randn:
            mod.randn = meta_randn


# ----------------------------------------------------------------------------- cases

def sample_configs(impl, problem, n, seed):
    """Up to n distinct random configurations of impl's space that its check admits for problem."""
    rng = random.Random(seed)
    keys = list(impl.space)
    default = impl.default_params()
    found = []
    for _ in range(4000):
        c = {k: rng.choice(impl.space[k]) for k in keys}
        if c != default and c not in found and (impl.check is None or impl.check(problem, c) is None):
            found.append(c)
            if len(found) == n:
                break
    return found


def cases(op, impl):
    """(problem, params) to call: the default parameters on every default problem first, then random ones."""
    spec = __import__("kernel_space").get_op(op)
    problems = list(dict.fromkeys(spec.default_problems("cpu") + spec.default_problems("h200")))
    default = impl.default_params()
    ok = (lambda p, c: impl.check is None or impl.check(p, c) is None)
    first = [(p, default) for p in problems if ok(p, default)]
    rest = []
    for p in problems:
        seed = zlib.crc32(f"{op}/{impl.name}/{tuple(p)}".encode())
        rest += [(p, c) for c in sample_configs(impl, p, RANDOM_CONFIGS, seed)]
    return first + rest


# ----------------------------------------------------------------------------- building

def resources(cubin: bytes) -> dict:
    """REG and STACK (bytes of local memory per thread: spills) of the kernel in a cubin."""
    with tempfile.NamedTemporaryFile("wb", suffix=".cubin", delete=False) as f:
        f.write(cubin)
    try:
        out = subprocess.run([str(tools() / "cuobjdump"), "--dump-resource-usage", f.name],
                             capture_output=True, text=True).stdout
    finally:
        os.unlink(f.name)
    get = lambda key: int(m.group(1)) if (m := re.search(rf"\b{key}:(\d+)", out)) else None  # noqa: E731
    return {"regs": get("REG"), "stack": get("STACK"), "shared": get("SHARED")}


def build(recorder, launch) -> dict:
    import triton
    from triton.compiler import ASTSource

    fn, signature, constexprs, attrs, options = launch
    t0 = time.perf_counter()
    try:
        c = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=recorder.target,
                           options=options.__dict__)
    except Exception as e:  # the compiler's error is the finding
        msg = str(e).strip() or type(e).__name__
        return {"ok": False, "error": f"{type(e).__name__}: {msg}"[-3000:], "secs": time.perf_counter() - t0}
    return {"ok": True, "secs": time.perf_counter() - t0, **resources(c.asm["cubin"])}


def features(launch) -> set:
    """What a build exercises: the kernel, argument types, constexpr values, alignment facts, warps, stages."""
    fn, signature, constexprs, attrs, options = launch
    names = list(signature)
    k = fn.fn.__qualname__
    return ({(k, "sig", n, t) for n, t in signature.items()}
            | {(k, "c", repr(p), repr(v)) for p, v in constexprs.items()}
            | {(k, "attr", names[p[0]], repr(v)) for p, v in attrs.items()}
            | {(k, "warps", options.num_warps), (k, "stages", options.num_stages)})


def pick(found: list, n: int) -> list:
    """n of the distinct launches: the first (the default parameters on the first problem), then greedily
    the one that exercises the most not yet built (a kernel, a constexpr value, warps, ...); ties go first-found."""
    left, chosen, seen = list(found), [], set()
    while left and len(chosen) < n:
        best = max(range(len(left)), key=lambda i: (len(features(left[i][0]) - seen), -i)) if chosen else 0
        chosen.append(left.pop(best))
        seen |= features(chosen[-1][0])
    return chosen


def short(constexprs, signature) -> str:
    names = list(signature)
    return ", ".join(f"{names[k[0]]}={v.__name__ if hasattr(v, '__name__') else v}"
                     for k, v in constexprs.items() if len(k) == 1)


def selftest(recorder) -> list:
    """The harness on two toy kernels the interpreter runs alike: the one with a runtime tl.arange bound must fail."""
    import torch
    import triton
    import triton.language as tl

    @triton.jit
    def good(X, Y, n, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        tl.store(Y + offs, tl.load(X + offs, mask=offs < n) * 2, mask=offs < n)

    @triton.jit
    def bad(X, Y, n, BLOCK: tl.constexpr):
        offs = tl.arange(0, n)  # the compiler wants a constexpr bound; the interpreter does not mind
        tl.store(Y + offs, tl.load(X + offs) * 2)

    x = torch.empty(64, device="meta")
    out = []
    for k in (good, bad):
        del recorder.launches[:]
        k[(1,)](x, x, 64, BLOCK=64, num_warps=4)
        (launch,) = recorder.launches
        out.append({"signature": launch[1], **build(recorder, launch)})
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-builds", type=int, default=8, help="distinct kernel builds per implementation at most")
    ap.add_argument("--only", nargs="*", default=None, help="op/impl names to build (default: all)")
    ap.add_argument("--selftest", action="store_true", help="build two toy kernels, one that must fail")
    args = ap.parse_args()
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("run without TRITON_INTERPRET=1: the interpreter compiles nothing")
    import kernel_space as ks

    recorder = Recorder()
    patch_for_offline(ks, recorder)
    if args.selftest:
        print(json.dumps(selftest(recorder), default=str))
        return
    report = {}
    for op, impl in triton_impls(ks):
        name = f"{op}/{impl.name}"
        if args.only and name not in args.only:
            continue
        entry = report[name] = {"cases": 0, "wrapper_failures": [], "builds": [], "skipped_builds": 0}
        keys = {}
        for problem, params in cases(op, impl):
            tensors, attrs = ks.get_op(op).make_inputs(problem, "meta", 0)
            del recorder.launches[:]
            try:
                impl.bind(params)(*tensors, **attrs)
            except Exception as e:
                entry["wrapper_failures"].append({"problem": repr(problem), "params": params,
                                                  "error": f"{type(e).__name__}: {e}"[-1500:],
                                                  "where": traceback.format_exc(limit=-3)[-1500:]})
                continue
            entry["cases"] += 1
            if not recorder.launches:
                entry["wrapper_failures"].append({"problem": repr(problem), "params": params,
                                                  "error": "the wrapper launched no @triton.jit kernel"})
            for launch in recorder.launches:
                fn, signature, constexprs, attrs_, options = launch
                key = (fn.fn.__module__, fn.fn.__qualname__, repr(signature), repr(constexprs), repr(attrs_),
                       repr(sorted(options.__dict__.items())))
                if key not in keys:
                    keys[key] = (launch, problem, params)
        todo = pick(list(keys.values()), args.max_builds)
        entry["skipped_builds"] = len(keys) - len(todo)
        for launch, problem, params in todo:
            fn, signature, constexprs, _, options = launch
            entry["builds"].append({
                "kernel": fn.fn.__qualname__, "problem": repr(problem), "params": params,
                "num_warps": options.num_warps, "num_stages": options.num_stages,
                "constexprs": short(constexprs, signature), **build(recorder, launch),
            })
        print(f"{name}: {entry['cases']} calls, {len(keys)} distinct kernels, built {len(entry['builds'])}",
              file=sys.stderr, flush=True)
    print(json.dumps(report, default=str))


if __name__ == "__main__":
    main()
