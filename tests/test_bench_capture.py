"""On a CUDA GPU: the benchmarks' CUDA graph helper keeps alive what a captured step reads.

decode_step.py's `eager+graph` and `converted+graph` crashed on the H200 (illegal address, a
device-side assert) because e2e_model.capture kept only the graph: the model, cache and input of
the first captured model were freed when the next model was built, and the next capture's
empty_cache() returned their memory to the driver.
"""
from __future__ import annotations

import gc
import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
ROOT = Path(__file__).resolve().parents[1]


def _load(name: str):
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def test_a_captured_step_keeps_its_model_and_input_alive():
    e2e = _load("e2e_model")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 512)).cuda()
    x = torch.randn(64, 512, device="cuda")
    with torch.no_grad():
        want = model(x).clone()
        replay = e2e.capture(lambda m=model, x=x: m(x), None)
    del model, x  # the caller keeps nothing but the replay, as decode_step.py's loop did
    gc.collect()
    torch.cuda.empty_cache()  # as the next capture's torch.cuda.graph does
    junk = [torch.full((1 << 20,), float("nan"), device="cuda") for _ in range(16)]  # reuses what was freed
    out = replay()
    torch.cuda.synchronize()
    del junk
    torch.testing.assert_close(out, want)


def test_decode_step_graph_variants_run_and_agree(tmp_path):
    """Both graph variants of decode_step.py's layer part (a 2-layer and a 1-layer model each) run; the
    original model replayed from its graph gives eager's top-1 tokens."""
    ds = _load("decode_step")
    rc = ds.main(["--tiny", "--device", "cuda", "--parts", "layer", "--batches", "1,8", "--contexts", "16",
                  "--layer-variants", "eager,eager+graph,converted+graph", "--in-process", "--rounds", "1", "--reps", "2",
                  "--out", str(tmp_path)])
    assert rc == 0
    rows = json.loads((tmp_path / "decode_step.json").read_text())["rows"]
    assert len(rows) == 6 and not [r for r in rows if r.get("error")], rows
    eager = {r["case"]: r["top1"] for r in rows if r["variant"] == "eager"}
    for r in rows:
        if r["variant"] == "eager+graph":
            assert r["top1"] == eager[r["case"]], r
