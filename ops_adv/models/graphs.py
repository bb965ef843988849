"""generate()'s decode steps in CUDA graphs of ops-adv's own, for a converted transformers model.

On CUDA with a static cache, transformers compiles the decode forward of generate() (`get_compiled_call`:
torch.compile, reduce-overhead's CUDA graphs). For a converted model that path cost more host time per step
than the graphs it replays: on the H100 (B=1, ctx 1024, 2 layers) compile(converted) took 1 329 µs a step for
784 µs of kernels, our own capture of the same converted step 952 µs. A converted model's `get_compiled_call`
can return a `DecodeGraphs` call instead: each decode-shaped call (at most MAX_TOKENS new tokens, a static
cache, no gradient, eval mode, nothing recording or profiling) is run eagerly once, then captured in a CUDA
graph and replayed; every other call goes to what transformers would have run. No Dynamo: no guards,
recompiles or graph breaks.

A graph holds addresses. Before each generate() (each `get_compiled_call`) the graphs are checked against the
model's parameters and buffers (same storage, same version: a `load_state_dict`, an in-place edit or a
replaced parameter drops them) and the dispatch tables (a table loaded since drops them). generate() makes a
new static cache per call: one of a layout seen before takes over the graphed cache's tensors (see _Storage).
Between two generate() calls nothing is checked: whoever calls the returned function directly must call
`get_compiled_call` again after changing weights. The graphs keep the last static cache of each layout (its
memory) while the model lives; `release(model)` gives it back.

When: by default where a table with winners for the device is loaded (H100, torch 2.11, Llama-3-8B dims,
4 layers, a tuned table: 1.05-1.53x the original's compiled generate, 1.09-1.12x torch.compile of the
converted model at B=8, whose B=1 run failed in cudagraph trees). With nothing tuned the converted model runs
the original's code (`_dispatch.passthrough`; torch.compile traces it too), and Inductor's fusion of it beat
these graphs (0.88-0.98x): transformers' torch.compile runs then. OPS_ADV_GENERATE_GRAPHS=1 or 0 forces either; a compile config for a
backend other than Inductor or cudagraphs always gets transformers' path.
"""
from __future__ import annotations

import collections
import functools
import warnings
import weakref
from typing import Any, Callable

import torch
import torch.nn as nn

from .. import _dispatch, _settings

MAX_TOKENS = 16  # input tokens per row beyond which a call is a prefill (compute-bound): not graphed
MAX_GRAPHS = 16  # graphs kept per model (each decode shape x cache); the oldest goes first
_GRAPH_BACKENDS = ("inductor", "cudagraphs")


def _tensors_of(cache: Any) -> list[tuple[Any, str, torch.Tensor]]:
    """(layer, attribute, tensor) for every tensor a cache's layers hold, in a fixed order."""
    out = []
    for layer in getattr(cache, "layers", None) or ():
        out += [(layer, k, v) for k, v in vars(layer).items() if isinstance(v, torch.Tensor)]
    return out


def _is_static_cache(v: Any) -> bool:
    return getattr(v, "is_compileable", False) is True and hasattr(v, "layers")


class _Storage:
    """The cache tensors that graphs were captured with. generate() makes a new static cache per call; one of the
    same layout adopts these tensors (its prefilled contents copied in once, its layers then holding ours), so
    the graphs stay valid across generate() calls. A storage is adopted only once its last owner is gone."""
    __slots__ = ("layout", "tensors", "owner")

    def __init__(self, cache: Any, layout: tuple) -> None:
        self.layout = layout
        self.tensors = [t for _, _, t in _tensors_of(cache)]
        self.owner = weakref.ref(cache)

    def adopt(self, cache: Any) -> None:
        for (layer, k, t), mine in zip(_tensors_of(cache), self.tensors):
            if t is not mine:
                mine.copy_(t)
                setattr(layer, k, mine)
        self.owner = weakref.ref(cache)

    def holds(self, cache: Any) -> bool:  # once a step: the first tensor only (all layers': 75 µs a step at 32 layers)
        layers = getattr(cache, "layers", None)
        first = next((v for v in vars(layers[0]).values() if isinstance(v, torch.Tensor)), None) if layers else None
        return first is not None and first is self.tensors[0]


