"""Phi-3 and Gemma blocks on the fused ops (issue 31): the (1 + weight) RMS norm variant of rms_norm and
add_rms_norm, GeGLU (GeLU-tanh gate) in swiglu, and converted Phi-3 / Gemma models against the originals."""
from __future__ import annotations

import copy
import json

import pytest
import torch
import torch.nn.functional as F

import kernel_space
import ops_adv
from kernel_space import get_impl, get_op, relative_error

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _cfg(BLOCK_N, ROWS_PER_PROGRAM=1, PROGRAMS_PER_SM=0, num_warps=4, num_stages=1):
    return dict(BLOCK_N=BLOCK_N, ROWS_PER_PROGRAM=ROWS_PER_PROGRAM, PROGRAMS_PER_SM=PROGRAMS_PER_SM,
                num_warps=num_warps, num_stages=num_stages)


# single pass, multi-row, persistent (pipelined), looped over column blocks with a partial last block, looped persistent
NORM_CASES = {
    (1, 1000): [_cfg(0), _cfg(512, num_warps=1)],
    (7, 1000): [_cfg(0, ROWS_PER_PROGRAM=4, num_warps=8), _cfg(0, ROWS_PER_PROGRAM=2, PROGRAMS_PER_SM=1, num_stages=2),
                _cfg(512, ROWS_PER_PROGRAM=2, num_warps=2, num_stages=2), _cfg(512, PROGRAMS_PER_SM=2, num_warps=1)],
    (37, 129): [_cfg(0, num_warps=1), _cfg(0, ROWS_PER_PROGRAM=16, PROGRAMS_PER_SM=1, num_warps=4)],
}


def _gemma_norm(x, w, eps):
    """transformers' GemmaRMSNorm.forward, written out."""
    h = x.float()
    return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + w.float())).type_as(x)


@pytest.mark.parametrize("op", ["rms_norm", "add_rms_norm"])
@pytest.mark.parametrize("dtype", ["fp32", "fp16"])  # the interpreter rounds bf16 its own way
def test_unit_offset_triton_matches_gemma_and_the_reference(op, dtype):
    pytest.importorskip("triton")
    spec, impl = get_op(op), get_impl(op, f"triton_{op}_unit_offset")
    vendor = get_impl(op, f"torch_{op}_unit_offset")
    for (rows, cols), cfgs in NORM_CASES.items():
        p = spec.problem(rows, cols, dtype, True)
        args, attrs = spec.make_inputs(p, DEVICE, seed=3)
        assert spec.signature(*args, **attrs) == tuple(p) and attrs["unit_offset"] is True
        ref = spec.reference(*args, **attrs)
        want = vendor.fn(*args, **attrs)
        x = args[0] + args[1] if op == "add_rms_norm" else args[0]
        torch.testing.assert_close(want[0] if op == "add_rms_norm" else want, _gemma_norm(x, args[-1], 1e-6), rtol=0, atol=0)
        for cfg in cfgs:
            assert impl.check(p, cfg) is None, (p, cfg)
            out = impl.fn(*args, **attrs, **cfg)
            if op == "add_rms_norm":
                assert torch.equal(out[1], want[1]), "the new residual is x + residual in x's dtype"
                out, w0 = out[0], want[0]
            else:
                w0 = want
            assert relative_error(out, ref) <= spec.tolerance(dtype), (p, cfg)
            torch.testing.assert_close(out, w0, rtol=2e-6, atol=2e-6 if dtype == "fp32" else 1e-3)


