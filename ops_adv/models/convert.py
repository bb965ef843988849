"""convert_model: the same model, its layers running through ops-adv's ops.

Modules are recognised by what they are and do, not by family name: `nn.Linear`,
`nn.LayerNorm`, `nn.RMSNorm`, `nn.Conv2d`, and any module shaped like an RMS norm (one
weight vector, an epsilon, no children) whose output matches the RMS-norm formula on a probe.
A converted module keeps its class (a subclass is swapped in), its parameters, buffers and
state_dict keys; its forward calls the op, which runs torch's own function for any call
ops-adv has no kernel for. Hugging Face models also get ops-adv attention through
transformers' AttentionInterface when transformers is importable.
"""
from __future__ import annotations

import types
from typing import Any, Iterator

import torch
import torch.nn as nn

from ..ops.conv2d import conv2d
from ..ops.layer_norm import layer_norm
from ..ops.linear import linear
from ..ops.rms_norm import rms_norm
from . import blocks, conv_bn, hf

_SUBCLASSES: dict[type, type] = {}


# Parameters are read from `_parameters`: through nn.Module.__getattr__ each name costs ~0.3 µs a call.
def _linear_forward(self, x: torch.Tensor) -> torch.Tensor:
    p = self._parameters
    return linear(x, p["weight"], p["bias"])


def _layer_norm_forward(self, x: torch.Tensor) -> torch.Tensor:
    p = self._parameters
    if len(self.normalized_shape) != 1 or p["weight"] is None:
        return super(type(self), self).forward(x)
    return layer_norm(x, p["weight"], p["bias"], self.eps)


def _rms_norm_forward(self, x: torch.Tensor) -> torch.Tensor:
    p = self._parameters
    if len(self.normalized_shape) != 1 or p["weight"] is None:
        return super(type(self), self).forward(x)
    return rms_norm(x, p["weight"], self.eps)


def _conv2d_forward(self, x: torch.Tensor) -> torch.Tensor:
    if self.padding_mode != "zeros" or isinstance(self.padding, str):
        return super(type(self), self).forward(x)
    bn = self.__dict__.get("_ops_adv_bn")
    if bn is not None and not self.training and not bn.training:
        w, b = _folded(self, bn)
        return conv2d(x, w, b, self.stride, self.padding, self.dilation, self.groups)
    if bn is not None:  # batch norm in train mode updates its statistics without a version bump: fold again later
        self.__dict__.pop("_ops_adv_folded", None)
    return conv2d(x, self.weight, self.bias, self.stride, self.padding, self.dilation, self.groups)


def _folded(conv: nn.Conv2d, bn: nn.BatchNorm2d) -> tuple[torch.Tensor, torch.Tensor]:
    return conv_bn.fold_bn(conv, bn)


def _bn_forward(self, x: torch.Tensor) -> torch.Tensor:
    conv = self.__dict__.get("_ops_adv_conv")
    if conv is not None and not self.training and not conv.training:
        return x  # folded into the conv before it
    return super(type(self), self).forward(x)


def _library_rms_forward(self, x: torch.Tensor) -> torch.Tensor:
    # The library's own forward (fp32 statistics, then its casts) where dtypes differ.
    w = self._parameters["weight"]
    if x.dtype is not w.dtype:
        return super(type(self), self).forward(x)
    name = _EPS_NAMES.get(type(self))
    if name is None:  # a missing name costs ~1.5 µs through nn.Module.__getattr__: found once per class
        name = _EPS_NAMES[type(self)] = _eps_attr(self)
    return rms_norm(x, w, float(getattr(self, name)))


_EPS_NAMES: dict[type, str] = {}


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


def _swap(m: nn.Module, forward) -> None:
    """Give `m` a subclass of its class whose forward is `forward` (isinstance and state_dict unchanged)."""
    cls = type(m)
    sub = _SUBCLASSES.get(cls)
    if sub is None:
        sub = _SUBCLASSES[cls] = type(cls.__name__, (cls,), {"forward": forward, "_ops_adv_converted": True,
                                                            "__module__": cls.__module__, "__qualname__": cls.__qualname__})
    m.__class__ = sub


def _looks_like_rms_norm(m: nn.Module) -> str | None:
    """Why `m` is not an RMS norm ops-adv can run, or None (structure, then a probe of its output)."""
    params = dict(m.named_parameters(recurse=False))
    if list(m.children()) or set(params) != {"weight"} or params["weight"].dim() != 1:
        return "not shaped like an RMS norm (one weight vector, no children)"
    eps = _eps_attr(m)
    if not eps:
        return "no float eps attribute"
    w = params["weight"]
    if not w.dtype.is_floating_point or w.device.type == "meta":
        return "weight is not a floating-point tensor on a device"
    g = torch.Generator(device="cpu").manual_seed(0)
    x = (torch.randn(3, w.shape[0], generator=g) * 0.01).to(device=w.device, dtype=w.dtype)
    with torch.no_grad():
        try:
            got = m(x)
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


