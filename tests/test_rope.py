"""rope: the Triton kernel (interpreter on CPU) and the runtime op against the float64 reference and
transformers' apply_rotary_pos_emb; layouts, in place, GQA, positions, torch.compile and gradients."""
from __future__ import annotations

import pytest
import torch

from kernel_space import get_impl, get_op, relative_error
from kernel_space.rope.problem import RopeProblem
from ops_adv.ops.rope import apply_rotary_pos_emb, rope

pytest.importorskip("triton")
hf = pytest.importorskip("transformers.models.llama.modeling_llama")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SPEC = get_op("rope")
TRITON = get_impl("rope", "triton_rope")
DTYPES = ["fp32", "fp16"] + (["bf16"] if DEVICE == "cuda" else [])  # bf16: GPU only, as the other Triton tests
TOL = {"fp32": 1e-5, "fp16": 2e-3, "bf16": 1e-2}
COMPILE_BACKEND = "inductor"


def _configs(p: RopeProblem, n: int = 3) -> list[dict]:
    ok = [c for c in TRITON.configs() if TRITON.why_not(p, c, "cuda") is None]
    assert ok, f"no valid config for {p}"
    return ok[:: max(1, len(ok) // n)][:n]


def _tables(S: int, D: int, dtype, interleaved: bool = False, B: int | None = None, seed: int = 0):
    """Full-width transformers-style tables at random positions: (S, D), or (B, S, D)."""
    g = torch.Generator().manual_seed(seed)
    pos = torch.randint(0, 4096, (B or 1, S), generator=g).double()
    inv = 10000.0 ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)
    a = pos[..., None] * inv
    a = a.repeat_interleave(2, -1) if interleaved else torch.cat([a, a], -1)
    cos, sin = a.cos().to(DEVICE, dtype), a.sin().to(DEVICE, dtype)
    return (cos, sin) if B else (cos[0], sin[0])


# --------------------------------------------------------------------------- kernel_space


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,Hq,Hkv,D,interleaved,positions", [
    (37, 4, 2, 64, False, False), (13, 3, 1, 128, False, False), (9, 4, 4, 16, True, False),
    (21, 6, 2, 64, True, True), (7, 2, 1, 16, False, True), (1, 8, 2, 128, False, False),
])
def test_triton_matches_reference(tokens, Hq, Hkv, D, interleaved, positions, dtype):
    p = RopeProblem(tokens, Hq, Hkv, D, interleaved, positions, dtype)
    args, attrs = SPEC.make_inputs(p, DEVICE, seed=3)
    assert SPEC.signature(*args, **attrs) == tuple(p)
    ref = SPEC.reference(*args, **attrs)
    assert relative_error(get_impl("rope", "torch_rope").fn(*args, **attrs), ref) < SPEC.tolerance(dtype)
    for cfg in _configs(p):
        out = TRITON.bind(cfg)(*args, **attrs)
        assert out.shape == (tokens, Hq + Hkv, D)
        assert relative_error(out, ref) < TOL[dtype], cfg


@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
@pytest.mark.parametrize("interleaved", [False, True])
def test_triton_strided_layouts_and_in_place(layout, interleaved):
    """(B, H, S, D) as the transposed view, (B, S, D) tables, out= into q and k themselves."""
    B, S, Hq, Hkv, D = 2, 5, 4, 2, 32
    q = torch.randn(B, S, Hq, D, device=DEVICE)
    k = torch.randn(B, S, Hkv, D, device=DEVICE)
    if layout == "bhsd":  # contiguous (B, H, S, D) seen as (B, S, H, D)
        q, k = q.transpose(1, 2).contiguous().transpose(1, 2), k.transpose(1, 2).contiguous().transpose(1, 2)
    cos, sin = _tables(S, D, torch.float32, interleaved, B=B)
    ref = SPEC.reference(q, k, cos, sin, interleaved=interleaved)
    p = RopeProblem(B * S, Hq, Hkv, D, interleaved, False, "fp32")
    for cfg in _configs(p, 2):
        qc, kc = q.clone(), k.clone()
        qo, ko = TRITON.bind(cfg)(qc, kc, cos, sin, interleaved=interleaved, out=(qc, kc))
        assert qo is qc and ko is kc
        assert relative_error(torch.cat([qc, kc], -2), ref) < 1e-6


