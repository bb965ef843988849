"""How fast does the tuner's search find the best configuration, against an exhaustive sweep?

Two phases:
  sweep   (on the GPU)  measure every valid configuration of the space opsadv-tune searches
                        for each problem (the op's full space, narrowed as the tuner narrows it),
                        recording its median time, the seconds its compilation took (cold) and
                        the seconds its check and timing took.  Compilation runs ahead in
                        compile-only processes on the spare cores (workers/compile_ahead.py), so
                        a sweep of thousands of configurations fits in minutes; each op is
                        swept in a child process, and a configuration that kills it is
                        recorded as crashed and the sweep goes on without it;
  replay  (anywhere)    run the tuner's own Optuna search (TPE with constant liar, warm-started
                        from the nearest other problems' best configurations as opsadv-tune
                        does; TPE cold; random) over the measured sweep, several seeds each, and
                        count evaluations until one is within 2% of the exhaustive best.
Replaying over measured results (as Kernel Tuner's simulation mode does) lets every seed of
every sampler see the same numbers, so samplers are compared on the search alone.

  python benchmarks/search_efficiency.py sweep --out DIR [--budget-s 500] [--ops gemm,attention,rms_norm]
  python benchmarks/search_efficiency.py replay SWEEP.json[.gz] ... [--seeds 5] [--out PREFIX]
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

SWEEP_OPS = ("gemm", "attention", "rms_norm")


def problems(op: str, device: str = "cuda") -> list:
    from kernel_space import get_op, ops

    if op not in ops():
        return []
    p = get_op(op).problem
    if device == "cpu":  # a smoke set for the CPU implementations
        sizes = {"gemm": [(256, 256, 256, "fp32"), (512, 256, 256, "fp32")],
                 "attention": [(1, 2, 128, 128, 64, False, "fp32"), (1, 2, 256, 256, 64, False, "fp32")]}
    else:
        sizes = {
            "gemm": [(4096, 4096, 4096, "bf16"), (2048, 4096, 4096, "bf16"), (32, 4096, 4096, "bf16"), (16, 4096, 4096, "bf16")],
            "attention": [(4, 32, 2048, 2048, 128, False, "bf16"), (4, 32, 2048, 2048, 128, True, "bf16"), (2, 32, 4096, 4096, 128, True, "bf16")],
            "rms_norm": [(4096, 4096, "bf16"), (2048, 8192, "bf16"), (1024, 16384, "bf16")],
        }
    return [p(*s) for s in sizes.get(op, [])]


def tunable(op: str, backend: str):
    from kernel_space import impls

    tun = [i for i in impls(op, backend=backend) if not i.vendor and not i.unavailable and i.space]
    return tun[0] if tun else None


def valid_configs(impl, problem, backend: str) -> list[dict]:
    return [c for c in impl.configs() if impl.why_not(problem, c, backend) is None]


def _sweep_op(op: str, jsonl: str, device: str, deadline: float, compile_workers: int) -> None:
    """Child process: measure every valid configuration of `op`'s problems not yet in `jsonl`."""
    from kernel_space import backend_of
    from workers.measure import Bench

    backend = backend_of(device)
    impl = tunable(op, backend)
    done = set()
    if os.path.exists(jsonl):
        for line in open(jsonl):
            r = json.loads(line)
            if "status" in r:
                done.add(_key2(r["problem"], r["params"]))
    todo = [(p, c) for p in problems(op, backend) for c in valid_configs(impl, p, backend) if _key2(p._asdict(), c) not in done]
    futures = []
    pool = None
    if backend == "cuda" and compile_workers > 0:
        from workers.compile_ahead import CompileAhead, _compile

        pool = CompileAhead(device, compile_workers, sys.path, [])
        futures = [pool.pool.submit(_compile, {"op": op, "problem": p._asdict(), "impl": impl.name, "params": c}) for p, c in todo]
    bench = Bench(device)
    with open(jsonl, "a") as f:
        for n, (p, cfg) in enumerate(todo):
            if time.time() > deadline:
                break
            compile_s = 0.0
            if futures:
                try:
                    compile_s = futures[n].result(timeout=max(1.0, deadline - time.time()))
                except Exception:
                    break
            row = {"problem": p._asdict(), "params": cfg}
            f.write(json.dumps({**row, "begin": True}) + "\n")
            f.flush()
            c0 = time.monotonic()
            r = bench.run({"op": op, "problem": p._asdict(), "impl": impl.name, "params": cfg}, budget_s=0.03, reps=15)
            f.write(json.dumps({**row, "status": r["status"], "median_ms": r.get("median_ms"), "compile_s": compile_s,
                                "measure_s": time.monotonic() - c0, "error": r.get("error")}) + "\n")
            f.flush()
            if r.get("context_lost"):
                os._exit(3)  # the process's CUDA context is gone: the parent starts a fresh one
    if pool:
        pool.shutdown()
    os._exit(0)


