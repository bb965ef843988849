#!/usr/bin/env python
"""Tuning throughput against the number of measuring workers (one per GPU) on one host, through Ray.

Runs the same `opsadv-tune` command -- same problem set, trials, sampler and seed -- once per worker
count (`--workers N`), each into a fresh database and in a fresh process (its own local Ray instance),
and reports for each count:

  wall          seconds for the whole command (Ray and worker start-up included)
  tuning        seconds from the workers being up to the last winner stored (Tuner.stats["wall_s"])
  measured      trials a worker measured (stored rows other than `pruned`, vendor baselines included)
  trials/min    measured / tuning minutes
  busy          the workers' (GPUs') busy fraction: Σ per-worker busy seconds / (N × tuning seconds)
  efficiency    trials/min at N / (N/N0 × trials/min at N0), N0 the smallest count run (1 normally)
  winners       problems whose winner (implementation and parameters) equals the N0 run's

and writes DIR/<date>-<device>-scaling.json (everything, per-worker numbers included) and .md (the table).

    python benchmarks/scaling.py --device h100 --out DIR [--counts 1,2,4,8] [--ops gemm,attention] [--trials 24]
    python benchmarks/scaling.py --device cpu --counts 1,2 --trials 8 --out /tmp/scaling      # smoke test

Counts above the GPUs present (or the CPU cores, on --device cpu) are skipped with a note.  Anything
after `--` goes to opsadv-tune unchanged (e.g. `-- --impls triton_gemm --measure-budget 0.1`).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def run_one(json_out: str, tune_argv: list[str]) -> int:
    """Child process: the opsadv-tune command line in this process, keeping the Tuner's stats."""
    import tuner.driver as driver
    from tuner.cli import tune_main

    seen: dict = {}
    run = driver.Tuner.run

    def run_and_keep_stats(self):
        try:
            return run(self)
        finally:
            seen["stats"] = self.stats
            seen["run_id"] = getattr(self, "run_id", None)

    driver.Tuner.run = run_and_keep_stats
    t = time.monotonic()
    rc = tune_main(tune_argv)
    Path(json_out).write_text(json.dumps({"rc": rc, "wall_s": time.monotonic() - t, **seen}))
    return rc


def _from_db(url: str, run_id: int | None) -> dict:
    from sqlalchemy import select
    from sqlalchemy.orm import Session

    from db import Problem, Run, Trial, Winner, open_db

    with Session(open_db(url)) as s:
        where = [Trial.run_id == run_id] if run_id is not None else []
        statuses = [t for t in s.scalars(select(Trial.status).where(*where))]
        run = s.get(Run, run_id) if run_id is not None else None
        winners = {
            f"{p.op} {p.key}": {"impl": w.impl, "params": w.params, "median_ms": w.median_ms, "speedup": w.speedup, "trials": w.trials}
            for w, p in s.execute(select(Winner, Problem).join(Problem, Winner.problem_id == Problem.id)).all()
        }
    by_status: dict[str, int] = {}
    for st in statuses:
        by_status[st] = by_status.get(st, 0) + 1
    return {"run_status": run.status if run else None, "statuses": by_status,
            "measured": sum(n for st, n in by_status.items() if st != "pruned"), "winners": winners}


def _machine(device: str) -> dict:
    info = {"python": platform.python_version(), "cpus": os.cpu_count(), "host": platform.node()}
    try:
        import ray
        import torch

        info.update(torch=torch.__version__, ray=ray.__version__)
        if device != "cpu" and torch.cuda.is_available():
            info.update(gpus=torch.cuda.device_count(), gpu=torch.cuda.get_device_name(0))
    except Exception as e:  # pragma: no cover
        info["error"] = str(e)
    return info


