"""convert_model: the same model, its layers running through ops-adv's ops.

Modules are recognised by what they are and do, not by family name: `nn.Linear`,
`nn.LayerNorm`, `nn.RMSNorm`, `nn.Conv2d`, and any module shaped like an RMS norm (one
weight vector, an epsilon, no children) whose output matches the RMS-norm formula on a probe, with weight
or (Gemma's) with (1 + weight) in fp32, cast once (`rms_norm(unit_offset=True)`).
A converted module keeps its exact type, its parameters, buffers and state_dict keys (its forward
is replaced on the instance, so libraries matching exact types, pickling, hooks and
parametrizations see the module they know); its forward calls the op, which runs torch's own
function for any call ops-adv has no kernel for. Hugging Face models also get ops-adv attention through
transformers' AttentionInterface when transformers is importable.
"""
from __future__ import annotations

import copy
import functools
import warnings
from typing import Any, Iterator

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..ops.conv2d import conv2d
from ..ops.layer_norm import layer_norm
from ..ops.linear import linear
from ..ops.rms_norm import rms_norm
from . import blocks, conv_bn, graphs, hf
from .merge import runs_own


# A converted module keeps its exact type (libraries such as quantize_dynamic match exact types): its
# forward is replaced on the instance by functools.partial(<forward below>, module), which pickles,
# deep-copies and compiles as the module does.


def _weight(self: nn.Module) -> torch.Tensor:
    """The module's weight as its own forward would read it: through the attribute when a parametrization,
    pruning, weight_norm or spectral_norm computes it; else straight from `_parameters` (~0.3 µs saved
    a name: nn.Module.__getattr__ is slow)."""
    w = self._parameters.get("weight")
    return self.weight if w is None else w


def _linear_forward(self, x: torch.Tensor) -> torch.Tensor:
    p = self._parameters
    w, b = p.get("weight"), p.get("bias")
    if w is None or "bias" not in p:  # parametrized, pruned or re-normed: read what the module computes
        w, b = self.weight, self.bias
    if runs_own(x):  # nothing tuned here: nn.Linear's own call
        return F.linear(x, w, b)
    return linear(x, w, b)


def _layer_norm_forward(self, x: torch.Tensor) -> torch.Tensor:
    p = self._parameters
    w, b = p.get("weight"), p.get("bias")
    if w is None or "bias" not in p:
        w, b = self.weight, self.bias
    if runs_own(x):  # nothing tuned here: nn.LayerNorm's own call
        return F.layer_norm(x, self.normalized_shape, w, b, self.eps)
    if len(self.normalized_shape) != 1 or w is None:
        return type(self).forward(self, x)
    return layer_norm(x, w, b, self.eps)


def _rms_norm_forward(self, x: torch.Tensor) -> torch.Tensor:
    w = _weight(self)
    if runs_own(x):  # nothing tuned here: nn.RMSNorm's own call
        return F.rms_norm(x, self.normalized_shape, w, self.eps)
    if len(self.normalized_shape) != 1 or w is None:
        return type(self).forward(self, x)
    return rms_norm(x, w, self.eps)


def _is_conv1d(m: nn.Module) -> bool:
    """transformers' Conv1D (GPT-2's projections): weight (in, out), forward x @ weight + bias."""
    cls = type(m)
    return cls.__name__ == "Conv1D" and cls.__module__.startswith("transformers.") and hasattr(m, "nf") \
        and isinstance(m._parameters.get("weight"), torch.Tensor) and m._parameters["weight"].dim() == 2


def _conv1d_forward(self, x: torch.Tensor) -> torch.Tensor:
    if runs_own(x):
        return type(self).forward(self, x)
    p = self._parameters
    w, b = p.get("weight"), p.get("bias")
    if w is None or "bias" not in p:
        w, b = self.weight, self.bias
    return linear(x, w.t(), b)  # weight.t().t() is the stored (in, out) matrix: a plain gemm


_global_hooks = (torch.nn.modules.module._global_forward_hooks, torch.nn.modules.module._global_forward_pre_hooks)


