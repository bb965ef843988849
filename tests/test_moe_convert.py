"""convert_model runs the `moe` op in Mixtral, Qwen2-MoE and Qwen3-MoE sparse blocks (issue 31).

Each model is built from a tiny config with random weights, converted on a copy and compared with the original:
eval logits (the op forced, and through a table that holds a winner), the op actually called, train-step
gradients of every parameter, state_dict, hooks, torch.compile(fullgraph=True) with its graph breaks,
torch.export, generate(), pickling, explain_model, and the blocks left to transformers and why."""
from __future__ import annotations

import copy
import json
import pickle

import pytest
import torch
import torch.nn as nn

import ops_adv
from ops_adv.models import moe_block

transformers = pytest.importorskip("transformers")

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0)
QWEN = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)
FAMILIES = {  # name: (config, renormalize the router's top-k)
    "mixtral": (lambda: transformers.MixtralConfig(**TINY, num_local_experts=8, num_experts_per_tok=2), True),
    "qwen2_moe": (lambda: transformers.Qwen2MoeConfig(**TINY, **QWEN, shared_expert_intermediate_size=64,
                                                      norm_topk_prob=False), False),
    "qwen2_moe_norm": (lambda: transformers.Qwen2MoeConfig(**TINY, **QWEN, shared_expert_intermediate_size=64,
                                                           norm_topk_prob=True), True),
    "qwen3_moe": (lambda: transformers.Qwen3MoeConfig(**TINY, **QWEN, head_dim=16, norm_topk_prob=True), True),
}


def _lm(family: str) -> nn.Module:
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(FAMILIES[family][0]()).eval()


def _pair(family: str):
    ref = _lm(family)
    return ref, ops_adv.convert_model(copy.deepcopy(ref))


def _ids(b=2, s=9):
    return torch.randint(1, 120, (b, s), generator=torch.Generator().manual_seed(1))


def close(a, b, tol=1e-5):
    torch.testing.assert_close(a, b, rtol=tol, atol=tol)


def _blocks(model) -> list[tuple[str, nn.Module]]:
    return [(n, m) for n, m in model.named_modules() if type(m).__name__.endswith("SparseMoeBlock")]


def _rows(model) -> dict[str, dict]:
    return {r["module"]: r for r in ops_adv.explain_model(model)}


@pytest.fixture
def calls(monkeypatch):
    """How many times a converted block called ops_adv.moe (eager; conversion's probe too: tests zero it after)."""
    n = [0]
    real = moe_block.moe

    def counted(*a, **k):
        n[0] += 1
        return real(*a, **k)

    monkeypatch.setattr(moe_block, "moe", counted)
    return n


def _write_table(path, problems) -> None:
    from kernel_space import get_impl
    from ops_adv._table import FORMAT, FORMAT_VERSION, checksum

    winners = [{"op": "moe", "problem": p, "impl": "torch_grouped_mm", "params": {},
                "kernel_version": get_impl("moe", "torch_grouped_mm").version, "median_ms": 1.0, "speedup": 1.5}
               for p in problems]
    path.write_text(json.dumps({"format": FORMAT, "format_version": FORMAT_VERSION, "device_class": "cpu",
                                "winners": winners, "checksum": checksum(winners)}))