def _available(device: str, ray_address: str | None, machine: dict) -> int | None:
    if ray_address:
        return None  # the cluster decides
    return machine.get("cpus") if device == "cpu" else machine.get("gpus", 0)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["_one"]:
        return run_one(argv[1], argv[2:])
    extra: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1:]
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", required=True, help="cpu, h100, h200, ...")
    ap.add_argument("--out", required=True, help="folder for the JSON and markdown results")
    ap.add_argument("--counts", help="worker counts, comma-separated (default 1,2,4,8 on GPUs, 1,2 on cpu)")
    ap.add_argument("--ops", default="gemm,attention")
    ap.add_argument("--shapes", help="shapes file (default: the built-in problem set of the device)")
    ap.add_argument("--trials", type=int, default=24)
    ap.add_argument("--sampler", default="tpe")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ray-address", help="a cluster to run on instead of a local Ray instance per count")
    ap.add_argument("--run-timeout", type=float, default=3600, help="seconds one count may take before it is killed")
    ap.add_argument("--keep-db", action="store_true", help="keep each count's database (its path is in the JSON)")
    args = ap.parse_args(argv)

    machine = _machine(args.device)
    counts = [int(c) for c in (args.counts or ("1,2" if args.device == "cpu" else "1,2,4,8")).split(",") if c.strip()]
    have = _available(args.device, args.ray_address, machine)
    skipped = [c for c in counts if have is not None and c > have]
    counts = sorted(c for c in counts if c not in skipped)
    for c in skipped:
        print(f"skip {c} workers: this machine has {have} {'CPU cores' if args.device == 'cpu' else 'GPUs'}", file=sys.stderr)
    if not counts:
        print("no worker count to run", file=sys.stderr)
        return 2

    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"{datetime.date.today().isoformat()}-{args.device}-scaling"
    work = Path(tempfile.mkdtemp(prefix="opsadv-scaling-"))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    runs = []
    for n in counts:
        url = f"sqlite:///{work / f'n{n}.db'}"
        tune = ["--device", args.device, "--ops", args.ops, "--trials", str(args.trials), "--sampler", args.sampler,
                "--seed", str(args.seed), "--workers", str(n), "--db", url]
        tune += ["--shapes", args.shapes] if args.shapes else []
        tune += ["--ray-address", args.ray_address] if args.ray_address else []
        tune += extra
        res_file, log_file = work / f"n{n}.json", out_dir / f"{stem}-n{n}.log"
        print(f"== {n} worker(s): opsadv-tune {shlex.join(tune)}", file=sys.stderr, flush=True)
        t = time.monotonic()
        with open(log_file, "w") as log:
            try:
                rc = subprocess.run([sys.executable, __file__, "_one", str(res_file), *tune], env=env, stdout=log,
                                    stderr=subprocess.STDOUT, timeout=args.run_timeout).returncode
            except subprocess.TimeoutExpired:
                rc = 124
        child = json.loads(res_file.read_text()) if res_file.exists() else {"rc": rc, "wall_s": time.monotonic() - t}
        r = {"workers": n, "rc": rc, "wall_s": round(child["wall_s"], 2), "log": log_file.name}
        r.update({"db": url} if args.keep_db else {})
        stats = child.get("stats") or {}
        if stats:
            r["tuning_s"] = stats["wall_s"]
            r["per_worker"] = stats["workers"]
        try:
            r.update(_from_db(url, child.get("run_id")))
        except Exception as e:
            r["db_error"] = str(e).splitlines()[0]
        if r.get("tuning_s") and r.get("measured") is not None:
            r["trials_per_min"] = round(r["measured"] / (r["tuning_s"] / 60), 2)
            busy = sum(w["busy_s"] for w in r["per_worker"])
            r["busy_fraction"] = round(busy / (n * r["tuning_s"]), 3)
        runs.append(r)
        print(f"   rc={rc} wall {r['wall_s']:.1f} s, {r.get('measured', '?')} measured, "
              f"{r.get('trials_per_min', '?')} trials/min, busy {r.get('busy_fraction', '?')}", file=sys.stderr, flush=True)

    ok = [r for r in runs if r["rc"] == 0 and r.get("trials_per_min")]
    ref = ok[0] if ok else None
    for r in runs:
        if ref and r in ok:
            r["efficiency"] = round(r["trials_per_min"] / (r["workers"] / ref["workers"] * ref["trials_per_min"]), 3)
            same = [k for k, w in ref["winners"].items() if k in r["winners"]
                    and (r["winners"][k]["impl"], r["winners"][k]["params"]) == (w["impl"], w["params"])]
            same_impl = [k for k, w in ref["winners"].items() if k in r["winners"] and r["winners"][k]["impl"] == w["impl"]]
            r["winners_same"], r["winners_same_impl"], r["problems"] = len(same), len(same_impl), len(ref["winners"])
    problems = sorted({k for r in ok for k in r["winners"]})
    agree = {k: len({json.dumps([r["winners"].get(k, {}).get("impl"), r["winners"].get(k, {}).get("params")], sort_keys=True) for r in ok}) == 1
             for k in problems}
    result = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"), "device": args.device, "machine": machine,
        "ops": args.ops, "shapes": args.shapes, "trials": args.trials, "sampler": args.sampler, "seed": args.seed,
        "tune_args": extra, "counts": counts, "skipped": skipped, "runs": runs, "winners_agree": agree,
        "all_winners_agree": bool(problems) and all(agree.values()),
    }
    (out_dir / f"{stem}.json").write_text(json.dumps(result, indent=1, default=str))
    if not args.keep_db:
        shutil.rmtree(work, ignore_errors=True)
    md = _markdown(result, ref)
    (out_dir / f"{stem}.md").write_text(md)
    print(md)
    return 0 if runs and all(r["rc"] == 0 for r in runs) else 1


