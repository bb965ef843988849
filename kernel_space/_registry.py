"""Ops and their implementations: the one registry every part of ops-adv reads."""
from __future__ import annotations

import functools
import importlib.util
import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping, NamedTuple

if TYPE_CHECKING:
    import torch

Params = Mapping[str, Any]
Check = Callable[[Any, Params], "str | None"]


class OpsAdvError(Exception):
    """Root of every error ops-adv raises on purpose; the message is one line for a user."""

    def __reduce__(self):  # picklable across Ray's process boundary
        return (type(self), self.args)


class UnknownOpError(OpsAdvError):
    pass


class NoImplementationError(OpsAdvError):
    pass


@dataclass(frozen=True)
class OpSpec:
    """What ops-adv needs to know about an op, independent of any implementation.

    signature(*tensors, **attrs) -> Problem     the hashable key, computed on the hot path
    make_inputs(problem, device, seed) -> (tensors, attrs)
    reference(*tensors, **attrs) -> tensor        computed in float64 where it matters
    """

    name: str
    problem: type  # a NamedTuple class
    signature: Callable[..., tuple]  # a plain tuple equal to the problem (fast to build)
    make_inputs: Callable[..., tuple]
    reference: Callable[..., Any]
    tolerance: Callable[[str], float]
    flops: Callable[[Any], float]
    bytes_moved: Callable[[Any], float]
    size_fields: tuple[str, ...]  # numeric fields used for nearest-problem distance
    default_problems: Callable[[str], list]
    choices: Mapping[str, tuple] = field(default_factory=dict)  # allowed values of categorical fields
    # Dims that stream in production (tokens, batch, decode length): bucketed for the table and for tuning.
    streaming: tuple[str, ...] = ()
    # Fields whose value changes what a call computes but not which configuration suits it: a problem the
    # table has no winner for takes the winner of its twin with these values (every implementation takes both).
    twins: Mapping[str, Any] = field(default_factory=dict)

    def twin(self, problem: tuple) -> tuple | None:
        """`problem` with its `twins` fields set to their twin values, or None when that changes nothing."""
        if not self.twins:
            return None
        fields = self.problem._fields
        twin = tuple(self.twins.get(f, v) for f, v in zip(fields, problem))
        return None if twin == tuple(problem) else twin

    def bucket(self, problem: tuple) -> tuple:
        """`problem` with its streaming dims rounded up to their bucket (see `bucket_dim`)."""
        if not self.streaming:
            return problem
        fields = self.problem._fields
        return tuple(bucket_dim(v) if f in self.streaming else v for f, v in zip(fields, problem))

    def parse_problem(self, data: Mapping[str, Any]) -> Any:
        fields = self.problem._fields
        missing = [f for f in fields if f not in data and f not in self.problem._field_defaults]
        unknown = [k for k in data if k not in fields]
        if missing or unknown:
            raise OpsAdvError(
                f"{self.name} problem {dict(data)} is malformed"
                + (f": missing {', '.join(missing)}" if missing else "")
                + (f": unknown {', '.join(unknown)}" if unknown else "")
                + f"; a {self.name} problem has fields {', '.join(fields)}"
            )
        values = {}
        for f in fields:
            v = data.get(f, self.problem._field_defaults.get(f))
            default = self.problem._field_defaults.get(f)
            if f in self.size_fields:
                if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                    raise OpsAdvError(f"{self.name} problem field {f}={v!r} must be a positive integer")
            elif isinstance(default, bool) and not isinstance(v, bool):
                raise OpsAdvError(f"{self.name} problem field {f}={v!r} must be true or false")
            if f == "dtype":
                from ._common import canonical_dtype

                v = canonical_dtype(v) or v  # float16, half, torch.bfloat16, FP32, ... as fp16/bf16/fp32
            allowed = self.choices.get(f, ("fp16", "bf16", "fp32") if f == "dtype" else None)
            if allowed is not None and v not in allowed:
                raise OpsAdvError(f"{self.name} problem field {f}={v!r} must be one of {', '.join(map(str, allowed))}")
            values[f] = v
        return self.problem(**values)


