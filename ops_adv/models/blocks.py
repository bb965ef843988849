"""Fused ops inside decoder blocks: residual add + norm, SiLU-gate times up, rotary embedding.

A block's own `forward` is read and matched statement by statement; only the exact patterns
below are rewritten, everything else in the function stays as its library wrote it:
- `h = residual + <e>; residual = h; h = self.<norm>(h)` where `<norm>` is an RMS norm, plain or (1 + weight)
  (Gemma's) -> `h, residual = add_rms_norm(<e>, residual, ...)` (the sum is the new residual, as before; `<e>` is
  `h` in Llama, `self.resid_attn_dropout(h)` in Phi-3);
- `self.<act>(a) * b` or `b * self.<act>(a)` where `<act>` is SiLU or GeLU-tanh -> `swiglu(a, b[, activation])`;
- `a, b = y.chunk(2, dim=-1)` followed by a statement with `b * self.<act>(a)` (Phi-3's merged gate_up_proj)
  -> `swiglu(y)` on the merged [..., 2I] tensor, whose gate-then-up halves are swiglu's layout (nothing copied);
- a call of the module-level `apply_rotary_pos_emb` with transformers' signature -> ops-adv's rope;
- `_, w, ids = self.<gate>(x)` then `y = self.<experts>(x, ids, w)` (transformers' sparse MoE blocks: Mixtral,
  Qwen2-MoE, Qwen3-MoE) where router and experts pass `moe_block`'s checks -> the experts' call decided per call
  between ops_adv.moe on the router's logits and the experts module itself (`moe_block.moe_call`).
A block whose forward has none of them, whose source cannot be read, or that closes over
variables (`super()`), is left as it is, with the reason in `explain_model`.
"""
from __future__ import annotations

import ast
import copy
import hashlib
import json
import inspect
import textwrap
import types
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import moe_block
from .merge import _observed, keep_merged, merge, one_gemm, project, runs_own

_REWRITTEN: dict[tuple[type, str], tuple[Callable, list[str]] | str] = {}


def _is_silu(m: Any) -> bool:
    return _act_kind(m) == "silu"


def _act_kind(m: Any) -> str | None:
    """"silu" or "gelu_tanh" (F.gelu(approximate="tanh"), Gemma's gelu_pytorch_tanh) when the parameter-free module
    `m` computes it on a probe, else None."""
    if isinstance(m, nn.SiLU):
        return "silu"
    if not isinstance(m, nn.Module) or list(m.parameters()) or list(m.children()):
        return None
    x = torch.linspace(-6, 6, 97, device="cpu")  # not the default device (a `with torch.device(...)` block)
    try:
        with torch.no_grad():
            y = m.forward(x)  # no hooks see the probe
            for kind, want in (("silu", F.silu(x)), ("gelu_tanh", F.gelu(x, approximate="tanh"))):
                if torch.allclose(y, want, atol=1e-6):
                    return kind
    except Exception:
        pass
    return None


def _self_attr(node: ast.AST) -> str | None:
    """`self.<name>` -> name."""
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
        return node.attr
    return None


def _name(node: ast.AST) -> str | None:
    return node.id if isinstance(node, ast.Name) else None


_ACT_NAMES = {"silu": "", "gelu_tanh": " (GeGLU: GeLU-tanh gate)"}


def _chunk_pair(stmt: ast.stmt) -> tuple[str, str, ast.expr] | None:
    """`a, b = <y>.chunk(2, dim=-1)` (or `.chunk(2, -1)`) -> (a, b, y)."""
    if not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Tuple)):
        return None
    t, v = stmt.targets[0].elts, stmt.value
    if len(t) != 2 or not all(isinstance(e, ast.Name) for e in t) or t[0].id == t[1].id or not isinstance(v, ast.Call) \
            or not isinstance(v.func, ast.Attribute) or v.func.attr != "chunk":
        return None
    args = list(v.args) + [k.value for k in v.keywords if k.arg == "dim"]

    def const(n: ast.AST) -> Any:
        if isinstance(n, ast.UnaryOp) and isinstance(n.op, ast.USub) and isinstance(n.operand, ast.Constant):
            return -n.operand.value
        return n.value if isinstance(n, ast.Constant) else None

    if len(args) != 2 or any(k.arg != "dim" for k in v.keywords) or const(args[0]) != 2 or const(args[1]) != -1:
        return None
    return t[0].id, t[1].id, v.func.value


