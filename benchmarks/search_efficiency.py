"""How fast does the tuner's search find the best configuration, against an exhaustive sweep?

Two phases:
  sweep   (on the GPU)  measure every valid configuration of a reduced space per problem,
                        recording its median time and the wall time its evaluation cost
                        (compilation, correctness check, timing);
  replay  (anywhere)    run the tuner's own Optuna search (TPE with constant liar, warm-started
                        from the nearest other problems' best configurations as opsadv-tune
                        does; TPE cold; random) over the measured sweep, several seeds each, and
                        count evaluations until one is within 2% of the exhaustive best.
Replaying over measured results (as Kernel Tuner's simulation mode does) lets every seed of
every sampler see the same numbers, so samplers are compared on the search alone.

  python benchmarks/search_efficiency.py sweep --out DIR [--budget-s 300]
  python benchmarks/search_efficiency.py replay DIR/<date>-<gpu>-sweep.json [--seeds 5]
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

# Reduced spaces: each still spans the choices that decide speed on Hopper.
REDUCED = {
    "gemm": {"BLOCK_M": (16, 64, 128), "BLOCK_N": (64, 128, 256), "BLOCK_K": (64, 128), "GROUP_M": (8,), "num_warps": (4, 8),
             "num_stages": (3, 4), "SPLIT_K": (1, 4)},
    "attention": {"BLOCK_M": (64, 128), "BLOCK_N": (32, 64, 128), "num_warps": (4, 8), "num_stages": (2, 3), "streams": (1,)},
    "rms_norm": {"BLOCK_N": (0, 1024, 4096), "ROWS_PER_PROGRAM": (1, 2, 8), "PROGRAMS_PER_SM": (0, 4), "num_warps": (4, 8, 16),
                 "num_stages": (1, 3)},
}


def problems():
    from kernel_space import get_op, ops

    g, a = get_op("gemm").problem, get_op("attention").problem
    out = [
        ("gemm", g(4096, 4096, 4096, "bf16")), ("gemm", g(2048, 4096, 4096, "bf16")),
        ("gemm", g(16, 4096, 4096, "bf16")), ("gemm", g(32, 4096, 4096, "bf16")),
        ("attention", a(4, 32, 2048, 2048, 128, False, "bf16")), ("attention", a(4, 32, 2048, 2048, 128, True, "bf16")),
        ("attention", a(2, 32, 4096, 4096, 128, True, "bf16")),
    ]
    for op in ("rms_norm",):
        if op in ops():
            p = get_op(op).problem
            out += [(op, p(4096, 4096, "bf16")), (op, p(2048, 8192, "bf16")), (op, p(1024, 16384, "bf16"))]
    return out


def reduced_configs(impl, problem):
    red = REDUCED.get(impl.op, {})
    space = {k: tuple(c for c in v if c in red[k]) if k in red else v for k, v in impl.space.items()}
    import itertools

    keys = list(space)
    for vals in itertools.product(*(space[k] for k in keys)):
        cfg = dict(zip(keys, vals))
        if impl.why_not(problem, cfg, "cuda") is None:
            yield cfg


def sweep(out_dir: str, budget_s: float) -> str:
    import torch

    from kernel_space import impls
    from workers.measure import Bench

    bench = Bench("cuda:0")
    t_start = time.monotonic()
    results = []
    plist = problems()
    for n, (op, problem) in enumerate(plist):
        share = (budget_s - (time.monotonic() - t_start)) / (len(plist) - n)
        tun = [i for i in impls(op, backend="cuda") if not i.vendor and not i.unavailable]
        if not tun:
            continue
        impl = tun[0]
        cfgs = list(reduced_configs(impl, problem))
        rows, t0 = [], time.monotonic()
        for cfg in cfgs:
            if time.monotonic() - t0 > share:
                break
            c0 = time.monotonic()
            r = bench.run({"op": op, "problem": problem._asdict(), "impl": impl.name, "params": cfg}, budget_s=0.05)
            rows.append({"params": cfg, "status": r["status"], "median_ms": r.get("median_ms"), "cost_s": time.monotonic() - c0})
        complete = len(rows) == len(cfgs)
        ok = [r for r in rows if r["status"] == "ok"]
        best = min((r["median_ms"] for r in ok), default=None)
        print(f"{op} {tuple(problem)}: {len(rows)}/{len(cfgs)} configs{'' if complete else ' (budget)'}, {len(ok)} ok, "
              f"best {best} ms, {time.monotonic() - t0:.1f} s", flush=True)
        results.append({"op": op, "problem": problem._asdict(), "impl": impl.name, "space_size": len(cfgs),
                        "complete": complete, "configs": rows})
    gpu = torch.cuda.get_device_name(0)
    tag = "h200" if "H200" in gpu else "h100" if "H100" in gpu else "gpu"
    path = os.path.join(out_dir, f"{datetime.date.today()}-{tag}-sweep.json")
    with open(path, "w") as f:
        json.dump({"device": gpu, "torch": torch.__version__, "reduced_spaces": REDUCED, "problems": results}, f, indent=1)
    print(f"wrote {path}")
    return path


def _key(params: dict) -> str:
    return json.dumps(sorted(params.items()))


def replay(path: str, seeds: int, within: float = 0.02) -> dict:
    import optuna

    import kernel_space
    from kernel_space import get_op, problem_distance
    from tuner.driver import _sampler, _suggest

    optuna.logging.set_verbosity(optuna.logging.ERROR)
    import warnings

    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    data = json.load(open(path))
    probs = [p for p in data["problems"] if p["complete"] and any(c["status"] == "ok" for c in p["configs"])]
    best_cfg = {}
    for p in probs:
        ok = [c for c in p["configs"] if c["status"] == "ok"]
        best_cfg[id(p)] = min(ok, key=lambda c: c["median_ms"])["params"]
    summary = []
    for p in probs:
        spec = get_op(p["op"])
        problem = spec.parse_problem(p["problem"])
        import dataclasses

        full = kernel_space.get_impl(p["op"], p["impl"])
        red = data["reduced_spaces"].get(p["op"], {})
        # the search runs over the reduced space the sweep measured, as opsadv-tune runs over the full one
        impl = dataclasses.replace(full, space={k: tuple(c for c in v if c in red[k]) if k in red else v for k, v in full.space.items()})
        table = {_key(c["params"]): c for c in p["configs"]}
        ok_times = [c["median_ms"] for c in p["configs"] if c["status"] == "ok"]
        best = min(ok_times)
        sweep_cost = sum(c["cost_s"] for c in p["configs"])
        # the nearest other problems of the same op, as opsadv-tune's warm start picks them
        near = []
        for q in probs:
            if q is not p and q["op"] == p["op"]:
                d = problem_distance(spec, tuple(problem), tuple(spec.parse_problem(q["problem"])))
                if d is not None:
                    near.append((d, best_cfg[id(q)]))
        seeds_cfg = [cfg for _, cfg in sorted(near, key=lambda x: x[0])][:3]
        row = {"op": p["op"], "problem": p["problem"], "space": len(p["configs"]), "sweep_s": sweep_cost, "best_ms": best}
        for mode in ("tpe_warm", "tpe", "random"):
            evals, walls = [], []
            for seed in range(seeds):
                sampler = _sampler("random" if mode == "random" else "tpe", seed)
                study = optuna.create_study(direction="minimize", sampler=sampler)
                if mode == "tpe_warm":
                    for cfg in seeds_cfg:
                        if _key(cfg) in table:
                            study.enqueue_trial({f"{impl.name}.{k}": v for k, v in cfg.items()})
                seen, n, wall, t_sampler, hit = set(), 0, 0.0, 0.0, None
                for _ in range(20 * len(table)):
                    t0 = time.perf_counter()
                    trial = study.ask()
                    _, params = _suggest(trial, [impl])
                    t_sampler += time.perf_counter() - t0
                    k = _key(params)
                    c = table.get(k)
                    if c is None:  # outside the reduced space or pruned: refused before any compile
                        study.tell(trial, state=optuna.trial.TrialState.PRUNED)
                        continue
                    if k not in seen:
                        seen.add(k)
                        n += 1
                        wall += c["cost_s"]
                    if c["status"] == "ok":
                        study.tell(trial, c["median_ms"])
                        if c["median_ms"] <= best * (1 + within) and hit is None:
                            hit = n
                    else:
                        study.tell(trial, state=optuna.trial.TrialState.PRUNED)
                    if hit is not None or len(seen) == len(table):
                        break
                evals.append(hit if hit is not None else len(table))
                walls.append(wall + t_sampler)
            row[mode] = {"evals_median": statistics.median(evals), "evals": evals, "fraction": statistics.median(evals) / len(table),
                         "wall_s_median": statistics.median(walls)}
        summary.append(row)
    return {"sweep": path, "seeds": seeds, "within": within, "problems": summary,
            "median_fraction": {m: statistics.median(r[m]["fraction"] for r in summary) for m in ("tpe_warm", "tpe", "random")},
            "median_wall_s": {m: statistics.median(r[m]["wall_s_median"] for r in summary) for m in ("tpe_warm", "tpe", "random")}}


def main() -> None:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("sweep")
    s.add_argument("--out", required=True)
    s.add_argument("--budget-s", type=float, default=300)
    r = sub.add_parser("replay")
    r.add_argument("sweep_json")
    r.add_argument("--seeds", type=int, default=5)
    r.add_argument("--out")
    args = ap.parse_args()
    if args.cmd == "sweep":
        os.makedirs(args.out, exist_ok=True)
        sweep(args.out, args.budget_s)
        return
    res = replay(args.sweep_json, args.seeds)
    lines = ["| op | problem | space | sweep s | TPE+warm evals (frac) | TPE evals | random evals | TPE+warm wall s |", "|---|---|---|---|---|---|---|---|"]
    for r_ in res["problems"]:
        prob = " ".join(f"{k}={v}" for k, v in r_["problem"].items())
        lines.append(f"| {r_['op']} | {prob} | {r_['space']} | {r_['sweep_s']:.1f} | {r_['tpe_warm']['evals_median']:g} ({r_['tpe_warm']['fraction']:.0%}) | "
                     f"{r_['tpe']['evals_median']:g} | {r_['random']['evals_median']:g} | {r_['tpe_warm']['wall_s_median']:.1f} |")
    mf, mw = res["median_fraction"], res["median_wall_s"]
    lines.append("")
    lines.append(f"median fraction of the sweep's evaluations to come within 2%: TPE+warm {mf['tpe_warm']:.1%}, TPE {mf['tpe']:.1%}, random {mf['random']:.1%}; "
                 f"median wall s per problem: TPE+warm {mw['tpe_warm']:.1f}, TPE {mw['tpe']:.1f}, random {mw['random']:.1f}")
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out + ".json", "w") as f:
            json.dump(res, f, indent=1)
        with open(args.out + ".md", "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
