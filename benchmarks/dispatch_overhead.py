"""Dispatch overhead on the CPU: table lookup in ns, and dispatch over a direct call in µs.

Run: python benchmarks/dispatch_overhead.py   (builds a tuned table in a temp folder first)
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
import timeit

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402

import kernel_space  # noqa: E402
import ops_adv  # noqa: E402
from ops_adv import _dispatch, _table  # noqa: E402


def best_of(stmt, n: int, repeat: int = 15, g=None) -> float:
    """Fastest of `repeat` runs, per call, in seconds: the least-disturbed figure on a shared machine."""
    return min(t / n for t in timeit.repeat(stmt, number=n, repeat=repeat, globals=g))


def main() -> None:
    torch.set_num_threads(1)
    cases = [
        ("gemm", (torch.randn(16, 64), torch.randn(64, 32)), {}, "cpu_blocked", {"block_m": 32, "block_n": 32, "block_k": 0, "threads": 1}),
        ("gemm", (torch.randn(16, 64), torch.randn(64, 32)), {}, "torch_matmul", {}),
        ("attention", tuple(torch.randn(1, 1, 8, 16) for _ in range(3)), {"causal": False}, "sdpa", {}),
    ]
    rows = []
    for op, args, attrs, impl, params in cases:
        spec = kernel_space.get_op(op)
        key = spec.signature(*args, **attrs)
        w = {"op": op, "problem": spec.problem._make(key)._asdict(), "impl": impl, "params": params,
             "kernel_version": kernel_space.get_impl(op, impl).version, "median_ms": 1, "vendor_impl": impl, "vendor_ms": 1, "speedup": 1}
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "t.json")
            with open(path, "w") as f:
                json.dump({"format": _table.FORMAT, "format_version": _table.FORMAT_VERSION, "device_class": "cpu", "fingerprint": {},
                           "winners": [w], "checksum": _table.checksum([w])}, f)
            ops_adv.load_table(path)
        fn = ops_adv.op_function(op)
        assert ops_adv.explain(op, *args, **attrs)["source"] == "tuned"
        direct = kernel_space.get_impl(op, impl).bind(params)
        cache = _dispatch._caches[op]
        dev = args[0].device
        g = {"cache": cache, "key": (key, dev), "sig": spec.signature, "args": args, "attrs": attrs, "fn": fn, "direct": direct,
             "dispatch": ops_adv.dispatch, "op": op}
        n = 20000
        lookup_ns = best_of("cache.get(key)", n * 5, g=g) * 1e9
        sig_ns = best_of("sig(*args, **attrs)", n, g=g) * 1e9
        # alternate the three so drift on a shared machine hits each alike; keep each one's fastest round
        stmts = ("direct(*args, **attrs)", "fn(*args, **attrs)", "dispatch(op, *args, **attrs)")
        rounds = [[timeit.timeit(st, number=n // 20, globals=g) / (n // 20) for st in stmts] for _ in range(25)]
        t_direct, t_op, t_disp = (min(r[i] for r in rounds) for i in range(3))
        rows.append((op, impl, lookup_ns, sig_ns, t_direct * 1e6, (t_op - t_direct) * 1e6, (t_disp - t_direct) * 1e6))
    ops_adv.load_table("")
    print(f"CPU: {os.cpu_count()} cores, torch {torch.__version__}, python {sys.version.split()[0]}")
    print(f"{'op':10} {'impl':13} {'lookup ns':>10} {'signature ns':>13} {'direct µs':>10} {'ops_adv.<op> +µs':>17} {'dispatch() +µs':>15}")
    for op, impl, lk, sg, d, o, di in rows:
        print(f"{op:10} {impl:13} {lk:10.0f} {sg:13.0f} {d:10.2f} {o:17.2f} {di:15.2f}")


if __name__ == "__main__":
    main()
