"""The ops: torch's semantics, the table's kernels, and PyTorch custom operators for tracing.

Each op takes what its torch counterpart takes. A call ops-adv has no kernel family for (a
dtype, rank, feature or shape that no candidate covers) runs the torch function itself, so
it works, fails and promotes exactly as torch does. A call it covers:
- eager, with no input needing grad: signature, one dict lookup, the implementation;
- under torch.compile, torch.export or jit.trace, or when an input needs grad: the
  `ops_adv::<op>` custom operator. Its fake kernel gives the output's shape, its autograd
  formula runs vendor ops, and the table lookup happens inside it when it runs, so a graph
  never depends on the table and dynamic shapes stay symbolic.
A custom operator's own dispatch costs 17 µs (`torch.ops`) to 78 µs (`custom_op` object) a
call on this project's CPU machine, against 2 µs for a small matmul: eager stays off it.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from kernel_space import get_op
from kernel_space._common import DTYPE_CODE

from . import _dispatch
from ._dispatch import cache_for, lookup

_is_compiling = torch.compiler.is_compiling
_tracing_state = torch._C._get_tracing_state
_grad_enabled = torch.is_grad_enabled
# Under autocast torch's own function runs: autocast picks its dtypes (a kernel would return the input dtype).
_autocast = torch._C._is_any_autocast_enabled


def _traced(*ts: torch.Tensor) -> bool:
    """Whether this call is being traced or recorded for autograd (then the custom operator runs)."""
    if _is_compiling() or _tracing_state() is not None:
        return True
    if _grad_enabled():
        for t in ts:
            if t is not None and t.requires_grad:
                return True
    return False


def _op_needed(op: str, *args: Any) -> bool:
    """For a call recorded for autograd: whether a tuned kernel applies (then the custom operator runs
    it, with our backward), or the default does (then torch's own function runs, graph and all: a
    custom operator's dispatch costs 17-78 µs a call here, and torch's backward is torch's)."""
    problem = get_op(op).signature(*args)
    return not _dispatch.runs_default(op, problem, args[0].device)


# The dispatcher's per-op caches, read directly on the hot path (a function call costs ~150 ns).
_gemm_cache = cache_for("gemm")
DECODE_MAX_QUERY = 16  # query rows up to which grouped-head attention runs decode_attention
_attention_cache = cache_for("attention")

# --------------------------------------------------------------------------- gemm


def gemm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """torch.matmul(a, b); 2-D fp16/bf16/fp32 products run the tuned kernel."""
    if a.dim() != 2 or b.dim() != 2 or a.dtype is not b.dtype or a.dtype not in DTYPE_CODE or _autocast():
        return torch.matmul(a, b)
    if _is_compiling() or _tracing_state() is not None:
        return torch.ops.ops_adv.gemm(a, b)
    if _grad_enabled() and (a.requires_grad or b.requires_grad):
        if a.shape[1] != b.shape[0] or not a.numel() or not b.numel() or a.device != b.device \
                or not _op_needed("gemm", a, b):
            return torch.matmul(a, b)
        return torch.ops.ops_adv.gemm(a, b)
    return _gemm(a, b)


def _gemm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    M, K = a.shape
    K2, N = b.shape
    if K != K2 or not (M and N and K) or a.device != b.device:
        return torch.matmul(a, b)  # torch's error, or its empty/zero result
    key = ((M, N, K, DTYPE_CODE[a.dtype], not a.is_contiguous(), not b.is_contiguous()), a.device)
    fn = _gemm_cache.get(key)
    if fn is None:
        fn = lookup("gemm", *key)
    return fn(a, b)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           activation: str | None = None) -> torch.Tensor:
    """activation(F.linear(x, weight, bias)).

    Without an activation: x (..., in) @ weight.T through the gemm table (a trans_b problem, so
    the gemm winners, CPU variants included, serve nn.Linear), then the bias. With one ("relu",
    "gelu", "gelu_tanh", "silu"): the `linear` table, whose kernels add the bias and apply the
    activation in the gemm's epilogue.
    """
    if activation is not None and activation != "none":
        from ._epilogue import linear as fused

        return fused(x, weight, bias, activation)
    if x.dim() < 1 or weight.dim() != 2 or x.dtype is not weight.dtype or x.dtype not in DTYPE_CODE \
            or (bias is not None and (bias.dtype is not x.dtype or bias.dim() != 1)) or x.shape[-1] != weight.shape[1] \
            or x.numel() == 0 or _autocast():
        return F.linear(x, weight, bias)
    lead = x.shape[:-1]
    y = gemm(x.reshape(-1, x.shape[-1]), weight.t())
    if bias is not None:
        y = y + bias
    return y.reshape(*lead, weight.shape[0])


