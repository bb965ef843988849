"""generate()'s decode steps in ops-adv's own CUDA graphs (ops_adv.models.graphs, issue 28 item 3).

On the CPU the runner's capture is replaced by one that records the step (running it with the cache put back,
as a capture runs nothing) and replays it into the captured output tensors, as a CUDA graph writes its own
outputs: keys, static inputs, fresh outputs, invalidation and fall-backs are the real code's. On CUDA the real
capture runs (tiny Llama, fp32).
"""
from __future__ import annotations

import copy
import pickle

import pytest
import torch

transformers = pytest.importorskip("transformers")

import ops_adv  # noqa: E402
from ops_adv import _dispatch  # noqa: E402
from ops_adv.models import graphs  # noqa: E402


def _tiny(seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    m = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                     num_key_value_heads=2, vocab_size=256, max_position_embeddings=128)).eval()
    m.generation_config.eos_token_id = None
    m.generation_config.pad_token_id = 0
    return m


class _Replay:
    def __init__(self, fn, out):
        self.fn, self.outs, self.replays = fn, _tensors(out), 0  # a graph keeps its output tensors, nothing else

    def replay(self):
        self.replays += 1
        new = self.fn()
        for a, b in zip(self.outs, _tensors(new)):
            a.copy_(b)


def _tensors(out):
    return [v for v in (out.values() if isinstance(out, dict) else out) if isinstance(v, torch.Tensor)]


def _record(fn, pool):
    """A stand-in for a CUDA capture on the CPU: the step runs, then every cache tensor is put back (a capture
    runs no kernel), so only replays advance the cache."""
    caches = []
    for cell in fn.__closure__ or ():
        v = cell.cell_contents
        for x in (v.values() if isinstance(v, dict) else v if isinstance(v, (list, tuple)) else ()):
            if hasattr(x, "layers"):
                caches.append(x)
    saved = [(t, t.clone()) for c in caches for _, _, t in graphs._tensors_of(c)]
    out = fn()
    for t, s in saved:
        t.copy_(s)
    return _Replay(fn, out), out


@pytest.fixture
def cpu_graphs(monkeypatch):
    """Graphs on the CPU: the real runner with the recording capture; transformers' compiled call stays eager."""
    made, originals = [], []

    class Runner(graphs.DecodeGraphs):
        def __init__(self):
            super().__init__()
            self.capture, self.device_type = _record, "cpu"
            made.append(self)

    def original(model, cfg):
        originals.append(cfg)
        return model.__call__

    monkeypatch.setenv("OPS_ADV_GENERATE_GRAPHS", "1")
    monkeypatch.setattr(graphs, "DecodeGraphs", Runner)
    monkeypatch.setattr(graphs, "_graphable", lambda model: True)
    monkeypatch.setattr(graphs, "_original", original)
    return made, originals


def _gen(m, ids, mask, n=6, compiled=True):
    from transformers import CompileConfig

    kw = dict(max_new_tokens=n, do_sample=False, cache_implementation="static", pad_token_id=0, attention_mask=mask)
    if compiled:
        cc = CompileConfig()
        cc._compile_all_devices = True  # transformers compiles on CUDA-like devices only unless told
        kw["compile_config"] = cc
    else:
        kw["disable_compile"] = True
    with torch.no_grad():
        return m.generate(ids, **kw)


def _inputs(B=2, S=7, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 256, (B, S), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding on row 0
    return ids.masked_fill(mask == 0, 0), mask


def test_converted_model_reports_decode_graphs(monkeypatch):
    monkeypatch.delenv("OPS_ADV_GENERATE_GRAPHS", raising=False)
    m = ops_adv.convert_model(_tiny())
    assert "get_compiled_call" in m.__dict__
    rows = [r for r in m._ops_adv_report if r["type"] == "generate() decode steps"]
    assert rows and rows[0]["converted"] == "yes" and "where a table with winners" in rows[0]["why"]
    monkeypatch.setenv("OPS_ADV_GENERATE_GRAPHS", "0")
    rows = [r for r in ops_adv.convert_model(_tiny())._ops_adv_report if r["type"] == "generate() decode steps"]
    assert rows[0]["converted"] == "no"
    # not a generative model: nothing installed
    from transformers import BertConfig, BertModel

    b = ops_adv.convert_model(BertModel(BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                                   intermediate_size=64, vocab_size=64)).eval())
    assert "get_compiled_call" not in b.__dict__


