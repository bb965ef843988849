"""Dispatch through an exported table vs the vendor kernel, per tuned problem, interleaved.

  OPS_ADV_TABLE=dist/opsadv-table.json python benchmarks/verify_dispatch.py [--out FILE.md]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402

import kernel_space  # noqa: E402
import ops_adv  # noqa: E402
from workers.timing import interleaved  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    args = ap.parse_args()
    path = os.environ["OPS_ADV_TABLE"]
    ops_adv.load_table(path)  # checks the file: a corrupt or stale table stops here with one line
    with open(path) as f:
        table = json.load(f)
    device = "cpu" if table["device_class"] == "cpu" else "cuda:0"
    lines = ["| op | problem | dispatched | dispatch ms | vendor | vendor ms | vendor/dispatch | spread ms |", "|---|---|---|---|---|---|---|---|"]
    worst = None
    for w in table["winners"]:
        spec = kernel_space.get_op(w["op"])
        problem = spec.parse_problem(w["problem"])
        targs, attrs = spec.make_inputs(problem, device, seed=99)
        vendor = kernel_space.get_impl(w["op"], w["vendor_impl"]).bind({})
        d = ops_adv.explain(w["op"], *targs, **attrs)
        t = interleaved(
            {"dispatch": lambda: ops_adv.dispatch(w["op"], *targs, **attrs), "vendor": lambda: vendor(*targs, **attrs)},
            device=device, rounds=7, budget_s=0.2, reps=20,
        )
        ratio = t["vendor"].median_ms / t["dispatch"].median_ms
        noise = max(t["vendor"].spread_ms, t["dispatch"].spread_ms)
        slower_beyond_noise = t["dispatch"].median_ms - t["vendor"].median_ms > noise
        worst = ratio if worst is None else min(worst, ratio)
        prob = " ".join(f"{k}={v}" for k, v in w["problem"].items())
        lines.append(f"| {w['op']} | {prob} | {d['impl']} ({d['source']}) | {t['dispatch'].median_ms:.4g} | {w['vendor_impl']} | "
                     f"{t['vendor'].median_ms:.4g} | {ratio:.2f}x{' SLOWER' if slower_beyond_noise else ''} | {noise:.3g} |")
        del targs
        if device != "cpu":
            torch.cuda.empty_cache()
    lines.append(f"\nworst vendor/dispatch ratio: {worst:.3f}")
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