def test_triton_checks_give_reasons():
    p = RopeProblem(1, 32, 8, 128, dtype="bf16")
    assert "exceeds the 1 tokens" in TRITON.why_not(p, {**TRITON.default_params(), "BLOCK_T": 8})
    assert "under 16 bytes" in TRITON.why_not(p, {"BLOCK_T": 1, "BLOCK_H": 1, "SPLIT_HEADS": True, "num_warps": 16})
    assert "registers" in TRITON.why_not(RopeProblem(4096, 32, 8, 128), {"BLOCK_T": 32, "BLOCK_H": 32,
                                                                          "SPLIT_HEADS": False, "num_warps": 1})
    assert "odd" in TRITON.why_not(RopeProblem(8, 2, 2, 15), TRITON.default_params())
    liger = get_impl("rope", "liger_rope")
    assert liger.why_not(RopeProblem(8, 2, 2, 64, True)) is not None


# --------------------------------------------------------------------------- runtime op


def _hf_inputs(B, S, Hq, Hkv, D, dtype, seed=0):
    """q, k (B, H, S, D) as Llama's attention has them, and LlamaRotaryEmbedding's cos/sin."""
    from transformers import LlamaConfig

    cfg = LlamaConfig(hidden_size=Hq * D, num_attention_heads=Hq, num_key_value_heads=Hkv, head_dim=D)
    emb = hf.LlamaRotaryEmbedding(cfg).to(DEVICE)
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, S, Hq, D, generator=g).to(DEVICE, dtype).transpose(1, 2)  # q_proj(x).view(...).transpose
    k = torch.randn(B, S, Hkv, D, generator=g).to(DEVICE, dtype).transpose(1, 2)
    pos = torch.randint(0, 2048, (B, S), generator=g).to(DEVICE)
    cos, sin = emb(q, pos)
    return q, k, cos, sin, pos


@pytest.fixture(params=["default", "triton"])
def route(request, monkeypatch):
    """The runtime's eager path through its default (the composite on CPU) or the Triton kernel."""
    if request.param == "default":
        yield None
        return
    import ops_adv.ops.rope as m

    class Kernel(dict):  # every rope problem resolves to the Triton kernel at a config valid for it
        calls = 0

        def get(self, key, default=None):
            Kernel.calls += 1
            return TRITON.bind(_configs(RopeProblem._make(key[0]), 1)[0])

    monkeypatch.setattr(m, "_rope_cache", Kernel())
    yield Kernel
    assert Kernel.calls, "the Triton kernel never ran"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("B,S,Hq,Hkv,D", [(2, 7, 4, 2, 64), (1, 5, 3, 1, 128), (3, 1, 2, 2, 16)])
