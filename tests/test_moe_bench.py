"""benchmarks/moe.py (issue 31) in its CPU smoke mode: tiny dims, each case in its own process, every peer there."""
from __future__ import annotations

import json
import math
from pathlib import Path

from conftest import ROOT, run_cli

BENCH = str(ROOT / "benchmarks" / "moe.py")


def test_moe_bench_tiny_cpu(tmp_path):
    out = tmp_path / "moe"
    # the Triton kernel through the interpreter; torch.compile in its default mode (max-autotune takes longer on CPU)
    r = run_cli(BENCH, "--device", "cpu", "--tiny", "--rounds", "1", "--reps", "1", "--compile-mode", "default",
                "--out", str(out), env={"TRITON_INTERPRET": "1"}, timeout=240)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    md, jsonl = out / "moe.md", out / "moe.jsonl"
    assert md.is_file() and jsonl.is_file()
    rows = [json.loads(line) for line in jsonl.read_text().splitlines() if line.strip()]
    assert [(r_["dims"], r_["T"]) for r_ in rows] == [("mixtral-tiny", 1), ("mixtral-tiny", 8)], rows

    for row in rows:
        peers = row["peers"]
        default = row["default_impl"]
        # every experts implementation transformers offers, the compiled default, and ours (op and direct kernel)
        for impl in row["impls"]:
            assert (f"{impl} (default)" if impl == default else impl) in peers, (impl, list(peers))
        assert {"eager", "grouped_mm", "batched_mm"} <= set(row["impls"])
        assert f"compile({default})" in peers and "ops_adv.moe" in peers and "triton (default cfg)" in peers
        # what runs on a CPU ran, agreed with the reference and was timed
        for name in ("eager", "batched_mm", f"compile({default})", "ops_adv.moe", "triton (default cfg)",
                     f"{default} (default)"):
            p = peers.get(name) or peers[name.replace(" (default)", "")]
            assert p["status"] == "ok", (name, p)
            assert p["rel_err"] <= row["tolerance"]["rel_err"] and math.isfinite(p["max_abs_diff"]), (name, p)
            assert p["us"] > 0 and p["timing"] == "cpu"
        # what needs a GPU says why, rather than vanishing from the table
        for name, p in peers.items():
            assert p.get("status") in ("ok", "n/a", "error"), (name, p)
            if p["status"] != "ok":
                assert p.get("note"), (name, p)
        assert math.isfinite(row["ratio_vs_default"]) and row["ratio_vs_default"] > 0
        assert math.isfinite(row["ratio_vs_fastest_other"]) and row["ratio_vs_fastest_other"] > 0
        assert row["fastest_other"] in peers and peers[row["fastest_other"]]["role"] == "peer"
        assert isinstance(row["pass"], bool)

    text = md.read_text()
    header = next(line for line in text.splitlines() if line.startswith("| dims | T |"))
    for name in rows[0]["peers"]:
        assert f" {name} |" in header, (name, header)
    assert "vs default" in header and "vs fastest other" in header
    table_rows = [line for line in text.splitlines() if line.startswith("| mixtral-tiny |")]
    assert len(table_rows) >= 2 and all(("PASS" in line) != ("MISS" in line) for line in table_rows[:2])
    assert "max abs diff" in text
    # the console table too
    assert "vs default" in r.stdout and "cases PASS" in r.stdout
