"""Sibling projections as one gemm: a block's q/k/v, its gate/up.

convert_model finds, in a block's forward, Linear layers applied to the same input in consecutive
statements (q_proj, k_proj, v_proj) or as SiLU(gate) * up (gate_proj, up_proj), and moves their weights
(and biases) into one tensor, each parameter becoming a view of its rows: the same Parameter objects,
state_dict keys and values, the memory held once. A call where no gradient is needed runs one gemm over
the merged rows, through the gemm table; a decode step reads one 6144x4096 weight instead of three, and
launches one kernel.

Any call where that would not be exactly what the model does runs the layers one by one, as before:
gradients needed (a train step computes each layer's gradient as the original does), a layer hooked,
replaced or re-forwarded, or parameters no longer side by side in one storage (`.data` replaced,
`load_state_dict(assign=True)`, a replica or a deep copy). The test is made on every call (eager) or
inside the `ops_adv::project` operator when it runs (compile, export), never on a cached copy, so nothing
can go stale. `.to()`, `.half()` and `.cuda()` merge again (`keep_merged`).
"""
from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn as nn

from .. import _settings
from .._dispatch import _OP_FUNCS, passthrough
from .._op import _autocast, _functorch, _is_compiling, _is_exporting, _tracing_state, define


def merge(mods: list[nn.Module]) -> str | None:
    """Move the weights (and biases) of `mods` into one tensor, rows in order; why not, or None when done."""
    if any(type(m) is not nn.Linear for m in mods):
        return "not all of them are nn.Linear"
    ws = [m._parameters.get("weight") for m in mods]
    bs = [m._parameters.get("bias") for m in mods]
    if any(w is None for w in ws) or any("bias" not in m._parameters for m in mods):
        return "a weight is computed (parametrized or pruned)"
    if len({id(t) for t in ws + bs if t is not None}) != len([t for t in ws + bs if t is not None]):
        return "they share a parameter"
    if _span(ws) is not None and (bs[0] is None or _span(bs) is not None):
        return None  # already merged
    w0 = ws[0]
    if any(type(w) is not nn.Parameter or type(w.data) is not torch.Tensor or w.layout is not torch.strided
           or w.dim() != 2 or w.dtype is not w0.dtype or w.device != w0.device or w.shape[1] != w0.shape[1]
           for w in ws):
        return "their weights differ in kind, dtype, device or input size"
    if w0.device.type == "meta":
        return "weights are on the meta device: convert after loading"
    if any(b is not None for b in bs) and not all(
            b is not None and type(b) is nn.Parameter and b.dim() == 1 and b.dtype is w0.dtype and b.device == w0.device
            for b in bs):
        return "some have a bias and some not, or their biases differ in dtype or device"
    ts = [t for t in ws + bs if t is not None]
    if any(t.storage_offset() or t.untyped_storage().nbytes() != t.numel() * t.element_size() or not t.is_contiguous()
           for t in ts):
        return "a parameter shares its storage with another tensor (tied or a view): merging would hold it twice"
    sizes = [w.shape[0] for w in ws]
    with torch.no_grad():
        W = torch.cat([w.detach() for w in ws])
        B = torch.cat([b.detach() for b in bs]) if bs[0] is not None else None
    for w, v in zip(ws, W.split(sizes)):
        w.data = v
    if B is not None:
        for b, v in zip(bs, B.split(sizes)):
            b.data = v
    for m in mods:  # pickle and deepcopy give each parameter its own rows only (a view pickles its whole storage)
        m.__dict__["__getstate__"] = functools.partial(_state, m)
    return None


def keep_merged(block: nn.Module, groups: tuple[tuple[str, ...], ...]) -> None:
    """Merge `block`'s groups again after `.to()`, `.half()`, `.cuda()` (which give each parameter its own new
    tensor): nn.Module._apply reaches each module through its instance attribute."""
    block.__dict__["_apply"] = functools.partial(_apply_and_merge, block, groups)


def _apply_and_merge(block: nn.Module, groups: tuple[tuple[str, ...], ...], fn: Any, recurse: bool = True) -> nn.Module:
    out = type(block)._apply(block, fn, recurse)
    for group in groups:
        merge([getattr(block, n) for n in group])
    return out


def _state(m: nn.Module) -> dict:
    state = dict(m.__dict__)
    del state["__getstate__"]  # the copy holds its own tensors: nothing merged to keep compact
    params = state["_parameters"] = dict(m._parameters)
    for k, p in params.items():
        if isinstance(p, nn.Parameter) and p.untyped_storage().nbytes() != p.numel() * p.element_size():
            q = nn.Parameter(p.detach().clone(), requires_grad=p.requires_grad)
            q.__dict__.update(p.__dict__)
            params[k] = q
    return state