def test_apply_rotary_pos_emb_matches_transformers(route, B, S, Hq, Hkv, D, dtype):
    q, k, cos, sin, _ = _hf_inputs(B, S, Hq, Hkv, D, dtype)
    want = hf.apply_rotary_pos_emb(q, k, cos, sin)
    got = apply_rotary_pos_emb(q, k, cos, sin)
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype
        if route is None:
            assert torch.equal(g, w)  # the composite is transformers' formula, bit for bit
        else:
            assert relative_error(g, w) < TOL["fp32" if dtype == torch.float32 else "fp16"]
    # (B, S, H, D) with unsqueeze_dim=2
    got2 = apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin, unsqueeze_dim=2)
    for g, w in zip(got2, want):
        assert relative_error(g.transpose(1, 2), w) < 2e-3


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
def test_rope_in_place_writes_q_and_k(route, interleaved, layout):
    B, S, Hq, Hkv, D = 2, 9, 4, 2, 32
    q = torch.randn(B, S, Hq, D, device=DEVICE)
    k = torch.randn(B, S, Hkv, D, device=DEVICE)
    if layout == "bhsd":
        q, k = q.transpose(1, 2).contiguous(), k.transpose(1, 2).contiguous()
    cos, sin = _tables(S, D, torch.float32, interleaved, B=B)
    want = rope(q, k, cos, sin, interleaved=interleaved, layout=layout)
    qp, kp = q.data_ptr(), k.data_ptr()
    q0, k0 = q.clone(), k.clone()
    got = rope(q, k, cos, sin, interleaved=interleaved, inplace=True, layout=layout)
    assert got[0] is q and got[1] is k and q.data_ptr() == qp and k.data_ptr() == kp
    assert not torch.equal(q, q0) and not torch.equal(k, k0)
    for g, w in zip(got, want):
        assert relative_error(g, w) < 1e-6
    qa, ka = (q0.transpose(1, 2), k0.transpose(1, 2)) if layout == "bhsd" else (q0, k0)
    ref = SPEC.reference(qa, ka, cos, sin, interleaved=interleaved)
    gq, gk = (q.transpose(1, 2), k.transpose(1, 2)) if layout == "bhsd" else (q, k)
    assert relative_error(torch.cat([gq, gk], -2), ref) < 1e-6


@pytest.mark.parametrize("full_width", [False, True])
@pytest.mark.parametrize("interleaved", [False, True])
def test_rope_positions_cache(route, interleaved, full_width):
    """A (max_pos, D/2) cache (or a full-width one) read at positions (B, S), (S,), and for (T, H, D) tensors at (T,)."""
    B, S, Hq, Hkv, D, max_pos = 2, 11, 4, 1, 64, 100
    g = torch.Generator().manual_seed(1)
    q = torch.randn(B, S, Hq, D, generator=g).to(DEVICE)
    k = torch.randn(B, S, Hkv, D, generator=g).to(DEVICE)
    a = torch.arange(max_pos, dtype=torch.float64)[:, None] * 10000.0 ** (-torch.arange(0, D, 2) / D)
    if full_width:
        a = a.repeat_interleave(2, -1) if interleaved else torch.cat([a, a], -1)
    cache_cos, cache_sin = a.cos().float().to(DEVICE), a.sin().float().to(DEVICE)
    for pos in (torch.randint(0, max_pos, (B, S), generator=g).to(DEVICE), torch.arange(S, device=DEVICE) + 50):
        got = rope(q, k, cache_cos, cache_sin, pos, interleaved=interleaved)
        ref = SPEC.reference(q, k, cache_cos, cache_sin, pos, interleaved=interleaved)
        assert relative_error(torch.cat(got, -2), ref) < 1e-6
    qt, kt = q[0], k[0]
    pos = torch.randint(0, max_pos, (S,), generator=g).to(DEVICE)
    got = rope(qt, kt, cache_cos, cache_sin, pos, interleaved=interleaved)
    assert relative_error(torch.cat(got, -2), SPEC.reference(qt, kt, cache_cos, cache_sin, pos, interleaved=interleaved)) < 1e-6


def test_uncovered_calls_run_the_composite():
    """fp32 tables with fp16 q/k promote (as transformers' formula does); the op does the same."""
    q, k, cos, sin, _ = _hf_inputs(1, 4, 2, 2, 16, torch.float16)
    want = hf.apply_rotary_pos_emb(q, k, cos.float(), sin.float())
    got = apply_rotary_pos_emb(q, k, cos.float(), sin.float())
    assert all(g.dtype == torch.float32 and torch.equal(g, w) for g, w in zip(got, want))
    with pytest.raises(ValueError, match="layout"):
        rope(q, k, cos, sin, layout="sbhd")