def _problem(model, tokens: int, renormalize: bool) -> dict:
    e = _blocks(model)[0][1].experts
    E, N2, K = e.gate_up_proj.shape
    return dict(T=tokens, E=E, top_k=2, N=N2 // 2, K=K, dtype="fp32", activation="silu", renormalize=renormalize)


# --------------------------------------------------------------------------- recognised, and the same model


@pytest.mark.parametrize("family", list(FAMILIES))
def test_sparse_block_runs_the_op_and_matches_in_eval(family, calls):
    renorm = FAMILIES[family][1]
    ref, conv = _pair(family)
    calls[0] = 0
    rows = _rows(conv)
    blocks = _blocks(conv)
    assert len(blocks) == 2
    for name, block in blocks:
        assert rows[name]["converted"] == "yes" and "-> moe (top_k=2" in rows[name]["why"], rows[name]
        assert f"renormalize={renorm}" in rows[name]["why"]
        ex = rows[name + ".experts"]  # its forward stays transformers' (grouped_mm), called where the op is not
        assert ex["converted"] == "no" and "its block calls ops_adv.moe" in ex["why"], ex
        assert "forward" not in block.experts.__dict__ and "forward" not in block.gate.__dict__
    ids = _ids()
    with torch.no_grad():
        want = ref(ids, output_router_logits=True)
        got = conv(ids, output_router_logits=True)  # nothing tuned: the experts run as transformers chose
        assert calls[0] == 0
        close(got.logits, want.logits)
        with moe_block.forced():  # the op, whatever the table holds
            forced = conv(ids, output_router_logits=True)
        assert calls[0] == 2
    close(forced.logits, want.logits)
    for a, b in zip(forced.router_logits, want.router_logits):  # the aux loss reads the router's own logits
        close(a, b)


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_a_tuned_problem_runs_the_op_untuned_ones_are_misses(family, calls, tmp_path):
    renorm = FAMILIES[family][1]
    ref, conv = _pair(family)
    calls[0] = 0
    ids = _ids()
    table = tmp_path / "t.json"
    _write_table(table, [_problem(conv, 18, True)])  # a renormalize=False problem borrows it (its twin)
    try:
        ops_adv.load_table(str(table))
        def small_misses():  # of the 5-token calls (a twin's calls count as misses too)
            return sum(v for (op, p), v in ops_adv.misses().items() if op == "moe" and p[0] < 16)

        before = small_misses()
        with torch.no_grad():
            close(conv(ids).logits, ref(ids).logits)
            assert calls[0] == 2
            why = ops_adv.explain("moe", torch.zeros(18, 64), torch.zeros(18, 8),
                                  _blocks(conv)[0][1].experts.gate_up_proj, _blocks(conv)[0][1].experts.down_proj,
                                  top_k=2, renormalize=renorm)
            assert why["impl"] == "torch_grouped_mm", why
            close(conv(ids[:1, :5]).logits, ref(ids[:1, :5]).logits)  # 5 tokens: nothing tuned near
        assert calls[0] == 2
        assert small_misses() == before + 2  # the experts ran in the op's place: counted as the op's misses
    finally:
        ops_adv.load_table("")


@pytest.mark.parametrize("family", list(FAMILIES))
def test_train_step_gradients_and_state_dict_are_the_originals(family):
    ref, conv = _pair(family)
    assert list(conv.state_dict()) == list(ref.state_dict())
    for (k, a), b in zip(ref.state_dict().items(), conv.state_dict().values()):
        assert torch.equal(a, b), k
    ids = _ids()
    for model in (ref, conv):
        model.train()
        with moe_block.forced():  # a call that needs gradients runs the experts module even so
            out = model(ids, labels=ids, output_router_logits=True)
        (out.loss + (out.aux_loss if out.aux_loss is not None else 0)).backward()
    grads = {n: p.grad for n, p in ref.named_parameters()}
    seen = 0
    for n, p in conv.named_parameters():
        assert p.grad is not None or grads[n] is None, n
        if p.grad is not None:
            close(p.grad, grads[n], 1e-5)
            seen += "experts" in n
    assert seen == 4  # gate_up_proj and down_proj of both blocks


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_eval_with_gradients_runs_the_experts_and_their_autograd(family, calls):
    ref, conv = _pair(family)
    calls[0] = 0
    ids = _ids()
    with moe_block.forced():
        conv(ids).logits.square().mean().backward()
    ref(ids).logits.square().mean().backward()
    assert calls[0] == 0
    got = dict(conv.named_parameters())
    for n, p in ref.named_parameters():
        if "experts" in n or "gate" in n:
            close(got[n].grad, p.grad)


# --------------------------------------------------------------------------- hooks, copies, generate


def test_hooks_registered_after_conversion_fire_and_the_hooked_call_runs_as_before(calls):
    ref, conv = _pair("qwen2_moe")
    calls[0] = 0
    (_, b0), (_, b1) = _blocks(conv)
    seen = []
    b0.experts.register_forward_hook(lambda m, a, o: seen.append(("experts", a[0].shape)))
    b0.gate.register_forward_pre_hook(lambda m, a: seen.append(("gate", a[0].shape)))
    h = b1.experts.act_fn.register_forward_hook(lambda m, a, o: seen.append(("act", 0)))
    ids = _ids()
    with torch.no_grad(), moe_block.forced():
        close(conv(ids).logits, ref(ids).logits)
    assert ("experts", (18, 64)) in seen and ("gate", (18, 64)) in seen and ("act", 0) in seen
    assert calls[0] == 0  # block 0's experts are hooked, block 1's activation is: both run themselves
    h.remove()
    with torch.no_grad(), moe_block.forced():
        close(conv(ids).logits, ref(ids).logits)
    assert calls[0] == 1


def test_replaced_experts_or_activation_run_as_they_are_now(calls):
    ref, conv = _pair("mixtral")
    calls[0] = 0
    (_, b0), (_, b1) = _blocks(conv)
    b0.experts.act_fn = nn.GELU()  # replaced after conversion: the op (SiLU) must not stand in for it
    ref.model.layers[0].mlp.experts.act_fn = nn.GELU()
    ids = _ids()
    with torch.no_grad(), moe_block.forced():
        close(conv(ids).logits, ref(ids).logits)
    assert calls[0] == 1


def test_deepcopy_and_pickle_keep_the_op(calls):
    ref, conv = _pair("qwen3_moe")
    calls[0] = 0
    ids = _ids()
    with torch.no_grad():
        want = ref(ids).logits
        for m in (copy.deepcopy(conv), pickle.loads(pickle.dumps(conv))):
            with moe_block.forced():
                close(m(ids).logits, want)
    assert calls[0] == 4


_LOAD = """
import pickle, sys, torch
from ops_adv.models import moe_block
n = [0]
real = moe_block.moe
moe_block.moe = lambda *a, **k: (n.__setitem__(0, n[0] + 1), real(*a, **k))[1]
conv = pickle.load(open(sys.argv[1], "rb"))
ids, want = torch.load(sys.argv[2])
with torch.no_grad(), moe_block.forced():
    got = conv(ids).logits
torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
print("calls", n[0])
"""


def test_pickled_model_loads_and_runs_the_op_in_a_new_process(tmp_path):
    """The rewritten block forward is found by name and rebuilt from the class in another process."""
    import os
    from pathlib import Path

    from conftest import run_cli

    ref, conv = _pair("mixtral")
    ids = _ids()
    with torch.no_grad():
        torch.save((ids, ref(ids).logits), tmp_path / "ref.pt")
    (tmp_path / "conv.pkl").write_bytes(pickle.dumps(conv))
    root = str(Path(__file__).resolve().parents[1])  # the same transformers as this process (5.17 in the low run)
    path = os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), root, str(Path(__file__).parent)) if p)
    r = run_cli("-c", _LOAD, str(tmp_path / "conv.pkl"), str(tmp_path / "ref.pt"), env={"PYTHONPATH": path})
    assert r.returncode == 0, r.stderr[-2000:]
    assert "calls 2" in r.stdout


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_generate_agrees_greedy(family, calls):
    ref, conv = _pair(family)
    calls[0] = 0
    ids = _ids(1, 5)
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        want = ref.generate(ids, **kw)
        with moe_block.forced():
            got = conv.generate(ids, **kw)
    assert torch.equal(got, want)
    assert calls[0] == 2 * 6  # two blocks, one prefill and five decode steps