def runs_own(x: Any) -> bool:
    """Whether this call may run the original module's own code: nothing is tuned for its device
    (`_dispatch.passthrough`), and it is eager, or compiled (decided when the graph is traced, as the vendor-only
    ops are: load the table before compiling; then the compiled graph is the original model's). Not under
    torch.export (an exported program dispatches through the table of the machine that runs it), jit tracing,
    or OPS_ADV_COMPILE_OPERATORS=1. Eager, conversion then costs one check."""
    if not isinstance(x, torch.Tensor) or _tracing_state() is not None:
        return False
    if _is_compiling():
        return not _is_exporting() and _passthrough_traced(str(x.device))
    return passthrough(x.device)


@torch.compiler.assume_constant_result
def _passthrough_traced(device: str) -> bool:
    return not _settings.compile_keeps_operators() and passthrough(torch.device(device))


def _span(ts: list[torch.Tensor]) -> torch.Tensor | None:
    """One tensor over the rows of `ts` when they sit in order, side by side, in one storage; else None."""
    t0 = ts[0]
    if not t0.is_contiguous():
        return None
    es, rows, end = t0.element_size(), t0.shape[0], t0.data_ptr() + t0.numel() * t0.element_size()
    for t in ts[1:]:
        if t.data_ptr() != end or t.dtype is not t0.dtype or t.shape[1:] != t0.shape[1:] or not t.is_contiguous():
            return None
        end += t.numel() * es
        rows += t.shape[0]
    st = t0.untyped_storage()  # alive (t0 holds it): memory inside it belongs to it alone
    if st.data_ptr() + st.nbytes() < end or t0.device != ts[-1].device:
        return None
    if t0.dim() == 1:
        return t0.as_strided((rows,), (1,))
    return t0.as_strided((rows, t0.shape[1]), (t0.shape[1], 1))


def _project(x: torch.Tensor, weights: list[torch.Tensor], biases: list[torch.Tensor]) -> torch.Tensor:
    """The layers' outputs side by side on the last dimension: one gemm where their rows are merged."""
    linear = _OP_FUNCS["linear"]
    W = _span(weights)
    B = _span(biases) if biases else None
    if W is None or (biases and B is None):
        return torch.cat([linear(x, w, b) for w, b in zip(weights, biases or [None] * len(weights))], -1)
    return linear(x, W, B)


def _fake(x, weights, biases):
    return x.new_empty((*x.shape[:-1], sum(w.shape[0] for w in weights)))


define("project", _project, _fake)


_hooks = torch.nn.modules.module


def _observed(m: nn.Module) -> bool:
    """Whether something would see `m` called (its hooks or global ones), or its forward is not its own or ours:
    then a fused block calls it as the original does, so hooks fire with the original's values."""
    if m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks \
            or _hooks._global_forward_hooks or _hooks._global_forward_pre_hooks or _hooks._global_backward_hooks \
            or _hooks._global_backward_pre_hooks:
        return True
    f = m.__dict__.get("forward")
    return f is not None and not getattr(getattr(f, "func", None), "_ops_adv_forward", False)


def one_gemm(x: torch.Tensor, mods: tuple[nn.Module, ...]) -> torch.Tensor | None:
    """The layers' outputs side by side from one gemm, or None where the layers must run as they are."""
    if not isinstance(x, torch.Tensor) or x.dim() < 1 or not x.numel() or _autocast() or _functorch():
        return None
    ws, bs = [], []
    grad_on = torch.is_grad_enabled()
    grad = grad_on and x.requires_grad
    for m in mods:
        if type(m) is not nn.Linear or _observed(m):
            return None
        p = m._parameters
        w, b = p.get("weight"), p.get("bias")
        if w is None or "bias" not in p or w.dim() != 2:
            return None
        if grad_on and (w.requires_grad or (b is not None and b.requires_grad)):
            grad = True
        ws.append(w)
        if b is not None:
            bs.append(b)
    if grad or (bs and len(bs) != len(ws)) or x.dtype is not ws[0].dtype or x.shape[-1] != ws[0].shape[1]:
        return None
    if _is_compiling() or _tracing_state() is not None:
        return torch.ops.ops_adv.project(x, ws, bs)  # the side-by-side test runs inside, on the real tensors
    return _project(x, ws, bs)


def project(x: torch.Tensor, *mods: nn.Module) -> tuple[Any, ...]:
    """(mods[0](x), mods[1](x), ...), from one gemm where their weights are merged."""
    y = one_gemm(x, mods)
    if y is None:
        return tuple(m(x) for m in mods)
    return y.split([m._parameters["weight"].shape[0] for m in mods], -1)