def test_rope_compiles_fullgraph_in_place_and_not():
    q, k, cos, sin, _ = _hf_inputs(2, 6, 4, 2, 32, torch.float32)
    want = hf.apply_rotary_pos_emb(q, k, cos, sin)

    @torch.compile(fullgraph=True, backend=COMPILE_BACKEND)
    def f(q, k, cos, sin):
        return apply_rotary_pos_emb(q, k, cos, sin)

    got = f(q, k, cos, sin)
    assert all(relative_error(g, w) < 1e-6 for g, w in zip(got, want))

    @torch.compile(fullgraph=True, backend=COMPILE_BACKEND)
    def g_inplace(q, k, cos, sin):
        qo, ko = rope(q, k, cos, sin, inplace=True, layout="bhsd")
        return qo * 1.0, ko * 1.0

    qc, kc = q.clone(), k.clone()
    out = g_inplace(qc, kc, cos, sin)
    assert relative_error(qc, want[0]) < 1e-6 and relative_error(kc, want[1]) < 1e-6
    assert relative_error(out[0], want[0]) < 1e-6


def test_rope_custom_op_opcheck():
    q, k, cos, sin, _ = _hf_inputs(1, 3, 2, 1, 16, torch.float32)
    torch.library.opcheck(torch.ops.ops_adv.rope.default, (q.transpose(1, 2), k.transpose(1, 2), cos, sin, None, False, "bshd"))


@pytest.mark.parametrize("interleaved", [False, True])
def test_rope_gradient_matches_composite(route, interleaved):
    B, S, Hq, Hkv, D = 2, 5, 4, 2, 16
    q = torch.randn(B, Hq, S, D, device=DEVICE, dtype=torch.float64 if DEVICE == "cpu" and route is None else torch.float32)
    k = torch.randn(B, Hkv, S, D, device=DEVICE, dtype=q.dtype)
    cos, sin = _tables(S, D, q.dtype, interleaved, B=B)
    from kernel_space.rope.vendor import composite

    def ref_fn(q, k):
        c, s = cos.unsqueeze(1), sin.unsqueeze(1)
        return composite(q, c, s, interleaved), composite(k, c, s, interleaved)

    gq, gk = torch.randn_like(q), torch.randn_like(k)
    grads = []
    for fn in (ref_fn, lambda q, k: rope(q, k, cos, sin, interleaved=interleaved, layout="bhsd")):
        qq, kk = q.clone().requires_grad_(), k.clone().requires_grad_()
        qo, ko = fn(qq, kk)
        ((qo * gq).sum() + (ko * gk).sum()).backward()
        grads.append((qq.grad, kk.grad))
    for a, b in zip(*grads):
        assert relative_error(b, a) < 1e-6


@pytest.mark.skipif(DEVICE == "cpu", reason="bf16 runs on the GPU only")
def test_bf16_against_transformers_on_gpu():
    q, k, cos, sin, _ = _hf_inputs(2, 300, 32, 8, 128, torch.bfloat16)
    want = hf.apply_rotary_pos_emb(q.float(), k.float(), cos.float(), sin.float())
    for cfg in _configs(RopeProblem(600, 32, 8, 128, dtype="bf16"), 4):
        qo, ko = torch.empty_like(q), torch.empty_like(k)
        TRITON.bind(cfg)(q.transpose(1, 2), k.transpose(1, 2), cos, sin, out=(qo.transpose(1, 2), ko.transpose(1, 2)))
        assert relative_error(qo, want[0]) < 1e-2 and relative_error(ko, want[1]) < 1e-2


def test_liger_candidate_matches_reference():
    pytest.importorskip("liger_kernel")
    p = RopeProblem(6, 4, 2, 32, dtype="fp32")
    args, attrs = SPEC.make_inputs(p, DEVICE, seed=5)
    q0 = args[0].clone()
    liger = get_impl("rope", "liger_rope")
    out = liger.fn(*args, **attrs)
    assert torch.equal(args[0], q0)  # out of place: the inputs are left alone
    assert relative_error(out, SPEC.reference(*args, **attrs)) < 1e-5