@pytest.mark.parametrize("op", ["rms_norm", "add_rms_norm", "swiglu"])
def test_variant_kernels_run_the_plain_problems_as_the_plain_kernels(op):
    """UNIT=False / GELU=False: the variant kernels compute the plain problems as the kernels made before them do."""
    pytest.importorskip("triton")
    spec = get_op(op)
    p = spec.problem(7, 4000, False, "fp16") if op == "swiglu" else spec.problem(7, 4000, "fp16")
    args, attrs = spec.make_inputs(p, DEVICE, seed=4)
    assert not attrs.get("unit_offset") and "activation" not in attrs
    new = get_impl(op, "triton_geglu" if op == "swiglu" else f"triton_{op}_unit_offset")
    old = get_impl(op, f"triton_{op}")
    cfg = new.default_params()
    assert new.check(p, cfg) is None and old.check(p, cfg) is None
    a, b = new.fn(*args, **attrs, **cfg), old.fn(*args, **attrs, **cfg)
    for x, y in zip(a if isinstance(a, tuple) else (a,), b if isinstance(b, tuple) else (b,)):
        torch.testing.assert_close(x, y, rtol=0, atol=1e-3)


@pytest.mark.parametrize("merged", [False, True])
@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_geglu_triton_matches_gelu_tanh_times_up(dtype, merged):
    pytest.importorskip("triton")
    spec, impl = get_op("swiglu"), get_impl("swiglu", "triton_geglu")
    ran = 0
    for rows, cols in [(1, 1000), (9, 333), (64, 96)]:
        p = spec.problem(rows, cols, merged, dtype, "gelu_tanh")
        args, attrs = spec.make_inputs(p, DEVICE, seed=5)
        assert spec.signature(*args, **attrs) == tuple(p)
        g, u = (args[0][..., :cols], args[0][..., cols:]) if merged else args
        want = F.gelu(g, approximate="tanh") * u
        torch.testing.assert_close(get_impl("swiglu", "torch_geglu").fn(*args, **attrs), want, rtol=0, atol=0)
        for cfg in [dict(BLOCK_N=1024, ROWS_PER_PROGRAM=1, num_warps=4), dict(BLOCK_N=128, ROWS_PER_PROGRAM=8, num_warps=1)]:
            if impl.check(p, cfg) is not None:
                continue
            y = impl.fn(*args, **attrs, **cfg)
            assert y.shape == (rows, cols) and relative_error(y, spec.reference(*args, **attrs)) <= spec.tolerance(dtype)
            ran += 1
    assert ran


def test_variants_have_their_own_implementations_and_old_problems_keep_theirs():
    """The plain problems' defaults and implementations are what they were (a table made before keys its winners
    the same way and runs the same kernels); the variants default to their own vendor composites."""
    for op, plain, variant, old, new in (
            ("rms_norm", (8, 64, "fp32"), (8, 64, "fp32", True), "torch_rms_norm", "torch_rms_norm_unit_offset"),
            ("add_rms_norm", (8, 64, "fp32"), (8, 64, "fp32", True), "torch_add_rms_norm", "torch_add_rms_norm_unit_offset"),
            ("swiglu", (8, 64, True, "fp32"), (8, 64, True, "fp32", "gelu_tanh"), "torch_swiglu", "torch_geglu")):
        spec = get_op(op)
        p = spec.parse_problem(dict(zip(spec.problem._fields, plain)))  # a table's problem written before the field
        assert p == spec.problem(*plain) and len(p) == len(plain) + 1
        assert kernel_space.choose_default(op, p, "cpu").name == old
        # its key (database rows, study names) and dict form (tables, explain) are the ones it had
        assert p._asdict() == dict(zip(spec.problem._fields, plain))
        assert kernel_space.problem_key(p) == json.dumps(dict(zip(spec.problem._fields, plain)), sort_keys=True,
                                                         separators=(",", ":"))
        v = spec.problem(*variant)
        assert spec.parse_problem(v._asdict()) == v and len(v._asdict()) == len(variant)
        assert kernel_space.choose_default(op, v, "cpu").name == new
        for impl in kernel_space.impls(op):
            if not impl.name.endswith(("unit_offset", "geglu")):  # the implementations made before refuse the variant
                assert impl.check(v, impl.default_params()) is not None, impl.name
        # the variants' Triton kernels offer a plain problem their default configuration alone (its own kernel's to search)
        triton = get_impl(op, "triton_geglu" if op == "swiglu" else f"triton_{op}_unit_offset")
        big = spec.problem(64, 4096, *plain[2:])
        cfgs = [c for c in triton.configs() if triton.check(big, c) is None]
        assert cfgs == [triton.default_params()]
        assert len([c for c in triton.configs() if triton.check(big._replace(**dict(zip(spec.problem._fields[-1:], variant[-1:]))), c) is None]) > 1
    with pytest.raises(kernel_space.OpsAdvError, match="activation"):
        get_op("swiglu").parse_problem({"rows": 1, "cols": 2, "activation": "relu"})