def _moe_pair(a: ast.stmt, b: ast.stmt) -> tuple[str, str, str, tuple[str, str, str]] | None:
    """`l, w, i = self.<gate>(x)` and `y = self.<experts>(x, i, w)` -> (gate, experts, x, (l, w, i))."""
    if not (isinstance(a, ast.Assign) and isinstance(b, ast.Assign) and len(a.targets) == 1 and len(b.targets) == 1
            and isinstance(a.targets[0], ast.Tuple) and isinstance(b.targets[0], ast.Name)
            and isinstance(a.value, ast.Call) and isinstance(b.value, ast.Call)):
        return None
    names = [_name(t) for t in a.targets[0].elts]
    gate, experts = _self_attr(a.value.func), _self_attr(b.value.func)
    if len(names) != 3 or None in names or len(set(names)) != 3 or not gate or not experts or gate == experts \
            or len(a.value.args) != 1 or a.value.keywords or len(b.value.args) != 3 or b.value.keywords:
        return None
    x = _name(a.value.args[0])
    if not x or x in names or [_name(n) for n in b.value.args] != [x, names[2], names[1]]:
        return None
    return gate, experts, x, (names[0], names[1], names[2])


class _Rewriter(ast.NodeTransformer):
    """`norm_ok(name)` / `silu_ok(name)` / `linear_ok(name)`: whether `self.<name>` is an RMS norm (its kind: "rms"
    or "unit_offset") / a gate activation (its kind: "silu" or "gelu_tanh") / an nn.Linear (checked on the instance,
    or read from the names a pickled forward was built with: then any true value)."""

    def __init__(self, norm_ok: Callable[[str], Any], silu_ok: Callable[[str], Any],
                 linear_ok: Callable[[str], bool], moe_ok: Callable[[str, str], Any] | None = None):
        self.norm_ok, self.silu_ok, self.linear_ok, self.moe_ok = norm_ok, silu_ok, linear_ok, moe_ok
        self.done: list[str] = []
        self.names: set[str] = set()
        self.groups: list[tuple[str, ...]] = []  # Linear layers on one input, run as one gemm (see merge)
        self.checked = False  # a pattern matched in the source, and the instance's modules were checked

    def _check(self, ok: Callable[[str], Any], name: str) -> Any:
        self.checked = True
        return ok(name)

    def _fuse_moe(self, body: list[ast.stmt]) -> list[ast.stmt]:
        """`<logits>, <w>, <ids> = self.<gate>(<x>)` then `<y> = self.<experts>(<x>, <ids>, <w>)` ->
        `<y> = __ops_adv_moe(self.<experts>, <x>, <ids>, <w>, <logits>)` (the router's call as it was)."""
        if self.moe_ok is None:
            return body
        out, i = [], 0
        while i < len(body):
            pair = _moe_pair(body[i], body[i + 1]) if i + 1 < len(body) else None
            if pair is not None:
                gate, experts, x, (logits, w, ids) = pair
                spec = self._check(lambda _: self.moe_ok(gate, experts), gate)
                if spec:
                    s = ast.Name("self", ast.Load())
                    call = ast.Call(func=ast.Name("__ops_adv_moe", ast.Load()),
                                    args=[ast.Attribute(s, experts, ast.Load()), ast.Name(x, ast.Load()),
                                          ast.Name(ids, ast.Load()), ast.Name(w, ast.Load()),
                                          ast.Name(logits, ast.Load())], keywords=[])
                    out += [body[i], ast.copy_location(ast.Assign(targets=body[i + 1].targets, value=call),
                                                       body[i + 1])]
                    top_k, renorm = spec if isinstance(spec, tuple) else ("k", "?")
                    self.done.append(f"{gate}'s router logits + {experts}({x}, {ids}, {w}) -> moe (top_k={top_k}, "
                                     f"renormalize={renorm}; where the table has a tuned moe kernel, in eval with no "
                                     f"gradient, else {experts} runs as transformers chose)")
                    self.names.update((gate, experts))
                    i += 2
                    continue
            out.append(body[i])
            i += 1
        return out

    def _fuse_add_norm(self, body: list[ast.stmt]) -> list[ast.stmt]:
        out, i = [], 0
        while i < len(body):
            s = body[i: i + 3]
            if len(s) == 3 and all(isinstance(t, ast.Assign) and len(t.targets) == 1 for t in s):
                (a, b, c) = s
                h, r = _name(a.targets[0]), _name(b.targets[0])
                add = a.value
                norm = _self_attr(c.value.func) if isinstance(c.value, ast.Call) else None
                # the other addend: `h` (Llama), or an expression of it (Phi-3's `self.resid_attn_dropout(h)`)
                other = None
                if h and r and isinstance(add, ast.BinOp) and isinstance(add.op, ast.Add):
                    other = add.right if _name(add.left) == r else add.left if _name(add.right) == r else None
                if other is not None and any(isinstance(n, ast.NamedExpr) for n in ast.walk(other)):
                    other = None  # it would assign while the sum is formed
                kind = None
                if (other is not None and _name(b.value) == h
                        and _name(c.targets[0]) == h and norm and len(c.value.args) == 1 and not c.value.keywords
                        and _name(c.value.args[0]) == h):
                    kind = self._check(self.norm_ok, norm)
                if kind:
                    call = ast.Call(func=ast.Name("__ops_adv_add_rms_norm", ast.Load()),
                                    args=[other, ast.Name(r, ast.Load()),
                                          ast.Attribute(ast.Name("self", ast.Load()), norm, ast.Load())], keywords=[])
                    out.append(ast.copy_location(ast.Assign(
                        targets=[ast.Tuple([ast.Name(h, ast.Store()), ast.Name(r, ast.Store())], ast.Store())],
                        value=call), a))
                    self.done.append(f"residual add + {norm} -> add_rms_norm"
                                     + (" (1 + weight)" if kind == "unit_offset" else ""))
                    self.names.add(norm)
                    i += 3
                    continue
            out.append(body[i])
            i += 1
        return out

    def _proj_call(self, node: ast.AST) -> tuple[str, str] | None:
        """`self.<lin>(<name>)` where <lin> is a Linear layer -> (lin, name)."""
        if isinstance(node, ast.Call) and len(node.args) == 1 and not node.keywords and _name(node.args[0]):
            lin = _self_attr(node.func)
            if lin and lin not in self.names and self.linear_ok(lin):
                return lin, _name(node.args[0])
        return None

    def _one_projection(self, stmt: ast.stmt) -> tuple[ast.Call, str, str] | None:
        """The one `self.<lin>(x)` an assignment evaluates unconditionally, when it has exactly one and does not
        assign x; else None."""
        if not isinstance(stmt, ast.Assign):
            return None
        found, stored = [], set()

        def walk(n: ast.AST, sure: bool) -> None:
            if isinstance(n, (ast.Lambda, ast.FunctionDef, ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp,
                              ast.NamedExpr)):
                found.append(None)  # evaluated later, or assigns: not this pattern
                return
            if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
                stored.add(n.id)
            pc = self._proj_call(n) if sure else None
            if pc is not None:
                found.append((n, *pc))
            cond = isinstance(n, (ast.IfExp, ast.BoolOp))
            for i, c in enumerate(ast.iter_child_nodes(n)):
                walk(c, sure and not (cond and (i > 0 or isinstance(n, ast.BoolOp))))

        walk(stmt, True)
        if len(found) != 1 or found[0] is None or found[0][2] in stored:
            return None
        return found[0]

    def _group_projections(self, body: list[ast.stmt]) -> list[ast.stmt]:
        """Consecutive assignments each applying a different Linear layer to the same `x`
        (`q = self.q_proj(x)...; k = self.k_proj(x)...; v = ...`) -> the layers' outputs from one call first."""
        out, i = [], 0
        while i < len(body):
            run = []
            for s in body[i:]:
                p = self._one_projection(s)
                if p is None or (run and (p[2] != run[0][2] or p[1] in {r[1] for r in run})):
                    break
                run.append(p)
            if len(run) < 2:
                out.append(body[i])
                i += 1
                continue
            tmp = [f"__ops_adv_proj{len(self.groups)}_{k}" for k in range(len(run))]
            swap = {id(call): t for (call, _, _), t in zip(run, tmp)}

            class _Swap(ast.NodeTransformer):
                def visit_Call(self, n: ast.Call) -> ast.AST:
                    t = swap.get(id(n))
                    return ast.copy_location(ast.Name(t, ast.Load()), n) if t else self.generic_visit(n)

            names = tuple(r[1] for r in run)
            call = ast.Call(func=ast.Name("__ops_adv_project", ast.Load()),
                            args=[ast.Name(run[0][2], ast.Load()),
                                  *[ast.Attribute(ast.Name("self", ast.Load()), n, ast.Load()) for n in names]],
                            keywords=[])
            out.append(ast.copy_location(ast.Assign(
                targets=[ast.Tuple([ast.Name(t, ast.Store()) for t in tmp], ast.Store())], value=call), body[i]))
            out += [_Swap().visit(s) for s in body[i: i + len(run)]]
            self.groups.append(names)
            self.names.update(names)
            self.done.append(f"{', '.join(names)} -> one gemm (merged weights)")
            i += len(run)
        return out

    def _fuse_chunks(self, body: list[ast.stmt]) -> list[ast.stmt]:
        """`a, b = y.chunk(2, dim=-1)` then a statement with `b * self.act(a)` (or `self.act(a) * b`) -> swiglu on
        y itself: its halves are gate then up, swiglu's merged layout (Phi-3's gate_up_proj output)."""
        out: list[ast.stmt] = []
        for i, stmt in enumerate(body):
            pair = _chunk_pair(stmt)
            nxt = body[i + 1] if i + 1 < len(body) else None
            if pair is None or nxt is None or any(isinstance(n, ast.NamedExpr) for n in ast.walk(nxt)):
                out.append(stmt)
                continue
            a, b, y = pair
            tmp = f"__ops_adv_chunk{len(self.done)}_{i}"
            rw, found = self, []

            class _Product(ast.NodeTransformer):
                def visit_BinOp(self, n: ast.BinOp) -> ast.AST:
                    n = self.generic_visit(n)
                    if found or not isinstance(n.op, ast.Mult):
                        return n
                    for call, other, right in ((n.left, n.right, False), (n.right, n.left, True)):
                        if isinstance(call, ast.Call) and len(call.args) == 1 and not call.keywords \
                                and _name(call.args[0]) == a and _name(other) == b:
                            act = _self_attr(call.func)
                            kind = act and rw._check(rw.silu_ok, act)
                            if kind:
                                found.append((act, kind, right))
                                return ast.copy_location(ast.Call(
                                    func=ast.Name("__ops_adv_chunked", ast.Load()),
                                    args=[call.func, ast.Name(tmp, ast.Load()), ast.Name(a, ast.Load()),
                                          ast.Name(b, ast.Load()), ast.Constant(right)], keywords=[]), n)
                    return n

            new_next = _Product().visit(copy.deepcopy(nxt))
            if not found:
                out.append(stmt)
                continue
            act, kind, right = found[0]
            out.append(ast.copy_location(ast.Assign(targets=[ast.Name(tmp, ast.Store())], value=y), stmt))
            stmt.value.func.value = ast.Name(tmp, ast.Load())
            out.append(stmt)
            body[i + 1] = new_next
            prev = body[i - 1] if i else None  # `y = self.<proj>(x)` just before: name the projection
            proj = (_self_attr(prev.value.func) if isinstance(prev, ast.Assign) and isinstance(prev.value, ast.Call)
                    and isinstance(y, ast.Name) and [_name(t) for t in prev.targets] == [y.id] else None)
            prod = f"{b} * {act}({a})" if right else f"{act}({a}) * {b}"
            self.done.append(f"{prod} on the halves of {proj or _name(y) or 'one tensor'}'s output -> swiglu on the merged "
                             f"[..., 2I] tensor{_ACT_NAMES[kind] if kind in _ACT_NAMES else ''} (gate half first, as "
                             "swiglu reads it: nothing copied)")
            self.names.add(act)
        return out

    def generic_visit(self, node: ast.AST) -> ast.AST:
        for field in ("body", "orelse", "finalbody"):  # before the products inside are visited one by one
            stmts = getattr(node, field, None)
            if isinstance(stmts, list) and stmts and isinstance(stmts[0], ast.stmt):
                setattr(node, field, self._fuse_chunks(list(stmts)))
        node = super().generic_visit(node)
        for field in ("body", "orelse", "finalbody"):
            stmts = getattr(node, field, None)
            if isinstance(stmts, list) and stmts and isinstance(stmts[0], ast.stmt):
                setattr(node, field, self._group_projections(self._fuse_add_norm(self._fuse_moe(stmts))))
        return node

    def visit_BinOp(self, node: ast.BinOp) -> ast.AST:
        node = self.generic_visit(node)
        if not isinstance(node.op, ast.Mult):
            return node
        for call, other, right in ((node.left, node.right, False), (node.right, node.left, True)):
            if not (isinstance(call, ast.Call) and len(call.args) == 1 and not call.keywords):
                continue
            act = _self_attr(call.func)
            kind = act and self._check(self.silu_ok, act)
            if not kind:
                continue
            what = _ACT_NAMES.get(kind, "")
            g, u = self._proj_call(call.args[0]), self._proj_call(other)
            prod = "up * {act}(gate)" if right else "{act}(gate) * up"
            if g and u and g[1] == u[1] and g[0] != u[0]:  # act(self.gate(x)) * self.up(x), either order: one gemm
                self.done.append((f"{u[0]} * {act}({g[0]})" if right else f"{act}({g[0]}) * {u[0]}")
                                 + f" -> one gemm (merged weights), swiglu{what}")
                self.names.update((act, g[0], u[0]))
                self.groups.append((g[0], u[0]))
                s = ast.Name("self", ast.Load())
                return ast.copy_location(ast.Call(
                    func=ast.Name("__ops_adv_gate_up", ast.Load()),
                    args=[call.func, ast.Attribute(s, g[0], ast.Load()), ast.Attribute(s, u[0], ast.Load()),
                          ast.Name(g[1], ast.Load()), ast.Constant(right)], keywords=[]), node)
            self.done.append(prod.format(act=act) + f" -> swiglu{what}")
            self.names.add(act)
            # the operands are evaluated in the order the original evaluates them
            args = [call.func, other, call.args[0]] if right else [call.func, call.args[0], other]
            return ast.copy_location(ast.Call(func=ast.Name("__ops_adv_swiglu_r" if right else "__ops_adv_swiglu",
                                                            ast.Load()), args=args, keywords=[]), node)
        return node

    def visit_Call(self, node: ast.Call) -> ast.AST:
        node = self.generic_visit(node)
        if _name(node.func) == "apply_rotary_pos_emb" and len(node.args) == 4 \
                and not any(isinstance(a, ast.Starred) for a in node.args) \
                and all(k.arg == "unsqueeze_dim" for k in node.keywords):  # (q, k, cos, sin[, unsqueeze_dim=])
            self.done.append("apply_rotary_pos_emb -> rope")
            node.func = ast.Name("__ops_adv_apply_rotary_pos_emb", ast.Load())
        return node