def _fold_now(conv: nn.Module, bn: nn.Module) -> bool:
    """Whether conv -> bn may run as one conv with folded weights in this call: both in eval mode, no
    parameter on the path that autograd must reach, no hook that would see the folded tensors, not
    under jit.trace (whose check retraces and must take the same path). Decided per call, cheaply."""
    if conv.training or bn.training or conv._forward_hooks or bn._forward_hooks or bn._forward_pre_hooks \
            or conv._backward_hooks or bn._backward_hooks or bn._backward_pre_hooks or _global_hooks[0] \
            or _global_hooks[1] or torch._C._get_tracing_state() is not None:
        return False
    if torch.is_grad_enabled():
        for t in (conv._parameters.values(), bn._parameters.values()):
            for p in t:
                if p is not None and p.requires_grad:
                    return False
    return "weight" in conv._parameters  # a parametrized conv computes its weight: not folded


def _conv2d_forward(self, x: torch.Tensor) -> torch.Tensor:
    w = _weight(self)
    if self.padding_mode != "zeros" or isinstance(self.padding, str):
        return type(self).forward(self, x)
    bn = self.__dict__.get("_ops_adv_bn")
    if bn is not None and _fold_now(self, bn) and conv_bn.fold_pays(self, x):
        w, b = conv_bn.fold_bn(self, bn)
        return conv2d(x, w, b, self.stride, self.padding, self.dilation, self.groups)
    return conv2d(x, w, self.bias, self.stride, self.padding, self.dilation, self.groups)


def _bn_forward(self, x: torch.Tensor) -> torch.Tensor:
    conv = self.__dict__.get("_ops_adv_conv")
    # folded into the conv before it: the same decision, on the same state (x has the conv's output's size)
    if conv is not None and _fold_now(conv, self) and x.dim() == 4 \
            and conv._parameters["weight"].numel() <= x.numel():
        return x
    return type(self).forward(self, x)


def _library_rms_forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    # The library's own forward (fp32 statistics, then its casts) where dtypes differ or more than x is passed.
    w = _weight(self)
    if x.dtype is not w.dtype or args or kwargs or runs_own(x):
        return type(self).forward(self, x, *args, **kwargs)
    name = _EPS_NAMES.get(type(self))
    if name is None:  # a missing name costs ~1.5 µs through nn.Module.__getattr__: found once per class
        name = _EPS_NAMES[type(self)] = _eps_attr(self)
    return rms_norm(x, w, float(getattr(self, name)))


_EPS_NAMES: dict[type, str] = {}


def _unit_rms_forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    # A (1 + weight) norm (Gemma's): the library's own forward where dtypes differ or more than x is passed.
    w = _weight(self)
    if x.dtype is not w.dtype or args or kwargs or runs_own(x):
        return type(self).forward(self, x, *args, **kwargs)
    name = _EPS_NAMES.get(type(self))
    if name is None:
        name = _EPS_NAMES[type(self)] = _eps_attr(self)
    return rms_norm(x, w, float(getattr(self, name)), unit_offset=True)


_FORWARDS = {
    nn.Linear: _linear_forward,
    nn.LayerNorm: _layer_norm_forward,
    nn.Conv2d: _conv2d_forward,
}
if hasattr(nn, "RMSNorm"):
    _FORWARDS[nn.RMSNorm] = _rms_norm_forward


def _eps_attr(m: nn.Module) -> str:
    for name in ("eps", "variance_epsilon", "epsilon"):
        if isinstance(getattr(m, name, None), float):
            return name
    return ""


_OURS = {_conv1d_forward, _linear_forward, _layer_norm_forward, _rms_norm_forward, _conv2d_forward, _bn_forward,
         _library_rms_forward, _unit_rms_forward}


def _swap(m: nn.Module, forward) -> None:
    """Run `m` through `forward` (type, isinstance, parameters and state_dict unchanged)."""
    m.forward = functools.partial(forward, m)
    m.__dict__["__prepare_scriptable__"] = functools.partial(_not_scriptable, m)


for _f in _OURS:
    _f._ops_adv_forward = True  # conv_bn tells ours apart by this mark (it does not import this module)


def converted(m: nn.Module) -> bool:
    """Whether convert_model gave `m` one of ops_adv's forwards."""
    f = m.__dict__.get("forward")
    return isinstance(f, functools.partial) and (f.func in _OURS or getattr(f.func, "_ops_adv_fused", False))


def _not_scriptable(m: nn.Module) -> nn.Module:
    # torch.jit.script calls __prepare_scriptable__ on each module before compiling it.
    raise RuntimeError(f"torch.jit.script cannot compile a converted {type(m).__name__} (its forward runs ops_adv in "
                       "Python): script the model before ops_adv.convert_model, or use torch.jit.trace, torch.compile "
                       "or torch.export on the converted model")


