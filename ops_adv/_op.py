"""What every op shares: the checks on its hot path, and `define`, which registers `ops_adv::<op>`.

Each op (`ops_adv.ops.<op>`) takes what its torch counterpart takes. A call ops-adv has no kernel
family for (a dtype, rank, feature or shape that no candidate covers) runs the torch function
itself, so it works, fails and promotes exactly as torch does. A call it covers:
- eager, with no input needing grad: signature, one dict lookup, the implementation;
- under torch.compile, torch.export or jit.trace, or when an input needs grad: the
  `ops_adv::<op>` custom operator. Its fake kernel gives the output's shape, its autograd
  formula runs vendor ops, and the table lookup happens inside it when it runs, so a graph
  never depends on the table and dynamic shapes stay symbolic.
A custom operator's own dispatch costs 17 µs (`torch.ops`) to 78 µs (`custom_op` object) a
call on this project's CPU machine, against 2 µs for a small matmul: eager stays off it.

No op module imports another: one that routes to another op (linear without an activation to
gemm, grouped-head attention to decode_attention) calls it through `_dispatch`'s registry.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from kernel_space._common import DTYPE_CODE

from . import _dispatch

_is_compiling = torch.compiler.is_compiling
_compiler = torch.compiler


def _is_exporting() -> bool:
    """Whether torch.export is tracing. torch 2.11's Dynamo folds `torch.compiler.is_exporting()` to True under any
    torch.compile (2.14 reads the flag), which kept every operator opaque there: read the flag export sets."""
    flag = getattr(_compiler, "_is_exporting_flag", None)
    return _compiler.is_exporting() if flag is None else flag
_tracing_state = torch._C._get_tracing_state
_grad_enabled = torch.is_grad_enabled
# Under autocast torch's own function runs: autocast picks its dtypes (a kernel would return the input dtype).
_autocast = torch._C._is_any_autocast_enabled
# Under torch.func transforms (grad, vmap, jacrev, ...) torch's own function runs: the custom operators'
# autograd is not functorch's, and the kernels have no batching rule (66 ns a call to ask).
_functorch = torch._C._are_functorch_transforms_active


@torch.compiler.assume_constant_result
def _vendor_only(op: str, device: str) -> bool:
    return not _dispatch._settings.compile_keeps_operators() and _dispatch.vendor_only(op, torch.device(device))


def _compiled_vendor(op: str, device: torch.device) -> bool:
    """Under torch.compile, whether the table leaves `op` on `device` to vendor kernels only: then the op
    traces as torch's own function, which Inductor fuses with its neighbours, instead of an opaque custom
    operator. Decided when the graph is traced: load the table before compiling. torch.export keeps the
    operators, so an exported program dispatches through the table of the machine that runs it."""
    return _is_compiling() and not _is_exporting() and _vendor_only(op, str(device))


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
    problem = _dispatch.signature_of(op)(*args)
    return not _dispatch.runs_default(op, problem, args[0].device)


def _rows_ok(x: torch.Tensor, *params: torch.Tensor | None) -> bool:
    """Whether a row-wise op (norms) covers x with these per-column parameters."""
    if x.dim() < 1 or x.dtype not in DTYPE_CODE or _autocast() or _functorch():
        return False
    cols = x.shape[-1]
    for p in params:
        if p is not None and (p.dim() != 1 or p.shape[0] != cols or p.dtype is not x.dtype or p.device != x.device):
            return False
    return True


def _last_dim(x: torch.Tensor, normalized_shape: Any) -> bool:
    """Whether a norm's `normalized_shape` (a sequence of ints, as torch takes it) is x's last dimension;
    anything else runs torch's function, which raises its own error."""
    if x.dim() < 1 or isinstance(normalized_shape, int):
        return False
    try:
        return len(normalized_shape) == 1 and normalized_shape[0] == x.shape[-1]
    except TypeError:
        return False


def _pair_ok(x: torch.Tensor, residual: torch.Tensor) -> bool:
    """Whether a second operand (a residual, swiglu's up) matches x in shape, dtype and device."""
    return torch.is_tensor(residual) and residual.shape == x.shape and residual.dtype is x.dtype \
        and residual.device == x.device


def _square(v: Any) -> int | None:
    """A conv's stride/padding/dilation as one int when it is square, else None."""
    if isinstance(v, int):
        return v
    if isinstance(v, (tuple, list)) and len(v) == 2 and v[0] == v[1] and isinstance(v[0], int):
        return v[0]
    return None


def _conv_format(x: torch.Tensor) -> torch.memory_format:
    """The output layout of the conv operators: channels_last for a channels_last input, as cuDNN gives."""
    if x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous():
        return torch.channels_last
    return torch.contiguous_format


def _fresh(out: torch.Tensor, inputs: tuple, memory_format: torch.memory_format = torch.contiguous_format) -> torch.Tensor:
    """The output as the fake kernel promised: in `memory_format`, and never an input or a view of one."""
    out = out.contiguous(memory_format=memory_format)
    for t in inputs:
        if out is t or (out.numel() and out.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()):
            return out.clone(memory_format=memory_format)
    return out


def unit_offset_composite(x: torch.Tensor, weight: torch.Tensor, eps: float | None) -> torch.Tensor:
    """Gemma's RMSNorm in torch: fp32 statistics and scale (1 + weight), cast to x's dtype at the end."""
    h = x.float()
    if eps is None:
        eps = torch.finfo(torch.float32).eps
    return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + weight.float())).to(x.dtype)


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


def _both(ctx, gh: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """For an op of x + residual: x and residual get the same gradient: a copy for the second only when both need it."""
    need_x, need_r = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    return (gh if need_x else None), ((gh.clone() if need_x else gh) if need_r else None)


# --------------------------------------------------------------------------- custom operators

_lib_ops: dict[str, Any] = {}


def define(op: str, body: Callable[..., Any], fake: Callable[..., Any], *, setup: Callable[..., Any] | None = None,
           backward: Callable[..., Any] | None = None) -> Any:
    """Register `ops_adv::<op>`: `body` runs it (its annotations give the schema), `fake` gives the output's
    shape under tracing, and `backward` with `setup` is its autograd formula (none: an inference op)."""
    from torch.library import custom_op

    if hasattr(torch.ops.ops_adv, op):  # a reload of the op's module must not define it twice
        return _lib_ops.get(op)
    lib_op = custom_op(f"ops_adv::{op}", body, mutates_args=())
    lib_op.register_fake(fake)
    if backward is not None:
        lib_op.register_autograd(backward, setup_context=setup)
    _lib_ops[op] = lib_op
    return lib_op
