"""Sparse MoE blocks (Mixtral, Qwen2-MoE, Qwen3-MoE) running their routed experts through `ops_adv.moe`.

transformers' sparse block calls its router, then its experts module with the router's choice:

    _, top_k_weights, top_k_index = self.gate(hidden_states)
    hidden_states = self.experts(hidden_states, top_k_index, top_k_weights)

`blocks` finds these two statements in a block's forward and rewrites the second into `moe_call(self.experts,
hidden_states, top_k_index, top_k_weights, <router logits>)`; everything else (jitter, the router and its
hooks, the shared expert and its sigmoid gate, the router logits transformers records for the aux loss) runs
as the library wrote it. The block is converted when, on this instance:
- the experts module holds `gate_up_proj` [E, 2N, K] (gate rows, then up rows) and `down_proj` [E, K, N] and no
  other parameter, computes SiLU(gate) * up (its `act_fn`, probed), with transformers' default layout flags
  (concatenated, not transposed, no bias, gated, no post-expert norm);
- the router, probed on random tokens, returns (logits [T, E], weights [T, k], ids [T, k]) where ids and weights
  are softmax-in-fp32, top-k of the logits, renormalised or not (that decides `renormalize`: Mixtral and
  `norm_topk_prob=True` renormalise, Qwen2-MoE's default does not);
- the rewritten block, probed on a random input in eval (hooks not seeing it), gives the original's output.

Each call then decides (`moe_call`) whether the op runs or the experts module does, as transformers chose
(grouped_mm, batched_mm, its loop): the experts module runs for a call that needs gradients, in train mode,
under autocast or torch.func, with a hook on the experts or their activation, a replaced forward or activation,
expert parallelism, other dtypes or shapes, and, in eager, where the table has nothing for the problem (the op's default is the expert
loop, slower than transformers' grouped_mm); under torch.compile it runs where the table leaves moe to vendor
kernels (its graph, as the original's). torch.export keeps the `ops_adv::moe` operator, as every op's export
does: the exported program dispatches through the table of the machine that runs it.
"""
from __future__ import annotations

import contextlib
import copy
from collections import OrderedDict
from typing import Any, Callable

import torch
import torch.nn as nn

from kernel_space._common import DTYPE_CODE
from kernel_space.moe.problem import route

from .. import _dispatch
from ..ops.moe import moe, problem_of
from .._op import _autocast, _functorch, _is_compiling, _is_exporting, _tracing_state, _vendor_only
from .merge import _observed

SPEC = "_ops_adv_moe"  # experts.__dict__: (top_k, renormalize), set when its block is converted
REFUSED = "_ops_adv_moe_refused"  # experts.__dict__: why its block does not run the op
_force = [False]  # the block probe runs the op whatever the table holds


def _dtype_ok(dt: torch.dtype) -> bool:
    return dt in DTYPE_CODE