def _looks_like_rms_norm(m: nn.Module) -> str | None:
    """Why `m` is not an RMS norm ops-adv can run, or None (structure, then a probe of its output)."""
    params = dict(m.named_parameters(recurse=False))
    if list(m.children()) or set(params) != {"weight"} or params["weight"].dim() != 1:
        return "not shaped like an RMS norm (one weight vector, no children)"
    eps = _eps_attr(m)
    if not eps:
        return "no float eps attribute"
    extra = _extra_inputs(m)
    if extra:
        return f"forward takes more than its input ({', '.join(extra)}): a gated or conditioned norm"
    w = params["weight"]
    if w.device.type == "meta":
        return "weights are on the meta device: an RMS norm cannot be told apart without running it; convert after loading"
    if not w.dtype.is_floating_point:
        return "weight is not a floating-point tensor"
    g = torch.Generator(device="cpu").manual_seed(0)
    x = (torch.randn(3, w.shape[0], generator=g, device="cpu") * 0.01).to(device=w.device, dtype=w.dtype)
    with torch.no_grad():
        try:
            got = m.forward(x)  # not m(x): the model's hooks must not see the probe
        except Exception as e:  # a forward with another contract
            return f"forward refused a (rows, {w.shape[0]}) probe: {type(e).__name__}"
        h = x.float()
        want = h * torch.rsqrt(h.square().mean(-1, keepdim=True) + getattr(m, eps)) * w.float()
    if not isinstance(got, torch.Tensor) or got.shape != x.shape:
        return "output is not shaped like its input"
    tol = 1e-5 if w.dtype == torch.float32 else 2e-2
    err = (got.float() - want).norm() / want.norm().clamp_min(1e-30)
    if not err <= tol:
        return f"output differs from x·rsqrt(mean(x²)+eps)·weight (relative error {float(err):.2g})"
    return None


def _unit_offset_refusal(m: nn.Module) -> str | None:
    """Why `m` (shaped like an RMS norm) is not Gemma's: x·rsqrt(mean(x²)+eps)·(1 + weight) in fp32, cast to x's
    dtype at the end (what rms_norm(unit_offset=True) computes), or None. Probed on copies of `m` with other weights
    (Gemma starts its weights at 0, where 1 + w cannot be told from 1), in the weight's dtype and in bfloat16, whose
    output must stay bfloat16 (a norm that returns fp32 there is another op)."""
    w = m._parameters["weight"]
    eps = getattr(m, _eps_attr(m))
    g = torch.Generator(device="cpu").manual_seed(1)
    for dtype in dict.fromkeys((w.dtype, torch.bfloat16)):
        wt = (0.5 * torch.randn(w.shape, generator=g, device="cpu")).to(device=w.device, dtype=dtype)
        x = torch.randn(3, w.shape[0], generator=g, device="cpu").to(device=w.device, dtype=dtype)
        c = copy.copy(m)  # its own parameter dict: the model's module is not touched
        c.__dict__["_parameters"] = {**m._parameters, "weight": wt}
        with torch.no_grad():
            try:
                got = c.forward(x)
            except Exception as e:
                return f"as a (1 + weight) norm: forward refused a {dtype} probe ({type(e).__name__})"
            h = x.float()
            want = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + wt.float())
        if not isinstance(got, torch.Tensor) or got.shape != x.shape or got.dtype != dtype:
            return f"as a (1 + weight) norm: its output for {dtype} input is not {dtype} of the input's shape"
        err = (got.float() - want).norm() / want.norm().clamp_min(1e-30)
        if not err <= (1e-5 if dtype == torch.float32 else 2e-2):
            return f"output differs from x·rsqrt(mean(x²)+eps)·(1 + weight) (relative error {float(err):.2g})"
    return None


def rms_kind(m: Any) -> str | None:
    """"rms" for a module ops_adv runs as rms_norm, "unit_offset" for a (1 + weight) one (Gemma's), else None."""
    if not isinstance(m, nn.Module):
        return None
    f = getattr(m.__dict__.get("forward"), "func", None)  # converted already: what the probe found
    if f is _unit_rms_forward:
        return "unit_offset"
    if isinstance(m, nn.RMSNorm) or f is _library_rms_forward:
        return "rms"
    why = _looks_like_rms_norm(m)
    if why is None:
        return "rms"
    return "unit_offset" if why.startswith("output differs") and _unit_offset_refusal(m) is None else None