@dataclass(frozen=True)
class Impl:
    op: str
    name: str
    fn: Callable[..., Any]
    priority: int
    backends: frozenset[str]
    space: Mapping[str, tuple]
    vendor: bool
    check: Check | None
    requires: tuple[str, ...]
    # Declared capturable in a CUDA graph: the tuner's gate fails it when capture raises. Whatever
    # this says, a candidate whose graph replays are wrong (state kept between calls) fails.
    graph_safe: bool = True
    # adapt(tuned problem, new problem, params) -> params: a borrowed winner's parameters fitted to the problem
    # it runs (a split count for another batch or context); None keeps them as tuned.
    adapt: Callable[[Any, Any, Params], Params] | None = None

    @functools.cached_property
    def unavailable(self) -> str | None:
        """Why this implementation cannot run here, or None."""
        for mod in self.requires:
            if importlib.util.find_spec(mod) is None:
                return f"{mod} not available"
        return None

    @functools.cached_property
    def version(self) -> str:
        """Hash of what this implementation runs: its launch function, the kernels and helpers
        that reaches, its parameter space and validity check (see `_version`)."""
        from ._version import impl_version

        return impl_version(self)

    def why_not(self, problem: Any, params: Params | None = None, backend: str | None = None) -> str | None:
        """Reason this implementation cannot run `problem` with `params`, or None."""
        if self.unavailable:
            return self.unavailable
        if backend is not None and backend not in self.backends:
            return f"no {backend} backend"
        if self.check is not None:
            return self.check(problem, params if params is not None else self.default_params())
        return None

    def default_params(self) -> dict[str, Any]:
        return {k: v[0] for k, v in self.space.items()}

    def configs(self) -> Iterator[dict[str, Any]]:
        """Every point of the parameter space (unfiltered)."""
        keys = list(self.space)
        for values in itertools.product(*(self.space[k] for k in keys)):
            yield dict(zip(keys, values))

    def bind(self, params: Params) -> Callable[..., Any]:
        return functools.partial(self.fn, **params) if params else self.fn


_OPS: dict[str, OpSpec] = {}
_IMPLS: dict[str, dict[str, Impl]] = {}


