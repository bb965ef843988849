"""First-five-minutes polish: readable studies in optuna-dashboard, dtype spellings, a quiet start, progress display."""
from __future__ import annotations

import io
import json
import os
import re
import select
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from sqlalchemy import select as sql_select
from sqlalchemy.orm import Session

import db
from conftest import ROOT, cli, counted, run_cli
from kernel_space import OpsAdvError, get_op
from kernel_space._common import canonical_dtype
from tuner import TuneOptions, Tuner
from tuner import driver
from tuner import study as study_module
from tuner.progress import Progress, wants_bar

TUNE_CODE = "import sys; from tuner.cli import tune_main as m; sys.exit(m(sys.argv[1:]))"
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
# a line Ray's Python or C++ logging writes: "2026-12-03 14:25:54,941\tWARNING file.py:85 -- ..." or "[2026-... W 123 123] file.cc:"
RAY_LOG_LINE = re.compile(r"^\d{4}-\d\d-\d\d [\d:,]+\s+(WARNING|INFO|DEBUG)\b|^\[\d{4}-\d\d-\d\d [\d:,.]+ [WID] \d+ \d+\]")


# ---- study names -------------------------------------------------------------------------------

def test_study_names_are_readable_unique_and_stable():
    gemm, att = get_op("gemm"), get_op("attention")
    problems = [
        ("gemm", gemm.problem(4096, 4096, 4096, "bf16")),
        ("gemm", gemm.problem(16, 4096, 4096, "bf16", trans_b=True)),
        ("gemm", gemm.problem(4096, 4096, 4096, "fp16")),
        ("attention", att.problem(4, 32, 2048, 2048, 128, True, "bf16")),
        ("attention", att.problem(4, 32, 2048, 2048, 128, False, "bf16")),
    ]
    names = [driver.study_name("h200", op, p, "cuda") for op, p in problems]
    v = driver.kernel_set_version("gemm", "cuda")[:8]
    assert names[0] == f"h200/gemm/M=4096,N=4096,K=4096,bf16@{v}"
    assert names[1] == f"h200/gemm/M=16,N=4096,K=4096,bf16,trans_b@{v}"
    assert re.fullmatch(r"h200/attention/B=4,H=32,Sq=2048,Skv=2048,D=128,causal,bf16@[0-9a-f]{8}", names[3])
    assert len(set(names)) == len(names)
    assert names == [driver.study_name("h200", op, p, "cuda") for op, p in problems]  # stable
    assert driver.study_name("h100", *problems[0], "cuda") != names[0]
    assert driver.legacy_study_name("h200", *problems[0], "cuda").startswith("opsadv:h200:gemm:")


def _tune(url, problems, **kw):
    logs: list[str] = []
    opts = TuneOptions(device="cpu", problems=problems, db_url=url, log=logs.append, **kw)
    return Tuner(opts).run(), logs


@pytest.mark.ray
def test_a_database_tuned_under_the_old_names_resumes_under_them(ray_session, sqlite_url, monkeypatch):
    import optuna

    import kernel_space

    problem = get_op("gemm").problem(96, 160, 128)
    valid = sum(i.why_not(problem, c, "cpu") is None for i in kernel_space.impls("gemm", backend="cpu") if not i.vendor
                for c in i.configs())
    assert valid >= 6
    with monkeypatch.context() as m:  # the driver as it was: studies named opsadv:<device>:<op>:<hash>:<kernels>
        m.setattr(study_module, "study_name", driver.legacy_study_name)
        m.setattr(study_module, "_set_attrs", lambda *a: None)  # nor any user attributes
        m.setattr(driver, "_set_attrs", lambda *a: None)
        _tune(sqlite_url, [("gemm", problem)], trials=3)
    legacy = driver.legacy_study_name("cpu", "gemm", problem, "cpu")
    assert optuna.study.get_all_study_names(sqlite_url) == [legacy]

    rows, logs = _tune(sqlite_url, [("gemm", problem)], trials=6)
    assert any(line.startswith("resume gemm") and "3 trials done" in line for line in logs), logs
    assert optuna.study.get_all_study_names(sqlite_url) == [legacy]  # no second study under the new name
    study = optuna.load_study(study_name=legacy, storage=sqlite_url)
    assert sum(counted(t) for t in study.trials) == 6  # 3 kept, 3 more: resumed, not restarted
    assert study.user_attrs["op"] == "gemm" and study.user_attrs["problem"]["M"] == 96
    with Session(db.open_db(sqlite_url)) as s:
        assert {w.study for w in s.scalars(sql_select(db.Winner))} == {legacy}
        assert {t.study for t in s.scalars(sql_select(db.Trial))} == {legacy}
    again, logs = _tune(sqlite_url, [("gemm", problem)], trials=6)
    assert any(line.startswith("skip gemm") for line in logs), logs
    assert again == rows