def test_runtime_ops_compute_the_variants_eagerly_and_under_autograd():
    g = torch.Generator().manual_seed(0)
    x, r = torch.randn(3, 5, 32, generator=g), torch.randn(3, 5, 32, generator=g)
    w = (0.1 * torch.randn(32, generator=g)).requires_grad_()
    torch.testing.assert_close(ops_adv.rms_norm(x, w, 1e-6, unit_offset=True), _gemma_norm(x, w, 1e-6), rtol=0, atol=0)
    y, h = ops_adv.add_rms_norm(x, r, w, 1e-6, unit_offset=True)
    assert torch.equal(h, x + r)
    torch.testing.assert_close(y, _gemma_norm(x + r, w, 1e-6), rtol=0, atol=0)
    y.sum().backward()
    gw = w.grad.clone()
    w.grad = None
    _gemma_norm(x + r, w, 1e-6).sum().backward()
    torch.testing.assert_close(gw, w.grad)
    gu = torch.randn(4, 64, generator=g)
    torch.testing.assert_close(ops_adv.swiglu(gu, activation="gelu_tanh"),
                               F.gelu(gu[:, :32], approximate="tanh") * gu[:, 32:], rtol=0, atol=0)
    torch.testing.assert_close(ops_adv.swiglu(gu[:, :32], gu[:, 32:], activation="gelu_tanh"),
                               F.gelu(gu[:, :32], approximate="tanh") * gu[:, 32:], rtol=0, atol=0)
    with pytest.raises(ValueError, match="activation"):
        ops_adv.swiglu(gu, activation="relu")
    assert ops_adv.explain("swiglu", gu, activation="gelu_tanh")["impl"] == "torch_geglu"
    assert ops_adv.explain("rms_norm", x, w.detach(), 1e-6, unit_offset=True)["impl"] == "torch_rms_norm_unit_offset"


@pytest.mark.parametrize("op", ["rms_norm", "add_rms_norm", "swiglu"])
def test_custom_operators_backward_matches_torch(op):
    """The operators' own backward (what a tuned kernel's call under autograd runs) for the variants."""
    g = torch.Generator().manual_seed(1)
    x, r = torch.randn(6, 48, generator=g), torch.randn(6, 48, generator=g)
    w = 0.1 * torch.randn(48, generator=g)
    ins = [t.clone().requires_grad_() for t in (x, r, w)]
    ref = [t.clone().requires_grad_() for t in (x, r, w)]
    if op == "rms_norm":
        out, want = torch.ops.ops_adv.rms_norm(ins[0], ins[2], 1e-6, True), _gemma_norm(ref[0], ref[2], 1e-6)
    elif op == "add_rms_norm":
        out = torch.ops.ops_adv.add_rms_norm(ins[0], ins[1], ins[2], 1e-6, True)
        out = out[0] * 2 + out[1]
        h = ref[0] + ref[1]
        want = _gemma_norm(h, ref[2], 1e-6) * 2 + h
    else:
        out = torch.ops.ops_adv.swiglu(ins[0], ins[1], "gelu_tanh")
        want = F.gelu(ref[0], approximate="tanh") * ref[1]
    torch.testing.assert_close(out, want)
    go = torch.randn(out.shape, generator=g)
    out.backward(go)
    want.backward(go)
    for a, b in zip(ins, ref):
        if b.grad is not None:
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------- converted models

