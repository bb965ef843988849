"""The benchmarks' child processes: one that hangs is stopped at its limit and says where it hung."""
from __future__ import annotations

import importlib.util
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _e2e():
    if "e2e_model" not in sys.modules:
        spec = importlib.util.spec_from_file_location("e2e_model", ROOT / "benchmarks" / "e2e_model.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules["e2e_model"] = mod
        spec.loader.exec_module(mod)
    return sys.modules["e2e_model"]


def test_a_hung_child_is_stopped_and_names_its_frame(tmp_path):
    e2e = _e2e()
    child = tmp_path / "child.py"
    child.write_text(textwrap.dedent(f"""
        import importlib.util, json, sys, time
        spec = importlib.util.spec_from_file_location("e2e_model", {str(ROOT / "benchmarks" / "e2e_model.py")!r})
        e2e = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(e2e)
        e2e.arm_stack_dump(json.load(open(sys.argv[2])))

        def stuck_in_warm_up():
            while True:
                time.sleep(0.05)

        stuck_in_warm_up()
    """))
    rc, tail = e2e.Child.run({"job": "hang"}, 9.5, script=str(child))
    assert rc is None  # stopped at its limit
    assert "in stuck_in_warm_up" in e2e.hung_at(tail), tail[-20:]
    assert e2e.hung_at(["no dump here"]) == ""
