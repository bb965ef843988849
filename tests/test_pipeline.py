"""The whole pipeline on the CPU, for real: Ray workers, Optuna, SQLite, export, dispatch."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from sqlalchemy import func, select
from sqlalchemy.orm import Session

import db
from conftest import ROOT, cli, counted, run_cli
from kernel_space import get_op
from tuner import TuneOptions, Tuner

pytestmark = pytest.mark.ray

SMALL = [
    ("gemm", get_op("gemm").problem(96, 160, 128)),
    ("attention", get_op("attention").problem(1, 2, 64, 96, 32, True)),
]


def _tune(url, problems=SMALL, **kw):
    opts = TuneOptions(device="cpu", problems=problems, db_url=url, log=lambda s: None, **{"trials": 8, **kw})
    return Tuner(opts).run()


def _valid(problems=SMALL) -> dict[str, int]:
    """Valid configurations of each op's tuned (non-vendor) CPU implementations for its problem."""
    import kernel_space

    return {op: sum(i.why_not(p, c, "cpu") is None for i in kernel_space.impls(op, backend="cpu") if not i.vendor
                    for c in i.configs()) for op, p in problems}


def _count(url, model, **where):
    with Session(db.open_db(url)) as s:
        return s.scalar(select(func.count()).select_from(model).filter_by(**where))


def test_tune_stores_every_trial_and_a_winner_then_skips(ray_session, sqlite_url):
    rows = _tune(sqlite_url)
    assert [r["op"] for r in rows] == ["gemm", "attention"]
    for r in rows:
        assert r["vendor_impl"] in ("torch_matmul", "sdpa")
        assert r["median_ms"] > 0 and r["vendor_ms"] > 0
        assert r["speedup"] == pytest.approx(r["vendor_ms"] / r["median_ms"])
        assert r["speedup"] >= 1.0 or r["impl"] == r["vendor_impl"]
    # every measured or pruned configuration and each vendor baseline is recorded with a status
    # (a configuration Optuna proposes twice is answered from the first measurement)
    import optuna

    assert _count(sqlite_url, db.Trial, impl="torch_matmul") == 1 and _count(sqlite_url, db.Trial, impl="sdpa") == 1
    with Session(db.open_db(sqlite_url)) as s:
        studies = set(s.scalars(select(db.Trial.study)))
    assert len(studies) == 2
    valid = _valid()
    for name in studies:
        study = optuna.load_study(study_name=name, storage=sqlite_url)
        # invalid ones are free; a space smaller than the budget is measured whole, once
        assert sum(counted(t) for t in study.trials) == min(8, valid[study.user_attrs["op"]])
        assert _count(sqlite_url, db.Trial, study=name) >= 4
    with Session(db.open_db(sqlite_url)) as s:
        statuses = {t.status for t in s.scalars(select(db.Trial))}
        run = s.scalars(select(db.Run)).one()
    assert statuses <= {"ok", "pruned"} and "ok" in statuses
    assert run.status == "finished"
    before = _count(sqlite_url, db.Trial)
    again = _tune(sqlite_url)
    assert _count(sqlite_url, db.Trial) == before  # already tuned: nothing measured again
    assert [r["impl"] for r in again] == [r["impl"] for r in rows]


def test_interrupted_run_resumes_where_it_stopped(ray_session, sqlite_url):
    _tune(sqlite_url, trials=30, timeout_s=1.0)
    with Session(db.open_db(sqlite_url)) as s:
        first = s.scalars(select(db.Run)).one()
        done_first = s.scalar(select(func.count()).select_from(db.Trial).where(db.Trial.optuna_number.is_not(None)))
    assert first.status == "interrupted"
    rows = _tune(sqlite_url, trials=30)
    assert len(rows) == 2
    import optuna

    valid = _valid()
    for name in {t.study for t in Session(db.open_db(sqlite_url)).scalars(select(db.Trial))}:
        study = optuna.load_study(study_name=name, storage=sqlite_url)
        n_counted = sum(counted(t) for t in study.trials)
        want = min(30, valid[study.user_attrs["op"]])  # a space smaller than the budget is measured whole, once
        assert want <= n_counted <= want + 2  # resumed, not restarted
    assert done_first > 0


