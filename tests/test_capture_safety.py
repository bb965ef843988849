"""On a CUDA GPU: converted decode steps with ops-adv's own kernels forced capture in CUDA graphs on
the first capture at any batch, after other captures and failed compiles, and under
torch.compile(mode="reduce-overhead"), with the process usable afterwards."""
from __future__ import annotations

import copy
import itertools
import json

import pytest
import torch

import kernel_space
import ops_adv

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
transformers = pytest.importorskip("transformers")


def forced_table(shapes: dict, path) -> int:
    """A table whose every problem runs the first non-vendor implementation with a valid configuration."""
    from kernel_space._device import local_device_class
    from ops_adv import _table

    winners = []
    for op, problems in shapes.items():
        impls = sorted((i for i in kernel_space.impls(op) if not i.vendor and not i.unavailable), key=lambda i: i.priority)
        for pd in problems:
            p = kernel_space.get_op(op).parse_problem(pd)
            for impl in impls:
                cfg = next((c for c in itertools.islice(impl.configs(), 5000) if impl.why_not(p, c, "cuda") is None), None)
                if cfg is not None:
                    winners.append({"op": op, "problem": pd, "impl": impl.name, "params": cfg, "kernel_version": impl.version,
                                    "median_ms": 1.0, "vendor_impl": "x", "vendor_ms": 2.0, "speedup": 2.0})
                    break
    path.write_text(json.dumps({"format": _table.FORMAT, "format_version": _table.FORMAT_VERSION,
                                "device_class": local_device_class(), "fingerprint": {}, "winners": winners,
                                "checksum": _table.checksum(winners)}))
    return len(winners)


def _llama():
    cfg = transformers.LlamaConfig(vocab_size=1024, hidden_size=512, intermediate_size=1536, num_hidden_layers=2,
                                   num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=2048)
    torch.manual_seed(0)
    with torch.device("cuda"):
        return transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).eval()


class Decode:
    """One static-cache decode step of `model` at batch B after a ctx-token prefill."""

    def __init__(self, model, B: int, ctx: int = 200) -> None:
        from transformers import StaticCache

        g = torch.Generator().manual_seed(B)
        self.model, self.ctx = model, ctx
        self.tok = torch.randint(0, 1024, (B, 1), generator=g).cuda()
        self.cache = StaticCache(config=model.config, max_cache_len=ctx + 16)
        with torch.no_grad():
            model(torch.randint(0, 1024, (B, ctx), generator=g).cuda(), past_key_values=self.cache)
        self.lengths = [layer.cumulative_length for layer in self.cache.layers if hasattr(layer, "cumulative_length")]
        self.pos = torch.tensor([ctx], device="cuda")

    def prep(self) -> None:
        for n in self.lengths:
            n.fill_(self.ctx)

    def __call__(self, model=None) -> torch.Tensor:
        with torch.no_grad():
            return (self.model if model is None else model)(self.tok, past_key_values=self.cache, cache_position=self.pos).logits


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    base = _llama()
    conv = ops_adv.convert_model(copy.deepcopy(base))
    with ops_adv.record() as rec:
        for B in (1, 8, 64):
            d = Decode(conv, B)
            d.prep()
            d()
    path = tmp_path_factory.mktemp("t") / "forced.json"
    assert forced_table(rec.shapes(), path) > 0
    ops_adv.load_table(str(path))
    yield base, conv
    ops_adv.load_table("")


def _capture(step: Decode, warmup: bool) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    if warmup:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            step.prep()
            step()
        torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    step.prep()
    with torch.cuda.graph(g):
        out = step()
    return g, out


@pytest.mark.parametrize("B", [1, 8, 64])
def test_first_capture_without_warmup_matches_eager(models, B):
    base, conv = models
    step = Decode(conv, B)
    g, out = _capture(step, warmup=False)
    step.prep()
    g.replay()
    step.prep()
    want = step(base)
    torch.testing.assert_close(out.float(), want.float(), rtol=0.05, atol=0.05)
    step.prep()
    g.replay()  # twice: nothing a launch keeps between calls drifts
    torch.testing.assert_close(out.float(), want.float(), rtol=0.05, atol=0.05)


def test_graphs_freed_between_captures_leave_the_process_usable(models):
    """The e2e benchmark's order: capture at B=1, drop the graphs, compile, then capture at B=8."""
    import gc

    base, conv = models
    small = Decode(conv, 1)
    graphs = [_capture(small, warmup=True) for _ in range(2)]
    del graphs
    compiled = torch.compile(conv, mode="reduce-overhead")
    for _ in range(3):
        small.prep()
        small(compiled)
    big = Decode(conv, 8)
    cycle = [None]
    cycle[0] = (cycle, _capture(Decode(conv, 2), warmup=True))  # freed by the collector, maybe mid-capture
    del cycle
    g, out = _capture(big, warmup=True)
    gc.collect()
    big.prep()
    g.replay()
    torch.cuda.synchronize()
    big.prep()
    torch.testing.assert_close(out.float(), big(base).float(), rtol=0.05, atol=0.05)


def test_reduce_overhead_compile_of_converted_decode(models):
    base, conv = models
    torch._dynamo.reset()
    step = Decode(conv, 8)
    compiled = torch.compile(conv, mode="reduce-overhead", fullgraph=True)
    outs = []
    for _ in range(4):
        step.prep()
        outs.append(step(compiled).float().clone())
    step.prep()
    want = step(base).float()
    for o in outs:
        torch.testing.assert_close(o, want, rtol=0.05, atol=0.05)


def test_capture_after_a_profiled_step(models):
    """The e2e benchmark profiled a step at B=1, then captured B=8: the profiler stayed installed and
    synchronised inside the capture, which left the process unusable (issue 20)."""
    base, conv = models
    step = Decode(conv, 4)
    with ops_adv.profiler.ProfileContext() as prof:
        step.prep()
        step()
    assert prof.calls
    big = Decode(conv, 8)
    g, out = _capture(big, warmup=False)
    big.prep()
    g.replay()
    big.prep()
    torch.testing.assert_close(out.float(), big(base).float(), rtol=0.05, atol=0.05)
