"""opsadv-tune --list, and the progress line counting problems against the run's total (issue 22, item 7)."""
from __future__ import annotations

import pytest

import kernel_space
from kernel_space import get_op
from kernel_space._device import KNOWN_CLASSES
from tuner import TuneOptions, Tuner
from tuner.cli import tune_main


def test_list_prints_devices_ops_and_implementations(capsys):
    assert tune_main(["--list"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == f"devices: {', '.join(KNOWN_CLASSES)}"
    for op in kernel_space.ops():
        assert f"\n  {op}\n" in out
        for impl in kernel_space.impls(op):
            assert f"\n    {impl.name}{'*' if impl.vendor else ''}: " in out


def test_device_and_ops_are_still_required_without_list(capsys):
    with pytest.raises(SystemExit) as e:
        tune_main(["--ops", "gemm"])
    assert e.value.code == 2 and "required: --device" in capsys.readouterr().err


@pytest.mark.ray
def test_progress_counts_problems_against_the_total(ray_session, sqlite_url, monkeypatch):
    import tuner.progress as progress

    monkeypatch.setattr(progress, "PLAIN_EVERY_S", -1.0)  # every update prints
    first, second = get_op("gemm").problem(32, 32, 32), get_op("gemm").problem(48, 32, 32)

    def tune(problems):
        logs: list[str] = []
        Tuner(TuneOptions(device="cpu", problems=problems, db_url=sqlite_url, log=logs.append, progress="plain",
                          only_impls=["torch_matmul"], measure_budget_s=0.02)).run()
        return [line for line in logs if "problems done" in line]

    tune([("gemm", first)])
    lines = tune([("gemm", first), ("gemm", second)])  # the first is skipped as tuned: done, and counted
    assert lines and all("/2 problems done" in line for line in lines), lines
    assert "1/2 problems done" in lines[0] and "2/2 problems done" in lines[-1], lines