def refusal(block: nn.Module, gate_name: str, experts_name: str,
            act_kind: Callable[[Any], str | None]) -> tuple[tuple[int, bool] | None, str]:
    """((top_k, renormalize), "") when `block.<gate_name>` and `block.<experts_name>` are a router and experts
    ops_adv.moe computes exactly (structure, then a probe of the router); else (None, why)."""
    gate, experts = getattr(block, gate_name, None), getattr(block, experts_name, None)
    if not isinstance(gate, nn.Module) or not isinstance(experts, nn.Module):
        return None, f"{gate_name} or {experts_name} is not a module"
    p = experts._parameters
    w13, w2 = p.get("gate_up_proj"), p.get("down_proj")
    if set(p) != {"gate_up_proj", "down_proj"} or not isinstance(w13, torch.Tensor) or not isinstance(w2, torch.Tensor):
        return None, (f"{experts_name} holds parameters {sorted(p)}, where ops_adv.moe takes gate_up_proj and "
                      "down_proj alone (biases, quantised or parametrized experts run as transformers chose)")
    if w13.dim() != 3 or w13.shape[1] % 2 or w2.dim() != 3 \
            or tuple(w2.shape) != (w13.shape[0], w13.shape[2], w13.shape[1] // 2):
        return None, (f"{experts_name}'s gate_up_proj {tuple(w13.shape)} and down_proj {tuple(w2.shape)} are no "
                      "[E, 2N, K] and [E, K, N] pair")
    flags = {"has_bias": False, "is_transposed": False, "has_gate": True, "has_post_expert_norm": False,
             "is_concatenated": True}
    odd = [k for k, want in flags.items() if getattr(experts, k, want) != want]
    if odd:
        return None, f"{experts_name} is declared {', '.join(f'{k}={not flags[k]}' for k in odd)} (ops_adv.moe: " \
                     "concatenated gate and up rows, untransposed, no bias, no post-expert norm)"
    if set(experts._modules) - {"act_fn"} or act_kind(experts._modules.get("act_fn")) != "silu":
        return None, f"{experts_name}'s act_fn is not SiLU on a probe, or it has other submodules"
    if w13.device.type == "meta":
        return None, "expert weights are on the meta device: convert after loading"
    if not _dtype_ok(w13.dtype) or w2.dtype is not w13.dtype:
        return None, f"expert weights are {w13.dtype} / {w2.dtype}, which ops_adv.moe does not run"
    E, K = w13.shape[0], w13.shape[2]
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(7, K, generator=g, device="cpu").to(device=w13.device, dtype=w13.dtype)
    try:
        with torch.no_grad():
            out = gate.forward(x)  # no hooks see the probe
    except Exception as e:
        return None, f"{gate_name} refused a (7, {K}) probe ({type(e).__name__})"
    if not (isinstance(out, tuple) and len(out) == 3 and all(isinstance(t, torch.Tensor) for t in out)):
        return None, f"{gate_name} returns no (router_logits, top_k_weights, top_k_index) triple"
    logits, weights, ids = out
    if logits.shape != (7, E) or not logits.dtype.is_floating_point or ids.dim() != 2 or ids.shape[0] != 7 \
            or ids.dtype.is_floating_point or weights.shape != ids.shape or not 1 <= ids.shape[1] <= E:
        return None, f"{gate_name}'s (logits, weights, ids) are shaped {[tuple(t.shape) for t in out]}, not " \
                     f"[T, {E}], [T, k], [T, k]"
    top_k = int(ids.shape[1])
    tol = 1e-5 if weights.dtype == torch.float32 else 1e-2
    for renorm in (True, False):
        w, i = route(logits, top_k, renorm)
        if torch.equal(i, ids.to(i.dtype)) and torch.allclose(w, weights.float(), rtol=tol, atol=tol):
            return (top_k, renorm), ""
    return None, (f"{gate_name}'s top-{top_k} choice is not a softmax top-k of its logits, renormalised or not "
                  "(a router with a bias, groups or another score): ops_adv.moe routes by softmax top-k")


def _unhooked(m: nn.Module) -> nn.Module:
    """A shallow copy of `m` and its submodules (the same parameters) with no hooks: a probe no hook sees."""
    c = copy.copy(m)
    for k in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks"):
        c.__dict__[k] = OrderedDict()
    c.__dict__["_modules"] = {k: None if v is None else _unhooked(v) for k, v in m._modules.items()}
    return c


def probe_block(block: nn.Module, new: Callable, experts_names: list[str]) -> str | None:
    """Why the rewritten forward `new` is not the block's own on a random input in eval (the op forced), or None."""
    experts = [getattr(block, n) for n in experts_names]
    K = experts[0]._parameters["gate_up_proj"].shape[2]
    w = experts[0]._parameters["gate_up_proj"]
    g = torch.Generator(device="cpu").manual_seed(2)
    x = torch.randn(2, 3, K, generator=g, device="cpu").to(device=w.device, dtype=w.dtype)
    c = _unhooked(block)
    for m in c.modules():
        m.__dict__["training"] = False  # Mixtral's router jitter runs in train mode only
    misses = dict(_dispatch._misses)  # the probe is no call of the model's: its problem is no miss
    try:
        with torch.no_grad():
            try:
                want = type(block).forward(c, x.clone())
            except Exception as e:
                return f"the block's forward refused a (2, 3, {K}) probe ({type(e).__name__})"
            with forced():
                got = new(c, x.clone())
    except Exception as e:
        return f"ops_adv.moe raised on the block's probe ({type(e).__name__}: {str(e)[:120]})"
    finally:
        _dispatch._misses.clear()
        _dispatch._misses.update(misses)
    if not isinstance(want, torch.Tensor) or not isinstance(got, torch.Tensor) or got.shape != want.shape:
        return "the block with ops_adv.moe returns another shape than its own forward on a probe"
    tol = 1e-5 if want.dtype == torch.float32 else 2e-2
    err = (got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-30)
    if not err <= tol:
        return f"the block with ops_adv.moe differs from its own forward on a probe (relative error {float(err):.2g})"
    return None


def _op_args(experts: Any, x: Any, logits: Any) -> tuple | None:
    """(w13, w2, top_k, renormalize) when ops_adv.moe may compute this call of `experts`, else None."""
    if not isinstance(experts, nn.Module):
        return None
    d = experts.__dict__
    spec = d.get(SPEC)
    if spec is None or experts.training or d.get("_is_expert_parallel") or _observed(experts):
        return None  # (expert parallel: this rank's experts are a slice of those the logits route to)
    act = experts._modules.get("act_fn")
    if act is None or act.__dict__.get("_ops_adv_act") != "silu" or _observed(act):
        return None  # replaced or hooked since: it runs as the module it is now
    p = experts._parameters
    w13, w2 = p.get("gate_up_proj"), p.get("down_proj")
    if w13 is None or w2 is None or not isinstance(x, torch.Tensor) or not isinstance(logits, torch.Tensor) \
            or x.dim() != 2 or logits.dim() != 2 or w13.dim() != 3 or w2.dim() != 3:
        return None
    E, K = w13.shape[0], w13.shape[2]
    if x.shape[1] != K or logits.shape[0] != x.shape[0] or logits.shape[1] != E or not logits.dtype.is_floating_point \
            or w13.dtype is not x.dtype or w2.dtype is not x.dtype or not _dtype_ok(x.dtype) \
            or w13.device != x.device or w2.device != x.device or logits.device != x.device \
            or _autocast() or _functorch():
        return None
    if torch.is_grad_enabled() and (x.requires_grad or logits.requires_grad or w13.requires_grad or w2.requires_grad):
        return None  # a train step: transformers' experts, their autograd as before
    return w13, w2, spec[0], spec[1]


def moe_call(experts: Any, x: Any, top_k_index: Any, top_k_weights: Any, router_logits: Any) -> Any:
    """`experts(x, top_k_index, top_k_weights)`, or ops_adv.moe on the router logits where it computes the same."""
    args = _op_args(experts, x, router_logits)
    if args is None:
        return experts(x, top_k_index, top_k_weights)
    w13, w2, top_k, renormalize = args
    if _is_compiling() or _tracing_state() is not None:
        if not _is_exporting() and _is_compiling() and not _force[0] and _vendor_only("moe", str(x.device)):
            return experts(x, top_k_index, top_k_weights)  # transformers' graph (grouped_mm), as the original's
        return moe(x, router_logits, w13, w2, top_k, renormalize=renormalize)
    if not _force[0]:
        problem = problem_of(x, w13, w2, top_k, renormalize)
        if _dispatch.runs_default("moe", problem, x.device):  # nothing tuned: transformers' choice, counted a miss
            return _dispatch.stand_in("moe", problem, x.device, experts)(x, top_k_index, top_k_weights)
    return moe(x, router_logits, w13, w2, top_k, renormalize=renormalize)


@contextlib.contextmanager
def forced():
    """Within: a converted block runs ops_adv.moe whatever the table holds (tests, probes)."""
    prev, _force[0] = _force[0], True
    try:
        yield
    finally:
        _force[0] = prev