def test_decode_steps_replay_graphs_and_match_eager(cpu_graphs):
    made, originals = cpu_graphs
    m = ops_adv.convert_model(_tiny())
    ids, mask = _inputs()
    want = _gen(m, ids, mask, compiled=False)
    got = _gen(m, ids, mask)
    assert torch.equal(got, want)
    (runner,) = made
    (e,) = runner.entries.values()  # one decode shape: one graph, captured at the second step, replayed after
    assert e.failed is None and e.graph.replays == 6 - 2
    assert originals == []  # transformers' compiled call was never needed
    got2 = _gen(m, ids, mask)  # the next generate replays the same graph from its first decode step
    assert torch.equal(got2, want) and e.graph.replays == 4 + 5
    ids1, mask1 = _inputs(B=1, S=5, seed=3)
    assert torch.equal(_gen(m, ids1, mask1), _gen(m, ids1, mask1, compiled=False))
    assert len(runner.storages) == 2 and len(runner.entries) == 2  # a second layout: its own cache and graph
    graphs.release(m)
    assert not runner.storages and not runner.entries


def test_outputs_are_fresh_tensors(cpu_graphs):
    from transformers import CompileConfig

    made, _ = cpu_graphs
    m = ops_adv.convert_model(_tiny())
    ids, mask = _inputs()
    cc = CompileConfig()
    cc._compile_all_devices = True
    with torch.no_grad():
        out = m.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, cache_implementation="static",
                         compile_config=cc, return_dict_in_generate=True)
    cache = getattr(out, "past_key_values", None) or getattr(out, "cache", None)
    ((key, e),) = made[0].entries.items()
    fwd = m.get_compiled_call(cc)
    assert fwd.func is made[0]
    step = {}  # the call generate made, in its order
    inputs = iter(e.inputs)
    for part in key:
        step[part[0]] = cache if part[1:2] == ("cache",) else next(inputs).clone() if isinstance(part[1], torch.Size) else part[1]
    for layer in cache.layers:
        layer.cumulative_length.fill_(5)
    with torch.no_grad():
        a = fwd(**step)
        b = fwd(**{**step, "input_ids": (step["input_ids"] + 1) % 256})
    assert len(made[0].entries) == 1 and e.graph.replays == 2 + 2  # the same graph replayed
    assert a.logits.data_ptr() != b.logits.data_ptr() and not torch.equal(a.logits, b.logits)


def test_weight_changes_between_generates_drop_the_graphs(cpu_graphs):
    made, _ = cpu_graphs
    m = ops_adv.convert_model(_tiny())
    ids, mask = _inputs()
    _gen(m, ids, mask)
    with torch.no_grad():  # an in-place edit (EMA, surgery) and a replaced parameter
        m.model.layers[0].mlp.down_proj.weight.mul_(-3.0)
    fresh = _tiny()
    fresh.load_state_dict(m.state_dict())
    assert torch.equal(_gen(m, ids, mask), _gen(ops_adv.convert_model(fresh), ids, mask, compiled=False))
    m.model.layers[1].self_attn.o_proj.weight = torch.nn.Parameter(torch.randn_like(m.model.layers[1].self_attn.o_proj.weight))
    fresh.load_state_dict(m.state_dict())
    assert torch.equal(_gen(m, ids, mask), _gen(fresh, ids, mask, compiled=False))


def test_table_change_drops_the_graphs(cpu_graphs):
    made, _ = cpu_graphs
    m = ops_adv.convert_model(_tiny())
    ids, mask = _inputs()
    _gen(m, ids, mask)
    first = dict(made[0].entries)
    ops_adv.forget_resolved() if hasattr(ops_adv, "forget_resolved") else _dispatch.forget_resolved()
    _gen(m, ids, mask)
    assert first and not set(map(id, first.values())) & set(map(id, made[0].entries.values()))


def test_what_is_not_graphed(cpu_graphs):
    made, originals = cpu_graphs
    m = ops_adv.convert_model(_tiny())
    ids, mask = _inputs()
    with ops_adv.census() as c:  # the census must see every call: transformers' path, counted
        _gen(m, ids, mask)
    assert not made and len(originals) == 1 and c.calls > 0
    fwd = m.get_compiled_call(None)
    runner = made[0]
    with torch.enable_grad():
        fwd(input_ids=ids, attention_mask=mask)  # gradient on: not graphed
    m.train()
    with torch.no_grad():
        fwd(input_ids=ids[:, :1])  # training mode: not graphed
    m.eval()
    with torch.no_grad():
        fwd(input_ids=torch.randint(1, 256, (2, graphs.MAX_TOKENS + 1)))  # a prefill: not graphed
    assert runner.entries == {}


