"""The tuning database only gets better: tuned problems are skipped, a rerun never stores a slower winner, and an
outlier is measured again before it is stored (issue 22, items 1 and 2)."""
from __future__ import annotations

import pytest
from sqlalchemy import select, update
from sqlalchemy.orm import Session

import db
from kernel_space import get_op
from tuner import TuneOptions, Tuner
from tuner.problems import default_problems
from tuner.winners import FAR, far, outliers


def _tune(url, problems, **kw):
    logs: list[str] = []
    opts = TuneOptions(device="cpu", problems=problems, db_url=url, log=logs.append,
                       **{"trials": 4, "measure_budget_s": 0.03, **kw})
    return Tuner(opts).run(), logs


def _winners(url) -> dict[int, db.Winner]:
    with Session(db.open_db(url, migrate=False)) as s:
        out = {w.problem_id: w for w in s.scalars(select(db.Winner))}
        s.expunge_all()
    return out


# ---- 1. tuned means tuned ---------------------------------------------------------------------------

@pytest.mark.ray
def test_make_tune_three_times_skips_and_never_worsens(ray_session, sqlite_url):
    """`make tune`'s problem set, three runs in a row: the attention spaces (15-16 configurations) are smaller than
    --trials 18 and the gemm ones larger; every rerun skips every problem and no stored time changes for the worse."""
    problems = default_problems(["gemm", "attention"], "cpu")
    _, logs = _tune(sqlite_url, problems, trials=18)
    first = _winners(sqlite_url)
    assert len(first) == len(problems)
    for _ in range(2):
        _, logs = _tune(sqlite_url, problems, trials=18)
        skipped = [line for line in logs if line.startswith("skip ")]
        assert len(skipped) == len(problems), logs
        now = _winners(sqlite_url)
        assert now.keys() == first.keys()
        for pid, w in now.items():
            assert w.median_ms <= first[pid].median_ms and w.run_id == first[pid].run_id


@pytest.mark.ray
def test_vendor_only_problem_is_done_after_one_run(ray_session, sqlite_url):
    problem = get_op("gemm").problem(64, 64, 64)
    _, logs = _tune(sqlite_url, [("gemm", problem)], only_impls=["torch_matmul"])
    assert any(line.startswith("  done gemm") for line in logs), logs
    _, logs = _tune(sqlite_url, [("gemm", problem)], only_impls=["torch_matmul"])
    assert any(line.startswith("skip gemm") for line in logs), logs


@pytest.mark.ray
def test_a_rerun_keeps_the_faster_stored_winner_and_records_its_own(ray_session, sqlite_url):
    problem = get_op("gemm").problem(96, 160, 128)
    _tune(sqlite_url, [("gemm", problem)], trials=2)
    (w,) = _winners(sqlite_url).values()
    best = w.median_ms / 1.5  # an earlier run that measured it faster (within FAR: not an outlier)
    engine = db.open_db(sqlite_url)
    with engine.begin() as c:
        c.execute(update(db.Winner).values(median_ms=best))
    _, logs = _tune(sqlite_url, [("gemm", problem)], trials=4)  # more trials: searched and confirmed again
    (after,) = _winners(sqlite_url).values()
    if after.run_id == w.run_id:  # kept: this run measured nothing faster
        assert after.median_ms == best and after.trials == 4
        assert any(line.startswith("  kept gemm") for line in logs), logs
        kept = [h for h in after.history if h.get("kept") == "stored"]
        assert kept and kept[-1]["median_ms"] >= best and kept[-1]["run_id"] != w.run_id
    else:  # replaced: only by a faster one, and the one it replaced is in the history
        assert after.median_ms < best
        assert any(h.get("replaced_by") == after.run_id and h["median_ms"] == best for h in after.history)
    _, logs = _tune(sqlite_url, [("gemm", problem)], trials=4)
    assert any(line.startswith("skip gemm") for line in logs), logs


# ---- 2. outliers measured again -------------------------------------------------------------------

def _measured(fn_ms: dict) -> dict:
    """Real times of real callables, interleaved as the confirmation measures them."""
    from workers.timing import interleaved

    res = interleaved(fn_ms, device="cpu", rounds=3, budget_s=0.05, reps=5, warmup=1)
    return {k: v.as_dict() for k, v in res.items()}


def test_a_contended_vendor_time_is_an_outlier_and_a_steady_one_is_not():
    import time

    import torch

    a, b = torch.randn(128, 128), torch.randn(128, 128)

    steady = _measured({"v": lambda: torch.matmul(a, b)})["v"]["median_ms"]
    hold = max(0.02, 10 * steady / 1000)

    def contended():  # the same kernel while something else holds the core for 10 times its time
        end = time.perf_counter() + hold
        while time.perf_counter() < end:
            pass
        return torch.matmul(a, b)

    slow = _measured({"v": contended})["v"]["median_ms"]
    assert slow > FAR * steady
    earlier = {"v": [steady, steady * 1.1], "t": [steady * 0.9]}
    row = lambda key, ms, vendor: {"key": key, "impl": key, "params": {}, "vendor": vendor, "median_ms": ms, "spread_ms": 0.0}  # noqa: E731
    odd = outliers([row("v", slow, True), row("t", steady * 0.9, False)], earlier)
    assert [r["key"] for r, _ in odd] == ["v"]  # the contended vendor would have made a large speedup
    assert outliers([row("v", steady * 1.05, True), row("t", steady * 0.9, False)], earlier) == []
    assert far(slow, []) is None  # nothing to compare with: not an outlier


@pytest.mark.ray
def test_a_vendor_far_from_its_history_is_measured_again_before_it_is_stored(ray_session, sqlite_url):
    problem = get_op("gemm").problem(96, 160, 128)
    _tune(sqlite_url, [("gemm", problem)], trials=2)
    (w,) = _winners(sqlite_url).values()
    fast = w.vendor_ms / 10
    engine = db.open_db(sqlite_url)
    with engine.begin() as c:  # every earlier run measured the vendor 10x faster than this machine now does
        c.execute(update(db.Trial).where(db.Trial.impl == "torch_matmul").values(median_ms=fast))
        c.execute(update(db.Winner).values(vendor_ms=fast))
        if w.impl == "torch_matmul":
            c.execute(update(db.Winner).values(median_ms=fast))
    _, logs = _tune(sqlite_url, [("gemm", problem)], trials=4)
    assert any("torch_matmul measured" in line and "measuring the finalists again" in line for line in logs), logs
    (w,) = _winners(sqlite_url).values()
    rounds = [h["rounds"] for h in w.history or [] if "rounds" in h]
    assert rounds and len(rounds[-1]["torch_matmul"]) == 3  # the first round and two more, all kept as data


def test_report_shows_the_spread_behind_each_winner():
    from tuner.report import format_markdown, format_table

    rows = [{"op": "gemm", "problem": {"M": 1}, "impl": "torch_matmul", "params": {}, "median_ms": 0.5, "spread_ms": 0.01,
             "vendor_impl": "torch_matmul", "vendor_ms": 0.5, "speedup": 1.0,
             "history": [{"median_ms": 0.52}, {"median_ms": 0.68}]}]
    text = format_table(rows)
    assert "spread" in text.splitlines()[0] and "±0.01 (others 0.52-0.68 ms, 2 measured)" in text
    assert "| ±0.01 (others" in format_markdown(rows)