# ---- a tune from the command line: dtype spellings, a quiet start, plain progress, the dashboard -------

@pytest.fixture(scope="module")
def cli_tune(tmp_path_factory):
    """One real CPU tune through opsadv-tune, its shapes written with torch's dtype names; stderr is a pipe."""
    d = tmp_path_factory.mktemp("cli_tune")
    url = f"sqlite:///{d / 'tuning.db'}"
    shapes = d / "shapes.yaml"
    shapes.write_text(
        "gemm:\n  - {M: 64, N: 96, K: 64, dtype: float32}\n"
        "attention:\n  - {B: 1, H: 2, Sq: 64, Skv: 64, D: 32, causal: true, dtype: torch.float32}\n"
    )
    r = cli("opsadv-tune", "--device", "cpu", "--ops", "gemm,attention", "--shapes", str(shapes), "--trials", "5", "--db", url)
    assert r.returncode == 0, r.stderr[-3000:]
    return url, r


@pytest.mark.ray
def test_start_is_quiet_no_ray_warnings_and_plain_progress_off_a_terminal(cli_tune):
    _, r = cli_tune
    lines = r.stderr.splitlines()
    assert lines and lines[0].startswith("tuning 2 problem(s) of gemm, attention on cpu"), r.stderr
    assert not [line for line in lines if RAY_LOG_LINE.search(line) or "WARNING" in line], r.stderr
    assert "authentication_token_setup" not in r.stderr and "Token authentication" not in r.stderr
    # not a terminal: plain lines, no bar redrawn with carriage returns
    assert "\r" not in r.stderr and "%|" not in r.stderr and "\x1b[" not in r.stderr
    assert sum(line.startswith("  done ") for line in lines) == 2


@pytest.mark.ray
def test_dtype_spellings_are_stored_as_codes(cli_tune):
    url, r = cli_tune
    with Session(db.open_db(url)) as s:
        keys = [json.loads(p.key) for p in s.scalars(sql_select(db.Problem))]
    assert sorted(k["dtype"] for k in keys) == ["fp32", "fp32"]
    assert "dtype=fp32" in r.stdout


