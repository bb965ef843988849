"""model.generate(..., cache_implementation="static") on converted Llama/Qwen2/Mistral: greedy tokens equal the
unconverted model's (fp32, CPU), eager and under torch.compile; decode steps run decode_attention, with a key mask
where the 2-D mask pads (left padding, or transformers 5.17's all-ones mask)."""
from __future__ import annotations

import copy
import inspect

import pytest
import torch

import ops_adv
from ops_adv.models import hf as _convert

transformers = pytest.importorskip("transformers")
pytest.importorskip("ops_adv.ops.decode_attention")

LAYERS, NEW = 2, 16
assert ops_adv.ops.attention.DECODE_MAX_QUERY < 20


def _model(family: str):
    import transformers as t

    torch.manual_seed(0)
    kw = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256)
    if family == "mistral":
        kw["sliding_window"] = None
    cfg = getattr(t, f"{family.capitalize()}Config")(**kw)
    return getattr(t, f"{family.capitalize()}ForCausalLM")(cfg).eval()


def _batch(padded: bool):
    # 20 > DECODE_MAX_QUERY: the prefill never runs decode_attention, so its calls count decode steps
    ids = torch.randint(1, 256, (3, 20), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(ids)
    if padded:  # left padding, two lengths
        mask[0, :6] = 0
        mask[2, :1] = 0
        ids = ids.masked_fill(mask == 0, 0)
    return ids, mask


def _generate(model, ids, mask):
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
                              cache_implementation="static", pad_token_id=0)