def bucket_dim(v: int) -> int:
    """Values up to 16 stay exact; larger ones round up to a multiple of a quarter of their
    power-of-two octave (at most 25% padding; a stream over 1..131072 meets 68 buckets)."""
    if v <= 16:
        return v
    step = 1 << (v.bit_length() - 3)
    return -(-v // step) * step


def register_op(spec: OpSpec) -> OpSpec:
    _OPS[spec.name] = spec
    _IMPLS.setdefault(spec.name, {})
    return spec


def define_op(name: str, problem: type, signature: Callable[..., tuple], make_inputs: Callable[..., tuple],
              reference: Callable[..., Any], *, size_fields: tuple[str, ...], flops: Callable[[Any], float],
              bytes_moved: Callable[[Any], float], default_problems: Callable[[str], list],
              streaming: tuple[str, ...] = (), choices: Mapping[str, tuple] | None = None,
              tolerance: Callable[[str], float] | None = None, twins: Mapping[str, Any] | None = None) -> OpSpec:
    """Register op `name` from the pieces its `problem.py` defines; the tolerance is the dtype's
    (`_common.tolerance`) unless the op gives its own."""
    if tolerance is None:
        from ._common import tolerance
    return register_op(OpSpec(name=name, problem=problem, signature=signature, make_inputs=make_inputs,
                              reference=reference, tolerance=tolerance, flops=flops, bytes_moved=bytes_moved,
                              size_fields=size_fields, default_problems=default_problems, choices=choices or {},
                              streaming=streaming, twins=twins or {}))


def register_impl(
    op: str,
    *,
    name: str | None = None,
    priority: int = 0,
    backends: tuple[str, ...] = ("cpu",),
    space: Mapping[str, tuple] | None = None,
    vendor: bool = False,
    check: Check | None = None,
    requires: tuple[str, ...] = (),
    graph_safe: bool | None = None,
    adapt: Callable[[Any, Any, Params], Params] | None = None,
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Register an implementation of `op`; higher priority is preferred when nothing is tuned.

    `space` maps each parameter to its choices (the first is the default); `check(problem,
    params)` returns why a configuration is invalid, or None; `requires` names modules that
    must be importable (a missing one is reported as the reason, not hidden). `graph_safe`
    (default: ours yes, vendor kernels no) declares it capturable in a CUDA graph. `adapt(tuned problem,
    problem, params)` fits a winner borrowed from a near problem to the one it runs.
    """

    def deco(fn: Callable[..., Any]) -> Callable[..., Any]:
        if op not in _OPS:
            raise UnknownOpError(f"cannot register {fn.__name__}: unknown op {op!r}")
        impl = Impl(
            op=op,
            name=name or fn.__name__,
            fn=fn,
            priority=priority,
            backends=frozenset(backends),
            space=dict(space or {}),
            vendor=vendor,
            check=check,
            requires=tuple(requires),
            graph_safe=not vendor if graph_safe is None else graph_safe,
            adapt=adapt,
        )
        _IMPLS[op][impl.name] = impl
        return fn

    return deco


def register_vendor(op: str, name: str, *, priority: int = 100, backends: tuple[str, ...] = ("cpu", "cuda"),
                    check: Check | None = None) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Register a vendor kernel (what the caller gets without ops-adv): the baseline every tuned one must beat."""
    return register_impl(op, name=name, priority=priority, backends=backends, vendor=True, check=check)


def register_triton(op: str, name: str, *, space: Mapping[str, tuple], check: Check, priority: int = 50,
                    adapt: Callable[[Any, Any, Params], Params] | None = None) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Register a Triton implementation: CUDA only, tuned over `space`, reported unavailable without triton."""
    return register_impl(op, name=name, priority=priority, backends=("cuda",), space=space, check=check,
                         requires=("triton",), adapt=adapt)


class LazyModule:
    """A module imported on first attribute access, so that `import kernel_space` needs no triton.

    The first access copies the module's names onto this object: later lookups are plain
    attribute reads (an import statement in the wrapper cost about a microsecond a call).
    """

    def __init__(self, name: str) -> None:
        self.__dict__["_lazy_name"] = name

    def load(self) -> Any:
        return importlib.import_module(self._lazy_name)

    def __getattr__(self, attr: str) -> Any:
        mod = self.load()
        self.__dict__.update(vars(mod))
        return getattr(mod, attr)


# Where an implementation comes from, for reports: "ours" (ops-adv's Triton/CPU kernels), "library"
# (a third-party kernel library such as Liger-Kernel: it requires a module besides triton), "torch" (vendor).
SOURCES = ("ours", "library", "torch")


def source_of(impl: Impl) -> str:
    if any(m != "triton" for m in impl.requires):
        return "library"
    return "torch" if impl.vendor else "ours"


def unregister_impl(op: str, name: str) -> None:
    _IMPLS.get(op, {}).pop(name, None)


def get_op(op: str) -> OpSpec:
    try:
        return _OPS[op]
    except KeyError:
        raise UnknownOpError(f"unknown op {op!r}; known ops: {', '.join(sorted(_OPS))}") from None


def ops() -> list[str]:
    return sorted(_OPS)


def impls(op: str, *, backend: str | None = None) -> list[Impl]:
    """Implementations of `op`, highest priority first."""
    get_op(op)
    found = [i for i in _IMPLS[op].values() if backend is None or backend in i.backends]
    return sorted(found, key=lambda i: (-i.priority, i.name))


def get_impl(op: str, name: str) -> Impl:
    get_op(op)
    try:
        return _IMPLS[op][name]
    except KeyError:
        raise NoImplementationError(
            f"{op} has no implementation {name!r}; known: {', '.join(sorted(_IMPLS[op]))}"
        ) from None


def choose_default(op: str, problem: Any, backend: str) -> Impl:
    """Highest-priority implementation that runs `problem` on `backend`, or an error listing why each was refused."""
    reasons = []
    for impl in impls(op):
        why = impl.why_not(problem, backend=backend)
        if why is None:
            return impl
        reasons.append(f"{impl.name}: {why}")
    raise NoImplementationError(f"no {op} implementation runs {problem} on {backend} ({'; '.join(reasons)})")


def backend_of(device: "torch.device | str") -> str:
    t = device if isinstance(device, str) else device.type
    return "cuda" if t.startswith("cuda") else t


def problem_key(problem: NamedTuple) -> str:
    """Canonical text form of a problem, used as a database key."""
    import json

    return json.dumps(problem._asdict(), sort_keys=True, separators=(",", ":"))


def problem_distance(spec: OpSpec, a: tuple, b: tuple) -> float | None:
    """Σ |log2(a_i / b_i)| over the size fields, or None when a non-size field differs or a size is 0."""
    import math

    fields = spec.problem._fields
    d = 0.0
    for i, f in enumerate(fields):
        if f in spec.size_fields:
            if a[i] <= 0 or b[i] <= 0:
                return None
            d += abs(math.log2(a[i] / b[i]))
        elif a[i] != b[i]:
            return None
    return d