class _Entry:
    __slots__ = ("graph", "inputs", "output", "failed", "warm", "call")

    def __init__(self) -> None:
        self.graph = None
        self.call: tuple = ()  # the captured call's args and kwargs; its cache slots hold None between calls
        self.inputs: list[torch.Tensor] = []  # static copies, in the order the call's tensors come
        self.output: Any = None
        self.failed: str | None = None
        self.warm = False


class DecodeGraphs:
    """The decode forward of one converted model: CUDA graphs per call signature (see the module's doc)."""

    def __init__(self) -> None:
        self.entries: dict[tuple, _Entry] = {}
        self.storages: list[_Storage] = []
        self.caches: dict[int, tuple[Any, int]] = {}  # id(cache) -> (weakref, storage index)
        self.pool = None
        self.state: tuple = ()
        self.capture: Callable[..., Any] = _cuda_capture  # tests on a machine without CUDA pass their own
        self.device_type = "cuda"

    def __reduce__(self):  # pickles and deep-copies as a fresh, empty runner: graphs belong to one process
        return (_new_runner, ())

    def drop(self) -> None:
        self.entries.clear()
        self.storages.clear()
        self.caches.clear()
        self.pool = None

    def validate(self, model: nn.Module) -> None:
        """Once per generate(): graphs of other weights or another table are dropped."""
        if _state(model) != self.state:
            self.drop()
        self.caches = {k: v for k, v in self.caches.items() if v[0]() is not None}

    def _storage_of(self, cache: Any) -> int | None:
        known = self.caches.get(id(cache))
        if known is not None and known[0]() is cache and self.storages[known[1]].holds(cache):
            return known[1]
        parts = _tensors_of(cache)
        if not parts:
            return None  # not initialised (no prefill yet)
        layout = tuple((type(layer).__name__, k, t.shape, t.dtype, t.device) for layer, k, t in parts)
        for i, st in enumerate(self.storages):
            if st.layout == layout and (st.owner() is None or st.owner() is cache):
                st.adopt(cache)
                break
        else:
            if len(self.storages) >= MAX_GRAPHS:
                self.drop()
            self.storages.append(_Storage(cache, layout))
            i = len(self.storages) - 1
        self.caches[id(cache)] = (weakref.ref(cache), i)
        return i

    # ------------------------------------------------------------------ one call
    def key(self, args: tuple, kwargs: dict) -> tuple[tuple | None, Any]:
        """(the call's signature, or None where it is not graphed; the call's static cache)."""
        parts: list[Any] = []
        tokens = cache = None
        for name, v in list(enumerate(args)) + list(kwargs.items()):
            if isinstance(v, torch.Tensor):
                if v.device.type != self.device_type or v.requires_grad:
                    return None, None
                if name in (0, "input_ids", "inputs_embeds") and v.dim() >= 2:
                    tokens = v.shape[1]
                parts.append((name, v.shape, v.dtype, v.device))
            elif v is None or isinstance(v, (bool, int, float, str)):
                parts.append((name, v))
            elif self._known(v) or _is_static_cache(v):  # is_compileable asks every layer: known caches skip it
                if tokens is None or tokens > MAX_TOKENS:
                    return None, None  # (input ids come first in every forward here) a prefill: its cache is left alone
                i = self._storage_of(v)
                if i is None:
                    return None, None
                parts.append((name, "cache", i))
                cache = v
            else:
                return None, None
        if tokens is None or tokens > MAX_TOKENS:
            return None, None
        return tuple(parts), cache

    def _known(self, cache: Any) -> bool:
        known = self.caches.get(id(cache))
        return known is not None and known[0]() is cache

    def __call__(self, model: nn.Module, fallback: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        key, cache = (None, None) if torch.is_grad_enabled() or model.training or _dispatch.observed() else \
            self.key(args, kwargs)
        if key is None:
            return fallback(*args, **kwargs)
        e = self.entries.get(key)
        if e is None:
            if len(self.entries) >= MAX_GRAPHS:
                self.entries.pop(next(iter(self.entries)))
            e = self.entries[key] = _Entry()
        if e.failed is not None:
            return fallback(*args, **kwargs)
        if e.graph is not None:
            it = iter(e.inputs)
            for v in list(args) + list(kwargs.values()):
                if isinstance(v, torch.Tensor):
                    next(it).copy_(v)
            _run(e, cache)
            return _fresh(e.output, cache)
        if not e.warm:  # first sight: an eager step on a side stream (lazy inits, Triton's compiles) outside any capture
            e.warm = True
            if self.device_type != "cuda":
                return model(*args, **kwargs)
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                out = model(*args, **kwargs)
            torch.cuda.current_stream().wait_stream(s)
            return out
        return self._capture_and_run(model, fallback, e, cache, args, kwargs)

    def _capture_and_run(self, model, fallback, e: _Entry, cache: Any, args: tuple, kwargs: dict) -> Any:
        statics = [v.clone() if isinstance(v, torch.Tensor) else v for v in args]
        skw = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
        state = _state(model)
        if state != self.state:  # a table loaded by this generate's prefill, say: older graphs are stale
            self.entries = {k: v for k, v in self.entries.items() if v is e}
            self.pool, self.state = None, state
        try:
            if self.pool is None and self.device_type == "cuda":
                self.pool = torch.cuda.graph_pool_handle()
            e.graph, e.output = self.capture(lambda: model(*statics, **skw), self.pool)
        except Exception as exc:  # noqa: BLE001 - a step that cannot be captured runs as transformers would run it
            e.graph, e.failed = None, f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
            warnings.warn(f"ops_adv: a decode step of {type(model).__name__} could not be captured in a CUDA graph "
                          f"({e.failed}); its calls run transformers' compiled forward", RuntimeWarning, stacklevel=3)
            return fallback(*args, **kwargs)
        e.inputs = [v for v in statics + list(skw.values()) if isinstance(v, torch.Tensor)]
        # the graph must not keep this generate's cache object alive (the next one adopts its tensors): its
        # slots in the call and the output hold a stand-in, the current call's cache goes in at each replay
        slots = [(statics, i) for i, v in enumerate(statics) if v is cache] + [(skw, k) for k, v in skw.items() if v is cache]
        e.call = (slots,)
        for where, k in slots:
            where[k] = None
        e.output = _strip(e.output, cache)
        _run(e, cache)  # the capture ran nothing: this is the call's step
        return _fresh(e.output, cache)


def _new_runner() -> DecodeGraphs:
    return DecodeGraphs()


def _state(model: nn.Module) -> tuple:
    """What a graph of `model` depends on beyond its inputs and cache: the dispatch epoch, and the storage
    and version of every parameter and buffer."""
    return (_dispatch.epoch(),) + tuple((t.data_ptr(), t._version) for t in list(model.parameters()) + list(model.buffers()))


def _cuda_capture(fn: Callable[[], Any], pool: Any) -> tuple[Any, Any]:
    g = torch.cuda.CUDAGraph()
    # thread_local: a Triton compile thread or another thread's CUDA work cannot invalidate this capture
    with torch.cuda.graph(g, pool=pool, capture_error_mode="thread_local"):
        out = fn()
    return g, out


class _CacheSlot:
    """Where the call's cache object goes in a graph's output."""


_CACHE = _CacheSlot()


def _run(e: _Entry, cache: Any) -> None:
    (slots,) = e.call
    for where, k in slots:
        where[k] = cache
    try:
        e.graph.replay()
    finally:
        for where, k in slots:
            where[k] = None


def _strip(out: Any, cache: Any) -> Any:
    if cache is not None and out is cache:
        return _CACHE
    if isinstance(out, dict):
        return type(out)(**{k: _strip(v, cache) for k, v in out.items()})
    if isinstance(out, tuple):
        return tuple(_strip(v, cache) for v in out) if type(out) is tuple else type(out)(*(_strip(v, cache) for v in out))
    return out


def _fresh(out: Any, cache: Any) -> Any:
    """The graph's output with its tensors copied (the next replay overwrites the graph's own) and the call's
    cache in the cache's place."""
    if isinstance(out, torch.Tensor):
        return out.clone()
    if out is _CACHE:
        return cache
    if isinstance(out, collections.OrderedDict) and hasattr(type(out), "to_tuple"):
        # a transformers ModelOutput, made without its __init__ / __post_init__ (25 µs of a step's host time)
        new = type(out).__new__(type(out))
        new.__dict__.update(out.__dict__)
        collections.OrderedDict.update(new, out)
        for k, v in out.items():
            f = _fresh(v, cache)
            if f is not v:
                new[k] = f
        return new
    if isinstance(out, dict):
        return type(out)(**{k: _fresh(v, cache) for k, v in out.items()})
    if isinstance(out, tuple):
        return tuple(_fresh(v, cache) for v in out) if type(out) is tuple else type(out)(*(_fresh(v, cache) for v in out))
    return out


def _original(model: nn.Module, compile_config: Any) -> Callable[..., Any]:
    """What transformers' own get_compiled_call returns (torch.compile of the model's __call__)."""
    return type(model).get_compiled_call(model, compile_config)


def _graphable(model: nn.Module) -> bool:
    return torch.cuda.is_available() and getattr(model, "device", torch.device("cpu")).type == "cuda"


def _wanted(model: nn.Module) -> bool:
    on = _settings.generate_graphs()
    if on is None:  # where something is tuned for the device; with nothing tuned Inductor's fusion does better
        return not _dispatch.passthrough(getattr(model, "device", torch.device("cpu")))
    return on


def get_compiled_call(model: nn.Module, compile_config: Any = None) -> Callable[..., Any]:
    """transformers' `get_compiled_call` for a converted model (installed on the instance by convert_model)."""
    backend = getattr(compile_config, "backend", "inductor") if compile_config is not None else "inductor"
    if backend not in _GRAPH_BACKENDS or _dispatch.observed() or not _graphable(model) or not _wanted(model):
        return _original(model, compile_config)
    runner = model.__dict__.get("_ops_adv_decode_graphs")
    if not isinstance(runner, DecodeGraphs):
        runner = model.__dict__["_ops_adv_decode_graphs"] = DecodeGraphs()
    runner.validate(model)
    compiled: list[Callable[..., Any]] = []

    def fallback(*args: Any, **kwargs: Any) -> Any:  # transformers' compiled forward, made on first need
        if not compiled:
            compiled.append(_original(model, compile_config))
        return compiled[0](*args, **kwargs)

    return functools.partial(runner, model, fallback)


def release(model: nn.Module) -> None:
    """Drop `model`'s decode graphs and the cache tensors they hold (the next generate() captures again)."""
    runner = model.__dict__.get("_ops_adv_decode_graphs")
    if isinstance(runner, DecodeGraphs):
        runner.drop()


def install(model: nn.Module) -> list[dict[str, str]]:
    """Give a transformers generative model `get_compiled_call` (see the module's doc); a report row."""
    can = getattr(model, "can_generate", None)
    if not callable(getattr(type(model), "get_compiled_call", None)) or not callable(can) or not can():
        return []
    model.__dict__["get_compiled_call"] = functools.partial(get_compiled_call, model)
    on = _settings.generate_graphs()
    return [{"module": "", "type": "generate() decode steps", "converted": "no" if on is False else "yes",
             "why": "transformers' torch.compile (OPS_ADV_GENERATE_GRAPHS=0)" if on is False else
                    "CUDA graphs of the converted forward per decode shape" + (
                        "" if on else " where a table with winners for the device is loaded (else transformers' "
                                      "torch.compile)") + "; prefill, gradients and other backends take transformers' path"}]