def _extra_inputs(m: nn.Module) -> list[str]:
    """The parameters of m's forward after its input (a gated norm's `gate`), or [] when it takes x alone."""
    import inspect

    try:
        params = list(inspect.signature(type(m).forward).parameters.values())  # the class's: ours takes *args
    except (TypeError, ValueError):
        return ["(signature not readable)"]
    return [p.name for p in params[2:]]


_USES: dict[type, dict[str, set[str]]] = {}


def _self_uses(cls: type) -> dict[str, set[str]]:
    """How the forwards of cls (and its non-torch bases) use each `self.<name>`: the attributes read off it
    (`self.qkv.weight` -> {"weight"}), "()" for a call or any other use. Empty when a source is not readable.
    Forwards only (a whole class's source took 1.6 s for a Llama): a layer called from a helper and read in
    forward is left unconverted, which changes nothing it computes."""
    if cls in _USES:
        return _USES[cls]
    import ast
    import inspect
    import textwrap

    uses: dict[str, set[str]] = {}
    for c in cls.__mro__:
        if c is object or c.__module__.startswith("torch.") or "forward" not in c.__dict__:
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(inspect.unwrap(c.__dict__["forward"]))))
        except (OSError, TypeError, SyntaxError):
            uses = {}
            break
        up = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
        for n in ast.walk(tree):
            if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "self" \
                    and not isinstance(n.ctx, ast.Store):  # `self.qkv = nn.Linear(...)` is no use
                p = up.get(n)
                how = p.attr if isinstance(p, ast.Attribute) and p.value is n and p.attr != "forward" else "()"
                uses.setdefault(n.attr, set()).add(how)
    _USES[cls] = uses
    return uses


def _never_called(model: nn.Module) -> dict[int, str]:
    """Leaf layers whose parent never calls them, only reads their tensors (torchvision Swin's attention passes
    `self.qkv.weight` to a function): id -> why. Converting them would change nothing that runs."""
    out: dict[int, str] = {}
    for pname, parent in model.named_modules():
        if type(parent).__module__.startswith("torch.nn") or not parent._modules:
            continue
        uses = _self_uses(type(parent))
        for cname, child in parent._modules.items():
            how = uses.get(cname)
            if child is not None and how and "()" not in how and not child._modules:
                out[id(child)] = (f"never called as a module: {type(parent).__name__} reads its "
                                  f"{', '.join(sorted(how))} directly (nothing of ops_adv would run)")
    return out