def test_cli_shapes_export_and_runtime_in_another_process(tmp_path):
    url = f"sqlite:///{tmp_path / 'db.sqlite'}"
    shapes = tmp_path / "shapes.yaml"
    shapes.write_text("gemm:\n  - {M: 64, N: 256, K: 128}\nattention:\n  - {B: 1, H: 2, Sq: 64, Skv: 64, D: 32}\n")
    r = cli("opsadv-tune", "--device", "cpu", "--ops", "gemm,attention", "--shapes", str(shapes), "--trials", "6", "--db", url)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "speedup" in r.stdout and "gemm" in r.stdout and "attention" in r.stdout
    out = tmp_path / "export"
    r = cli("opsadv-export", "--device", "cpu", "--out", str(out), "--db", url)
    assert r.returncode == 0, r.stderr
    table = json.loads((out / "opsadv-table.json").read_text())
    assert table["device_class"] == "cpu" and len(table["winners"]) == 2
    assert table["fingerprint"]["torch"] and table["kernel_versions"]
    assert "ENV OPS_ADV_TABLE=" in (out / "Dockerfile.opsadv").read_text()
    code = (
        "import torch, ops_adv, json; a = torch.randn(64, 128); b = torch.randn(128, 256); "
        "q = torch.randn(1, 2, 64, 32); "
        "print(json.dumps([ops_adv.explain('gemm', a, b), ops_adv.explain('attention', q, q, q)]))"
    )
    r = run_cli("-c", code, env={"OPS_ADV_TABLE": str(out / "opsadv-table.json")})
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    for d, w in zip(got, table["winners"][::-1] if table["winners"][0]["op"] == "attention" else table["winners"]):
        assert d["source"] == "tuned" and (d["impl"], d["params"]) == (w["impl"], w["params"])
    r = cli("opsadv-report", "--device", "cpu", "--db", url, "--plot", str(tmp_path / "p.png"))
    assert r.returncode == 0 and (tmp_path / "p.png").stat().st_size > 1000, r.stderr


