"""Review of the runtime side of decode_attention, add_rms_norm, add_layer_norm, swiglu, rope, linear with an
activation and conv2d_bn_relu: each against the torch composite it replaces (results, dtypes, shapes, errors,
aliasing, gradients), on the default (CPU) route and, where it matters, the Triton kernel (interpreter)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kernel_space import get_impl, get_op
from kernel_space.decode_attention.problem import reference as decode_reference
from kernel_space.linear import activate
from ops_adv import _dispatch
from ops_adv.ops import add_layer_norm as _add_ln, add_rms_norm as _add_rms, decode_attention as _decode, \
    rope as _rope, swiglu as _swiglu
from ops_adv.ops.conv2d_bn_relu import conv2d_bn_relu
from ops_adv.ops.linear import linear_fused

O = torch.ops.ops_adv
DEV = "cuda" if torch.cuda.is_available() else "cpu"  # where the Triton-route tests run (the interpreter on the CPU)
SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
TOL = {torch.float64: 1e-9, torch.float32: 2e-5, torch.float16: 2e-2, torch.bfloat16: 5e-2}


@pytest.fixture
def triton_route(monkeypatch):
    """Every problem resolves to `name`'s Triton kernel at its first valid config (the interpreter on the CPU)."""
    pytest.importorskip("triton")

    def use(name: str):
        def resolve(op, problem, device):
            impl = get_impl(op, name)
            p = get_op(op).problem._make(problem)
            valid = (c for c in impl.configs() if impl.check is None or impl.check(p, c) is None)
            return impl.bind(next(valid, None) or impl.default_params())

        monkeypatch.setattr(_dispatch, "_resolve", resolve)
        for c in _dispatch._caches.values():
            c.clear()

    yield use
    monkeypatch.undo()
    for c in _dispatch._caches.values():
        c.clear()


def _close(got, want, dtype):
    assert got.shape == want.shape and got.dtype == want.dtype, (got.shape, want.shape, got.dtype, want.dtype)
    assert torch.allclose(got.double(), want.double(), atol=TOL[dtype], rtol=TOL[dtype], equal_nan=True)


def _outcome(fn):
    try:
        out = fn()
    except Exception as e:  # the error type is part of the semantics
        return type(e)
    return out if isinstance(out, tuple) else (out,)


def _same(got, want, dtype):
    if isinstance(want, type):
        assert got is want or (isinstance(got, type) and issubclass(got, want)), (got, want)
        return
    assert not isinstance(got, type), f"ops_adv raised {got.__name__} where torch works"
    for g, w in zip(got, want):
        _close(g, w, dtype)


# --------------------------------------------------------------------------- rope