def _decode_op_calls(fn) -> tuple[object, int]:
    """fn()'s result and how many times the ops_adv::decode_attention operator ran (the profiler sees it)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        out = fn()
    return out, sum(e.count for e in prof.key_averages() if e.key == "ops_adv::decode_attention")


@pytest.fixture
def no_table():
    ops_adv.load_table("")
    yield
    ops_adv.load_table("")


@pytest.mark.parametrize("padded", [False, True], ids=["all-ones", "left-padded"])
@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
def test_generate_static_cache_matches_and_routes(no_table, family, padded):
    ref = _model(family)
    model = ops_adv.convert_model(copy.deepcopy(ref))
    ids, mask = _batch(padded)
    want = _generate(ref, ids, mask)
    _convert.ROUTE_LOG = routes = []
    try:
        got = _generate(model, ids, mask)
    finally:
        _convert.ROUTE_LOG = None
    assert got.shape[1] == ids.shape[1] + NEW
    assert torch.equal(got, want)
    decode = routes[LAYERS:]  # the prefill's calls come first
    assert len(decode) == (NEW - 1) * LAYERS
    assert decode == ["decode_attention"] * len(decode), set(decode)


@pytest.mark.parametrize("padded", [False, True], ids=["all-ones", "left-padded"])
def test_a_decode_step_reads_its_mask_once(no_table, padded, monkeypatch):
    """Every layer of a decode step gets the same mask: its seq_lens are computed by the first layer only, and a
    mask changed in place, another mask or other shapes compute them again."""
    ref = _model("llama")
    model = ops_adv.convert_model(copy.deepcopy(ref))
    ids, mask = _batch(padded)
    reads = []
    real = _convert._seq_lens_of
    monkeypatch.setattr(_convert, "_seq_lens_of", lambda *a: reads.append(1) or real(*a))
    assert torch.equal(_generate(model, ids, mask), _generate(ref, ids, mask))
    assert len(reads) == NEW - 1  # one a decode step, not one a layer
    q, k = torch.randn(2, 4, 1, 16), torch.randn(2, 2, 8, 16)
    m = torch.arange(8).lt(5).expand(2, 1, 1, 8).contiguous().as_strided((2, 1, 1, 8), (8, _convert._PREFIX_STRIDE, 8, 1))
    first = _convert._decode_seq_lens(q, k, m)
    assert _convert._decode_seq_lens(q, k, m) is first and first[1].tolist() == [5, 5]
    m[:, :, :, 5] = True  # in place: read again
    assert _convert._decode_seq_lens(q, k, m)[1].tolist() == [6, 6]
    assert _convert._decode_seq_lens(q[:1], k[:1], m[:1])[1].tolist() == [6]  # another mask (a view) and batch


@pytest.mark.parametrize("padded", [False, True], ids=["all-ones", "left-padded"])
def test_generate_compiled_matches_and_routes(no_table, padded, monkeypatch):
    """The same under torch.compile (aot_eager): the route is decided from mask metadata, so the compiled
    decode step runs the decode_attention operator without reading the mask on the host. (Without a table
    the op would trace as torch's SDPA: OPS_ADV_COMPILE_OPERATORS=1 keeps the operator visible.)"""
    monkeypatch.setenv("OPS_ADV_COMPILE_OPERATORS", "1")
    ref = _model("llama")
    model = ops_adv.convert_model(copy.deepcopy(ref))
    ids, mask = _batch(padded)
    want = _generate(ref, ids, mask)
    torch._dynamo.reset()
    model.forward = torch.compile(model.forward, backend="aot_eager", fullgraph=False)
    try:
        _generate(model, ids, mask)  # compiles prefill and decode step
        got, calls = _decode_op_calls(lambda: _generate(model, ids, mask))
    finally:
        torch._dynamo.reset()
    assert torch.equal(got, want)
    assert calls == (NEW - 1) * LAYERS


def test_marked_mask_survives_contiguous_and_copies_lose_it(no_table):
    """The prefix mark is metadata of a size-1 dimension: .contiguous() keeps it, a clone or a caller's mask has
    none (so those run SDPA, whatever their values)."""
    from transformers.masking_utils import causal_mask_function

    m = _convert._ops_adv_mask(batch_size=2, q_length=1, kv_length=8, q_offset=torch.tensor(4), kv_offset=0,
                               mask_function=causal_mask_function, attention_mask=None, allow_is_causal_skip=False)
    assert m.stride(1) == _convert._PREFIX_STRIDE and m.is_contiguous() and m.contiguous() is m
    assert m[:, 0, -1].sum(-1).tolist() == [5, 5]
    q, k = torch.randn(2, 4, 1, 16), torch.randn(2, 2, 8, 16)
    ok, lens, key_mask = _convert._decode_seq_lens(q, k, m)
    assert key_mask is None
    assert ok and lens.tolist() == [5, 5]
    fresh = torch.arange(8).lt(5).expand(2, 1, 1, 8).contiguous()  # the same values, made by a caller
    assert torch.equal(fresh, m) and _convert._decode_seq_lens(q, k, fresh)[0] is False
    pad = torch.ones(2, 5, dtype=torch.bool)
    pad[1, :3] = False  # left padding of the second sequence
    padded = _convert._ops_adv_mask(batch_size=2, q_length=1, kv_length=8, q_offset=torch.tensor(4), kv_offset=0,
                                    mask_function=causal_mask_function, attention_mask=pad, allow_is_causal_skip=False)
    assert padded.stride(1) == _convert._PADDED_STRIDE
    ok, lens, key_mask = _convert._decode_seq_lens(q, k, padded)
    assert ok and lens.tolist() == [5, 5]
    assert key_mask.tolist() == [[True] * 5 + [False] * 3, [False] * 3 + [True] * 2 + [False] * 3]
    windowed = _convert._ops_adv_mask(batch_size=2, q_length=1, kv_length=8, q_offset=torch.tensor(4), kv_offset=0,
                                      mask_function=causal_mask_function, attention_mask=pad, local_size=2,
                                      allow_is_causal_skip=False)
    assert windowed.stride(1) not in (_convert._PREFIX_STRIDE, _convert._PADDED_STRIDE)
    assert _convert._decode_seq_lens(q, k, windowed)[0] is False


def test_converted_generate_compiles_without_the_guards_conversion_adds(no_table, monkeypatch):
    """convert_model gives generate() transformers' default compile with `conversion_guard_filter`: Dynamo then
    checks none of the hook dicts and forward partials conversion adds (they made a compiled call's guard checks
    cost more than the original's whole set), every other guard stays, and the tokens are the original's."""
    from transformers import CompileConfig

    ref = _model("llama")
    model = ops_adv.convert_model(copy.deepcopy(ref))
    cc = model.generation_config.compile_config
    assert cc.mode is None and cc.options["triton.cudagraphs"] is True and cc.options["guard_filter_fn"] is _convert.conversion_guard_filter
    assert any(r["type"] == "generate() compile" and r["converted"] == "yes" for r in ops_adv.explain_model(model))
    assert "conversion_guard_filter" in str(model.generation_config)  # still prints as JSON
    seen: list[tuple[str, str, bool]] = []
    real = _convert._GuardFilter.__call__

    def spy(self, entries):
        keep = real(self, entries)
        seen.extend((e.name, e.guard_type, k) for e, k in zip(entries, keep))
        return keep

    monkeypatch.setattr(_convert._GuardFilter, "__call__", spy)
    cc._compile_all_devices = True  # transformers compiles on CUDA-like devices only unless told
    ids, mask = _batch(False)
    want = _generate(ref, ids, mask)
    torch._dynamo.reset()
    try:
        got = _generate(model, ids, mask)
        assert hasattr(model, "_compiled_call")  # generate compiled its decode step
    finally:
        torch._dynamo.reset()
    assert torch.equal(got, want)
    dropped = [(n, g) for n, g, k in seen if not k]
    assert dropped and len(dropped) < len(seen)
    assert all(n.endswith(_convert._HOOK_DICTS) or ".forward." in n for n, _ in dropped)
    assert not any(g == "TENSOR_MATCH" for _, g in dropped)
    assert any(n.endswith(".forward.func") for n, _, k in seen if k)  # what a converted module runs stays guarded

    # a config of the user's own is kept (the filter is offered, not forced); another backend's comes back unchanged
    own = _model("llama")
    own.generation_config.compile_config = CompileConfig(fullgraph=True)
    ops_adv.convert_model(own)
    assert own.generation_config.compile_config.mode == "reduce-overhead"
    eager = CompileConfig(backend="eager")
    assert _convert.compile_config(eager) is eager
    assert _convert.compile_config(CompileConfig(fullgraph=True)).fullgraph is True