# --------------------------------------------------------------------------- compile and export


def _explain(model, ids):
    torch._dynamo.reset()
    with torch.no_grad():
        e = torch._dynamo.explain(model)(ids, use_cache=False)
    ops = {str(n.target) for g in e.graphs for n in g.graph.nodes if "ops_adv" in str(n.target)}
    return e.graph_break_count, ops


@pytest.mark.parametrize("family", list(FAMILIES))
def test_compile_fullgraph_keeps_zero_graph_breaks_with_the_op_in_the_graph(family, monkeypatch):
    ref, conv = _pair(family)
    ids = _ids()
    breaks, _ = _explain(ref, ids)
    assert breaks == 0
    # vendor kernels only (nothing tuned): transformers' experts graph, as the original's
    breaks, ops = _explain(conv, ids)
    assert breaks == 0 and "ops_adv.moe" not in ops, ops
    monkeypatch.setenv("OPS_ADV_COMPILE_OPERATORS", "1")  # as a table with an ops-adv kernel does
    breaks, ops = _explain(conv, ids)
    assert breaks == 0 and "ops_adv.moe" in ops, ops
    torch._dynamo.reset()
    with torch.no_grad():
        got = torch.compile(conv, fullgraph=True, backend="aot_eager")(ids, use_cache=False).logits
        close(got, ref(ids, use_cache=False).logits)


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_export_holds_the_op_and_matches(family):
    ref, conv = _pair(family)
    ids = _ids()
    with torch.no_grad():
        torch.export.export(ref, (ids,), kwargs={"use_cache": False})  # the original exports
        ep = torch.export.export(conv, (ids,), kwargs={"use_cache": False})
        assert sum(str(n.target) == "ops_adv.moe.default" for n in ep.graph.nodes) == 2
        close(ep.module()(ids, use_cache=False).logits, ref(ids, use_cache=False).logits)