def _markdown(res: dict, ref: dict | None) -> str:
    m = res["machine"]
    where = f"{m.get('gpus')}× {m.get('gpu')}" if m.get("gpu") else f"{m.get('cpus')}-core CPU"
    lines = [
        f"# Tuning throughput against measuring workers: {res['device']}",
        "",
        f"{res['date']} on {where} ({m.get('host')}), torch {m.get('torch')}, Ray {m.get('ray')}, Python {m.get('python')}.",
        f"Problem set: --ops {res['ops']}" + (f" --shapes {res['shapes']}" if res["shapes"] else " (built-in set)")
        + f", {res['trials']} trials per problem, sampler {res['sampler']}, seed {res['seed']}"
        + (f", extra: `{shlex.join(res['tune_args'])}`" if res["tune_args"] else "") + "; a fresh database and Ray instance per row.",
        "",
        "| workers | wall (s) | tuning (s) | measured trials | trials/min | busy | efficiency | winners as with "
        + (f"{ref['workers']}" if ref else "N0") + " |",
        "|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in res["runs"]:
        if r["rc"] != 0:
            lines.append(f"| {r['workers']} | {r['wall_s']:.1f} | failed (exit {r['rc']}, see {r['log']}) | | | | | |")
            continue
        win = f"{r.get('winners_same', '?')}/{r.get('problems', '?')} (impl {r.get('winners_same_impl', '?')}/{r.get('problems', '?')})"
        lines.append(
            f"| {r['workers']} | {r['wall_s']:.1f} | {r.get('tuning_s', 0):.1f} | {r.get('measured', '?')} | {r.get('trials_per_min', '?')} "
            f"| {r.get('busy_fraction', 0):.0%} | {r.get('efficiency', 0):.2f} | {win} |"
        )
    lines += ["", "Per worker (jobs measured / busy seconds; * = lost with its node):", ""]
    for r in res["runs"]:
        if r.get("per_worker"):
            parts = [f"{w['jobs']}/{w['busy_s']:.0f}s" + ("*" if w.get("lost") else "") for w in r["per_worker"]]
            lines.append(f"- {r['workers']} worker(s): " + ", ".join(parts))
    differ = [k for k, same in res["winners_agree"].items() if not same]
    lines += ["", "Winners agree across all runs: " + ("yes" if res["all_winners_agree"] else f"no, {len(differ)} of {len(res['winners_agree'])} problems differ:")]
    for k in differ:
        per = "; ".join(f"{r['workers']}w {r['winners'].get(k, {}).get('impl')} {r['winners'].get(k, {}).get('params')} "
                        f"({r['winners'].get(k, {}).get('median_ms', float('nan')):.4g} ms)" for r in res["runs"] if r.get("winners"))
        lines.append(f"- {k}: {per}")
    lines += [
        "",
        "trials/min counts measured trials over the tuning time (start-up excluded); busy is the share of that time the",
        "workers had a trial or confirmation in flight; efficiency is trials/min divided by the smallest count's, scaled by",
        "the worker ratio (1.0 = linear). Timings vary run to run: a different winner within the noise is expected.",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