@pytest.mark.parametrize("seed", range(8))
def test_triton_random_cases(seed):
    """Sampled problems: any token count, GQA head counts, head dims whose half is not a power of two
    (80, 96), both layouts and pair orders, tables or a cache, out of place or in place."""
    import random

    r = random.Random(seed)
    B, S = r.choice([1, 2, 3]), r.randint(1, 13)
    Hkv = r.choice([1, 2, 3])
    Hq = Hkv * r.choice([1, 2, 4])
    D = r.choice([16, 32, 80, 96, 128])
    interleaved, positions, inplace = (r.random() < 0.5 for _ in range(3))
    bhsd = bool(seed % 2)
    dtype = r.choice([torch.float32, torch.float16])
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, S, Hq, D, generator=g).to(DEVICE, dtype)
    k = torch.randn(B, S, Hkv, D, generator=g).to(DEVICE, dtype)
    if bhsd:  # physically (B, H, S, D)
        q, k = q.transpose(1, 2).contiguous().transpose(1, 2), k.transpose(1, 2).contiguous().transpose(1, 2)
    if positions:
        a = torch.arange(64, dtype=torch.float64)[:, None] * 10000.0 ** (-torch.arange(0, D, 2) / D)
        cos, sin, pos = a.cos().to(DEVICE, dtype), a.sin().to(DEVICE, dtype), torch.randint(0, 64, (B, S), generator=g)
        pos = pos.to(DEVICE)
    else:
        (cos, sin), pos = _tables(S, D, dtype, interleaved, B=B, seed=seed), None
    ref = SPEC.reference(q, k, cos, sin, pos, interleaved=interleaved)
    p = RopeProblem(B * S, Hq, Hkv, D, interleaved, positions, "fp32" if dtype == torch.float32 else "fp16")
    cfg = r.choice(_configs(p, 8))
    qc, kc = q.clone(), k.clone()
    out = (qc, kc) if inplace else (torch.empty_like(q), torch.empty_like(k))
    TRITON.bind(cfg)(qc, kc, cos, sin, pos, interleaved=interleaved, out=out)
    assert relative_error(torch.cat(out, -2), ref) < TOL[p.dtype], (p, cfg)


def test_rope_compiled_backward_matches_composite():
    q, k, cos, sin, _ = _hf_inputs(2, 5, 4, 2, 16, torch.float32)
    gq, gk = torch.randn_like(q), torch.randn_like(k)
    grads = []
    for fn in (hf.apply_rotary_pos_emb, torch.compile(apply_rotary_pos_emb, fullgraph=True, backend=COMPILE_BACKEND)):
        qq, kk = q.detach().clone().requires_grad_(), k.detach().clone().requires_grad_()
        qo, ko = fn(qq, kk, cos, sin)
        ((qo * gq).sum() + (ko * gk).sum()).backward()
        grads.append((qq.grad, kk.grad))
    for a, b in zip(*grads):
        assert relative_error(b, a) < 1e-6


@pytest.mark.parametrize("inplace", [False, True])
def test_with_no_winner_rope_runs_transformers_formula_in_the_callers_layout_and_counts_the_miss(inplace):
    """No table: the vendor's math on the caller's (B, H, S, D) tensors (no repacking, issue 30), bit for bit
    transformers', and the call still counts as a miss."""
    import ops_adv
    from ops_adv import _dispatch

    ops_adv.load_table("")
    q, k, cos, sin, _ = _hf_inputs(2, 5, 4, 2, 32, torch.float32)
    want = hf.apply_rotary_pos_emb(q, k, cos, sin)
    key = ("rope", get_op("rope").bucket((2 * 5, 4, 2, 32, False, False, "fp32")))
    before = ops_adv.misses().get(key, 0)
    with torch.no_grad():
        fn = _dispatch.lookup("rope", (2 * 5, 4, 2, 32, False, False, "fp32"), q.device)
        assert fn.vendor_miss is not None
        got = rope(q, k, cos, sin, layout="bhsd", inplace=inplace)
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    if inplace:
        assert got[0] is q and got[1] is k
    assert ops_adv.misses()[key] == before + 1