def _rope_matches(fn: Any) -> Any:
    """ops-adv's drop-in for `fn` when it is transformers' rotate-half apply_rotary_pos_emb (checked on a probe):
    the partial-rotary form where `fn` takes a narrower table, else the full one; None when it is neither."""
    from ..ops.rope import apply_rotary_pos_emb as ours, apply_rotary_pos_emb_partial as partial

    try:  # (q, k, cos, sin, unsqueeze_dim=1): another parameter (position_ids) would be taken for unsqueeze_dim
        extra = list(inspect.signature(fn).parameters)[4:]
    except (TypeError, ValueError):
        return False
    if extra not in ([], ["unsqueeze_dim"]):
        return None
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 2, 3, 8, generator=g, device="cpu"), torch.randn(1, 1, 3, 8, generator=g, device="cpu")
    ang = torch.randn(1, 3, 4, generator=g, device="cpu")
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
    try:
        with torch.no_grad():
            want, got = fn(q, k, cos, sin), ours(q, k, cos, sin)
        if not all(torch.allclose(w, o, atol=1e-5) for w, o in zip(want, got)):
            return None
    except Exception:
        return None
    cos, sin = torch.cat([ang[..., :2].cos()] * 2, -1), torch.cat([ang[..., :2].sin()] * 2, -1)
    try:  # a narrower table (partial rotary): where the model's formula takes one, ours must agree
        with torch.no_grad():
            want = fn(q, k, cos, sin)
    except Exception:
        return ours  # the model's formula has no partial form (it raises, as ours does)
    try:
        with torch.no_grad():
            got = partial(q, k, cos, sin)
        return partial if all(torch.allclose(w, o, atol=1e-5) for w, o in zip(want, got)) else None
    except Exception:
        return None