def _walk(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    yield from model.named_modules()


def convert_model(model: nn.Module, *, attention: bool = True, fuse: bool = True) -> nn.Module:
    """Run `model`'s Linear, LayerNorm, RMSNorm (any library's), Conv2d layers and attention through ops-adv.

    With `fuse`, decoder blocks whose forward adds a residual before an RMS norm, multiplies a
    SiLU gate by an up projection, or applies transformers' rotary embedding run the fused ops
    (`ops_adv.models.blocks`), and eval-mode Conv2d -> BatchNorm2d (-> ReLU) runs as one conv2d_bn_relu.

    Converts in place and returns the model, with `tune_for_hardware` attached and
    `ops_adv.explain_model(model)` describing what was and was not converted.
    """
    report: list[dict[str, str]] = []
    for name, m in _walk(model):
        if getattr(type(m), "_ops_adv_converted", False):
            report.append({"module": name, "type": type(m).__name__, "converted": "yes", "why": "already converted"})
            continue
        forward = next((f for cls, f in _FORWARDS.items() if type(m) is cls), None)
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
        if "norm" in type(m).__name__.lower() or _eps_attr(m) and not list(m.children()):
            why = _looks_like_rms_norm(m)
            if why is None:
                _swap(m, _library_rms_forward)
                report.append({"module": name, "type": type(m).__name__, "converted": "yes",
                               "why": "behaves as an RMS norm (structure and probe)"})
            else:
                report.append({"module": name, "type": type(m).__name__, "converted": "no", "why": why})
    if fuse:
        report += _fuse_blocks(model)
        report += _fuse_conv_bn_relu(model)
    report += _fold_batch_norms(model)
    if attention:
        report += hf.use_attention(model)
    model._ops_adv_report = report
    model.tune_for_hardware = types.MethodType(_tune_method, model)
    return model


_NO_FUSION: dict[type, str] = {}  # classes whose forward has nothing to fuse, and why
_FUSED: dict[tuple[type, tuple[str, ...]], type] = {}


def _fuse_blocks(model: nn.Module) -> list[dict[str, str]]:
    """Rewrite the forward of blocks with fusable patterns (see `blocks`); the class is swapped per pattern set."""
    def rms_ok(norm: Any) -> bool:
        return isinstance(norm, nn.Module) and (isinstance(norm, nn.RMSNorm) or _looks_like_rms_norm(norm) is None)

    out = []
    for name, m in list(model.named_modules()):
        cls = type(m)
        if not list(m.children()) or cls.__module__.startswith("torch.") or getattr(cls, "_ops_adv_fused", False) \
                or cls in _NO_FUSION:
            continue
        new, done, why = blocks.rewrite_forward(m, rms_ok)
        if new is None:
            if why.startswith("no residual-add") or "not readable" in why or "not a" in why:
                _NO_FUSION[cls] = why  # a property of the class's code, not of this instance
            continue
        key = (cls, tuple(done))
        sub = _FUSED.get(key)
        if sub is None:
            sub = _FUSED[key] = type(cls.__name__, (cls,), {"forward": new, "_ops_adv_fused": True,
                                                             "__module__": cls.__module__, "__qualname__": cls.__qualname__})
        m.__class__ = sub
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
        if not isinstance(conv, nn.Conv2d) or not getattr(type(conv), "_ops_adv_converted", False):
            continue
        bn = modules[n.target]
        if bn.__dict__.get("_ops_adv_fused"):
            continue  # runs in a fused conv2d_bn_relu site (see conv_bn)
        if len(src.users) != 1 or calls[src.target] != 1 or calls[n.target] != 1 or not bn.track_running_stats \
                or bn.running_var is None:
            out.append({"module": n.target, "type": "BatchNorm2d", "converted": "no",
                        "why": f"not folded into {src.target}: the conv's output has other readers, or a module is called twice"})
            continue
        conv.__dict__["_ops_adv_bn"] = bn  # plain attributes: state_dict keys stay the same
        bn.__dict__["_ops_adv_conv"] = conv
        _folded(conv, bn)  # folded once now, so a compiled graph finds the fold ready
        _swap(bn, _bn_forward)
        out.append({"module": n.target, "type": "BatchNorm2d", "converted": "yes",
                    "why": f"folded into {src.target} in eval mode (train mode runs both as before)"})
    return out


def explain_model(model: nn.Module) -> list[dict[str, str]]:
    """What convert_model converted in `model`, what it did not, and why."""
    report = getattr(model, "_ops_adv_report", None)
    if report is None:
        return [{"module": "", "type": type(model).__name__, "converted": "no", "why": "convert_model was not applied"}]
    return list(report)


def _tune_method(model: nn.Module, *args: Any, **kwargs: Any) -> dict:
    from .record import tune_for_hardware

    return tune_for_hardware(model, *args, **kwargs)
