"""Every model family convert_model touches compiles whole: torch.compile(fullgraph=True), 0 graph breaks,
no recompiles between decode steps, the same logits as the original.

Dynamo's graph capture and guards are what broke on torch 2.11 (a rewritten forward's globals were a
dict copy that Dynamo looked up through the library's module), so the fast `aot_eager` backend is
enough to catch that class of failure; one family also goes through inductor."""
from __future__ import annotations

import copy
import inspect
import os
import sys
from pathlib import Path

import pytest
import torch

import ops_adv

transformers = pytest.importorskip("transformers")

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128, pad_token_id=0)
FAMILIES = {
    "llama": ("LlamaConfig", {}),
    "mistral": ("MistralConfig", {"sliding_window": None}),
    "qwen2": ("Qwen2Config", {}),
    "qwen3": ("Qwen3Config", {"head_dim": 16}),
    "phi3": ("Phi3Config", {}),
    "gemma": ("GemmaConfig", {"head_dim": 16}),
    "gemma2": ("Gemma2Config", {"head_dim": 16}),
    "gemma3": ("Gemma3TextConfig", {"head_dim": 16}),
    "gemma_hd256": ("GemmaConfig", {"head_dim": 256}),  # Gemma-7B's head dim
    "gpt2": ("GPT2Config", None),
}


def _decoder(family: str) -> torch.nn.Module:
    name, extra = FAMILIES[family]
    if extra is None:  # GPT-2 names its dimensions its own way
        cfg = transformers.GPT2Config(vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=128)
    else:
        if not hasattr(transformers, name):
            pytest.skip(f"transformers {transformers.__version__} has no {name}")
        cfg = getattr(transformers, name)(**TINY, **extra)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    if family.startswith("gemma"):  # Gemma's norms start at 0, where (1 + w) and 1 agree: make them differ
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "norm" in n:
                    p.normal_(0.0, 0.3, generator=torch.Generator().manual_seed(len(n)))
    return model


def _rewritten_forwards(model: torch.nn.Module) -> list:
    out = []
    for m in model.modules():
        f = m.__dict__.get("forward")
        for f in (getattr(f, "func", f), type(m).forward):  # a converted module's forward is a partial on it
            f = inspect.unwrap(f)  # the class's decorators wrap the rewritten forward as they wrapped its own
            code = getattr(f, "__code__", None)
            if code is not None and code.co_filename.endswith("(ops_adv fused)"):
                out.append(f)
    return out