# --------------------------------------------------------------------------- left to transformers, and why


def test_a_router_that_is_no_softmax_top_k_is_refused_with_its_reason(calls):
    ref = _lm("qwen3_moe")
    gate = ref.model.layers[0].mlp.gate
    bias = torch.linspace(-1, 1, 8)

    def biased(hidden_states):  # DeepSeek-style: the choice on biased scores, the weights from the logits
        logits = nn.functional.linear(hidden_states.reshape(-1, gate.hidden_dim), gate.weight)
        probs = torch.softmax(logits.float(), -1)
        ids = torch.topk(probs + bias, 2, dim=-1).indices
        w = probs.gather(-1, ids)
        return logits, w / w.sum(-1, keepdim=True), ids

    gate.forward = biased
    conv = ops_adv.convert_model(copy.deepcopy(ref))
    calls[0] = 0
    rows = _rows(conv)
    assert "model.layers.0.mlp" not in rows or "moe" not in rows["model.layers.0.mlp"]["why"]
    why = rows["model.layers.0.mlp.experts"]["why"]
    assert "does not call ops_adv.moe" in why and "not a softmax top-k" in why, why
    assert "its block calls ops_adv.moe" in rows["model.layers.1.mlp.experts"]["why"]
    ids = _ids()
    with torch.no_grad(), moe_block.forced():
        close(conv(ids).logits, ref(ids).logits)
    assert calls[0] == 1


def test_experts_that_are_no_silu_gate_are_refused_with_their_reason(calls):
    ref = _lm("mixtral")
    for layer in ref.model.layers:
        layer.mlp.experts.act_fn = nn.GELU()
    conv = ops_adv.convert_model(copy.deepcopy(ref))
    calls[0] = 0
    rows = _rows(conv)
    for i in range(2):
        why = rows[f"model.layers.{i}.mlp.experts"]["why"]
        assert rows[f"model.layers.{i}.mlp.experts"]["converted"] == "no" and "act_fn is not SiLU" in why, why
    ids = _ids()
    with torch.no_grad(), moe_block.forced():
        close(conv(ids).logits, ref(ids).logits)
    assert calls[0] == 0


def test_a_block_whose_probe_differs_is_left_as_it_was(monkeypatch):
    """The whole-block probe (op forced) against the block's own forward: an op that computed otherwise (here
    scaled by 2) leaves the block's forward as transformers wrote it, and says why."""
    real = moe_block.moe
    monkeypatch.setattr(moe_block, "moe", lambda *a, **k: 2 * real(*a, **k))
    ref, conv = _pair("mixtral")
    rows = _rows(conv)
    for name, block in _blocks(conv):
        assert "forward" not in block.__dict__ and name not in rows  # nothing else in Mixtral's block to fuse
        why = rows[name + ".experts"]["why"]
        assert "does not call ops_adv.moe" in why and "differs from its own forward" in why, why
        assert moe_block.SPEC not in block.experts.__dict__
    ids = _ids()
    with torch.no_grad(), moe_block.forced():
        close(conv(ids).logits, ref(ids).logits)
