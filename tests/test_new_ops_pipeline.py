"""The decode and fused ops through the whole pipeline: a shapes file, opsadv-tune, export, and the
runtime in another process dispatching the tuned winners with the reference's results."""
from __future__ import annotations

import json

from conftest import cli, run_cli

SHAPES = """\
decode_attention:
  - {B: 3, Hq: 8, Hkv: 2, Sq: 2, Skv: 77, D: 32, ragged: true, causal: true, dtype: fp32}
add_rms_norm:
  - {rows: 24, cols: 96, dtype: fp32}
add_layer_norm:
  - {rows: 5, cols: 200, dtype: fp32}
swiglu:
  - {rows: 7, cols: 48, merged: true, dtype: fp32}
rope:
  - {tokens: 9, Hq: 4, Hkv: 2, D: 32, dtype: fp32}
linear:
  - {M: 6, N: 40, K: 24, bias: true, activation: gelu_tanh, dtype: fp32}
conv2d_bn_relu:
  - {N: 2, C: 8, H: 9, W: 9, K: 16, R: 3, S: 3, stride: 1, padding: 1, dilation: 1, layout: nchw, relu: true, dtype: fp32}
"""
OPS = "decode_attention,add_rms_norm,add_layer_norm,swiglu,rope,linear,conv2d_bn_relu"

CHECK = """
import json, sys, torch, ops_adv
from kernel_space import get_op, relative_error
table = json.load(open(sys.argv[1]))
out = []
for w in table["winners"]:
    spec = get_op(w["op"])
    p = spec.parse_problem(w["problem"])
    tensors, attrs = spec.make_inputs(p, "cpu", seed=3)
    why = ops_adv.explain(w["op"], *tensors, **attrs)
    got = ops_adv.dispatch(w["op"], *[t.clone() if t is not None else None for t in tensors], **attrs)
    ref = spec.reference(*tensors, **attrs)
    first = lambda x: x[0] if isinstance(x, (tuple, list)) else x
    err = relative_error(first(got), first(ref)) if w["op"] != "rope" else relative_error(
        torch.cat([got[0], got[1]], dim=-2), ref)
    out.append({"op": w["op"], "source": why["source"], "impl": why["impl"], "winner": w["impl"], "err": err,
                "tol": spec.tolerance(p.dtype)})
print(json.dumps(out))
"""


def test_new_ops_tune_export_and_dispatch(tmp_path):
    url = f"sqlite:///{tmp_path / 'db.sqlite'}"
    shapes = tmp_path / "shapes.yaml"
    shapes.write_text(SHAPES)
    r = cli("opsadv-tune", "--device", "cpu", "--ops", OPS, "--shapes", str(shapes), "--trials", "2", "--db", url)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "wins by source" in r.stdout
    out = tmp_path / "export"
    r = cli("opsadv-export", "--device", "cpu", "--out", str(out), "--db", url)
    assert r.returncode == 0, r.stderr
    table_path = out / "opsadv-table.json"
    winners = json.loads(table_path.read_text())["winners"]
    assert sorted(w["op"] for w in winners) == sorted(OPS.split(","))
    script = tmp_path / "check.py"
    script.write_text(CHECK)
    r = run_cli(str(script), str(table_path), env={"OPS_ADV_TABLE": str(table_path)})
    assert r.returncode == 0, r.stderr[-3000:]
    for row in json.loads(r.stdout):
        assert row["source"] == "tuned" and row["impl"] == row["winner"], row
        assert row["err"] <= row["tol"], row
    # the report names the library candidates and why they did not run on this machine
    r = cli("opsadv-report", "--device", "cpu", "--db", url)
    assert r.returncode == 0, r.stderr
    assert "library candidates" in r.stdout
    lines = [line.strip() for line in r.stdout.splitlines() if "/liger_" in line]
    assert {line.split("/")[0] for line in lines} >= {"add_rms_norm", "swiglu", "rope"}, r.stdout
    assert all(line.endswith(("needs cuda", "liger_kernel not available")) for line in lines), lines
