#!/usr/bin/env python
"""Several `opsadv-tune` processes on one database: wall time for N = 1, 2, 4 tuners finishing the same problem set.

Each count gets a fresh database (SQLite file, or --db a PostgreSQL URL whose ops-adv/Optuna tables are dropped first);
N identical commands start at once, each with its own local Ray instance and one measuring worker. Reported per N: wall
seconds until the last process ends, exit codes, winners (must be one per problem), counted Optuna trials per problem
(must equal the budget) and how many problems each process tuned.

    python benchmarks/fleet.py --counts 1,2,4 --problems 8 --trials 6 [--db postgresql://...] [--out DIR]

On a machine with fewer cores than tuners the processes share them: wall time falls only while cores are free.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def fresh(url: str | None, tmp: Path, n: int) -> str:
    if not url:
        return f"sqlite:///{tmp / f'fleet-{n}.db'}"
    import db
    from sqlalchemy import MetaData

    engine = db.make_engine(url)
    md = MetaData()
    md.reflect(engine)
    md.drop_all(engine)
    engine.dispose()
    return url


def check(url: str, trials: int) -> dict:
    import optuna
    from sqlalchemy import select
    from sqlalchemy.orm import Session

    import db

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    from tuner.driver import REPEAT

    engine = db.open_db(url, migrate=False)
    with Session(engine) as s:
        winners = s.scalars(select(db.Winner)).all()
        per_run: dict[int, set] = {}
        for t in s.scalars(select(db.Trial)):
            per_run.setdefault(t.run_id, set()).add(t.study)
    storage = optuna.storages.RDBStorage(db.normalize(url))
    counts = []
    for st in optuna.get_all_study_summaries(storage):
        ts = optuna.load_study(study_name=st.study_name, storage=storage).get_trials(deepcopy=False)
        counts.append(sum(t.state != optuna.trial.TrialState.PRUNED and not t.user_attrs.get(REPEAT) for t in ts))
    engine.dispose()
    return {"winners": len(winners), "problems_with_winner": len({w.problem_id for w in winners}),
            "counted_trials": sorted(counts), "problems_per_run": sorted(len(v) for v in per_run.values())}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--counts", default="1,2,4")
    ap.add_argument("--problems", type=int, default=8)
    ap.add_argument("--trials", type=int, default=6)
    ap.add_argument("--db", help="PostgreSQL URL (its tables are dropped for each count); default a fresh SQLite file")
    ap.add_argument("--out", help="write fleet.json here")
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="opsadv-fleet-"))
    shapes = tmp / "shapes.json"
    shapes.write_text(json.dumps({"gemm": [{"M": 64 + 16 * i, "N": 128, "K": 96, "dtype": "fp32"} for i in range(a.problems)]}))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    code = "import sys; from tuner.cli import tune_main as m; sys.exit(m(sys.argv[1:]))"
    results = []
    for n in [int(c) for c in a.counts.split(",")]:
        url = fresh(a.db, tmp, n)
        cmd = [sys.executable, "-c", code, "--device", "cpu", "--ops", "gemm", "--shapes", str(shapes), "--trials",
               str(a.trials), "--db", url, "--progress", "plain"]
        t0 = time.monotonic()
        procs = [subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env) for _ in range(n)]
        errs = [p.communicate()[1] for p in procs]
        wall = time.monotonic() - t0
        row = {"tuners": n, "wall_s": round(wall, 1), "exit": [p.returncode for p in procs],
               "tracebacks": sum("Traceback" in e for e in errs), **check(url, a.trials)}
        results.append(row)
        print(json.dumps(row), flush=True)
    if a.out:
        Path(a.out).mkdir(parents=True, exist_ok=True)
        (Path(a.out) / "fleet.json").write_text(json.dumps({"cpus": os.cpu_count(), "results": results}, indent=1))
    return 0 if all(r["exit"] == [0] * r["tuners"] and r["problems_with_winner"] == a.problems for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