@pytest.mark.parametrize("family", list(FAMILIES))
def test_converted_family_compiles_whole_and_matches(family):
    torch._dynamo.reset()
    model = _decoder(family)
    ids = torch.randint(1, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(ids).logits
        conv = ops_adv.convert_model(copy.deepcopy(model))
        # Dynamo (torch 2.11) reaches an inlined function's globals through the module named by __name__:
        # a rewritten forward's globals must be that module's own dict.
        assert _rewritten_forwards(conv) or family == "gpt2"
        for f in _rewritten_forwards(conv):
            assert sys.modules[f.__globals__["__name__"]].__dict__ is f.__globals__, f.__qualname__
        got = torch.compile(conv, fullgraph=True, backend="aot_eager")(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma2", "phi3", "gemma"])
def test_converted_decode_steps_compile_once(family):
    """Static-cache decode steps: the converted model compiles no more often than the original (once for
    Llama and Qwen3; Gemma 2's own forward guards on the cache length) and gives the same logits."""
    from torch._dynamo.utils import counters
    from transformers import StaticCache

    model = _decoder(family)
    conv = ops_adv.convert_model(copy.deepcopy(model))
    g = torch.Generator().manual_seed(2)
    prompt, toks = torch.randint(1, 128, (2, 8), generator=g), torch.randint(1, 128, (2, 3), generator=g)
    outs, compiles = {}, {}
    for name, m in (("eager", model), ("original", model), ("converted", conv)):
        torch._dynamo.reset()
        counters.clear()
        cache = StaticCache(config=model.config, max_cache_len=32)
        with torch.no_grad():
            m(prompt, past_key_values=cache, use_cache=True)
            step = m if name == "eager" else torch.compile(m, fullgraph=True, backend="aot_eager")
            logits = [step(toks[:, i:i + 1], past_key_values=cache, use_cache=True, cache_position=torch.tensor([8 + i])).logits
                      for i in range(3)]
        outs[name], compiles[name] = torch.cat(logits, 1), counters["stats"]["unique_graphs"]
    assert compiles["converted"] <= compiles["original"], compiles
    if family != "gemma2":
        assert compiles["converted"] == 1, compiles
    torch.testing.assert_close(outs["converted"], outs["eager"], rtol=1e-4, atol=1e-4)


def test_converted_llama_compiles_with_inductor():
    torch._dynamo.reset()
    model = _decoder("llama")
    ids = torch.randint(1, 128, (1, 8), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = model(ids).logits
        got = torch.compile(ops_adv.convert_model(copy.deepcopy(model)), fullgraph=True)(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("arch", ["resnet18", "mobilenet_v3_small"])
def test_converted_torchvision_compiles_whole(arch):
    tv = pytest.importorskip("torchvision")
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = getattr(tv.models, arch)(num_classes=10).eval()
    x = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want = model(x)
        got = torch.compile(ops_adv.convert_model(copy.deepcopy(model)), fullgraph=True, backend="aot_eager")(x)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(bool(os.environ.get("OPS_ADV_LOW_CHILD")), reason="already the low-end run")
def test_families_compile_under_the_oldest_supported_transformers():
    """The same family tests, and generate()'s decode routing (its masks differ: 5.17 passes an all-ones 2-D
    mask on), under the oldest transformers pyproject admits (`make test` installs it in
    .venv/low-transformers); this venv's own transformers is the newest end."""
    import subprocess

    low = Path(sys.prefix) / "low-transformers"
    if not (low / "transformers").is_dir():
        pytest.skip(f"{low} is missing: `make test` installs the oldest supported transformers there")
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(low), str(root)]), "OPS_ADV_LOW_CHILD": "1"}
    version = subprocess.run([sys.executable, "-c", "import transformers; print(transformers.__version__)"],
                             capture_output=True, text=True, env=env, check=True).stdout.strip()
    assert version != transformers.__version__, "the low end must differ from the venv's transformers"
    tests = [__file__, str(root / "tests" / "test_generate.py"), str(root / "tests" / "test_e2e_decode.py")]
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests,
                        "-k", "compiles_whole_and_matches or decode_steps_compile_once or generate or mask"],
                       capture_output=True, text=True, env=env, cwd=root, timeout=1500)
    assert r.returncode == 0, f"transformers {version}:\n{r.stdout[-4000:]}"


def _ops_in_compiled_graph(model, *args) -> set[str]:
    """The ops_adv operators in the graph torch.compile traces for model(*args)."""
    seen: set[str] = set()

    def backend(gm, example_inputs):
        seen.update(str(n.target) for n in gm.graph.nodes if n.op == "call_function" and "ops_adv" in str(n.target))
        return gm.forward

    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(model, fullgraph=True, backend=backend)(*args)
    return seen


def test_compile_traces_torchs_own_ops_where_the_table_has_only_vendor_kernels(tmp_path):
    """With nothing of ops-adv's tuned, a compiled converted model is torch's own graph (Inductor fuses
    it as it fuses the original's), but for the merged projections' operator (ops_adv.models.merge), whose test
    that the weights still sit side by side runs on the real tensors; a table with one of our kernels keeps that
    op's custom operator."""
    import json

    import kernel_space
    from ops_adv import _table

    model = ops_adv.convert_model(_decoder("llama"))
    ids = torch.randint(1, 128, (1, 8), generator=torch.Generator().manual_seed(5))
    ops_adv.load_table("")
    try:
        assert _ops_in_compiled_graph(model, ids) == {"ops_adv.project"}
        with ops_adv.record() as rec:
            with torch.no_grad():
                model(ids)
        gemms = rec.shapes()["gemm"]
        impl = kernel_space.get_impl("gemm", "cpu_blocked")
        params = next(c for c in impl.configs() if impl.why_not(get_op_problem(gemms[0]), c, "cpu") is None)
        winners = [{"op": "gemm", "problem": p, "impl": "cpu_blocked", "params": params, "kernel_version": impl.version,
                    "median_ms": 1.0, "vendor_impl": "torch_matmul", "vendor_ms": 2.0, "speedup": 2.0} for p in gemms]
        path = tmp_path / "t.json"
        path.write_text(json.dumps({"format": _table.FORMAT, "format_version": _table.FORMAT_VERSION, "device_class": "cpu",
                                    "fingerprint": {}, "winners": winners, "checksum": _table.checksum(winners)}))
        ops_adv.load_table(str(path))
        assert {o.split(".")[1] for o in _ops_in_compiled_graph(model, ids)} == {"gemm", "project"}
    finally:
        ops_adv.load_table("")


def get_op_problem(data: dict):
    import kernel_space

    return kernel_space.get_op("gemm").parse_problem(data)