def _walk(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    yield from model.named_modules()


def convert_model(model: nn.Module, *, attention: bool = True, fuse: bool = True) -> nn.Module:
    """Run `model`'s Linear, LayerNorm, RMSNorm (any library's), Conv2d layers and attention through ops-adv.

    With `fuse`, decoder blocks whose forward adds a residual before an RMS norm, multiplies a
    SiLU or GeLU-tanh gate by an up projection (also the halves of one merged projection, Phi-3's), or
    applies transformers' rotary embedding run the fused ops
    (`ops_adv.models.blocks`), and eval-mode Conv2d -> BatchNorm2d (-> ReLU) runs as one conv2d_bn_relu.

    Converts in place and returns the model, with `tune_for_hardware` attached and
    `ops_adv.explain_model(model)` describing what was and was not converted.
    """
    report: list[dict[str, str]] = []
    meta: list[str] = []
    uncalled = _never_called(model)
    for name, m in _walk(model):
        if converted(m):
            report.append({"module": name, "type": type(m).__name__, "converted": "yes", "why": "already converted"})
            continue
        if id(m) in uncalled:
            report.append({"module": name, "type": type(m).__name__, "converted": "no", "why": uncalled[id(m)]})
            continue
        forward = next((f for cls, f in _FORWARDS.items() if type(m) is cls), None)
        if forward is not None and "forward" in m.__dict__:
            report.append({"module": name, "type": type(m).__name__, "converted": "no",
                           "why": "its forward is already replaced on the instance (a hook library's wrapper?): left as is"})
            continue
        if forward is not None:
            _swap(m, forward)
            report.append({"module": name, "type": type(m).__name__, "converted": "yes", "why": f"{type(m).__name__} runs ops_adv"})
            continue
        if isinstance(m, tuple(_FORWARDS)):
            report.append({"module": name, "type": type(m).__name__, "converted": "no",
                           "why": "a subclass of a convertible layer may override forward: left as is"})
            continue
        if type(m).__module__.startswith("torch.nn"):
            continue  # torch's own modules are matched by type above
        if _is_conv1d(m):
            if "forward" in m.__dict__:
                report.append({"module": name, "type": "Conv1D", "converted": "no",
                               "why": "its forward is already replaced on the instance: left as is"})
            else:
                _swap(m, _conv1d_forward)
                report.append({"module": name, "type": "Conv1D", "converted": "yes",
                               "why": "transformers' Conv1D (x @ weight + bias) runs ops_adv's linear"})
            continue
        if list(m.children()):
            continue  # a container (Conv2dNormActivation, a decoder block): its layers are reported themselves
        if "norm" in type(m).__name__.lower() or _eps_attr(m):
            why = _looks_like_rms_norm(m)
            unit = _unit_offset_refusal(m) if why is not None and why.startswith("output differs") else why
            if why is None:
                _swap(m, _library_rms_forward)
                report.append({"module": name, "type": type(m).__name__, "converted": "yes",
                               "why": "behaves as an RMS norm (structure and probe)"})
            elif unit is None:
                _swap(m, _unit_rms_forward)
                report.append({"module": name, "type": type(m).__name__, "converted": "yes",
                               "why": "behaves as a (1 + weight) RMS norm, fp32 then cast (Gemma's; structure and probe): "
                                      "rms_norm(unit_offset=True)"})
            else:
                if unit != why:
                    why = f"{why}; {unit}"
                report.append({"module": name, "type": type(m).__name__, "converted": "no", "why": why})
                if why.startswith("weights are on the meta device"):
                    meta.append(name)
    if meta:
        warnings.warn(f"ops_adv.convert_model: {len(meta)} norm module(s) ({meta[0]}, ...) have their weights on the meta "
                      "device and cannot be probed, so they (and the fused add + RMS norm) keep their own forward: "
                      "convert after the weights are loaded", stacklevel=2)
    if fuse:
        report += _fuse_blocks(model)
        report += _fuse_conv_bn_relu(model)
    report += _fold_batch_norms(model)
    if attention:
        rows = hf.use_attention(model)
        if rows and "_ops_adv_attention" in model.__dict__:  # refreshed by explain_model: what calls took
            model.__dict__["_ops_adv_attention_rows"] = (len(report), len(rows))
        report += rows
        report += hf.use_compile_config(model)
        report += graphs.install(model)
    model._ops_adv_report = report
    model.tune_for_hardware = functools.partial(_tune_method, model)  # pickles, unlike a bound method
    for m in model.modules():
        if any(isinstance(v, functools.partial) and v.args and v.args[0] is m for v in m.__dict__.values()):
            m.__dict__["_replicate_for_data_parallel"] = functools.partial(_replicate, m)
    return model


# Attributes that tie a module to others of the model it was converted in (folds, fused conv sites).
_LINKS = ("_ops_adv_bn", "_ops_adv_conv", "_ops_adv_folded", "_ops_adv_fused_graph", "_ops_adv_fused_pairs",
          "_ops_adv_fused_mods")


def _replicate(m: nn.Module) -> nn.Module:
    """nn.parallel.replicate's copy of `m` (DataParallel): the replica's forwards are bound to the replica, so it
    computes with its own parameters; links to the original's other modules (folds, fused sites) are dropped,
    so those run unfused there."""
    r = type(m)._replicate_for_data_parallel(m)
    d = r.__dict__
    fused_site = "_ops_adv_fused_graph" in d
    for k in _LINKS:
        d.pop(k, None)
    for k, v in list(d.items()):
        if isinstance(v, functools.partial) and v.args and v.args[0] is m:
            d[k] = functools.partial(v.func, r, *v.args[1:], **v.keywords)
    if fused_site:
        d.pop("forward", None)
    return r


_NO_FUSION: dict[type, str] = {}  # classes whose forward has nothing to fuse, and why


def _fuse_blocks(model: nn.Module) -> list[dict[str, str]]:
    """Rewrite the forward of blocks with fusable patterns (see `blocks`), on the instance: types stay."""
    def rms_ok(norm: Any) -> str | None:
        return rms_kind(norm)

    out = []
    for name, m in list(model.named_modules()):
        cls = type(m)
        if not list(m.children()) or cls.__module__.startswith("torch.") or "forward" in m.__dict__ \
                or cls in _NO_FUSION:
            continue
        new, done, why = blocks.rewrite_forward(m, rms_ok)
        if new is None:
            if why.startswith("no residual-add") and "this instance" not in why or "not readable" in why \
                    or why.startswith("forward is not a"):
                _NO_FUSION[cls] = why  # a property of the class's code, not of this instance
            elif why.startswith("forward is dispatched by transformers'"):
                out.append({"module": name, "type": cls.__name__, "converted": "no", "why": why})
            continue
        m.forward = functools.partial(new, m)
        out.append({"module": name, "type": cls.__name__, "converted": "yes", "why": "fused: " + "; ".join(done)})
    return out


def _fuse_conv_bn_relu(model: nn.Module) -> list[dict[str, str]]:
    """Conv2d -> BatchNorm2d (-> ReLU) in eval mode as one conv2d_bn_relu with folded weights."""
    if model.training or not any(isinstance(m, nn.BatchNorm2d) for m in model.modules()):
        return []
    return conv_bn.fuse_conv_bn_relu(model)


def _fold_batch_norms(model: nn.Module) -> list[dict[str, str]]:
    """Pair each Conv2d with the BatchNorm2d that alone reads its output (found by tracing the model
    with torch.fx); in eval mode the pair runs as one conv with folded weights."""
    if not any(isinstance(m, nn.BatchNorm2d) for m in model.modules()):
        return []
    try:
        import torch.fx

        graph = torch.fx.symbolic_trace(model).graph
    except Exception as e:
        return [{"module": "", "type": "Conv2d+BatchNorm2d", "converted": "no",
                 "why": f"not folded: torch.fx cannot trace the model ({type(e).__name__})"}]
    modules = dict(model.named_modules())
    calls: dict[str, int] = {}
    for n in graph.nodes:
        if n.op == "call_module":
            calls[n.target] = calls.get(n.target, 0) + 1
    out = []
    for n in graph.nodes:
        if n.op != "call_module" or not isinstance(modules.get(n.target), nn.BatchNorm2d):
            continue
        src = n.args[0] if n.args else None
        conv = modules.get(getattr(src, "target", None)) if getattr(src, "op", None) == "call_module" else None
        if not isinstance(conv, nn.Conv2d) or not converted(conv):
            continue
        bn = modules[n.target]
        if bn.__dict__.get("_ops_adv_fused"):
            continue  # runs in a fused conv2d_bn_relu site (see conv_bn)
        why = conv_bn._conv_refusal(conv) or (
            f"{type(bn).__name__} is not BatchNorm2d itself" if type(bn) is not nn.BatchNorm2d or "forward" in bn.__dict__
            else None)
        if why is not None:
            out.append({"module": n.target, "type": "BatchNorm2d", "converted": "no",
                        "why": f"not folded into {src.target}: {why}; both run as before"})
            continue
        if len(src.users) != 1 or calls[src.target] != 1 or calls[n.target] != 1 or not bn.track_running_stats \
                or bn.running_var is None:
            out.append({"module": n.target, "type": "BatchNorm2d", "converted": "no",
                        "why": f"not folded into {src.target}: the conv's output has other readers, or a module is called twice"})
            continue
        conv.__dict__["_ops_adv_bn"] = bn  # plain attributes: state_dict keys stay the same
        bn.__dict__["_ops_adv_conv"] = conv
        _swap(bn, _bn_forward)
        out.append({"module": n.target, "type": "BatchNorm2d", "converted": "yes",
                    "why": f"folded into {src.target} in eval mode where no parameter of the pair requires grad and "
                           "no hook is registered (decided per call; else both run as before)"})
    return out


def explain_model(model: nn.Module) -> list[dict[str, str]]:
    """What convert_model converted in `model`, what it did not, and why."""
    report = getattr(model, "_ops_adv_report", None)
    if report is None:
        return [{"module": "", "type": type(model).__name__, "converted": "no", "why": "convert_model was not applied"}]
    at = model.__dict__.get("_ops_adv_attention_rows")
    if at is not None:  # attention is decided per call: say what the calls so far ran
        return report[:at[0]] + hf.attention_rows(model) + report[at[0] + at[1]:]
    return list(report)


def _tune_method(model: nn.Module, *args: Any, **kwargs: Any) -> dict:
    from .record import tune_for_hardware

    return tune_for_hardware(model, *args, **kwargs)