transformers = pytest.importorskip("transformers")

# family -> (config class, extra config, what explain_model must say the blocks fused)
FAMILIES = {
    "phi3": ("Phi3Config", {}, {"layer": "add_rms_norm", "mlp": "swiglu on the merged [..., 2I] tensor"}),
    "gemma": ("GemmaConfig", {"head_dim": 16}, {"layer": "add_rms_norm (1 + weight)", "mlp": "swiglu (GeGLU"}),
    "gemma_hd256": ("GemmaConfig", {"head_dim": 256}, {"layer": "add_rms_norm (1 + weight)", "mlp": "swiglu (GeGLU"}),
    "gemma2": ("Gemma2Config", {"head_dim": 16}, {"layer": "add_rms_norm (1 + weight)", "mlp": "swiglu (GeGLU"}),
    "gemma3": ("Gemma3TextConfig", {"head_dim": 16}, {"layer": "add_rms_norm (1 + weight)", "mlp": "swiglu (GeGLU"}),
}


def _model(family: str):
    name, extra, _ = FAMILIES[family]
    if not hasattr(transformers, name):
        pytest.skip(f"transformers {transformers.__version__} has no {name}")
    cfg = getattr(transformers, name)(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                      pad_token_id=0, bos_token_id=1, eos_token_id=2, **extra)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():  # Gemma starts its norms' weights at 0, where (1 + w) and 1 agree: make them differ
        for n, p in model.named_parameters():
            if "norm" in n:
                p.normal_(0.0, 0.3)
    return model


def _ids(seed=1, shape=(2, 9)):
    return torch.randint(3, 128, shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_converted_family_fuses_and_is_the_same_model(family):
    model = _model(family)
    conv = ops_adv.convert_model(copy.deepcopy(model))
    rows = {r["module"]: r for r in ops_adv.explain_model(conv)}
    want = FAMILIES[family][2]
    for layer in ("model.layers.0", "model.layers.1"):
        assert want["layer"] in rows[layer]["why"], rows[layer]
        assert want["mlp"] in rows[layer + ".mlp"]["why"], rows[layer + ".mlp"]
    norms = [r for r in rows.values() if r["type"].endswith("RMSNorm")]
    assert norms and all(r["converted"] == "yes" for r in norms), norms
    if family == "phi3":  # the fused qkv projection is one Linear: one linear call
        assert rows["model.layers.0.self_attn.qkv_proj"]["converted"] == "yes"
    # state_dict: the same keys and values
    sd, sd0 = conv.state_dict(), model.state_dict()
    assert list(sd) == list(sd0) and all(torch.equal(sd[k], sd0[k]) for k in sd)
    # eval logits, and the fused ops (with their variants) are what runs
    ids = _ids()
    with torch.no_grad(), ops_adv.record() as rec:
        got = conv(ids).logits
    with torch.no_grad():
        ref = model(ids).logits
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    probs = {}
    for op, p in rec.problems():
        probs.setdefault(op, []).append(p)
    assert "add_rms_norm" in probs and "swiglu" in probs, probs
    gemma = family.startswith("gemma")
    assert all(p[-1] == gemma for p in probs["add_rms_norm"])  # unit_offset
    assert all(p[-1] == ("gelu_tanh" if gemma else "silu") for p in probs["swiglu"])
    assert any(p[2] for p in probs["swiglu"])  # merged [..., 2I]: Phi-3's chunked output, Gemma's merged gate/up gemm
    if gemma:
        assert all(p[-1] for p in probs["rms_norm"])


@pytest.mark.parametrize("family", list(FAMILIES))
def test_converted_family_trains_as_the_original(family):
    """Training mode: the loss and the gradient of every parameter (norm weights, the merged gate_up, ...)."""
    model = _model(family).train()
    conv = ops_adv.convert_model(copy.deepcopy(model)).train()
    ids = _ids(2, (2, 12))
    loss = conv(ids, labels=ids).loss
    loss0 = model(ids, labels=ids).loss
    torch.testing.assert_close(loss, loss0, rtol=1e-5, atol=1e-6)
    loss.backward()
    loss0.backward()
    params0 = dict(model.named_parameters())
    for name, p in conv.named_parameters():
        q = params0[name]
        assert (p.grad is None) == (q.grad is None), name
        if q.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("family", ["phi3", "gemma", "gemma_hd256", "gemma3"])
@pytest.mark.parametrize("cache", [None, "static"])
def test_converted_family_generates_the_same_tokens(family, cache):
    model = _model(family)
    conv = ops_adv.convert_model(copy.deepcopy(model))
    ids = _ids(3, (2, 7))
    kw = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0)
    if cache:
        kw["cache_implementation"] = cache
    with torch.no_grad():
        want = model.generate(ids, **kw)
        got = conv.generate(ids, **kw)
    assert torch.equal(got, want)
    if cache == "static" and family != "gemma3":  # grouped K/V decode steps run decode_attention (head dim 256 too)
        rows = [r for r in ops_adv.explain_model(conv) if r["module"].endswith("self_attn") and "fused" not in r["why"]]
        assert len(rows) == 2 and all("decode_attention" in r["why"] for r in rows), rows