def rewrite_forward(m: nn.Module, rms_ok: Callable[[nn.Module], bool]) -> tuple[Callable | None, list[str], str]:
    """A forward for `m` with the fused ops in, what was fused, and why not when nothing was.

    The function is the same object for every instance of a class whose modules pass the same checks,
    and pickle finds it by name (`_fused`), so a model holding it pickles and loads in another process."""
    norms: dict[str, str] = {}
    acts: dict[str, str] = {}

    def norm_ok(name: str) -> str | None:
        kind = rms_ok(getattr(m, name, None))
        kind = "rms" if kind is True else kind or None  # a plain bool: an RMS norm
        if kind:
            norms[name] = kind
        return kind

    def silu_ok(name: str) -> str | None:
        kind = _act_kind(getattr(m, name, None))
        if kind:
            acts[name] = kind
        return kind

    def linear_ok(name: str) -> bool:
        return type(getattr(m, name, None)) is nn.Linear

    moe_specs: dict[str, tuple[int, bool]] = {}
    moe_why: dict[str, str] = {}

    def moe_ok(gate: str, experts: str) -> tuple[int, bool] | None:
        spec, why = moe_block.refusal(m, gate, experts, _act_kind)
        if spec is None:
            moe_why[experts] = why
        else:
            moe_specs[experts] = spec
        return spec

    new, done, why = _rewrite(type(m), norm_ok, silu_ok, linear_ok, moe_ok)
    if new is None and why.startswith("forward is dispatched by transformers'"):
        why = _experts_why(m, why)
    if moe_specs:
        why_not = _install_moe(m, new, moe_specs) if new is not None else f"its block's forward: {why}"
        if why_not is not None:  # rewritten again without the experts' call
            moe_why.update(dict.fromkeys(moe_specs, why_not))
            moe_specs.clear()
            new, done, why = _rewrite(type(m), norm_ok, silu_ok, linear_ok, lambda g, e: None)
    for name, reason in moe_why.items():
        experts = getattr(m, name, None)
        if isinstance(experts, nn.Module):
            experts.__dict__.pop(moe_block.SPEC, None)
            experts.__dict__[moe_block.REFUSED] = reason
    if new is not None:  # the modules checked here: a module put in their place later runs as itself
        for name, kind in norms.items():
            d = getattr(m, name).__dict__
            d["_ops_adv_rms_ok"] = True
            if kind == "unit_offset":
                d["_ops_adv_rms_unit"] = True  # (1 + weight): add_rms_norm(unit_offset=True)
        for name, kind in acts.items():
            d = getattr(m, name).__dict__
            d["_ops_adv_act"] = kind
            if kind == "silu":
                d["_ops_adv_silu_ok"] = True  # what forwards fused before the GeGLU kind read
        merged = []
        for group in new._ops_adv_groups:  # the layers' weights into one tensor; where not, they run one by one
            not_merged = merge([getattr(m, n) for n in group])
            if not_merged:
                done = [d if not d.startswith(", ".join(group) + " ->") and f"({group[0]}) * {group[-1]} ->" not in d
                        and not d.startswith(f"{group[-1]} * ") or "one gemm" not in d
                        else f"{', '.join(group)}: separate gemms ({not_merged})" for d in done]
            else:
                merged.append(group)
        if merged:
            keep_merged(m, tuple(merged))
    return new, done, why