def test_sigint_mid_run_keeps_trials_and_resumes(tmp_path):
    url = f"sqlite:///{tmp_path / 'db.sqlite'}"
    shapes = tmp_path / "s.json"
    shapes.write_text(json.dumps({"gemm": [{"M": 64, "N": 64, "K": 64}, {"M": 128, "N": 64, "K": 64}]}))
    # trials of ~0.5 s each (30 configurations per problem), so the run is surely still going when interrupted
    args = ["--device", "cpu", "--ops", "gemm", "--shapes", str(shapes), "--trials", "40", "--db", url,
            "--plugin", "plugins.slow", "--impls", "slow_matmul"]
    code = "import sys; from tuner.cli import tune_main as m; sys.exit(m(sys.argv[1:]))"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
    inherited = signal.getsignal(signal.SIGINT)
    # Ctrl-C as a user's shell delivers it: an earlier test's tooling may leave SIGINT ignored, which a child inherits
    p = subprocess.Popen([sys.executable, "-c", code, *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.time() + 240
    polled = []
    while time.time() < deadline:
        time.sleep(1)
        try:
            polled.append(_count(url, db.Trial))
            if polled[-1] >= 10:
                break
        except Exception as exc:
            polled.append(repr(exc)[:80])
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=120)
    assert p.returncode == 130, (inherited, len(polled), polled[-5:], err[-3000:])
    assert "re-run the same command to resume" in err
    kept = _count(url, db.Trial)
    assert kept >= 10
    r = cli("opsadv-tune", *args)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "resume" in r.stderr
    assert _count(url, db.Trial) > kept and _count(url, db.Winner) == 2


@pytest.mark.parametrize(
    "args,msg",
    [
        (["--device", "cpu", "--ops", "gemv"], "unknown op 'gemv'"),
        (["--device", "tpu9", "--ops", "gemm"], "unknown device 'tpu9'"),
        (["--device", "h200", "--ops", "gemm"], "needs an NVIDIA GPU"),
        (["--device", "cpu", "--ops", "gemm", "--sampler", "bayes"], "unknown sampler"),
        (["--device", "cpu", "--ops", "gemm", "--db", "postgresql://u:pw@127.0.0.1:1/x"], "cannot reach database"),
        (["--device", "cpu", "--ops", "gemm", "--db", "mysql://x/y"], "unsupported database URL"),
    ],
)
def test_bad_input_is_one_line_exit_2(args, msg, tmp_path):
    if "--db" not in args:
        args = [*args, "--db", f"sqlite:///{tmp_path / 'x.db'}"]
    r = cli("opsadv-tune", *args)
    assert r.returncode == 2, r.stderr[-2000:]
    lines = [line for line in r.stderr.strip().splitlines() if "WARNING" not in line]
    assert len(lines) == 1 and msg in lines[0], r.stderr
    assert "Traceback" not in r.stderr and "pw@" not in r.stderr


@pytest.mark.parametrize(
    "content,suffix,msg",
    [
        ("gemm: [{M: 4, N: 4}]", ".yaml", "missing K"),
        ("gemm: [{M: 4, N: 4, K: 4", ".yaml", "not valid YAML"),
        ('{"gemm": [{"M": 4, "N": 4, "K": 4}], "conv9": []}', ".json", "unknown op 'conv9'"),
        ('{"gemm": {"M": 4}}', ".json", "must map to a list"),
        ("[1, 2]", ".json", "needs an 'op' field"),
    ],
)
def test_malformed_shapes_file(content, suffix, msg, tmp_path):
    f = tmp_path / f"shapes{suffix}"
    f.write_text(content)
    url = f"sqlite:///{tmp_path / 'x.db'}"
    r = cli("opsadv-tune", "--device", "cpu", "--ops", "gemm", "--shapes", str(f), "--db", url)
    assert r.returncode == 2 and msg in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not (tmp_path / "x.db").exists()  # nothing written


def test_asking_ahead_for_compilation_changes_no_result_shape(ray_session, sqlite_url):
    # on the CPU nothing compiles, but the driver still asks one trial ahead per worker and sends it to prefetch
    rows = _tune(sqlite_url, compile_workers=1)
    assert len(rows) == 2
    import optuna

    with Session(db.open_db(sqlite_url)) as s:
        studies = set(s.scalars(select(db.Trial.study)))
    valid = _valid()
    for name in studies:
        study = optuna.load_study(study_name=name, storage=sqlite_url)
        assert sum(counted(t) for t in study.trials) == min(8, valid[study.user_attrs["op"]])
        assert all(t.state.is_finished() for t in study.trials)


def test_repeated_proposals_are_answered_and_the_search_moves_next_to_them(ray_session, sqlite_url):
    # all but 4 of the valid configurations of a small space: TPE proposes measured ones again,
    # which are answered from the first measurement and do not count
    import kernel_space

    problem = get_op("gemm").problem(128, 128, 128)
    impl = kernel_space.get_impl("gemm", "cpu_blocked")
    n = sum(impl.why_not(problem, c, "cpu") is None for c in impl.configs()) - 4
    rows = _tune(sqlite_url, problems=[("gemm", problem)], trials=n, only_impls=["cpu_blocked"])
    assert len(rows) == 1
    with Session(db.open_db(sqlite_url)) as s:
        measured = [t for t in s.scalars(select(db.Trial).where(db.Trial.impl == "cpu_blocked", db.Trial.status != "pruned"))]
        study_name = measured[0].study
    keys = [json.dumps(sorted(t.params.items())) for t in measured]
    assert len(keys) == n and len(set(keys)) == n  # each configuration measured once, the budget spent on new ones
    import optuna

    from tuner.driver import REPEAT

    trials = optuna.load_study(study_name=study_name, storage=sqlite_url).trials
    assert sum(counted(t) for t in trials) == n
    repeats = [t for t in trials if t.user_attrs.get(REPEAT)]
    assert repeats, "expected TPE to propose a measured configuration again in a space this small"
    values = {json.dumps(sorted(t.params.items())): t.value for t in trials if counted(t) and t.value is not None}
    assert all(t.value == values[json.dumps(sorted(t.params.items()))] for t in repeats)  # told the first measurement


def test_unseen_neighbour_differs_in_one_parameter_and_is_valid():
    import random

    import kernel_space
    from tuner.driver import _params_key, narrow, unseen_neighbour

    problem = get_op("gemm").problem(64, 64, 64)
    impl = narrow(kernel_space.get_impl("gemm", "cpu_blocked"), problem, "cpu")
    configs = [c for c in impl.configs() if impl.why_not(problem, c, "cpu") is None]
    start = configs[0]
    seen = {_params_key(impl.name, start)}
    rng = random.Random(0)
    for _ in range(len(configs) - 1):
        nb = unseen_neighbour(impl, start, problem, "cpu", seen, rng)
        if nb is None:
            break
        assert sum(nb[k] != start[k] for k in start) == 1 and impl.why_not(problem, nb, "cpu") is None
        seen.add(_params_key(impl.name, nb))
    everything = {_params_key(impl.name, c) for c in configs}
    assert unseen_neighbour(impl, start, problem, "cpu", everything, rng) is None