def test_unit_offset_norms_are_recognised_by_what_they_do():
    """A (1 + weight) norm that returns fp32 for bf16 input, or that ignores its weight, is another op: left alone."""
    import torch.nn as nn

    class Gemmalike(nn.Module):
        def __init__(self, n):
            super().__init__()
            self.weight = nn.Parameter(torch.zeros(n))  # 0: 1 + w and 1 agree on the model's own weight
            self.eps = 1e-6

        def forward(self, x):
            h = x.float()
            return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps) * (1.0 + self.weight.float())).type_as(x)

    class NoCast(Gemmalike):
        def forward(self, x):
            h = x.float()
            return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps) * (1 + self.weight)

    class NoWeight(Gemmalike):
        def forward(self, x):
            h = x.float()
            return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x)

    m = nn.Sequential(Gemmalike(32), NoCast(32), NoWeight(32))
    x = torch.randn(4, 32)
    want = m(x)
    ops_adv.convert_model(m)
    rows = {r["module"]: r for r in ops_adv.explain_model(m)}
    assert rows["0"]["converted"] == "yes" and "(1 + weight)" in rows["0"]["why"]
    assert rows["1"]["converted"] == "no" and "bfloat16" in rows["1"]["why"]
    assert rows["2"]["converted"] == "no" and "relative error" in rows["2"]["why"]
    torch.testing.assert_close(m(x), want, rtol=0, atol=0)


def test_act_on_the_right_and_chunked_gates_keep_hooks_and_fall_back():
    """`up * act(gate)` with separate projections merges them into one gemm; a hook on the activation runs the
    original expression (the hook sees the gate), in the original order."""
    import torch.nn as nn

    class RightMLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate_proj, self.up_proj, self.down_proj = nn.Linear(16, 24), nn.Linear(16, 24), nn.Linear(24, 16)
            self.act = nn.SiLU()

        def forward(self, x):
            return self.down_proj(self.up_proj(x) * self.act(self.gate_proj(x)))

    torch.manual_seed(0)
    mlp = RightMLP()
    x = torch.randn(3, 5, 16)
    with torch.no_grad():
        want = mlp(x)
    conv = ops_adv.convert_model(copy.deepcopy(mlp))
    row = next(r for r in ops_adv.explain_model(conv) if r["module"] == "")
    assert "up_proj * act(gate_proj) -> one gemm (merged weights), swiglu" in row["why"], row
    with torch.no_grad(), ops_adv.record() as rec:
        torch.testing.assert_close(conv(x), want, rtol=1e-6, atol=1e-6)
    assert ("swiglu", (15, 24, True, "fp32", "silu")) in set(rec.problems())
    seen = []
    conv.act.register_forward_hook(lambda mod, inp, out: seen.append(inp[0].shape))
    conv.up_proj.register_forward_hook(lambda mod, inp, out: seen.append("up"))
    conv.gate_proj.register_forward_hook(lambda mod, inp, out: seen.append("gate"))
    with torch.no_grad():
        torch.testing.assert_close(conv(x), want, rtol=1e-6, atol=1e-6)
    assert seen == ["up", "gate", torch.Size([3, 5, 24])]