@pytest.mark.ray
def test_ray_errors_stay_visible_while_its_warnings_are_not():
    code = (
        "import logging, ray; from tuner._pool import start_ray; start_ray(None, num_cpus=1); "
        "log = logging.getLogger('ray._private.worker'); log.warning('ray-warning-xyz'); log.error('ray-error-xyz'); "
        "ray.shutdown()"
    )
    r = run_cli("-c", code, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "ray-error-xyz" in r.stderr
    assert "ray-warning-xyz" not in r.stderr and "Token authentication" not in r.stderr, r.stderr


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get_json(url: str, timeout: float = 10.0):
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        assert resp.status == 200
        return json.loads(resp.read())


@pytest.mark.ray
def test_optuna_dashboard_shows_readable_studies_and_trial_attributes(cli_tune, tmp_path):
    url, _ = cli_tune
    exe = Path(sys.executable).with_name("optuna-dashboard")
    assert exe.exists(), "optuna-dashboard is in the dev extra: make test installs it"
    port = _free_port()
    log = open(tmp_path / "dashboard.log", "w+")
    server = subprocess.Popen([str(exe), url, "--host", "127.0.0.1", "--port", str(port)], stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        listing = None
        while listing is None:
            if server.poll() is not None or time.monotonic() > deadline:
                log.seek(0)
                pytest.fail(f"optuna-dashboard did not answer on {base} (exit {server.poll()}): {log.read()[-2000:]}")
            try:
                listing = _get_json(f"{base}/api/studies", timeout=5)
            except OSError:
                time.sleep(0.5)
        studies = {s["study_name"]: s for s in listing["study_summaries"]}
        assert len(studies) == 2, studies.keys()
        gemm = next(n for n in studies if n.startswith("cpu/gemm/"))
        assert re.fullmatch(r"cpu/gemm/M=64,N=96,K=64,fp32@[0-9a-f]{8}", gemm)
        assert any(re.fullmatch(r"cpu/attention/B=1,H=2,Sq=64,Skv=64,D=32,causal,fp32@[0-9a-f]{8}", n) for n in studies)
        attrs = {a["key"]: a["value"] for a in studies[gemm]["user_attrs"]}
        assert attrs["op"] == "gemm" and attrs["device_class"] == "cpu"
        assert json.loads(attrs["problem"]) == {"M": 64, "N": 96, "K": 64, "dtype": "fp32", "trans_a": False, "trans_b": False}
        assert "torch" in attrs["fingerprint"] and "cpu_blocked" in json.loads(attrs["kernel_versions"])

        detail = _get_json(f"{base}/api/studies/{studies[gemm]['study_id']}")
        trials = detail["trials"]
        assert trials and all(t["params"] for t in trials)
        tattrs = [{a["key"]: a["value"] for a in t["user_attrs"]} for t in trials]
        assert all(a.get("impl") == "cpu_blocked" and a.get("status") for a in tattrs)
        ok = [a for a in tattrs if a["status"] == "ok" and "opsadv_repeat" not in a]
        assert ok and all(float(a["rel_error"]) >= 0 and float(a["spread_ms"]) >= 0 for a in ok)
    finally:
        server.terminate()
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(timeout=10)
        log.close()


# ---- dtype spellings ---------------------------------------------------------------------------

ACCEPTED = {
    "fp16": ["fp16", "float16", "half", "FP16", "Float16", "torch.float16", "torch.half", "f16", " float16 "],
    "bf16": ["bf16", "bfloat16", "BF16", "BFloat16", "torch.bfloat16", "TORCH.BFLOAT16"],
    "fp32": ["fp32", "float32", "float", "FP32", "Float", "torch.float32", "torch.float", "f32"],
}


@pytest.mark.parametrize("code,spelling", [(c, s) for c, names in ACCEPTED.items() for s in names])
def test_accepted_dtype_spellings_normalise(code, spelling):
    assert canonical_dtype(spelling) == code
    assert get_op("gemm").parse_problem({"M": 8, "N": 8, "K": 8, "dtype": spelling}).dtype == code
    att = get_op("attention").parse_problem({"B": 1, "H": 1, "Sq": 8, "Skv": 8, "D": 8, "dtype": spelling})
    assert att.dtype == code


def test_torch_dtypes_normalise():
    import torch

    assert [canonical_dtype(t) for t in (torch.float16, torch.bfloat16, torch.float32)] == ["fp16", "bf16", "fp32"]
    assert canonical_dtype(torch.float64) is None


@pytest.mark.parametrize("spelling", ["int8", "float64", "double", "torch.float64", "fp8", "float8_e4m3fn", "tf32",
                                      "", "torch.", "fp 16", "bfloat", None, 16, True, ["fp16"]])
def test_refused_dtype_spellings_are_one_line_errors(spelling):
    assert canonical_dtype(spelling) is None
    with pytest.raises(OpsAdvError) as e:
        get_op("gemm").parse_problem({"M": 8, "N": 8, "K": 8, "dtype": spelling})
    msg = str(e.value)
    assert "\n" not in msg and "dtype" in msg and "fp16, bf16, fp32" in msg


def test_shapes_file_with_an_unsupported_dtype_is_exit_2(tmp_path):
    f = tmp_path / "shapes.yaml"
    f.write_text("gemm:\n  - {M: 4, N: 4, K: 4, dtype: float64}\n")
    r = cli("opsadv-tune", "--device", "cpu", "--ops", "gemm", "--shapes", str(f), "--db", f"sqlite:///{tmp_path / 'x.db'}")
    assert r.returncode == 2, r.stderr
    assert r.stderr.count("\n") == 1 and "dtype='float64' must be one of fp16, bf16, fp32" in r.stderr
    assert not (tmp_path / "x.db").exists()


# ---- progress display --------------------------------------------------------------------------

def test_bad_progress_option_is_one_line_exit_2(tmp_path):
    r = cli("opsadv-tune", "--device", "cpu", "--ops", "gemm", "--progress", "fancy", "--db", f"sqlite:///{tmp_path / 'x.db'}")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "--progress" in r.stderr, r.stderr


def test_progress_modes(monkeypatch):
    monkeypatch.setenv("TERM", "xterm")
    pipe = io.StringIO()
    assert not wants_bar("auto", pipe) and wants_bar("bar", pipe) and not wants_bar("plain", pipe)
    master, slave = os.openpty()
    try:
        with open(slave, "w", closefd=False) as tty:
            assert wants_bar("auto", tty) and not wants_bar("plain", tty)
            monkeypatch.setenv("TERM", "dumb")
            assert not wants_bar("auto", tty)
    finally:
        os.close(master)
        os.close(slave)


def test_plain_progress_is_the_periodic_line(monkeypatch):
    import tuner.progress as progress

    lines: list[str] = []
    p = Progress("plain", lines.append, io.StringIO())
    monkeypatch.setattr(progress, "PLAIN_EVERY_S", -1.0)  # every update prints, instead of every 10 s
    p.update(12.0, 1, 4, 30, 96, 31, 100, None)
    p.update(25.0, 2, 4, 50, 96, 52, 100, 1.5)
    p.log("  done something")
    p.close()
    assert lines == ["[   12s] 1/4 problems done, 30 trials asked", "[   25s] 2/4 problems done, 50 trials asked, best 1.50x so far",
                     "  done something"]


def test_bar_shows_problems_trials_best_and_eta():
    out = io.StringIO()
    logged: list[str] = []
    p = Progress("bar", lambda s: (logged.append(s), out.write(s + "\n")), out)
    p.update(3.0, 1, 4, 30, 96, 31, 100, 1.25)
    p.log("  done gemm M=64")
    p.close()
    text = out.getvalue()
    assert "problems 1/4, trials 30/96, best 1.25x" in text and "ETA" in text and "%|" in text
    assert logged == ["  done gemm M=64"] and "  done gemm M=64\n" in text


@pytest.mark.ray
def test_tune_on_a_terminal_draws_a_progress_bar(tmp_path):
    import fcntl
    import struct
    import termios

    shapes = tmp_path / "s.yaml"
    shapes.write_text("gemm:\n  - {M: 64, N: 64, K: 64}\n  - {M: 32, N: 64, K: 64, trans_b: true}\n")
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))
    p = subprocess.Popen(
        [sys.executable, "-c", TUNE_CODE, "--device", "cpu", "--ops", "gemm", "--shapes", str(shapes), "--trials", "5",
         "--db", f"sqlite:///{tmp_path / 't.db'}"],
        stdout=subprocess.PIPE, stderr=slave, env={**ENV, "TERM": "xterm"},
    )
    os.close(slave)
    buf = b""
    deadline = time.monotonic() + 300
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 1.0)
            if ready:
                try:
                    chunk = os.read(master, 65536)
                except OSError:  # the child closed the terminal
                    break
                if not chunk:
                    break
                buf += chunk
            elif p.poll() is not None:
                break
        out = p.stdout.read().decode()
        rc = p.wait(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        os.close(master)
    err = buf.decode(errors="replace")
    assert rc == 0, err[-3000:]
    assert "\r" in err and "%|" in err and "ETA" in err, err[-3000:]
    final = [seg for seg in err.replace("\n", "\r").split("\r") if seg.startswith("tuning") and "%|" in seg][-1]
    assert final.startswith("tuning 100%") and "problems 2/2" in final and "best " in final, final
    assert "problems done" not in err  # no plain periodic lines on a terminal
    assert sum(line.startswith("  done gemm") for line in err.replace("\r", "\n").splitlines()) == 2  # lines above the bar
    assert "speedup" in out


def test_runtime_does_not_import_the_display_or_dashboard():
    # torch itself may import tqdm: only what ops_adv adds counts
    code = ("import sys, torch; before = set(sys.modules); import ops_adv; a = torch.randn(8, 8); ops_adv.gemm(a, a); "
            "print(sorted(m for m in set(sys.modules) - before if m.split('.')[0] in ('tqdm', 'rich', 'optuna_dashboard')))")
    r = run_cli("-c", code)
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stderr