def _install_moe(m: nn.Module, new: Callable, specs: dict[str, tuple[int, bool]]) -> str | None:
    """Mark the experts `new` may run ops_adv.moe for and probe the block; why not (marks undone), or None."""
    for name, spec in specs.items():
        experts = getattr(m, name)
        experts.__dict__[moe_block.SPEC] = spec
        experts.__dict__.pop(moe_block.REFUSED, None)
        experts._modules["act_fn"].__dict__["_ops_adv_act"] = "silu"
    why = moe_block.probe_block(m, new, list(specs))
    if why is not None:
        for name in specs:
            experts = getattr(m, name)
            experts.__dict__.pop(moe_block.SPEC, None)
            experts._modules["act_fn"].__dict__.pop("_ops_adv_act", None)
    return why


def _experts_why(m: nn.Module, why: str) -> str:
    """The experts module's row (its forward is transformers' to dispatch): what its block does with it."""
    d = m.__dict__
    if moe_block.SPEC in d:
        top_k, renorm = d[moe_block.SPEC]
        why += (f"; its block calls ops_adv.moe in its place (top_k={top_k}, renormalize={renorm}) for calls in eval "
                "with no gradient where the table has a tuned moe kernel (compile: an ops-adv kernel; export: "
                "always, the table deciding when it runs)")
    elif moe_block.REFUSED in d:
        why += f"; its block does not call ops_adv.moe: {d[moe_block.REFUSED]}"
    return why