_CHILD = """
import pickle, sys, torch
model, ids = pickle.loads(sys.stdin.buffer.read())
with torch.no_grad():
    sys.stdout.buffer.write(pickle.dumps(model(ids).logits))
"""


def test_converted_phi3_and_gemma_pickle_into_another_process():
    """The fused forwards (chunked gate/up, GeGLU, (1 + weight) add + norm) are rebuilt by name in a fresh process."""
    import pickle
    import subprocess
    import sys

    for family in ("phi3", "gemma"):
        model = _model(family)
        conv = ops_adv.convert_model(copy.deepcopy(model))
        ids = _ids(4)
        r = subprocess.run([sys.executable, "-c", _CHILD], input=pickle.dumps((conv, ids)), capture_output=True,
                           timeout=300)
        assert r.returncode == 0, r.stderr.decode()[-2000:]
        with torch.no_grad():
            torch.testing.assert_close(pickle.loads(r.stdout), model(ids).logits, rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------- the tuner

_SHAPES = """\
rms_norm:
  - {rows: 8, cols: 96, dtype: fp32, unit_offset: true}
  - {rows: 8, cols: 96, dtype: fp32}
add_rms_norm:
  - {rows: 8, cols: 96, dtype: fp32, unit_offset: true}
swiglu:
  - {rows: 5, cols: 48, merged: true, dtype: fp32, activation: gelu_tanh}
"""

_DISPATCH = """
import json, sys, ops_adv
from kernel_space import get_op, relative_error
out = []
for w in json.load(open(sys.argv[1]))["winners"]:
    spec = get_op(w["op"])
    p = spec.parse_problem(w["problem"])
    tensors, attrs = spec.make_inputs(p, "cpu", seed=3)
    why = ops_adv.explain(w["op"], *tensors, **attrs)
    got = ops_adv.dispatch(w["op"], *tensors, **attrs)
    first = lambda x: x[0] if isinstance(x, (tuple, list)) else x
    out.append({"op": w["op"], "problem": w["problem"], "source": why["source"], "impl": why["impl"],
                "winner": w["impl"], "err": relative_error(first(got), spec.reference(*tensors, **attrs))})
print(json.dumps(out))
"""


def test_variants_tune_export_and_dispatch(tmp_path):
    """opsadv-tune takes the variant problems from a shapes file, the export keeps their fields (and leaves them out
    of the plain problems), and the runtime dispatches the variants' winners with the reference's results."""
    from conftest import cli, run_cli

    url = f"sqlite:///{tmp_path / 'db.sqlite'}"
    shapes = tmp_path / "shapes.yaml"
    shapes.write_text(_SHAPES)
    r = cli("opsadv-tune", "--device", "cpu", "--ops", "rms_norm,add_rms_norm,swiglu", "--shapes", str(shapes),
            "--trials", "2", "--db", url)
    assert r.returncode == 0, r.stderr[-3000:]
    out = tmp_path / "export"
    r = cli("opsadv-export", "--device", "cpu", "--out", str(out), "--db", url)
    assert r.returncode == 0, r.stderr
    table = out / "opsadv-table.json"
    winners = json.loads(table.read_text())["winners"]
    impls = {(w["op"], json.dumps(w["problem"], sort_keys=True)): w["impl"] for w in winners}
    assert impls == {
        ("rms_norm", '{"cols": 96, "dtype": "fp32", "rows": 8, "unit_offset": true}'): "torch_rms_norm_unit_offset",
        # the plain problem: torch_rms_norm, or the variant's vendor, which runs it with the same F.rms_norm
        ("rms_norm", '{"cols": 96, "dtype": "fp32", "rows": 8}'): impls.get(
            ("rms_norm", '{"cols": 96, "dtype": "fp32", "rows": 8}')) if impls.get(
            ("rms_norm", '{"cols": 96, "dtype": "fp32", "rows": 8}')) in ("torch_rms_norm", "torch_rms_norm_unit_offset")
        else "torch_rms_norm",
        ("add_rms_norm", '{"cols": 96, "dtype": "fp32", "rows": 8, "unit_offset": true}'): "torch_add_rms_norm_unit_offset",
        ("swiglu", '{"activation": "gelu_tanh", "cols": 48, "dtype": "fp32", "merged": true, "rows": 5}'): "torch_geglu",
    }, impls
    script = tmp_path / "check.py"
    script.write_text(_DISPATCH)
    r = run_cli(str(script), str(table), env={"OPS_ADV_TABLE": str(table)})
    assert r.returncode == 0, r.stderr[-3000:]
    for row in json.loads(r.stdout):
        assert row["source"] == "tuned" and row["impl"] == row["winner"] and row["err"] <= 2e-3, row


@pytest.mark.parametrize("family", ["phi3", "gemma"])
def test_converted_family_compiles_with_inductor(family):
    """Inductor (fullgraph) on the fused forwards: the variants trace as torch's own functions where the table has
    only vendor kernels, and Inductor fuses them as it fuses the original's."""
    torch._dynamo.reset()
    model = _model(family)
    ids = _ids(5, (1, 8))
    with torch.no_grad():
        want = model(ids).logits
        got = torch.compile(ops_adv.convert_model(copy.deepcopy(model)), fullgraph=True)(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("op,name", [("rms_norm", "liger_rms_norm_unit_offset"),
                                     ("add_rms_norm", "liger_add_rms_norm_unit_offset"), ("swiglu", "liger_geglu")])
def test_liger_variant_candidates_are_registered_with_their_reasons(op, name):
    from kernel_space._registry import source_of

    impl = get_impl(op, name)
    assert impl.requires == ("liger_kernel",) and impl.backends == {"cuda"} and source_of(impl) == "library"
    spec = get_op(op)
    plain = spec.problem(8, 64, True, "bf16") if op == "swiglu" else spec.problem(8, 64, "bf16")
    assert impl.why_not(plain, backend="cpu") in ("liger_kernel not available", "no cpu backend")
    if impl.unavailable is None and kernel_space._liger.missing(*(
            ("ops.geglu", "LigerGELUMulFunction") if op == "swiglu" else
            ("ops.rms_norm", "LigerRMSNormFunction") if op == "rms_norm" else
            ("ops.fused_add_rms_norm", "LigerFusedAddRMSNormFunction"))) is None:
        assert impl.check(plain, {}) is not None  # the plain problems are the plain candidates'
        assert impl.check(plain._replace(**({"activation": "gelu_tanh"} if op == "swiglu" else {"unit_offset": True})),
                          {}) is None


def test_tune_for_hardware_covers_every_call_of_a_converted_gemma(tmp_path):
    """generate()'s problems recorded, tuned and loaded: every call of the rerun, the variants' included, is tuned."""
    conv = ops_adv.convert_model(_model("gemma"))
    res = conv.tune_for_hardware(device="cpu", batch_size=[1], seq_len=8, max_new_tokens=4, trials=2,
                                 db=f"sqlite:///{tmp_path / 'db.sqlite'}", generate_kwargs={"cache_implementation": "static"})
    after = res["census_after"]
    assert after["tuned"] > 0 and after["tuned"] == sum(after.values()), after
    text = str(res["census"])
    for impl in ("torch_add_rms_norm_unit_offset", "torch_rms_norm_unit_offset", "torch_geglu"):
        assert impl in text, text