# --------------------------------------------------------------------------- attention


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None = None,
              dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None, enable_gqa: bool = False,
              *, causal: bool | None = None) -> torch.Tensor:
    """F.scaled_dot_product_attention's semantics (`causal` is an alias of `is_causal`).

    Grouped K/V heads (`enable_gqa`) with at most 16 query rows and no causal mask run
    `decode_attention`; masks, dropout, a custom scale, other grouped calls and Dv != D run SDPA itself.
    """
    if causal is not None:
        is_causal = causal
    dt = q.dtype
    if attn_mask is None and not dropout_p and scale is None and dt in DTYPE_CODE and k.dtype is dt and v.dtype is dt \
            and not _autocast():
        qs, ks = q.shape, k.shape
        # 4-D, the same heads and head dim for q, k and v (no grouped K/V, Dv == D)
        if len(qs) == 4 and ks == v.shape and len(ks) == 4 and ks[1] == qs[1] and ks[3] == qs[3] and ks[0] == qs[0]:
            if _is_compiling() or _tracing_state() is not None \
                    or (_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
                        and q.numel() and k.numel() and _op_needed("attention", q, k, v, bool(is_causal))):
                return torch.ops.ops_adv.attention(q, k, v, bool(is_causal))
            if _grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
                return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal)
            B, H, Sq, D = qs
            Skv = ks[2]
            if B and H and Sq and Skv and D:
                key = ((B, H, Sq, Skv, D, bool(is_causal), DTYPE_CODE[dt]), q.device)
                fn = _attention_cache.get(key)
                if fn is None:
                    fn = lookup("attention", *key)
                return fn(q, k, v, bool(is_causal))
        elif enable_gqa and not is_causal and len(qs) == 4 and len(ks) == 4 and ks == v.shape and ks[1] \
                and qs[1] != ks[1] and qs[1] % ks[1] == 0 and qs[2] <= DECODE_MAX_QUERY:
            # grouped K/V heads and a few query rows: the decode op reads K/V once per group, no copy
            from ._decode import decode_attention

            return decode_attention(q, k, v)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                                          scale=scale, enable_gqa=enable_gqa)


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    """The custom operator's body: what the eager path does, for tensors already checked at trace time."""
    B, H, Sq, D = q.shape
    Skv = k.shape[2]
    if k.shape != (B, H, Skv, D) or v.shape != k.shape or not (B and H and Sq and Skv and D):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    key = ((B, H, Sq, Skv, D, causal, DTYPE_CODE[q.dtype]), q.device)
    fn = _attention_cache.get(key)
    if fn is None:
        fn = lookup("attention", *key)
    return fn(q, k, v, causal)


# --------------------------------------------------------------------------- norms, softmax


def _rows_ok(x: torch.Tensor, *params: torch.Tensor | None) -> bool:
    if x.dim() < 1 or x.dtype not in DTYPE_CODE or _autocast():
        return False
    cols = x.shape[-1]
    for p in params:
        if p is not None and (p.dim() != 1 or p.shape[0] != cols or p.dtype is not x.dtype or p.device != x.device):
            return False
    return True


def layer_norm(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None = None,
               eps: float = 1e-5) -> torch.Tensor:
    """F.layer_norm(x, (x.shape[-1],), weight, bias, eps)."""
    if weight is None or not _rows_ok(x, weight, bias):
        return F.layer_norm(x, x.shape[-1:], weight, bias, eps)
    if _traced(x, weight, bias):
        if not _is_compiling() and _tracing_state() is None and (not x.numel() or not _op_needed("layer_norm", x, weight)):
            return F.layer_norm(x, x.shape[-1:], weight, bias, eps)
        return torch.ops.ops_adv.layer_norm(x, weight, bias, float(eps))
    return _layer_norm(x, weight, bias, float(eps))


