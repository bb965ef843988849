"""The Conv2d + BatchNorm2d (+ ReLU) model pass: find each site, fold the BatchNorm, run `conv2d_bn_relu`.

`fuse_conv_bn_relu(model)` rewrites an eval-mode model in place: each Conv2d -> BatchNorm2d
(-> ReLU) that torch.fx finds in one module's forward runs as one `ConvBNReLU` call (weights
folded on each call where that is cheaper than the BatchNorm pass, see `fold_bn`) in a rewritten forward that the module uses
in eval mode. The conv and BatchNorm modules stay, so state_dict keys, checkpoints and train
mode (which runs the module's own forward) are as before. The op itself is
`ops_adv.ops.conv2d_bn_relu`.
"""
from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..ops.conv2d import conv2d
from ..ops.conv2d_bn_relu import conv2d_bn_relu


# --------------------------------------------------------------------------- the module and the model pass


def fold_bn(conv: nn.Conv2d, bn: nn.BatchNorm2d) -> tuple[torch.Tensor, torch.Tensor]:
    """conv's weight and bias with the eval-mode BatchNorm after it folded in, from the tensors as they are now.

    Folded on each call, never cached: a cache cannot see edits through `.data` (EMA, weight surgery) nor
    a compiled graph's inputs changing under it, and it doubled what the model holds and what
    `torch.save(model)` writes. `fold_pays` keeps folding to the calls where it is cheaper than the
    BatchNorm pass it removes.
    """
    w = conv.weight
    hi = torch.float64 if w.dtype == torch.float64 else torch.float32
    scale = torch.rsqrt(bn.running_var.to(hi) + bn.eps)
    if bn.weight is not None:
        scale = scale * bn.weight.to(hi)
    shift = -bn.running_mean.to(hi) * scale
    if bn.bias is not None:
        shift = shift + bn.bias.to(hi)
    if conv.bias is not None:
        shift = shift + conv.bias.to(hi) * scale
    fmt = torch.channels_last if w.is_contiguous(memory_format=torch.channels_last) and not w.is_contiguous() \
        else torch.contiguous_format
    folded = (w.to(hi) * scale.view(-1, 1, 1, 1)).to(w.dtype).contiguous(memory_format=fmt)
    return folded, shift.to(device=w.device, dtype=w.dtype)


def fold_pays(conv: nn.Conv2d, x: torch.Tensor) -> bool:
    """Whether folding (a pass over the weight) costs no more than the BatchNorm pass over the conv's output it
    saves: early, wide-activation layers fold; late ones with large weights and small outputs run conv then BN."""
    if x.dim() != 4:  # BatchNorm2d refuses other ranks: unfolded, so it still does
        return False
    (kh, kw), (sh, sw), (ph, pw), (dh, dw) = conv.kernel_size, conv.stride, conv.padding, conv.dilation
    ho = (x.shape[-2] + 2 * ph - dh * (kh - 1) - 1) // sh + 1
    wo = (x.shape[-1] + 2 * pw - dw * (kw - 1) - 1) // sw + 1
    return conv._parameters["weight"].numel() <= x.shape[0] * conv.out_channels * ho * wo


def _bn_eval(bn: nn.BatchNorm2d, y: torch.Tensor) -> torch.Tensor:
    """An eval-mode BatchNorm2d's output (what its forward computes there)."""
    return F.batch_norm(y, bn.running_mean, bn.running_var, bn.weight, bn.bias, False, 0.0, bn.eps)


class ConvBNReLU(nn.Module):
    """One fused site: the model's own Conv2d and eval-mode BatchNorm2d (and a ReLU) as one conv2d_bn_relu.

    It refers to the model's modules without owning them (they stay where they are, with their
    state_dict keys), and folds them on use (`fold_bn`): w·γ/√(var+ε) and (b − mean)·γ/√(var+ε) + β.
    """

    def __init__(self, conv: nn.Conv2d, bn: nn.BatchNorm2d, relu: bool) -> None:
        super().__init__()
        self.__dict__["conv"], self.__dict__["bn"] = conv, bn  # not children: the model owns them
        self.relu = relu

    def folded(self) -> tuple[torch.Tensor, torch.Tensor]:
        return fold_bn(self.conv, self.bn)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        conv = self.conv
        if torch.is_grad_enabled() and (conv._parameters["weight"].requires_grad or x.requires_grad):
            y = self.bn(F.conv2d(x, conv.weight, conv.bias, conv.stride, conv.padding, conv.dilation))
            return F.relu(y) if self.relu else y  # torch's graph gives the gradients (eval-mode BN)
        if not fold_pays(conv, x):
            y = _bn_eval(self.bn, conv2d(x, conv.weight, conv.bias, conv.stride, conv.padding, conv.dilation))
            return y.relu_() if self.relu else y  # y is ours and nothing records it: in place, as the kernels do
        w, b = self.folded()
        return conv2d_bn_relu(x, w, b, conv.stride, conv.padding, conv.dilation, self.relu)

    def extra_repr(self) -> str:
        return f"relu={self.relu}"