def test_off_switch_and_other_backends(cpu_graphs, monkeypatch):
    from transformers import CompileConfig

    made, originals = cpu_graphs
    m = ops_adv.convert_model(_tiny())
    m.get_compiled_call(CompileConfig(backend="eager"))
    monkeypatch.setenv("OPS_ADV_GENERATE_GRAPHS", "0")
    m.get_compiled_call(None)
    assert not made and len(originals) == 2


def test_pickles_and_copies_without_graphs(cpu_graphs):
    made, _ = cpu_graphs
    m = ops_adv.convert_model(_tiny())
    ids, mask = _inputs()
    _gen(m, ids, mask)
    for other in (copy.deepcopy(m), pickle.loads(pickle.dumps(m))):
        r = other.__dict__.get("_ops_adv_decode_graphs")
        assert r is None or r.entries == {}
        assert other.__dict__["get_compiled_call"].args[0] is other


def test_a_step_that_cannot_be_captured_runs_transformers_path(cpu_graphs):
    made, originals = cpu_graphs
    m = ops_adv.convert_model(_tiny())
    ids, mask = _inputs()
    m.get_compiled_call(None)

    def refuse(fn, pool):
        raise RuntimeError("operation not permitted when stream is capturing")

    made[0].capture = refuse
    want = _gen(m, ids, mask, compiled=False)
    with pytest.warns(RuntimeWarning, match="could not be captured"):
        got = _gen(m, ids, mask)
    assert torch.equal(got, want) and len(originals) == 1
    (e,) = made[0].entries.values()
    assert e.failed.startswith("RuntimeError")


def test_on_where_something_is_tuned(monkeypatch, tmp_path):
    """Unset, the graphs run where a table with winners for the device is loaded; with nothing tuned the model runs
    the original's eager code, which transformers' compile fuses better (H100: 0.88-0.98x for the graphs)."""
    from test_passthrough import _cpu_table

    monkeypatch.delenv("OPS_ADV_GENERATE_GRAPHS", raising=False)
    monkeypatch.delenv("OPS_ADV_PASSTHROUGH", raising=False)
    monkeypatch.setattr(graphs, "_graphable", lambda model: True)
    seen = []
    monkeypatch.setattr(graphs, "_original", lambda model, cfg: seen.append(cfg) or model.__call__)
    try:
        ops_adv.load_table("")
        m = ops_adv.convert_model(_tiny())
        assert m.get_compiled_call(None) == m.__call__ and seen == [None]
        assert "_ops_adv_decode_graphs" not in m.__dict__
        ops_adv.load_table(_cpu_table(tmp_path))
        assert m.get_compiled_call(None).func is m.__dict__["_ops_adv_decode_graphs"] and len(seen) == 1
    finally:
        monkeypatch.setenv("OPS_ADV_PASSTHROUGH", "0")
        ops_adv.load_table("")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("fullgraph", [False, True])
def test_cuda_graphs_in_generate(fullgraph, monkeypatch):
    monkeypatch.setenv("OPS_ADV_GENERATE_GRAPHS", "1")
    from transformers import CompileConfig

    m = ops_adv.convert_model(_tiny().to("cuda"))  # fp32: greedy tokens comparable exactly
    ids, mask = (t.cuda() for t in _inputs(B=3, S=9))
    kw = dict(max_new_tokens=12, do_sample=False, cache_implementation="static", pad_token_id=0, attention_mask=mask)
    with torch.no_grad():
        want = m.generate(ids, disable_compile=True, **kw)
        got = m.generate(ids, compile_config=CompileConfig(fullgraph=fullgraph), **kw)
        again = m.generate(ids, compile_config=CompileConfig(fullgraph=fullgraph), **kw)
    runner = m.__dict__["_ops_adv_decode_graphs"]
    (e,) = runner.entries.values()
    assert e.failed is None and e.graph is not None
    assert not hasattr(m, "_compiled_call")  # Dynamo never ran
    assert torch.equal(got, want) and torch.equal(again, want)
    with torch.no_grad():
        m.model.layers[0].mlp.up_proj.weight.mul_(2.0)
        assert torch.equal(m.generate(ids, compile_config=CompileConfig(), **kw), m.generate(ids, disable_compile=True, **kw))