def _rewrite(cls: type, norm_ok: Callable[[str], Any], silu_ok: Callable[[str], Any],
             linear_ok: Callable[[str], bool],
             moe_ok: Callable[[str, str], Any] | None = None) -> tuple[Callable | None, list[str], str]:
    chain, fn = _wrappers(cls.forward)
    if not isinstance(fn, types.FunctionType):
        return None, [], "forward is not a Python function"
    for w in chain:
        mod = getattr(w, "__module__", "") or ""
        if mod.startswith("transformers.integrations") or "/transformers/integrations/" in w.__code__.co_filename:
            # transformers chooses this forward's implementation (experts' grouped_mm, hub kernels): its own
            return None, [], f"forward is dispatched by transformers' {w.__code__.co_filename.rsplit('/', 1)[-1]} " \
                             "(its experts or kernel implementations): left to transformers"
        if _inner_cell(w) is None:
            return None, [], f"forward is wrapped by {w.__qualname__}, which ops_adv cannot re-apply: left as is"
    if fn.__code__.co_freevars:
        return None, [], "forward closes over variables (super() or a closure): left as is"
    try:
        src = textwrap.dedent(inspect.getsource(fn))
        tree = ast.parse(src)
    except (OSError, TypeError, SyntaxError) as e:
        return None, [], f"forward's source is not readable ({type(e).__name__})"
    fdef = tree.body[0]
    if not isinstance(fdef, ast.FunctionDef):
        return None, [], "forward is not a plain function"
    fdef.decorator_list = []
    rw = _Rewriter(norm_ok, silu_ok, linear_ok, moe_ok)
    rw.visit(fdef)
    done = rw.done
    rope_fn = _rope_matches(fn.__globals__.get("apply_rotary_pos_emb")) if any("rope" in d for d in done) else None
    if any("rope" in d for d in done) and rope_fn is None:
        return None, [], "apply_rotary_pos_emb here is not transformers' rotate-half formula: left as is"
    if not done:
        if rw.checked:  # the source has a pattern, this instance's modules did not pass: not the class's property
            return None, [], ("no residual-add + RMS norm or SiLU / GeLU-tanh gate that passes its checks on this "
                              "instance: left as is")
        return None, [], "no residual-add + RMS norm, SiLU / GeLU-tanh gate or rotary embedding in forward"
    token = "f_" + json.dumps([cls.__module__, cls.__qualname__, sorted(rw.names)]).encode().hex()
    new = _BY_NAME.get(token)
    if new is not None:
        return new, done, ""
    from ..ops.add_rms_norm import add_rms_norm
    from ..ops.swiglu import swiglu

    def add_norm(h, residual, norm):
        d = norm.__dict__
        if not d.get("_ops_adv_rms_ok") or _observed(norm):  # replaced, hooked or re-forwarded: the module runs
            h = residual + h
            return norm(h), h
        name = _EPS_NAME.get(type(norm))
        if name is None:  # found once per class: a missing attribute costs ~2 µs through nn.Module.__getattr__
            name = _EPS_NAME[type(norm)] = _eps_name(norm)
        eps = d.get(name)
        w = norm._parameters.get("weight")
        w = norm.weight if w is None else w
        eps = float(getattr(norm, name) if eps is None else eps)
        if d.get("_ops_adv_rms_unit"):
            return add_rms_norm(h, residual, w, eps, unit_offset=True)
        return add_rms_norm(h, residual, w, eps)

    def kind_of(act):
        """The gate activation ops_adv computes for `act`, or None where `act` must run itself."""
        d = act.__dict__
        kind = d.get("_ops_adv_act") or ("silu" if d.get("_ops_adv_silu_ok") else None)
        return None if kind is None or _observed(act) else kind

    def glu(y, up, kind):
        return swiglu(y, up) if kind == "silu" else swiglu(y, up, activation=kind)

    def gated(act, gate, up):
        kind = kind_of(act)
        return act(gate) * up if kind is None else glu(gate, up, kind)

    def gated_r(act, up, gate):  # up * act(gate): the product commutes exactly
        kind = kind_of(act)
        return up * act(gate) if kind is None else glu(gate, up, kind)

    def chunked(act, y, gate, up, right):  # gate, up = y.chunk(2, dim=-1): y is swiglu's merged layout
        kind = kind_of(act)
        if kind is None or not isinstance(y, torch.Tensor) or y.dim() < 1 or y.shape[-1] % 2:
            return up * act(gate) if right else act(gate) * up
        return glu(y, None, kind)

    def gate_up(act, gate_proj, up_proj, x, right=False):
        kind = kind_of(act)
        if kind is not None and getattr(gate_proj, "out_features", None) == getattr(up_proj, "out_features", 0):
            y = one_gemm(x, (gate_proj, up_proj))
            if y is not None:
                return glu(y, None, kind)  # [..., 2I]: gate then up
        if right:  # the layers run in the original's order (their hooks see it)
            up = up_proj(x)
            return gated_r(act, up, gate_proj(x))
        return gated(act, gate_proj(x), up_proj(x))

    # The rewritten forward's globals are a real module in sys.modules: Dynamo (torch 2.11) reaches an
    # inlined function's globals through the module its __name__ names, and failed on a bare dict copy.
    glb = _globals_module(fn).__dict__
    own = _own_guard(fdef, token)
    if own is not None:  # nothing tuned for the device (runs_own): the class's own forward, at the cost of one
        glb[own] = fn    # check; the helpers below then never run, so they need none of their own
    glb.update(__ops_adv_runs_own=runs_own, __ops_adv_add_rms_norm=add_norm, __ops_adv_swiglu=gated, __ops_adv_swiglu_r=gated_r,
               __ops_adv_chunked=chunked, __ops_adv_gate_up=gate_up, __ops_adv_project=project,
               __ops_adv_moe=moe_block.moe_call)
    if rope_fn is not None:
        glb["__ops_adv_apply_rotary_pos_emb"] = rope_fn
    code = compile(ast.fix_missing_locations(tree), f"{inspect.getsourcefile(fn)} (ops_adv fused)", "exec")
    ns: dict[str, Any] = {}
    exec(code, glb, ns)
    new = ns[fdef.name]
    new.__defaults__, new.__kwdefaults__ = fn.__defaults__, fn.__kwdefaults__
    inner = fn
    for w in reversed(chain):  # the class's decorators (checkpointing, renamed keywords) wrap the rewrite as before
        new, inner = _rewrap(w, inner, new), w
    # pickle finds the function as ops_adv.models.blocks._fused.<token> (rebuilt there in a new process)
    new.__module__, new.__qualname__ = __name__, "_fused." + token
    new._ops_adv_fused = True
    new._ops_adv_groups = tuple(rw.groups)
    _BY_NAME[token] = new
    return new, done, ""