_fx_tracing = getattr(torch.fx._symbolic_trace, "is_fx_symbolic_tracing", None) or torch.fx._symbolic_trace.is_fx_tracing


def _fused_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """An owner's forward after fusion: the fused graph where it computes what the class's forward does
    and nothing observes the modules it skips; else its class's forward (decided per call)."""
    if _fused_ok(self):
        return self.__dict__["_ops_adv_fused_graph"](*args, **kwargs)
    return type(self).forward(self, *args, **kwargs)


_hooks = torch.nn.modules.module
_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")


def _fused_ok(owner: nn.Module) -> bool:
    """Eval mode everywhere, no parameter of a site that autograd must reach, no hook on a module the
    fused graph skips, not under torch.fx or jit tracing (jit.trace's check retraces)."""
    if owner.training or _fx_tracing() or torch._C._get_tracing_state() is not None \
            or _hooks._global_forward_hooks or _hooks._global_forward_pre_hooks:
        return False
    grad = torch.is_grad_enabled()
    for m in owner.__dict__["_ops_adv_fused_mods"]:
        if m.training or m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks:
            return False
        if grad:
            for p in m._parameters.values():
                if p is not None and p.requires_grad:
                    return False
        if "weight" not in m._parameters and isinstance(m, (nn.Conv2d, nn.BatchNorm2d)):
            return False  # parametrized (or pruned): the module computes its weight
    return True


class _OneLevel(torch.fx.Tracer):
    """Traces one module's own forward: every submodule call stays a call_module node."""

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return True


_RELU_FUNCS = (F.relu, torch.relu, torch.relu_, F.relu_)


def _is_relu(node: torch.fx.Node, modules: dict[str, nn.Module], src: torch.fx.Node) -> bool:
    """Whether `node` is relu(src) and nothing more (a ReLU module, F.relu / torch.relu, or .relu())."""
    if node.op == "call_module":
        m = modules.get(node.target)
        return type(m) is nn.ReLU and node.args == (src,) and not node.kwargs
    if node.op == "call_function":
        return node.target in _RELU_FUNCS and node.args[:1] == (src,) and len(node.args) + len(node.kwargs) <= 2 \
            and set(node.kwargs) <= {"inplace"}
    if node.op == "call_method":
        return node.target in ("relu", "relu_") and node.args == (src,) and not node.kwargs
    return False


def _site(name: str, why: str, fused: bool) -> dict[str, str]:
    return {"module": name, "type": "Conv2d+BatchNorm2d", "converted": "yes" if fused else "no", "why": why}


def _conv_refusal(conv: nn.Module) -> str | None:
    if type(conv).forward is not nn.Conv2d.forward or "forward" in conv.__dict__ and not _converted(conv):
        return f"{type(conv).__name__} overrides Conv2d.forward"
    if conv.groups != 1:
        return f"groups={conv.groups}: conv2d_bn_relu covers groups 1"
    if conv.padding_mode != "zeros":
        return f"padding_mode={conv.padding_mode!r}: only zero padding folds into conv2d_bn_relu"
    if isinstance(conv.padding, str):
        return f"padding={conv.padding!r}: only numeric padding is supported"
    if not conv.weight.dtype.is_floating_point:
        return f"weight dtype {conv.weight.dtype} is not floating point"
    return None


def _converted(m: nn.Module) -> bool:
    """Whether `m`'s forward is one convert_model gave it (marked `_ops_adv_forward`)."""
    f = m.__dict__.get("forward")
    return isinstance(f, functools.partial) and getattr(f.func, "_ops_adv_forward", False)


def _bn_refusal(bn: nn.Module, conv: nn.Conv2d) -> str | None:
    if type(bn).forward is not nn.BatchNorm2d.forward or "forward" in bn.__dict__ and not _converted(bn):
        return f"{type(bn).__name__} overrides BatchNorm2d.forward"
    if bn.training:
        return "the BatchNorm is in training mode (batch statistics): call model.eval() first"
    if not bn.track_running_stats or bn.running_mean is None or bn.running_var is None:
        return "the BatchNorm has no running statistics (track_running_stats=False)"
    if bn.num_features != conv.out_channels:
        return f"BatchNorm has {bn.num_features} features for the conv's {conv.out_channels} channels"
    return None