def _tables(n: int, D: int, dtype, interleaved: bool, half_width: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    c, s = torch.randn(n, D // 2, generator=g), torch.randn(n, D // 2, generator=g)
    if not half_width:
        c, s = (c.repeat_interleave(2, -1), s.repeat_interleave(2, -1)) if interleaved else (c.repeat(1, 2), s.repeat(1, 2))
    return c.to(dtype), s.to(dtype)


def _rope_reference(q, k, cos, sin, positions, interleaved, layout):
    """transformers' formula, written out here: tables read at positions, widened, per token."""
    if positions is not None:
        cos, sin = cos[positions], sin[positions]
    D = q.shape[-1]
    if cos.shape[-1] != D:
        cos, sin = ((cos.repeat_interleave(2, -1), sin.repeat_interleave(2, -1)) if interleaved
                    else (torch.cat((cos, cos), -1), torch.cat((sin, sin), -1)))
    cos, sin = cos.unsqueeze(-3 if layout == "bhsd" else -2), sin.unsqueeze(-3 if layout == "bhsd" else -2)

    def rot(x):
        if interleaved:
            return torch.stack((-x[..., 1::2], x[..., ::2]), -1).flatten(-2)
        return torch.cat((-x[..., D // 2:], x[..., :D // 2]), -1)

    return q * cos + rot(q) * sin, k * cos + rot(k) * sin


def test_rope_rotates_k_when_q_has_no_heads():
    """Hq = 0 used to skip the whole call and return k's output uninitialised."""
    q, k = torch.randn(2, 3, 0, 8), torch.randn(2, 3, 2, 8)
    cos, sin = _tables(3, 8, torch.float32, False, False)
    qo, ko = _rope.rope(q, k, cos, sin)
    want_q, want_k = _rope_reference(q, k, cos, sin, None, False, "bshd")
    assert qo.shape == want_q.shape and torch.allclose(ko, want_k)
    k2 = k.clone()
    _rope.rope(q, k2, cos, sin, inplace=True)
    assert torch.allclose(k2, want_k)


def test_rope_inplace_returns_the_callers_tensors_on_every_path():
    q, k = torch.randn(1, 2, 3, 8), torch.randn(1, 1, 3, 8)  # (B, H, S, D)
    cos, sin = _tables(3, 8, torch.float32, False, False)
    for c in (cos, cos.clone().requires_grad_(True)):  # covered, and the composite (a table needing grad)
        qq, kk = q.clone(), k.clone()
        with torch.no_grad():
            qo, ko = _rope.rope(qq, kk, c, sin, layout="bhsd", inplace=True)
        assert qo is qq and ko is kk
        assert torch.allclose(qq, _rope_reference(q, k, cos, sin, None, False, "bhsd")[0])


def test_rope_inplace_kernel_bumps_version(triton_route):
    """A tensor another op saved for backward, then rotated in place: autograd must notice, as with torch's ops."""
    triton_route("triton_rope")
    cos, sin = (t.to(DEV) for t in _tables(3, 8, torch.float32, False, False))
    p = torch.randn(1, 3, 2, 8, requires_grad=True, device=DEV)
    q, k = torch.randn(1, 3, 2, 8, device=DEV), torch.randn(1, 3, 1, 8, device=DEV)
    y = p * q  # saves q for p's gradient
    v = q._version
    _rope.rope(q, k, cos, sin, inplace=True)
    assert q._version > v
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


def test_apply_rotary_pos_emb_refuses_half_width_tables_as_transformers():
    """transformers' formula cannot broadcast a (B, S, D/2) table against (B, H, S, D): neither may the drop-in."""
    q, k = torch.randn(1, 2, 3, 8), torch.randn(1, 1, 3, 8)
    cos, sin = _tables(3, 8, torch.float32, False, True)
    with pytest.raises(RuntimeError, match="size of tensor"):
        _rope.apply_rotary_pos_emb(q, k, cos[None], sin[None])


def test_rope_inplace_refuses_what_torch_refuses(triton_route):
    """In place into an inference tensor outside inference mode, or into an expanded tensor: torch's in-place
    ops raise; the kernel's raw writes used to succeed (the table changed whether the call works)."""
    triton_route("triton_rope")
    cos, sin = (t.to(DEV) for t in _tables(3, 8, torch.float32, False, False))
    with torch.inference_mode():
        q = torch.randn(1, 3, 2, 8, device=DEV)
    with pytest.raises(RuntimeError, match="inference tensor"):
        _rope.rope(q, torch.randn(1, 3, 1, 8, device=DEV), cos, sin, inplace=True)
    with pytest.raises(RuntimeError, match="single memory location"):
        expanded = torch.randn(1, 1, 2, 8, device=DEV).expand(1, 3, 2, 8)
        _rope.rope(expanded, torch.randn(1, 3, 1, 8, device=DEV), cos, sin, inplace=True)
    with torch.inference_mode():  # inside inference mode it is an ordinary in-place call
        k = torch.randn(1, 3, 1, 8, device=DEV)
        want = _rope_reference(q, k, cos, sin, None, False, "bshd")
        qo, ko = _rope.rope(q, k, cos, sin, inplace=True)
        assert qo is q and torch.allclose(q, want[0]) and torch.allclose(k, want[1])


@SETTINGS
@given(B=st.integers(1, 2), S=st.integers(0, 3), Hq=st.integers(0, 3), Hkv=st.integers(0, 2), D=st.sampled_from([2, 4, 8]),
       layout=st.sampled_from(["bshd", "bhsd"]), interleaved=st.booleans(), half_width=st.booleans(),
       table=st.sampled_from(["S", "1S", "BS", "pos", "posB"]), dtype=st.sampled_from([torch.float32, torch.float16]),
       inplace=st.booleans(), grad=st.booleans())
def test_rope_property(B, S, Hq, Hkv, D, layout, interleaved, half_width, table, dtype, inplace, grad):
    g = torch.Generator().manual_seed(B * 100 + S * 10 + Hq)
    shape = lambda H: (B, H, S, D) if layout == "bhsd" else (B, S, H, D)  # noqa: E731
    q, k = torch.randn(shape(Hq), generator=g).to(dtype), torch.randn(shape(Hkv), generator=g).to(dtype)
    positions = None
    if table.startswith("pos"):
        cos, sin = _tables(7, D, dtype, interleaved, half_width)
        positions = torch.randint(0, 7, (B, S) if table == "posB" else (S,), generator=g)
    else:
        cos, sin = _tables(S, D, dtype, interleaved, half_width)
        if table != "S":
            n = B if table == "BS" else 1
            cos, sin = cos.expand(n, S, cos.shape[-1]), sin.expand(n, S, sin.shape[-1])
    want = _rope_reference(q, k, cos, sin, positions, interleaved, layout)
    if grad and not inplace:
        q.requires_grad_(True)
    qo, ko = _rope.rope(q, k, cos, sin, positions, interleaved=interleaved, inplace=inplace, layout=layout)
    _close(qo, want[0], dtype)
    _close(ko, want[1], dtype)
    if inplace:
        assert qo is q and ko is k
    if q.requires_grad and qo.numel():
        gq = torch.randn_like(qo)
        (qo * gq).sum().backward()
        qr = q.detach().clone().requires_grad_(True)
        (_rope_reference(qr, k, cos, sin, positions, interleaved, layout)[0] * gq).sum().backward()
        _close(q.grad, qr.grad, dtype)


# --------------------------------------------------------------------------- add + norm, swiglu


def _rand(shape, dtype, seed):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@SETTINGS
@given(lead=st.lists(st.integers(0, 3), max_size=2), cols=st.integers(1, 9),
       dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16, torch.float64]),
       res=st.sampled_from(["same", "bcast", "fp16", "transposed", "wrong"]), weight=st.sampled_from(["same", "none", "fp64"]),
       bias=st.booleans(), grads=st.sets(st.sampled_from(["x", "r", "w"])), no_grad=st.booleans())
def test_add_norms_property(lead, cols, dtype, res, weight, bias, grads, no_grad):
    shape = (*lead, cols)
    x = _rand(shape, dtype, 1)
    r = {"same": lambda: _rand(shape, dtype, 2), "bcast": lambda: _rand((cols,), dtype, 2),
         "fp16": lambda: _rand(shape, torch.float16, 2), "wrong": lambda: _rand((*lead, cols + 1), dtype, 2),
         "transposed": lambda: _rand(shape[::-1], dtype, 2).transpose(0, -1) if len(shape) > 1 else _rand(shape, dtype, 2)}[res]()
    w = None if weight == "none" else _rand((cols,), torch.float64 if weight == "fp64" else dtype, 3)
    b = _rand((cols,), dtype, 4) if bias and w is not None else None
    leaves = {"x": x, "r": r, "w": w}
    if dtype in (torch.float32, torch.float64):
        for n in grads:
            if leaves[n] is not None:
                leaves[n].requires_grad_(True)

    def run(rms, ours):
        if ours:
            return _add_rms.add_rms_norm(x, r, w) if rms else _add_ln.add_layer_norm(x, r, w, b)
        h = x + r
        return (F.rms_norm(h, h.shape[-1:], w), h) if rms else (F.layer_norm(h, h.shape[-1:], w, b), h)

    for rms in (True, False):
        with torch.set_grad_enabled(not no_grad):
            got, want = _outcome(lambda: run(rms, True)), _outcome(lambda: run(rms, False))
        _same(got, want, dtype)
        if isinstance(want, tuple) and want[0].requires_grad and want[0].numel():
            gy, gh = torch.randn_like(want[0]), torch.randn_like(want[1])
            ins = [t for t in leaves.values() if t is not None and t.requires_grad]
            g_got = torch.autograd.grad((got[0] * gy).sum() + (got[1] * gh).sum(), ins, allow_unused=True)
            g_want = torch.autograd.grad((want[0] * gy).sum() + (want[1] * gh).sum(), ins, allow_unused=True)
            for a, c in zip(g_got, g_want):
                _close(a, c, torch.float32)


@SETTINGS
@given(lead=st.lists(st.integers(0, 3), max_size=2), n=st.integers(1, 6), merged=st.booleans(),
       dtype=st.sampled_from([torch.float32, torch.float16, torch.float64]), up=st.sampled_from(["same", "bcast", "fp32"]),
       grad=st.booleans())
def test_swiglu_property(lead, n, merged, dtype, up, grad):
    gate = _rand((*lead, 2 * n if merged else n), dtype, 1)
    u = None if merged else {"same": _rand((*lead, n), dtype, 2), "bcast": _rand((n,), dtype, 2),
                             "fp32": _rand((*lead, n), torch.float32, 2)}[up]
    if grad and dtype is not torch.float16:
        gate.requires_grad_(True)
    want = _outcome(lambda: F.silu(gate[..., :n]) * gate[..., n:] if merged else F.silu(gate) * u)
    got = _outcome(lambda: _swiglu.swiglu(gate, u))
    _same(got, want, dtype)
    if gate.requires_grad and want[0].numel():
        go = torch.randn_like(want[0])
        _close(torch.autograd.grad((got[0] * go).sum(), gate)[0], torch.autograd.grad((want[0] * go).sum(), gate)[0], dtype)


@pytest.mark.parametrize("shape", [(2, 7), (3, 1), ()])
def test_swiglu_odd_merged_width_is_a_clear_error(shape):
    """An odd merged width has no gate/up halves: torch's composite failed with a size mismatch, or for width 1
    returned an empty tensor silently."""
    with pytest.raises(ValueError, match="even last dimension"):
        _swiglu.swiglu(torch.randn(shape))


# --------------------------------------------------------------------------- linear with an activation


@SETTINGS
@given(lead=st.lists(st.integers(0, 3), max_size=2), K=st.integers(0, 4), N=st.integers(0, 4),
       act=st.sampled_from(["none", "relu", "gelu", "gelu_tanh", "silu"]), bias=st.sampled_from(["none", "vec", "wrong", "fp64"]),
       dtype=st.sampled_from([torch.float32, torch.float16, torch.float64]), wt=st.booleans(), grads=st.sets(st.sampled_from("xwb")))
def test_linear_activation_property(lead, K, N, act, bias, dtype, wt, grads):
    x = _rand((*lead, K), dtype, 1)
    w = _rand((K, N), dtype, 2).t() if wt else _rand((N, K), dtype, 2)
    b = {"none": None, "vec": _rand((N,), dtype, 3), "wrong": _rand((N + 1,), dtype, 3), "fp64": _rand((N,), torch.float64, 3)}[bias]
    if dtype is not torch.float16:
        for n, t in zip("xwb", (x, w, b)):
            if n in grads and t is not None:
                t.requires_grad_(True)
    want = _outcome(lambda: activate(F.linear(x, w, b), act))
    got = _outcome(lambda: linear_fused(x, w, b, act))
    _same(got, want, dtype)
    ins = [t for t in (x, w, b) if t is not None and t.requires_grad]
    if ins and isinstance(want, tuple) and want[0].numel():
        go = torch.randn_like(want[0])
        for a, c in zip(torch.autograd.grad((got[0] * go).sum(), ins), torch.autograd.grad((want[0] * go).sum(), ins)):
            _close(a, c, dtype)


@pytest.mark.parametrize("K,N", [(0, 3), (4, 0)])
def test_linear_gradient_with_an_empty_dimension(K, N):
    """Found by test_linear_activation_property: the backward reshaped with -1, which fails when K or N is 0."""
    x, w = torch.randn(2, K, requires_grad=True), torch.randn(N, K, requires_grad=True)
    gx, gw = torch.autograd.grad(linear_fused(x, w, None, "relu").sum(), (x, w))
    assert gx.shape == x.shape and gw.shape == w.shape and not gx.any() and not gw.any()


# --------------------------------------------------------------------------- decode_attention


@SETTINGS
@given(B=st.integers(0, 2), Hkv=st.integers(1, 2), G=st.integers(1, 3), Sq=st.integers(0, 3), Skv=st.integers(0, 4),
       D=st.sampled_from([4, 8]), lens=st.booleans(), causal=st.booleans(), int32=st.booleans(), grad=st.booleans())
def test_decode_property(B, Hkv, G, Sq, Skv, D, lens, causal, int32, grad):
    g = torch.Generator().manual_seed(B + 10 * Sq + 100 * Skv)
    q = torch.randn(B, Hkv * G, Sq, D, generator=g)
    k, v = torch.randn(B, Hkv, Skv, D, generator=g), torch.randn(B, Hkv, Skv, D, generator=g)
    seq_lens = torch.randint(-1, Skv + 3, (B,), generator=g, dtype=torch.int32 if int32 else torch.int64) if lens else None
    want = decode_reference(q, k, v, seq_lens, causal).float()
    if grad:
        q.requires_grad_(True)
        v.requires_grad_(True)
    got = _decode.decode_attention(q, k, v, seq_lens, causal=causal)
    _close(got, want, torch.float32)
    if grad and got.numel():
        go = torch.randn_like(got)
        gq, gv = torch.autograd.grad((got * go).sum(), (q, v))
        qr, vr = q.detach().double().requires_grad_(True), v.detach().double().requires_grad_(True)
        rq, rv = torch.autograd.grad((decode_reference(qr, k.double(), vr, seq_lens, causal) * go.double()).sum(), (qr, vr))
        _close(gq, rq.float(), torch.float32)
        _close(gv, rv.float(), torch.float32)


def test_decode_seq_lens_not_a_tensor_is_a_clear_error():
    q, k = torch.randn(1, 4, 1, 8), torch.randn(1, 2, 4, 8)
    with pytest.raises(TypeError, match="seq_lens must be an int32 or int64 tensor"):  # was AttributeError: no .dim
        _decode.decode_attention(q, k, k, [3])


def test_decode_inputs_on_several_devices_fail_as_sdpa(triton_route):
    """k or v on another device than q: SDPA's one-line error, not the kernel's (on a GPU, a bad pointer)."""
    triton_route("triton_decode")
    q, k = torch.randn(1, 4, 1, 16, device=DEV), torch.randn(1, 2, 5, 16, device=DEV)
    for kk, vv in ((k.to("meta"), k), (k, k.to("meta"))):
        with pytest.raises(RuntimeError, match="same device"):
            _decode.decode_attention(q, kk, vv)


def test_decode_kernel_clamps_lengths_as_the_fallback(triton_route):
    """Negative and longer-than-cache lengths: the Triton kernel sees what the SDPA fallback sees."""
    q, k, v = (torch.randn(shape, device=DEV) for shape in ((3, 4, 2, 16), (3, 2, 6, 16), (3, 2, 6, 16)))
    lens = torch.tensor([-2, 9, 3], device=DEV)
    want = _decode._fallback(q, k, v, lens, True, None)
    triton_route("triton_decode")
    _close(_decode.decode_attention(q, k, v, lens, causal=True), want, torch.float32)


def test_autocast_gives_torchs_dtypes(triton_route):
    """Under autocast F.linear, SDPA and conv2d compute in bf16 (layer_norm in fp32 on CUDA); the kernels, which autocast
    does not see, returned fp32: the table changed the result's dtype."""
    x, w, b = torch.randn(4, 16, device=DEV), torch.randn(16, 16, device=DEV), torch.randn(16, device=DEV)
    q, k, v = (torch.randn(shape, device=DEV) for shape in ((1, 4, 1, 16), (1, 2, 5, 16), (1, 2, 5, 16)))
    r, nw = torch.randn(4, 16, device=DEV), torch.randn(16, device=DEV)
    cx, cw, cb = torch.randn(1, 3, 5, 5, device=DEV), torch.randn(4, 3, 3, 3, device=DEV), torch.randn(4, device=DEV)
    cases = [("triton", lambda: linear_fused(x, w, b, "relu"), lambda: F.relu(F.linear(x, w, b))),
             ("triton_decode", lambda: _decode.decode_attention(q, k, v),
              lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)),
             ("triton_add_layer_norm", lambda: _add_ln.add_layer_norm(x, r, nw, nw)[0],
              lambda: F.layer_norm(x + r, (16,), nw, nw)),
             ("triton_add_rms_norm", lambda: _add_rms.add_rms_norm(x, r, nw)[0], lambda: F.rms_norm(x + r, (16,), nw)),
             ("triton_implicit_gemm", lambda: conv2d_bn_relu(cx, cw, cb, 1, 1, 1),
              lambda: F.relu(F.conv2d(cx, cw, cb, 1, 1)))]
    for impl, ours, theirs in cases:
        triton_route(impl)
        with torch.autocast(DEV, dtype=torch.bfloat16):
            got, want = ours(), theirs()
        _close(got, want, torch.bfloat16)
        got.float().sum()  # and outside autocast the kernel serves the call again
        assert ours().dtype == torch.float32


# --------------------------------------------------------------------------- custom operators: float64 gradcheck


def _d(*shape, seed=0, grad=True):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).requires_grad_(grad)


def _half_table(n, D, seed):
    t = _d(n, D // 2, seed=seed, grad=False)
    return torch.cat((t, t), -1)


GRADCHECK = {
    "decode": lambda: (O.decode_attention, (_d(2, 4, 2, 4, seed=1), _d(2, 2, 5, 4, seed=2), _d(2, 2, 5, 4, seed=3),
                                            torch.tensor([3, 5]), True)),
    "decode_nolens": lambda: (O.decode_attention, (_d(1, 2, 1, 4, seed=1), _d(1, 1, 3, 4, seed=2), _d(1, 1, 3, 4, seed=3),
                                                   None, False)),
    "add_rms_norm": lambda: (O.add_rms_norm, (_d(3, 6, seed=1), _d(3, 6, seed=2), _d(6, seed=3), 1e-6)),
    "add_layer_norm": lambda: (O.add_layer_norm, (_d(3, 6, seed=1), _d(3, 6, seed=2), _d(6, seed=3), _d(6, seed=4), 1e-5)),
    "swiglu": lambda: (O.swiglu, (_d(3, 4, seed=1), _d(3, 4, seed=2))),
    "swiglu_merged": lambda: (O.swiglu, (_d(3, 8, seed=1), None)),
    "rope": lambda: (O.rope, (_d(2, 3, 2, 4, seed=1), _d(2, 3, 1, 4, seed=2), _half_table(3, 4, 3), _half_table(3, 4, 4),
                              None, False, "bshd")),
    "rope_positions_bhsd": lambda: (O.rope, (_d(2, 2, 3, 4, seed=1), _d(2, 1, 3, 4, seed=2), _d(5, 2, seed=3, grad=False),
                                             _d(5, 2, seed=4, grad=False), torch.tensor([4, 0, 2]), False, "bhsd")),
    "rope_interleaved": lambda: (O.rope, (_d(3, 2, 4, seed=1), _d(3, 1, 4, seed=2), _d(3, 2, seed=3, grad=False),
                                          _d(3, 2, seed=4, grad=False), None, True, "bshd")),
    "linear_gelu": lambda: (O.linear, (_d(2, 3, 4, seed=1), _d(5, 4, seed=2), _d(5, seed=3), "gelu")),
    "linear_silu_nobias": lambda: (O.linear, (_d(3, 4, seed=1), _d(5, 4, seed=2), None, "silu")),
}


@pytest.mark.parametrize("case", sorted(GRADCHECK))
def test_custom_operator_gradcheck_float64(case):
    """The operators' autograd formulas against numerical gradients of their float64 bodies (the composites)."""
    op, args = GRADCHECK[case]()
    tensors = [a for a in args if torch.is_tensor(a) and a.requires_grad]

    def f(*ts):
        it = iter(ts)
        return op(*[next(it) if torch.is_tensor(a) and a.requires_grad else a for a in args])

    assert torch.autograd.gradcheck(f, tensors, eps=1e-6, atol=1e-5)
    # second derivatives too, as the composites have them (linear's silu had none: aten.silu_backward)
    assert torch.autograd.gradgradcheck(f, tensors, eps=1e-6, atol=1e-4)


def test_export_keeps_the_custom_operators():
    """torch.export on the CPU: each covered call is its `ops_adv::` operator, and the program computes the same."""
    cos, sin = _tables(3, 8, torch.float32, False, False)

    class M(torch.nn.Module):
        def forward(self, q, k, v, lens, x, r, lw, lb, cx, cw, cb):
            a = _decode.decode_attention(q, k, v, lens, causal=True)
            qo, ko = _rope.rope(x.view(2, 3, 1, 8), r.view(2, 3, 1, 8), cos, sin)
            return a, qo, ko, linear_fused(x, lw, lb, "gelu"), conv2d_bn_relu(cx, cw, cb, 1, 1, 1)

    args = (torch.randn(2, 4, 2, 8), torch.randn(2, 2, 5, 8), torch.randn(2, 2, 5, 8), torch.tensor([3, 5]),
            torch.randn(6, 8), torch.randn(6, 8), torch.randn(5, 8), torch.randn(5), torch.randn(1, 3, 5, 5),
            torch.randn(4, 3, 3, 3), torch.randn(4))
    ep = torch.export.export(M(), args)
    targets = {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}
    for op in ("decode_attention", "rope", "linear", "conv2d_bn_relu"):
        assert f"ops_adv.{op}.default" in targets, targets
    for got, want in zip(ep.module()(*args), M()(*args)):
        _close(got, want, torch.float32)