_BY_NAME: dict[str, Callable] = {}
_EPS_NAME: dict[type, str] = {}


def _own_guard(fdef: ast.FunctionDef, token: str) -> str | None:
    """Put `if __ops_adv_runs_own(<first argument>): return <own forward>(<every argument>)` first in the
    rewritten forward; the name the original function must have in its globals, or None (no argument to test)."""
    a = fdef.args
    pos = a.posonlyargs + a.args
    if len(pos) < 2:
        return None
    own = "__ops_adv_own_" + hashlib.sha1(token.encode()).hexdigest()[:16]
    load = ast.Load()
    args = [ast.Name(x.arg, load) for x in pos] + ([ast.Starred(ast.Name(a.vararg.arg, load), load)] if a.vararg else [])
    kws = [ast.keyword(x.arg, ast.Name(x.arg, load)) for x in a.kwonlyargs]
    if a.kwarg:
        kws.append(ast.keyword(None, ast.Name(a.kwarg.arg, load)))
    guard = ast.If(test=ast.Call(ast.Name("__ops_adv_runs_own", load), [ast.Name(pos[1].arg, load)], []),
                   body=[ast.Return(ast.Call(ast.Name(own, load), args, kws))], orelse=[])
    fdef.body.insert(0, guard)
    return own
def _wrappers(f: Any) -> tuple[list, Any]:
    """(decorators' wrapper functions, outermost first; the function they wrap)."""
    chain = []
    while isinstance(f, types.FunctionType) and hasattr(f, "__wrapped__"):
        chain.append(f)
        f = f.__wrapped__
    return chain, f