def _layer_norm(x, weight, bias, eps: float) -> torch.Tensor:
    cols = x.shape[-1]
    rows = x.numel() // cols if cols else 0
    if not (rows and cols):
        return F.layer_norm(x, x.shape[-1:], weight, bias, eps)
    return lookup("layer_norm", (rows, cols, DTYPE_CODE[x.dtype]), x.device)(x, weight, bias, eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float | None = None) -> torch.Tensor:
    """F.rms_norm(x, (x.shape[-1],), weight, eps); `eps=None` is torch's default, not a constant of ours."""
    if weight is None or not _rows_ok(x, weight):
        return F.rms_norm(x, x.shape[-1:], weight, eps)
    if eps is None:  # as F.rms_norm: the epsilon of the type it computes in (fp32 for 16-bit inputs)
        eps = torch.finfo(torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype).eps
    if _traced(x, weight):
        if not _is_compiling() and _tracing_state() is None and (not x.numel() or not _op_needed("rms_norm", x, weight)):
            return F.rms_norm(x, x.shape[-1:], weight, eps)
        return torch.ops.ops_adv.rms_norm(x, weight, float(eps))
    return _rms_norm(x, weight, float(eps))


def _rms_norm(x, weight, eps: float) -> torch.Tensor:
    cols = x.shape[-1]
    rows = x.numel() // cols if cols else 0
    if not (rows and cols):
        return F.rms_norm(x, x.shape[-1:], weight, eps)
    return lookup("rms_norm", (rows, cols, DTYPE_CODE[x.dtype]), x.device)(x, weight, eps)


def softmax(x: torch.Tensor, dim: int = -1, dtype: torch.dtype | None = None) -> torch.Tensor:
    """torch.softmax(x, dim, dtype); the last dimension without a dtype change runs the tuned kernel."""
    if dtype is not None or x.dim() < 1 or dim not in (-1, x.dim() - 1) or x.dtype not in DTYPE_CODE or _autocast():
        return torch.softmax(x, dim, dtype=dtype)
    if _traced(x):
        if not _is_compiling() and _tracing_state() is None and (not x.numel() or not _op_needed("softmax", x)):
            return torch.softmax(x, -1)
        return torch.ops.ops_adv.softmax(x)
    return _softmax(x)


def _softmax(x: torch.Tensor) -> torch.Tensor:
    cols = x.shape[-1]
    rows = x.numel() // cols if cols else 0
    if not (rows and cols):
        return torch.softmax(x, -1)
    return lookup("softmax", (rows, cols, DTYPE_CODE[x.dtype]), x.device)(x)


# --------------------------------------------------------------------------- conv2d


def _square(v: Any) -> int | None:
    if isinstance(v, int):
        return v
    if isinstance(v, (tuple, list)) and len(v) == 2 and v[0] == v[1] and isinstance(v[0], int):
        return v[0]
    return None


def conv2d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, stride: Any = 1,
           padding: Any = 0, dilation: Any = 1, groups: int = 1) -> torch.Tensor:
    """F.conv2d's semantics; square stride/padding/dilation with groups 1 run the tuned kernel."""
    s, p, d = _square(stride), _square(padding), _square(dilation)
    if s is None or p is None or d is None or groups != 1 or x.dim() != 4 or weight.dim() != 4 \
            or x.dtype not in DTYPE_CODE or weight.dtype is not x.dtype or x.shape[1] != weight.shape[1] \
            or (bias is not None and bias.dtype is not x.dtype) or _autocast():
        return F.conv2d(x, weight, bias, stride, padding, dilation, groups)
    if _traced(x, weight, bias):
        if not _is_compiling() and _tracing_state() is None and (
                not x.numel() or not weight.numel() or x.device != weight.device or not _conv_out_ok(x, weight, s, p, d)
                or not _op_needed("conv2d", x, weight, s, p, d)):
            return F.conv2d(x, weight, bias, stride, padding, dilation, groups)
        return torch.ops.ops_adv.conv2d(x, weight, bias, s, p, d)
    return _conv2d(x, weight, bias, s, p, d)


def _conv_out_ok(x, weight, s: int, p: int, d: int) -> bool:
    H, W = x.shape[2:]
    R, S = weight.shape[2:]
    return (H + 2 * p - d * (R - 1) - 1) // s + 1 > 0 and (W + 2 * p - d * (S - 1) - 1) // s + 1 > 0