def _key2(problem: dict, params: dict) -> str:
    return json.dumps([sorted(problem.items()), sorted(params.items())], default=str)


def sweep(out_dir: str, budget_s: float, ops: list[str], device: str, compile_workers: int) -> str:
    import torch

    from kernel_space import backend_of

    backend = backend_of(device)
    t_start = time.time()
    results = []
    for n, op in enumerate(ops):
        impl = tunable(op, backend)
        if impl is None:
            continue
        jsonl = os.path.join(out_dir, f"sweep-{op}.jsonl")
        deadline = t_start + budget_s * (n + 1) / len(ops)  # an op that finishes early leaves its time to the next
        for attempt in range(10):  # a configuration that kills the process is recorded, and the sweep resumes after it
            if time.time() > deadline - 5:
                break
            cmd = [sys.executable, __file__, "_sweep_op", op, jsonl, device, str(deadline), str(compile_workers)]
            child = subprocess.Popen(cmd, start_new_session=True)
            try:
                rc = child.wait(timeout=deadline - time.time() + 60)
            except subprocess.TimeoutExpired:
                rc = "timeout"
            try:  # its compile processes too, which would otherwise keep our stdout open
                os.killpg(child.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            child.wait()
            rows = [json.loads(line) for line in open(jsonl)] if os.path.exists(jsonl) else []
            if rows and "begin" in rows[-1]:
                with open(jsonl, "a") as f:
                    f.write(json.dumps({**rows[-1], "begin": None, "status": "crashed", "median_ms": None, "compile_s": 0.0,
                                        "measure_s": 0.0, "error": f"sweep process ended: {rc}"}) + "\n")
                print(f"{op}: process ended ({rc}) on {rows[-1]['params']}; resuming after it", flush=True)
                continue
            break
        rows = [json.loads(line) for line in open(jsonl) if '"status"' in line] if os.path.exists(jsonl) else []
        cold: dict[str, float] = {}  # a configuration's compile cost is the largest seen for it (the cold one)
        for r in rows:
            k = json.dumps(sorted(r["params"].items()))
            cold[k] = max(cold.get(k, 0.0), r["compile_s"])
        for p in problems(op, backend):
            cfgs = valid_configs(impl, p, backend)
            mine = {json.dumps(sorted(r["params"].items())): r for r in rows if r["problem"] == p._asdict()}
            configs = [{"params": r["params"], "status": r["status"], "median_ms": r["median_ms"], "error": r["error"],
                        "compile_s": cold[k], "measure_s": r["measure_s"], "cost_s": cold[k] + r["measure_s"]} for k, r in mine.items()]
            ok = [c["median_ms"] for c in configs if c["status"] == "ok"]
            complete = len(configs) == len(cfgs)
            print(f"{op} {tuple(p)}: {len(configs)}/{len(cfgs)} configs{'' if complete else ' (budget)'}, {len(ok)} ok, "
                  f"best {min(ok, default=None)} ms, compile {sum(c['compile_s'] for c in configs):.0f} s (cold, serial), "
                  f"measure {sum(c['measure_s'] for c in configs):.0f} s", flush=True)
            results.append({"op": op, "problem": p._asdict(), "impl": impl.name, "space_size": len(cfgs), "complete": complete,
                            "configs": configs})
    name = torch.cuda.get_device_name(0) if backend == "cuda" else "cpu"
    tag = "h200" if "H200" in name else "h100" if "H100" in name else "gpu" if backend == "cuda" else "cpu"
    path = os.path.join(out_dir, f"{datetime.date.today()}-{tag}-sweep.json")
    with open(path, "w") as f:
        json.dump({"device": name, "torch": torch.__version__, "wall_s": time.time() - t_start, "problems": results}, f, indent=1)
    print(f"wrote {path} after {time.time() - t_start:.0f} s")
    return path


def _key(params: dict) -> str:
    return json.dumps(sorted(params.items()))


def _load(paths: list[str]) -> dict:
    """One or more sweep files (.json or .json.gz) of the same device, as one."""
    import gzip

    data = None
    for path in paths:
        d = json.load(gzip.open(path, "rt") if path.endswith(".gz") else open(path))
        if data is None:
            data = d
        elif d["device"] != data["device"]:
            raise SystemExit(f"{path} was measured on {d['device']}, not {data['device']}: replay one device at a time")
        else:
            data["problems"] += d["problems"]
    return data


def replay(paths: list[str], seeds: int, within: float = 0.02, startup: int | None = None, give_up: float = 0.25) -> dict:
    import dataclasses
    import warnings

    import optuna

    import kernel_space
    from kernel_space import get_op, problem_distance
    from tuner.driver import REPEAT, _params_key, _sampler, _suggest, narrow, unseen_neighbour

    optuna.logging.set_verbosity(optuna.logging.ERROR)
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    data = _load(paths)
    backend = "cpu" if data["device"] == "cpu" else "cuda"
    probs = [p for p in data["problems"] if p["complete"] and any(c["status"] == "ok" for c in p["configs"])]
    best_cfg = {id(p): min((c for c in p["configs"] if c["status"] == "ok"), key=lambda c: c["median_ms"])["params"] for p in probs}

    def sampler(kind: str, seed: int):
        if kind == "tpe" and startup is not None:  # sensitivity runs only; opsadv-tune uses _sampler
            return optuna.samplers.TPESampler(seed=seed, constant_liar=True, n_startup_trials=startup, multivariate=True, group=True)
        return _sampler(kind, seed)

    summary = []
    for p in probs:
        spec = get_op(p["op"])
        problem = spec.parse_problem(p["problem"])
        impl = narrow(kernel_space.get_impl(p["op"], p["impl"]), problem, backend)  # the space opsadv-tune asks in
        red = data.get("reduced_spaces", {}).get(p["op"])
        if red:  # sweeps of 2026-12-02 measured sub-grids only
            impl = dataclasses.replace(impl, space={k: tuple(c for c in v if c in red.get(k, v)) for k, v in impl.space.items()})
        table = {_key(c["params"]): c for c in p["configs"]}
        best = min(c["median_ms"] for c in p["configs"] if c["status"] == "ok")
        near = []  # the nearest other problems of the same op, as opsadv-tune's warm start picks them
        for q in probs:
            if q is not p and q["op"] == p["op"]:
                d = problem_distance(spec, tuple(problem), tuple(spec.parse_problem(q["problem"])))
                if d is not None:
                    near.append((d, best_cfg[id(q)]))
        seeds_cfg = [cfg for _, cfg in sorted(near, key=lambda x: x[0])][:3]
        row = {"op": p["op"], "problem": p["problem"], "space": len(table), "sweep_s": sum(c["cost_s"] for c in p["configs"]),
               "best_ms": best, "within_2pct": sum(1 for c in p["configs"] if c["status"] == "ok" and c["median_ms"] <= best * (1 + within))}
        for mode in ("tpe_warm", "tpe", "random"):
            evals, walls = [], []
            for seed in range(seeds):
                study = optuna.create_study(direction="minimize", sampler=sampler("random" if mode == "random" else "tpe", seed))
                if mode == "tpe_warm":
                    for cfg in seeds_cfg:
                        if _key(cfg) in table:
                            study.enqueue_trial({f"{impl.name}.{k}": v for k, v in cfg.items()})
                # as opsadv-tune does: a configuration proposed again is answered from its first
                # measurement and not counted; the next trial is an unseen neighbour of it
                seen, n, wall, hit, nxt = set(), 0, 0.0, None, None
                rng = random.Random(seed)
                for _ in range(20 * len(table)):
                    t0 = time.perf_counter()
                    if nxt is not None:
                        study.enqueue_trial({f"{impl.name}.{k}": v for k, v in nxt.items()})
                        nxt = None
                    trial = study.ask()
                    _, params = _suggest(trial, [impl])
                    wall += time.perf_counter() - t0
                    c = table.get(_key(params))
                    if c is None:  # not a valid configuration: refused before any compile, as in opsadv-tune
                        study.tell(trial, state=optuna.trial.TrialState.PRUNED)
                        continue
                    pk = _params_key(impl.name, params)
                    if pk in seen:
                        trial.set_user_attr(REPEAT, True)
                        nxt = unseen_neighbour(impl, params, problem, backend, seen, rng)
                    else:
                        seen.add(pk)
                        n += 1
                        wall += c["cost_s"]
                    if c["status"] == "ok":
                        study.tell(trial, c["median_ms"])
                        if hit is None and c["median_ms"] <= best * (1 + within):
                            hit = n
                    else:  # as opsadv-tune tells a failed trial
                        study.tell(trial, state=optuna.trial.TrialState.FAIL)
                    if hit is not None or n >= max(1, int(give_up * len(table))):
                        break
                evals.append(hit if hit is not None else len(table))  # not found: counted as the whole sweep
                walls.append(wall)
            row[mode] = {"evals_median": statistics.median(evals), "evals": evals, "fraction": statistics.median(evals) / len(table),
                         "wall_s_median": statistics.median(walls)}
        print(f"  {p['op']} {tuple(p['problem'].values())}: " + ", ".join(f"{m} {row[m]['evals_median']:g}/{len(table)}" for m in ("tpe_warm", "tpe", "random")),
              file=sys.stderr, flush=True)
        summary.append(row)
    return {"sweep": paths, "seeds": seeds, "within": within, "n_startup_trials": startup, "give_up_fraction": give_up, "problems": summary,
            "median_fraction": {m: statistics.median(r[m]["fraction"] for r in summary) for m in ("tpe_warm", "tpe", "random")},
            "median_wall_s": {m: statistics.median(r[m]["wall_s_median"] for r in summary) for m in ("tpe_warm", "tpe", "random")}}


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "_sweep_op":
        op, jsonl, device, deadline, cw = sys.argv[2:7]
        _sweep_op(op, jsonl, device, float(deadline), int(cw))
        return
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("sweep")
    s.add_argument("--out", required=True)
    s.add_argument("--budget-s", type=float, default=500)
    s.add_argument("--ops", default=",".join(SWEEP_OPS))
    s.add_argument("--device", default="cuda:0")
    s.add_argument("--compile-workers", type=int, default=max(1, (os.cpu_count() or 2) - 2))
    r = sub.add_parser("replay")
    r.add_argument("sweep_json", nargs="+")
    r.add_argument("--seeds", type=int, default=5)
    r.add_argument("--startup", type=int, help="TPE start-up trials (sensitivity; opsadv-tune's own when left out)")
    r.add_argument("--give-up", type=float, default=0.25,
                   help="stop a search after this fraction of the sweep's configurations; not found counts as the whole sweep")
    r.add_argument("--out")
    args = ap.parse_args()
    if args.cmd == "sweep":
        os.makedirs(args.out, exist_ok=True)
        sweep(args.out, args.budget_s, args.ops.split(","), args.device, args.compile_workers)
        return
    res = replay(args.sweep_json, args.seeds, startup=args.startup, give_up=args.give_up)
    lines = ["| op | problem | valid configs | within 2% | sweep s | TPE+warm evals (frac) | TPE evals | random evals | TPE+warm wall s |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r_ in res["problems"]:
        prob = " ".join(f"{k}={v}" for k, v in r_["problem"].items())
        lines.append(f"| {r_['op']} | {prob} | {r_['space']} | {r_['within_2pct']} | {r_['sweep_s']:.0f} | "
                     f"{r_['tpe_warm']['evals_median']:g} ({r_['tpe_warm']['fraction']:.1%}) | "
                     f"{r_['tpe']['evals_median']:g} | {r_['random']['evals_median']:g} | {r_['tpe_warm']['wall_s_median']:.1f} |")
    mf, mw = res["median_fraction"], res["median_wall_s"]
    lines.append("")
    lines.append(f"searches stop after {res['give_up_fraction']:.0%} of a sweep's configurations; one that has not come within 2% by then counts as 100%")
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