def _inner_cell(w: types.FunctionType) -> int | None:
    """Which closure cell of wrapper `w` holds the function it wraps (functools.wraps' __wrapped__), or None."""
    cells = [i for i, c in enumerate(w.__closure__ or ()) if _cell(c) is w.__wrapped__]
    return cells[0] if len(cells) == 1 else None


def _cell(c: Any) -> Any:
    try:
        return c.cell_contents
    except ValueError:
        return None


def _rewrap(w: types.FunctionType, old: Callable, new: Callable) -> types.FunctionType:
    """A copy of wrapper `w` that calls `new` where it called `old`."""
    i = _inner_cell(w)
    cells = tuple(types.CellType(new) if j == i else c for j, c in enumerate(w.__closure__))
    out = types.FunctionType(w.__code__, w.__globals__, w.__name__, w.__defaults__, cells)
    out.__kwdefaults__ = w.__kwdefaults__
    out.__dict__.update(w.__dict__)
    out.__wrapped__ = new
    out.__qualname__, out.__doc__ = w.__qualname__, w.__doc__
    return out


class _Fused:
    """Rewritten forwards by name, for pickle: a name unknown in this process is rebuilt from the class
    and the module names it was fused with."""

    def __getattr__(self, token: str) -> Callable:
        fn = _BY_NAME.get(token)
        if fn is not None:
            return fn
        if not token.startswith("f_"):
            raise AttributeError(token)
        import importlib

        mod, qualname, names = json.loads(bytes.fromhex(token[2:]))
        cls: Any = importlib.import_module(mod)
        for part in qualname.split("."):
            cls = getattr(cls, part)
        fn, _, why = _rewrite(cls, lambda n: n in names, lambda n: n in names, lambda n: n in names,
                              lambda g, e: g in names and e in names)
        if fn is None or _BY_NAME.get(token) is not fn:
            raise AttributeError(f"cannot rebuild ops_adv's fused forward of {qualname}: {why or 'its source changed'}")
        return fn


_fused = _Fused()


def _eps_name(m: nn.Module) -> str:
    for name in ("eps", "variance_epsilon", "epsilon"):
        if isinstance(getattr(m, name, None), float):
            return name
    raise AttributeError(f"{type(m).__name__} has no float eps")


def _globals_module(fn: types.FunctionType) -> types.ModuleType:
    """A module holding a copy of fn's globals, registered in sys.modules under its own name."""
    import sys

    src = f"{fn.__globals__.get('__name__', 'module')}.{fn.__qualname__}"
    name = "_ops_adv_fused__" + "".join(c if c.isalnum() else "_" for c in src)
    mod = sys.modules.get(name)
    if mod is None:
        mod = sys.modules[name] = types.ModuleType(name)
    mod.__dict__.update(fn.__globals__)
    mod.__dict__["__name__"] = name
    return mod
