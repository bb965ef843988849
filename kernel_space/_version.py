"""Kernel versions: a hash of what an implementation runs, not of the files it lives in.

An implementation's version covers
- its launch function (the registered callable), and every function, Triton kernel and
  plain-data constant of ours that it reaches through names: the kernels it launches, the
  jit functions those call, the helpers the launch uses;
- its parameter space, and its validity check with what that reaches.

Each function enters as a canonical dump of its syntax tree without docstrings, so
comments, docstrings, formatting, decorators of the launch function (the registration),
and anything it does not reach (other implementations, other ops, moved helpers) leave the
version alone. The dump is the same under Python 3.11-3.13, so a table tuned on one
machine is fresh on another with the same code.
"""
from __future__ import annotations

import ast
import functools
import hashlib
import inspect
import textwrap
import types
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from ._registry import Impl

_PLAIN = (type(None), bool, int, float, complex, str, bytes)
# Fields that say nothing about what runs, or that newer Pythons added with empty defaults.
_SKIP_FIELDS = {"ctx", "kind", "type_comment", "type_params"}


def impl_version(impl: Impl) -> str:
    parts = reached(impl.fn, entry=True)
    if impl.check is not None:
        parts |= reached(impl.check)
    h = hashlib.sha256()
    h.update(repr((impl.op, impl.name, [(k, tuple(v)) for k, v in impl.space.items()])).encode())
    for name, text in sorted(parts):
        h.update(b"\0" + name.encode() + b"\0" + text.encode())
    return h.hexdigest()[:16]


def reached(fn: Callable[..., Any], *, entry: bool = False) -> set[tuple[str, str]]:
    """(name, canonical text) of `fn` and of everything of ours it reaches through names."""
    roots = {_root(fn), "kernel_space"}
    out: set[tuple[str, str]] = set()
    seen: set[int] = set()
    todo: list[tuple[Any, str, bool]] = [(fn, _qualname(fn), entry)]
    while todo:
        obj, name, is_entry = todo.pop()
        func = _function_of(obj)
        if func is None:  # a constant: equal values under two names are two entries
            out.add((name, _plain_repr(obj)))
            continue
        if id(func) in seen:
            continue
        seen.add(id(func))
        out.add((_qualname(func), function_text(func, drop_decorators=is_entry)))
        for dep_name, dep in _references(func, roots):
            todo.append((dep, dep_name, False))
    return out


def _root(fn: Any) -> str:
    return (getattr(_function_of(fn) or fn, "__module__", None) or "").split(".")[0]


def _qualname(obj: Any) -> str:
    return getattr(obj, "__qualname__", None) or getattr(obj, "__name__", None) or type(obj).__name__


def _function_of(obj: Any) -> types.FunctionType | None:
    """The Python function behind a function, a Triton kernel or a decorated wrapper, else None."""
    if isinstance(obj, functools.partial):
        obj = obj.func
    inner = getattr(obj, "fn", None)  # triton JITFunction / InterpretedFunction
    if isinstance(inner, types.FunctionType) and type(obj).__module__.startswith("triton"):
        return inner
    obj = inspect.unwrap(obj) if callable(obj) else obj
    return obj if isinstance(obj, types.FunctionType) else None


def _is_ours(obj: Any, roots: set[str]) -> bool:
    mod = getattr(obj, "__module__", None) or getattr(obj, "__name__", None) or ""
    return isinstance(mod, str) and mod.split(".")[0] in roots


def _code_names(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _code_names(const)
    return names


def _references(func: types.FunctionType, roots: set[str]) -> list[tuple[str, Any]]:
    """Functions, kernels and plain constants of ours that `func` names."""
    from ._registry import LazyModule

    names = _code_names(func.__code__)
    found: list[tuple[str, Any]] = []
    modules = []
    for n in sorted(names):
        if n not in func.__globals__:
            continue
        value = func.__globals__[n]
        if isinstance(value, LazyModule):
            try:
                value = value.load()
            except ImportError as e:  # the backend is missing: the implementation is unavailable anyway
                found.append((n, f"unresolved: {e}"))
                continue
        if isinstance(value, types.ModuleType):
            if _is_ours(value, roots):
                modules.append(value)
            continue
        found.append((n, value))
    for mod in modules:  # `_kernels.launch(...)`: the attribute names the function uses
        for n in sorted(names):
            if n in vars(mod) and not isinstance(vars(mod)[n], types.ModuleType):
                found.append((n, vars(mod)[n]))
    if func.__closure__:
        for n, cell in zip(func.__code__.co_freevars, func.__closure__):
            try:
                found.append((n, cell.cell_contents))
            except ValueError:  # an empty cell
                pass
    keep = []
    for n, value in found:
        f = _function_of(value)
        if f is not None:
            if _is_ours(f, roots):
                keep.append((n, value))
        elif (_is_plain(value) and (n.isupper() or not isinstance(value, (dict, list, set)))) or _is_setting(value):
            keep.append((n, value))  # a mutable container counts when named as a constant: a lower-case one is state
    return keep


def _is_plain(v: Any) -> bool:
    """Immutable-looking data: plain scalars, and non-empty containers of them.

    Empty containers are left out: a module-level cache starts empty, and filling it
    must not change a version. `_references` also leaves out a filled dict, list or set unless its
    name is UPPER_CASE: a cache such as `_liger._missing`, filled by the checks a measuring process
    ran, made that process's version differ from the exporter's (H200, 2026-12-05).
    """
    if isinstance(v, _PLAIN):
        return True
    if isinstance(v, (tuple, list, frozenset, set)):
        return bool(v) and all(_is_plain(x) for x in v)
    if isinstance(v, dict):
        return bool(v) and all(_is_plain(k) and _is_plain(x) for k, x in v.items())
    return False


def _is_setting(v: Any) -> bool:
    """An enum or torch setting a factory closed over (an SDPA backend, a memory format, a dtype)."""
    import enum

    if isinstance(v, enum.Enum):
        return True
    t = type(v)
    return t.__module__.split(".")[0] == "torch" and t.__name__ in ("dtype", "memory_format", "SDPBackend")


def _plain_repr(v: Any) -> str:
    if isinstance(v, (set, frozenset)):
        return repr(sorted(v, key=repr))
    return repr(v)


@functools.lru_cache(maxsize=None)
def function_text(func: types.FunctionType, *, drop_decorators: bool = False) -> str:
    """A canonical dump of `func`'s syntax tree: no docstrings, comments, formatting or positions."""
    try:
        src = textwrap.dedent(inspect.getsource(func))
    except (OSError, TypeError):  # no source (built at run time): the bytecode is all there is
        return "bytecode:" + func.__code__.co_code.hex()
    tree = ast.parse(src)
    node = tree.body[0]
    if drop_decorators and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        node.decorator_list = []
    _strip_docstrings(node)
    return _dump(node)


def _strip_docstrings(tree: ast.AST) -> None:
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Module)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                    and isinstance(body[0].value.value, str):
                node.body = body[1:] or [ast.Pass()]


def _dump(node: Any) -> str:
    if isinstance(node, ast.AST):
        fields = []
        for name, value in ast.iter_fields(node):
            if name in _SKIP_FIELDS or value is None or value == []:
                continue
            fields.append(f"{name}={_dump(value)}")
        return f"{type(node).__name__}({','.join(fields)})"
    if isinstance(node, list):
        return "[" + ",".join(_dump(v) for v in node) + "]"
    return repr(node)
