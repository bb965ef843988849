"""Tuning what generate() runs: the workload, the census of calls by source, tune_for_hardware(max_new_tokens=...)
and opsadv-record (issue 28, item 1)."""
from __future__ import annotations

import copy
import json

import pytest
import torch

import ops_adv
from conftest import run_cli
from ops_adv.models.record import generate_workload, left_padding, record_generate

transformers = pytest.importorskip("transformers")

CFG = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
           vocab_size=256, max_position_embeddings=256)


@pytest.fixture
def no_table():
    ops_adv.load_table("")
    yield
    ops_adv.load_table("")


def tiny_llama():
    torch.manual_seed(0)
    m = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CFG)).eval()
    m.generation_config.eos_token_id = None
    return m


def test_left_padding_differs_per_row_and_leaves_tokens():
    mask = left_padding(4, 40)
    pads = (mask == 0).sum(1).tolist()
    assert len(set(pads)) == 4 and min(pads) >= 1 and max(pads) < 20
    assert all((mask[i, pads[i]:] == 1).all() and (mask[i, :pads[i]] == 0).all() for i in range(4))


def test_generate_workload_records_prefill_and_every_decode_problem(no_table):
    m = ops_adv.convert_model(tiny_llama())
    rec = record_generate(m, batch_sizes=[1, 2], prompt_lens=12, max_new_tokens=5,
                          generate_kwargs={"cache_implementation": "static"})
    probs = rec.problems()
    gemm_m = {p.M for op, p in probs if op == "gemm"}
    assert {1, 2, 12, 24} <= gemm_m  # decode rows of both batches and both prefills
    dec = [p for op, p in probs if op == "decode_attention"]
    # the static cache holds prompt + new tokens - 1 slots; both paddings (masked: left padding's key mask)
    assert {p.Skv for p in dec} == {16} and {p.B for p in dec} == {1, 2}
    assert "_previous_max_cache_length" not in m.__dict__  # the model's own cache memory is as it was
    assert {p.masked for p in dec if p.Sq == 1} == {False, True}


def test_census_counts_every_call_by_source(no_table):
    m = ops_adv.convert_model(tiny_llama())
    with ops_adv.census() as c:
        generate_workload(m, batch_sizes=1, prompt_lens=8, max_new_tokens=3, padding="none")
    src = c.by_source()
    assert c.calls > 0 and src == {"tuned": 0, "nearest": 0, "twin": 0, "default": c.calls}
    # a layer's 4 gemms (q/k/v merged, o, gate/up merged, down) + lm_head, per forward (1 prefill + 2 decode
    # steps, 2 layers)
    assert sum(r["calls"] for r in c.rows() if r["op"] == "gemm") == 3 * (2 * 4 + 1)
    assert "default" in str(c) and "gemm" in str(c)
    with ops_adv.census() as idle:
        pass
    assert idle.calls == 0 and idle.by_source()["tuned"] == 0


def test_generate_workload_refuses_what_it_cannot_run():
    m = ops_adv.convert_model(tiny_llama())
    for bad in (dict(max_new_tokens=0), dict(padding="right"), dict(batch_sizes=[1, 0]), dict(prompt_lens="8")):
        with pytest.raises(ops_adv.OpsAdvError):
            generate_workload(m, **{"max_new_tokens": 2, **bad})
    with pytest.raises(ops_adv.OpsAdvError, match="no generate"):
        generate_workload(torch.nn.Linear(2, 2), max_new_tokens=2)


@pytest.mark.ray
def test_tune_for_hardware_tunes_what_generate_runs(ray_session, sqlite_url, no_table):
    """After tuning a generate workload every op call of that generate runs a tuned winner, and the tokens stay."""
    ref = tiny_llama()
    m = ops_adv.convert_model(copy.deepcopy(ref))
    kw = {"cache_implementation": "static"}
    out = m.tune_for_hardware(device="cpu", batch_size=[1, 2], seq_len=10, max_new_tokens=4, generate_kwargs=kw,
                              trials=2, db=sqlite_url, measure_budget_s=0.02)
    before, after = out["census_before"], out["census_after"]
    assert before["default"] == sum(before.values()) > 0
    assert after["tuned"] == sum(after.values()) == sum(before.values()), out["census"]
    assert out["problems"] == len(out["winners"])
    ids = torch.randint(1, 256, (2, 10), generator=torch.Generator().manual_seed(1))
    mask = left_padding(2, 10)
    args = dict(attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0, disable_compile=True, **kw)
    with torch.no_grad():
        assert torch.equal(m.generate(ids.masked_fill(mask == 0, 0), **args), ref.generate(ids.masked_fill(mask == 0, 0), **args))


def test_opsadv_record_writes_a_shapes_file_opsadv_tune_reads(tmp_path):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"model_type": "llama", **CFG}))
    out = tmp_path / "shapes.json"
    r = run_cli("-m", "tuner.record_cli", "--model", str(cfg), "--device", "cpu", "--dtype", "fp32", "--batch-sizes", "1,2",
                "--prompt-lens", "8", "--new-tokens", "3", "--cache", "static", "--out", str(out))
    assert r.returncode == 0, r.stderr
    assert "problems" in r.stdout and "opsadv-tune" in r.stdout
    from tuner.problems import load_shapes

    shapes = json.loads(out.read_text())
    probs = load_shapes(str(out), sorted(shapes))
    assert len(probs) == sum(map(len, shapes.values())) and {op for op, _ in probs} >= {"gemm", "decode_attention"}
    # a folder with config.json works too; a missing model is one line and exit 2
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(cfg.read_text())
    r = run_cli("-m", "tuner.record_cli", "--model", str(tmp_path / "m"), "--device", "cpu", "--dtype", "fp32",
                "--prompt-lens", "4", "--new-tokens", "2", "--out", str(tmp_path / "s2.json"))
    assert r.returncode == 0, r.stderr
    for bad in (["--model", str(tmp_path / "none.json")], ["--model", str(cfg), "--batch-sizes", "0"],
                ["--model", str(cfg), "--padding", "right"]):
        r = run_cli("-m", "tuner.record_cli", "--device", "cpu", "--out", str(tmp_path / "x.json"), *bad)
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr, r.stderr