def fuse_conv_bn_relu(model: nn.Module) -> list[dict[str, str]]:
    """Fuse each Conv2d -> BatchNorm2d (-> ReLU) of an eval-mode `model`, in place, into a `ConvBNReLU`.

    Each module's own forward is traced with torch.fx (submodules kept as calls). A site fuses when
    the conv's output is read by the BatchNorm alone, and takes the ReLU in when the BatchNorm's
    output is read by one relu alone; the conv and BatchNorm must be called once, from one parent.
    A changed forward runs the rewritten graph in eval mode; conv and BatchNorm modules stay in place.
    Returns one entry per candidate site (a Conv2d feeding a BatchNorm2d) or per refusal, with why.
    """
    if model.training:
        return [_site("", "model is in training mode (BatchNorm uses batch statistics): call model.eval() "
                          "first; left unchanged", False)]
    parents: dict[int, int] = {}
    for _, m in model.named_modules(remove_duplicate=False):
        for c in m.children():
            parents[id(c)] = parents.get(id(c), 0) + 1
    report: list[dict[str, str]] = []
    for owner_name, owner in list(model.named_modules()):
        kids = dict(owner.named_children())
        if not any(isinstance(c, nn.Conv2d) for c in kids.values()) \
                or not any(isinstance(c, nn.BatchNorm2d) for c in kids.values()):
            continue
        if "_ops_adv_fused_graph" in owner.__dict__:
            continue  # fused before
        prefix = owner_name + "." if owner_name else ""
        try:
            graph = _OneLevel().trace(owner)
        except Exception as e:  # data-dependent control flow, unsupported Python
            report.append(_site(owner_name, f"torch.fx cannot trace {type(owner).__name__}.forward "
                                            f"({type(e).__name__}: {str(e)[:120]}); left unchanged", False))
            continue
        report += _fuse_in(owner, graph, prefix, parents)
    order = {name: i for i, (name, _) in enumerate(model.named_modules())}
    return sorted(report, key=lambda r: order.get(r["module"], -1))  # in the model's module order


def _fuse_in(owner: nn.Module, graph: torch.fx.Graph, prefix: str, parents: dict[int, int]) -> list[dict[str, str]]:
    modules = dict(owner.named_children())
    calls: dict[str, int] = {}
    for n in graph.nodes:
        if n.op == "call_module":
            calls[n.target] = calls.get(n.target, 0) + 1
    out, changed = [], False
    sites: dict[str, ConvBNReLU] = {}
    relus: list[nn.Module] = []
    for n in list(graph.nodes):
        bn = modules.get(n.target) if n.op == "call_module" else None
        src = n.args[0] if n.args else None
        if not isinstance(bn, nn.BatchNorm2d) or getattr(src, "op", None) != "call_module" \
                or not isinstance(modules.get(src.target), nn.Conv2d):
            continue
        conv = modules[src.target]
        name = prefix + src.target
        why = _conv_refusal(conv) or _bn_refusal(bn, conv)
        if why is None and (len(src.users) != 1 or len(n.args) != 1 or n.kwargs):
            why = f"the conv's output is also read elsewhere than {prefix}{n.target}"
        if why is None and (calls[src.target] != 1 or calls[n.target] != 1
                            or parents.get(id(conv), 0) != 1 or parents.get(id(bn), 0) != 1):
            why = "the conv or the BatchNorm is called more than once or shared between modules"
        if why is None and conv.training:
            why = "the conv is in training mode: call model.eval() first"
        if why is None and any(m._forward_hooks or m._forward_pre_hooks for m in (conv, bn)):
            why = "the conv or the BatchNorm has forward hooks, which fusing would drop"
        if why is None and any(a.op == "get_attr" and a.target.split(".")[0] in (src.target, n.target)
                               for a in graph.nodes):
            why = f"{type(owner).__name__}.forward reads the conv's or the BatchNorm's parameters directly"
        if why is not None:
            out.append(_site(name, f"not fused with {prefix}{n.target}: {why}", False))
            continue
        users = list(n.users)
        relu = users[0] if len(users) == 1 and _is_relu(users[0], modules, n) else None
        site = f"_ops_adv_site_{len(sites)}"
        sites[site] = ConvBNReLU(conv, bn, relu is not None)
        src.target = site
        bn.__dict__["_ops_adv_fused"] = True
        n.replace_all_uses_with(src)
        graph.erase_node(n)
        if relu is not None:
            if relu.op == "call_module":
                relus.append(modules[relu.target])
            relu.replace_all_uses_with(src)
            graph.erase_node(relu)
        changed = True
        tail = " -> ReLU" if relu is not None else " (its output has other readers than one ReLU: ReLU not fused)" \
            if len(users) != 1 else " (no ReLU follows)"
        out.append(_site(name, f"fused with {prefix}{n.target}{tail} into ConvBNReLU (folded weight and bias)", True))
    if changed:
        graph.lint()
        root = dict(modules)
        root.update(sites)
        # The fused forward calls the owner's own submodules and the sites; kept out of owner's
        # children, so parameters, state_dict keys and .train()/.eval() are the model's as before.
        gm = torch.fx.GraphModule(root, graph, class_name=type(owner).__name__ + "Fused")
        owner.__dict__["_ops_adv_fused_graph"] = gm
        owner.__dict__["_ops_adv_fused_pairs"] = [(site.conv, site.bn) for site in sites.values()]
        owner.__dict__["_ops_adv_fused_mods"] = [m for site in sites.values() for m in (site.conv, site.bn)] + relus
        owner.forward = functools.partial(_fused_forward, owner)  # pickles, unlike a bound method
    return out