def _conv2d(x, weight, bias, s: int, p: int, d: int) -> torch.Tensor:
    N, C, H, W = x.shape
    K, _, R, S = weight.shape
    P = (H + 2 * p - d * (R - 1) - 1) // s + 1
    Q = (W + 2 * p - d * (S - 1) - 1) // s + 1
    if not (N and C and K and R and S) or P <= 0 or Q <= 0 or x.device != weight.device:
        return F.conv2d(x, weight, bias, s, p, d)
    nhwc = not x.is_contiguous() and x.is_contiguous(memory_format=torch.channels_last)
    problem = (N, C, H, W, K, R, S, s, p, d, "nhwc" if nhwc else "nchw", DTYPE_CODE[x.dtype])
    y = lookup("conv2d", problem, x.device)(x, weight, s, p, d)
    if bias is not None:
        y = y + bias.view(1, -1, 1, 1)
    return y


# --------------------------------------------------------------------------- custom operators

_lib_ops: dict[str, Any] = {}


def _define() -> None:
    """Register `ops_adv::<op>` with fake kernels and autograd formulas (vendor ops in backward)."""
    from torch.library import custom_op

    @custom_op("ops_adv::gemm", mutates_args=())
    def gemm_op(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return _fresh(_gemm(a, b), (a, b))

    @gemm_op.register_fake
    def _(a, b):
        return torch.matmul(a, b).contiguous()

    def gemm_setup(ctx, inputs, output):
        ctx.save_for_backward(*inputs)

    def gemm_backward(ctx, g):
        a, b = ctx.saved_tensors
        ga = torch.matmul(g, b.t()) if ctx.needs_input_grad[0] else None
        gb = torch.matmul(a.t(), g) if ctx.needs_input_grad[1] else None
        return ga, gb

    gemm_op.register_autograd(gemm_backward, setup_context=gemm_setup)

    @custom_op("ops_adv::attention", mutates_args=())
    def attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
        return _fresh(_attention(q, k, v, causal), (q, k, v))

    @attention_op.register_fake
    def _(q, k, v, causal):
        return q.new_empty(q.shape[:-1] + v.shape[-1:])

    def attention_setup(ctx, inputs, output):
        q, k, v, causal = inputs
        ctx.causal = causal
        ctx.save_for_backward(q, k, v)

    def attention_backward(ctx, g):
        q, k, v = ctx.saved_tensors
        return (*_attention_grads(q, k, v, g, ctx.causal), None)

    attention_op.register_autograd(attention_backward, setup_context=attention_setup)

    @custom_op("ops_adv::layer_norm", mutates_args=())
    def layer_norm_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
        return _fresh(_layer_norm(x, weight, bias, eps), (x, weight))

    @layer_norm_op.register_fake
    def _(x, weight, bias, eps):
        return torch.empty_like(x, memory_format=torch.contiguous_format)

    def layer_norm_setup(ctx, inputs, output):
        x, weight, bias, eps = inputs
        ctx.eps, ctx.has_bias = eps, bias is not None
        ctx.save_for_backward(x, weight, bias)

    def layer_norm_backward(ctx, g):
        x, weight, bias = ctx.saved_tensors
        shape = [x.shape[-1]]
        _, mean, rstd = torch.ops.aten.native_layer_norm(x, shape, weight, bias, ctx.eps)
        mask = [ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.has_bias and ctx.needs_input_grad[2]]
        gx, gw, gb = torch.ops.aten.native_layer_norm_backward(g.contiguous(), x, shape, mean, rstd, weight, bias, mask)
        return gx, gw, gb, None

    layer_norm_op.register_autograd(layer_norm_backward, setup_context=layer_norm_setup)

    @custom_op("ops_adv::rms_norm", mutates_args=())
    def rms_norm_op(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return _fresh(_rms_norm(x, weight, eps), (x, weight))

    @rms_norm_op.register_fake
    def _(x, weight, eps):
        return torch.empty_like(x, memory_format=torch.contiguous_format)

    def rms_norm_setup(ctx, inputs, output):
        x, weight, eps = inputs
        ctx.eps = eps
        ctx.save_for_backward(x, weight)

    def rms_norm_backward(ctx, g):
        x, weight = ctx.saved_tensors
        gx, gw = _rms_grads(x, weight, ctx.eps, g)
        return gx.to(x.dtype), gw.to(weight.dtype), None

    rms_norm_op.register_autograd(rms_norm_backward, setup_context=rms_norm_setup)

    @custom_op("ops_adv::softmax", mutates_args=())
    def softmax_op(x: torch.Tensor) -> torch.Tensor:
        return _fresh(_softmax(x), (x,))

    @softmax_op.register_fake
    def _(x):
        return torch.empty_like(x, memory_format=torch.contiguous_format)

    def softmax_setup(ctx, inputs, output):
        ctx.save_for_backward(output)
        ctx.in_dtype = inputs[0].dtype

    def softmax_backward(ctx, g):
        (y,) = ctx.saved_tensors
        return torch._softmax_backward_data(g.contiguous(), y, -1, ctx.in_dtype)

    softmax_op.register_autograd(softmax_backward, setup_context=softmax_setup)

    @custom_op("ops_adv::conv2d", mutates_args=())
    def conv2d_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, stride: int, padding: int,
                  dilation: int) -> torch.Tensor:
        return _fresh(_conv2d(x, weight, bias, stride, padding, dilation), (x, weight), _conv_format(x))

    @conv2d_op.register_fake
    def _(x, weight, bias, stride, padding, dilation):
        return F.conv2d(x, weight, bias, stride, padding, dilation).contiguous(memory_format=_conv_format(x))

    def conv2d_setup(ctx, inputs, output):
        x, weight, bias, stride, padding, dilation = inputs
        ctx.args = (stride, padding, dilation)
        ctx.bias_sizes = list(bias.shape) if bias is not None else None
        ctx.save_for_backward(x, weight)

    def conv2d_backward(ctx, g):
        x, weight = ctx.saved_tensors
        s, p, d = ctx.args
        mask = [ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.bias_sizes is not None and ctx.needs_input_grad[2]]
        gx, gw, gb = torch.ops.aten.convolution_backward(
            g, x, weight, ctx.bias_sizes, [s, s], [p, p], [d, d], False, [0, 0], 1, mask)
        return gx, gw, gb, None, None, None

    conv2d_op.register_autograd(conv2d_backward, setup_context=conv2d_setup)
    _lib_ops.update(gemm=gemm_op, attention=attention_op, layer_norm=layer_norm_op, rms_norm=rms_norm_op,
                    softmax=softmax_op, conv2d=conv2d_op)


def _fresh(out: torch.Tensor, inputs: tuple, memory_format: torch.memory_format = torch.contiguous_format) -> torch.Tensor:
    """The output as the fake kernel promised: in `memory_format`, and never an input or a view of one."""
    out = out.contiguous(memory_format=memory_format)
    for t in inputs:
        if out is t or (out.numel() and out.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()):
            return out.clone(memory_format=memory_format)
    return out


def _conv_format(x: torch.Tensor) -> torch.memory_format:
    """The output layout of the conv2d operator: channels_last for a channels_last input, as cuDNN gives."""
    if x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous():
        return torch.channels_last
    return torch.contiguous_format


def _rms_grads(h: torch.Tensor, weight: torch.Tensor, eps: float, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """dL/dh and dL/dweight of rms_norm(h) * weight, in fp32 (float64 for float64)."""
    hi = torch.promote_types(h.dtype, torch.float32)
    hf, gf, w = h.to(hi), g.to(hi), weight.to(hi)
    rstd = torch.rsqrt(hf.square().mean(-1, keepdim=True) + eps)
    xhat = hf * rstd
    gxhat = gf * w
    gh = rstd * (gxhat - xhat * (gxhat * xhat).mean(-1, keepdim=True))
    gw = (gf * xhat).reshape(-1, h.shape[-1]).sum(0)
    return gh, gw


def _attention_grads(q, k, v, g, causal: bool):
    """SDPA's gradients by the math formula in fp32 (memory Sq x Skv per head)."""
    hi = torch.float32
    qf, kf, vf, gf = q.to(hi), k.to(hi), v.to(hi), g.to(hi)
    scale = q.shape[-1] ** -0.5
    s = qf @ kf.transpose(-1, -2) * scale
    if causal:
        Sq, Skv = s.shape[-2:]
        keep = torch.ones(Sq, Skv, dtype=torch.bool, device=q.device).tril()
        s = s.masked_fill(~keep, float("-inf"))
    p = torch.softmax(s, -1).nan_to_num(0.0)
    gv = p.transpose(-1, -2) @ gf
    gp = gf @ vf.transpose(-1, -2)
    gs = p * (gp - (gp * p).sum(-1, keepdim=True))
    gq = gs @ kf * scale
    gk = gs.transpose(-1, -2) @ qf * scale
    return gq.to(q.dtype), gk.to(k.dtype), gv.to(v.dtype)


_define()
