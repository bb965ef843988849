"""Conformance sweep: every causal-LM family the installed transformers ships, built tiny from its config (no
downloads), converted with ops_adv and checked against the original (issue 30, "Must show").

Per family, in its own subprocess with a time limit (a hang or a crash costs that family only):
  build     the family's config with small sizes (hidden 64, 2 layers, vocab 256, dropout 0); a family that cannot
            build or run tiny is skipped, with the reason
  convert   ops_adv.convert_model on a deep copy; ops_adv.explain_model's counts (converted / not) and refusals
  eval      the logits' max |diff| against the original (fp32, batch 2 x 9)
  train     one train step's loss and every parameter's gradient: max relative error (||g' - g|| / ||g||, ||g||
            floored at 1e-3 of the largest gradient's norm)
  generate  greedy tokens (8 new) equal to the original's: default cache, static cache, left padding (2 rows)
  compile   torch.compile (eval logits) against the eager original, and its graph count; the original is compiled
            too when the converted model's compile fails, differs or breaks into several graphs, to tell our failure
            (or added graph breaks) from the family's own

A check the original itself cannot run (a family without a static cache, say) is "n/a" with the original's error.
Results: OUT/conformance.md (a table per --table, the failures listed with their error line) and OUT/conformance.json.

  python benchmarks/conformance_sweep.py --out DIR [--jobs 1] [--timeout 300] [--families llama,gpt2]
      [--table none|forced|none,forced] [--compile-backend aot_eager|inductor|eager]

`--table forced` gives every problem the converted model meets (recorded per family) a non-vendor CPU winner, so
ops_adv's own kernels run instead of the vendor fallbacks; `none,forced` runs each family both ways.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import tempfile
import time
import traceback
from typing import Any

# This folder holds kernels.py, which would shadow the `kernels` package transformers imports.
_here = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _here]
sys.path.insert(0, os.path.dirname(_here))

HIDDEN, LAYERS, HEADS, KV_HEADS, HEAD_DIM, FFN, VOCAB, POSITIONS = 64, 2, 4, 2, 16, 128, 256, 128
NEW = 8  # tokens generated
EVAL_TOL = 1e-4  # max |diff| of fp32 logits, relative to max(1, max |logit|)
GRAD_TOL = 1e-3  # max relative gradient error

# Config keys (any family's spelling) set to the tiny sizes; a key the config lacks is left alone.
_SIZES = [
    (HIDDEN, ("hidden_size", "n_embd", "d_model", "dim", "embed_dim", "hidden_dim", "model_dim", "n_embed", "emb_size",
             "embedding_size", "word_embed_proj_dim")),
    (LAYERS, ("num_hidden_layers", "n_layer", "num_layers", "n_layers", "decoder_layers", "encoder_layers",
             "num_decoder_layers")),
    (HEADS, ("num_attention_heads", "n_head", "num_heads", "n_heads", "decoder_attention_heads", "encoder_attention_heads",
            "attention_heads")),
    (KV_HEADS, ("num_key_value_heads", "num_kv_heads", "n_kv_heads", "multi_query_group_num", "num_key_value_groups_")),
    (HEAD_DIM, ("head_dim", "kv_channels", "d_kv", "attention_head_dim", "qk_nope_head_dim", "v_head_dim",
               "global_head_dim")),
    (FFN, ("intermediate_size", "n_inner", "ffn_dim", "d_ff", "ffn_hidden_size", "decoder_ffn_dim", "encoder_ffn_dim",
          "moe_intermediate_size", "shared_expert_intermediate_size", "expert_intermediate_size", "dff", "d_inner",
          "filter_size", "intermediate_size_mlp", "mlp_hidden_size")),
    (VOCAB, ("vocab_size", "padded_vocab_size", "n_vocab", "vocab_size_per_layer_input")),
    (POSITIONS, ("max_position_embeddings", "n_positions", "n_ctx", "max_seq_len", "seq_length", "max_sequence_length",
                "max_length", "max_target_positions", "max_source_positions")),
]
_SMALL = {"num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4, "moe_num_experts": 4, "num_experts_per_tok": 2,
          "top_k": 2, "moe_topk": 2, "n_shared_experts": 1, "q_lora_rank": 32, "kv_lora_rank": 32, "qk_rope_head_dim": 8,
          "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1, "state_size": 8, "conv_kernel": 4,
          "mamba_d_state": 8, "mamba_d_conv": 4, "mamba_n_heads": 8, "mamba_d_head": 16, "mamba_n_groups": 1,
          "ssm_state_size": 8, "time_step_rank": 8, "num_buckets": 32, "hidden_size_per_layer_input": 8,
          "altup_num_inputs": 2, "laurel_rank": 8, "per_layer_input_dim": 8, "local_window_size": 32,
          "lru_width": 64, "attention_window_size": 32, "block_size": 16, "chunk_size": 16, "moe_k": 2}
_FAMILY = {  # sizes the generic rules get wrong for a family: head counts that must divide, state widths, ...
    "mamba2": {"num_heads": 8, "head_dim": 16, "n_groups": 1, "expand": 2},
    "falcon_mamba": {"expand": 2},
    "mamba": {"expand": 2},
    "bamba": {"mamba_n_heads": 8, "mamba_d_head": 16, "mamba_expand": 2},
    "nemotron_h": {"mamba_num_heads": 8, "mamba_head_dim": 16, "n_groups": 1, "expand": 2},
    "reformer": {"axial_pos_shape": [8, 16], "axial_pos_embds_dim": [32, 32], "attn_layers": ["local", "lsh"],
                 "attention_head_size": 16, "feed_forward_size": 128, "local_attn_chunk_length": 16,
                 "lsh_attn_chunk_length": 16},
    "xlstm": {"num_heads": 4, "qk_dim_factor": 0.5, "v_dim_factor": 1.0},
    "rwkv": {"attention_hidden_size": 64, "intermediate_size": 256, "context_length": 128},
    "gpt_neo": {"attention_types": [[["global", "local"], 1]]},
    "falcon_h1": {"mamba_d_ssm": 64, "mamba_n_heads": 8, "mamba_d_head": 8},
    "bamba": {"attn_layer_indices": [1]},
    "deepseek_v2": {"num_experts_per_tok": 2},
    "dots1": {"n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1},
    "nemotron": {"num_key_value_heads": KV_HEADS},
    "granitemoehybrid": {"layer_types": ["linear_attention", "attention"]},
    "jamba": {"attn_layer_period": 2, "attn_layer_offset": 1, "expert_layer_period": 2, "expert_layer_offset": 1},
    "recurrent_gemma": {"block_types": ["recurrent", "attention"]},
    "lfm2_moe": {"layer_types": ["conv", "full_attention"], "num_dense_layers": 1},
    "kimi_linear": {"num_experts_per_token": 2, "linear_head_dim": 16, "linear_num_heads": 4},
}


def _per_layer(v: list) -> list:
    """A per-layer list cut to LAYERS layers, each kind it holds first: a hybrid keeps one layer of every kind."""
    if all(isinstance(x, str) for x in v):
        return (list(dict.fromkeys(v)) + v)[:LAYERS]
    return v[:LAYERS]


def _shrink(d: dict, model_type: str, depth: int = 0) -> dict:
    """The config dict `d` with tiny sizes, dropout off and token ids inside the vocabulary; nested configs too."""
    out = dict(d)
    n0 = next((d[k] for k in _SIZES[1][1] if isinstance(d.get(k), int)), None)  # the default's layer count
    sizes = {k: v for v, keys in _SIZES for k in keys}
    for k, v in list(out.items()):
        low = k.lower()
        if k in sizes and isinstance(v, int) and not isinstance(v, bool):
            out[k] = sizes[k]
        elif k in sizes and isinstance(v, list) and v and all(isinstance(x, int) for x in v):
            out[k] = [sizes[k]] * (LAYERS if n0 and len(v) == n0 else len(v))  # one size per layer
        elif k == "head_dim" and v is None:
            out[k] = HEAD_DIM
        elif k in _SMALL and isinstance(v, int) and not isinstance(v, bool):
            out[k] = min(v, _SMALL[k]) if v > 0 else v
        elif isinstance(v, float) and ("dropout" in low or "pdrop" in low or low.endswith("_drop")):
            out[k] = 0.0
        elif isinstance(v, int) and not isinstance(v, bool) and k.endswith("token_id") and v >= VOCAB:
            out[k] = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}.get(k, 3)
        elif isinstance(v, list) and k.endswith("token_id"):
            out[k] = [t if t < VOCAB else 2 for t in v if isinstance(t, int)]
        elif isinstance(v, list) and n0 and n0 > LAYERS and len(v) == n0:
            out[k] = _per_layer(v)  # layer_types, per-layer limits, ...
        elif (isinstance(v, list) and v and n0 and all(isinstance(x, int) and not isinstance(x, bool) for x in v)
              and (low.endswith(("indices", "_layers", "layer_ids")) and max(v) < n0)):
            out[k] = [i for i in v if i < LAYERS] or [LAYERS - 1]  # which layers are attention, dense, ...
        elif isinstance(v, dict) and v and n0 and all(str(x).isdigit() for x in v):
            out[k] = {x: y for x, y in v.items() if int(x) < LAYERS}  # per-layer settings keyed by layer index
        elif isinstance(v, str) and k == "hybrid_override_pattern":
            out[k] = (("".join(dict.fromkeys(v))) + v)[:LAYERS]
        elif isinstance(v, dict) and depth < 2 and ("model_type" in v or k.endswith("_config")):
            out[k] = _shrink(v, v.get("model_type", model_type), depth + 1)
    heads = next((k for k in _SIZES[2][1] if isinstance(d.get(k), int)), None)
    for k in _SIZES[3][1]:  # multi-head attention (K/V heads = heads, as in MLA) stays so
        if heads and isinstance(d.get(k), int) and d[k] == d[heads]:
            out[k] = HEADS
    if isinstance(out.get("qk_head_dim"), int) and isinstance(out.get("qk_nope_head_dim"), int):
        out["qk_head_dim"] = out["qk_nope_head_dim"] + out.get("qk_rope_head_dim", 0)
    if isinstance(out.get("rotary_dim"), int):
        out["rotary_dim"] = HEAD_DIM // 2  # partial rotary, as the defaults of the families that have it
    if isinstance(out.get("qk_rope_head_dim"), int) and "head_dim" in out:
        out["head_dim"] = out["qk_rope_head_dim"]  # multi-head latent attention: rotary width
    if out.get("sliding_window") and isinstance(out["sliding_window"], int):
        out["sliding_window"] = min(out["sliding_window"], 64)
    for k, v in _FAMILY.get(model_type, {}).items():
        out[k] = v
    return out


def tiny_config(model_type: str):
    from transformers import CONFIG_MAPPING

    cls = CONFIG_MAPPING[model_type]
    d = cls().to_dict()
    d = _shrink(d, model_type)
    d.pop("transformers_version", None)
    d.pop("model_type", None)
    cfg = cls(**{k: v for k, v in d.items() if k not in ("architectures",)})
    cfg._attn_implementation = None
    return cfg


def _first_line(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}".strip()
    return text.splitlines()[0][:300] if text else type(e).__name__


def _logits(model, **kw):
    out = model(**kw)
    return out.logits if hasattr(out, "logits") else out[0]


def _inputs(vocab: int):
    import torch

    g = torch.Generator().manual_seed(1)
    return torch.randint(3, vocab, (2, 9), generator=g)


def _generate(model, ids, mask, pad: int, **kw):
    import torch

    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
                              pad_token_id=pad, **kw)


def _try(fn):
    """(result, None) or (None, error line)."""
    try:
        return fn(), None
    except Exception as e:  # every failure is a finding
        return None, _first_line(e)


def _forced_table(path: str, problems) -> int:
    """A table giving each recorded problem the first non-vendor CPU implementation that takes it (as
    tests/test_conformance.py's forced table)."""
    import itertools

    import kernel_space
    from ops_adv import _table

    winners, seen = [], set()
    for op, p in problems:
        key = (op, json.dumps(p._asdict(), sort_keys=True, default=str))
        if key in seen:
            continue
        seen.add(key)
        for impl in (i for i in kernel_space.impls(op) if not i.vendor and not i.unavailable and "cpu" in i.backends):
            cfg = next((c for c in itertools.islice(impl.configs(), 2000) if impl.why_not(p, c, "cpu") is None), None)
            if cfg is not None:
                winners.append({"op": op, "problem": p._asdict(), "impl": impl.name, "params": cfg,
                                "kernel_version": impl.version, "median_ms": 1.0, "vendor_impl": "x", "vendor_ms": 2.0,
                                "speedup": 2.0})
                break
    with open(path, "w") as f:
        json.dump({"format": _table.FORMAT, "format_version": _table.FORMAT_VERSION, "device_class": "cpu",
                   "fingerprint": {}, "winners": winners, "checksum": _table.checksum(winners)}, f)
    return len(winners)


def check_family(model_type: str, table: str, backend: str, workdir: str) -> dict[str, Any]:
    """Every check for one family; never raises."""
    import torch
    import transformers

    import ops_adv

    torch.manual_seed(0)
    res: dict[str, Any] = {"family": model_type, "status": "ok", "failures": []}

    def fail(check: str, line: str) -> None:
        res["status"] = "fail"
        res["failures"].append(f"{check}: {line}")

    # ---- build tiny, and the original must run
    arch = transformers.models.auto.modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]
    res["class"] = arch
    cfg, err = _try(lambda: tiny_config(model_type))
    if err:
        return {**res, "status": "skip", "why": f"config: {err}"}
    model, err = _try(lambda: transformers.AutoModelForCausalLM.from_config(cfg))
    if err:
        return {**res, "status": "skip", "why": f"build: {err}"}
    model.eval()
    res["params"] = sum(p.numel() for p in model.parameters())
    if res["params"] > 20_000_000:
        return {**res, "status": "skip", "why": f"not tiny: {res['params'] / 1e6:.0f}M parameters at the small sizes"}
    vocab = model.get_output_embeddings().weight.shape[0] if model.get_output_embeddings() is not None else VOCAB
    ids = _inputs(min(vocab, VOCAB))
    with torch.no_grad():
        ref_logits, err = _try(lambda: _logits(model, input_ids=ids))
    if err:
        return {**res, "status": "skip", "why": f"the original's forward: {err}"}

    # ---- convert
    conv, err = _try(lambda: ops_adv.convert_model(copy.deepcopy(model)))
    if err:
        fail("convert", err)
        return res
    report = ops_adv.explain_model(conv)
    res["converted"] = sum(r["converted"] == "yes" for r in report)
    res["not_converted"] = sum(r["converted"] != "yes" for r in report)
    res["refusals"] = sorted({f"{r['type']}: {r['why']}"[:160] for r in report if r["converted"] != "yes"})[:8]

    if table == "forced":
        with ops_adv.record() as rec:
            _try(lambda: _logits(conv, input_ids=ids))
            conv.train()
            _try(lambda: _logits(conv, input_ids=ids).float().square().mean().backward())
            conv.eval()
            conv.zero_grad(set_to_none=True)
        path = os.path.join(workdir, f"forced-{model_type}.json")
        res["forced_winners"] = _forced_table(path, rec.problems())
        os.environ["OPS_ADV_NEAREST"] = "1000000"
        ops_adv.load_table(path)

    # ---- eval logits
    with torch.no_grad():
        got, err = _try(lambda: _logits(conv, input_ids=ids))
    if err:
        fail("eval", err)
    else:
        diff = (got.float() - ref_logits.float()).abs().max().item()
        res["eval_max_diff"] = diff
        if not diff <= EVAL_TOL * max(1.0, ref_logits.abs().max().item()):
            fail("eval", f"logits max |diff| {diff:.3g}")

    # ---- one train step: loss and gradients
    def step(m):
        m.train()
        m.zero_grad(set_to_none=True)
        torch.manual_seed(0)
        out = m(input_ids=ids, labels=ids)
        loss = out.loss if getattr(out, "loss", None) is not None else _logits(m, input_ids=ids).float().square().mean()
        loss.backward()
        m.eval()
        return loss.item(), {n: p.grad.detach().clone() for n, p in m.named_parameters() if p.grad is not None}

    ref_step, err = _try(lambda: step(model))
    if err:
        res["train"] = f"n/a (original: {err})"
    else:
        got_step, err = _try(lambda: step(conv))
        if err:
            fail("train", err)
        else:
            (l1, g1), (l2, g2) = ref_step, got_step
            missing = sorted(set(g1) - set(g2))
            # relative to each gradient's norm, floored at 1e-3 of the largest: a gradient that is zero in exact
            # arithmetic (a key bias under softmax) is rounding noise in both models, not a size to divide by
            floor = 1e-3 * max((g.norm().item() for g in g1.values()), default=0.0)
            errs = [((g2[n] - g1[n]).norm().item() / max(g1[n].norm().item(), floor, 1e-30)) for n in g1 if n in g2]
            res["loss_diff"] = abs(l1 - l2)
            res["grad_max_rel_err"] = max(errs) if errs else 0.0
            if missing:
                fail("train", f"{len(missing)} parameter(s) get no gradient, e.g. {missing[0]}")
            if not res["grad_max_rel_err"] <= GRAD_TOL or not abs(l1 - l2) <= 1e-4 * max(1.0, abs(l1)):
                fail("train", f"gradient max rel error {res['grad_max_rel_err']:.3g}, loss diff {abs(l1 - l2):.3g}")
    model.zero_grad(set_to_none=True)
    conv.zero_grad(set_to_none=True)

    # ---- generate: default cache, static cache, left padding
    pad = cfg.pad_token_id if isinstance(getattr(cfg, "pad_token_id", None), int) else 0
    mask = torch.ones_like(ids)
    left_ids, left_mask = ids.clone(), mask.clone()
    left_mask[0, :3] = 0
    left_ids[0, :3] = pad
    cases = {"generate": (ids, mask, {}), "static": (ids, mask, {"cache_implementation": "static"}),
             "left_pad": (left_ids, left_mask, {})}
    res["generate"] = {}
    for name, (i, m, kw) in cases.items():
        want, err = _try(lambda: _generate(model, i, m, pad, **kw))
        if err:
            res["generate"][name] = f"n/a (original: {err})"
            continue
        got, err = _try(lambda: _generate(conv, i, m, pad, **kw))
        if err:
            res["generate"][name] = "error"
            fail(name, err)
        elif got.shape != want.shape or not torch.equal(got, want):
            first = next((j for j in range(min(got.shape[1], want.shape[1])) if not torch.equal(got[:, j], want[:, j])), None)
            res["generate"][name] = "differs"
            fail(name, f"greedy tokens differ from the original's (first at position {first} of {want.shape[1]})")
        else:
            res["generate"][name] = "equal"

    # ---- torch.compile, eval logits
    def compiled(m):
        torch._dynamo.reset()
        graphs = []

        def counting(gm, example_inputs):
            graphs.append(gm)
            if backend == "eager":
                return gm.forward
            from torch._dynamo.backends.registry import lookup_backend

            return lookup_backend(backend)(gm, example_inputs)

        cm = torch.compile(m, backend=counting)
        with torch.no_grad():
            out = _logits(cm, input_ids=ids)
        torch._dynamo.reset()
        return out, len(graphs)

    got, err = _try(lambda: compiled(conv))
    ok = err is None and (got[0].float() - ref_logits.float()).abs().max().item() <= EVAL_TOL * max(1.0, ref_logits.abs().max().item())
    if got is not None:
        res["compile_max_diff"] = (got[0].float() - ref_logits.float()).abs().max().item()
        res["compile_graphs"] = got[1]
    orig = oerr = None
    if not ok or (got is not None and got[1] > 1):  # a failure, or graph breaks: does the original have them too?
        orig, oerr = _try(lambda: compiled(model))
    if ok and orig is not None and got[1] > orig[1]:
        fail("compile", f"{got[1]} graphs against the original's {orig[1]} (graph breaks the conversion added)")
    if orig is not None:
        res["compile_graphs_original"] = orig[1]
    if not ok:
        if oerr is not None:
            res["compile"] = f"n/a (original: {oerr})"
        elif err is not None:
            fail("compile", err)
        else:
            fail("compile", f"compiled logits max |diff| {res['compile_max_diff']:.3g} (the original compiled: "
                            f"{(orig[0].float() - ref_logits.float()).abs().max().item():.3g})")
    if table == "forced":
        ops_adv.load_table("")
    return res


# --------------------------------------------------------------------------- the sweep: one subprocess per family


def _child(model_type: str, table: str, backend: str, workdir: str, conn) -> None:
    try:
        import torch

        torch.set_num_threads(1)
        res = check_family(model_type, table, backend, workdir)
    except BaseException as e:  # the checks catch their own; this is the harness failing
        res = {"family": model_type, "status": "fail", "failures": [f"harness: {_first_line(e)}"],
               "traceback": traceback.format_exc()[-2000:]}
    conn.send(res)
    conn.close()


def _run(items: list[tuple[str, str]], *, jobs: int, timeout: float, backend: str, workdir: str, log) -> list[dict]:
    """One subprocess per (family, table), at most `jobs` at once, each killed after `timeout` seconds."""
    import multiprocessing as mp

    ctx = mp.get_context("fork")  # torch, transformers and ops_adv are imported once, in the parent
    pending, running, done = list(items), {}, {}
    while pending or running:
        while pending and len(running) < jobs:
            fam, table = item = pending.pop(0)
            recv, send = ctx.Pipe(duplex=False)
            p = ctx.Process(target=_child, args=(fam, table, backend, workdir, send), daemon=True)
            p.start()
            send.close()
            running[item] = (p, recv, time.monotonic())
        for item, (p, recv, t0) in list(running.items()):
            fam, table = item
            res = None
            if recv.poll(0.05):
                try:
                    res = recv.recv()
                except EOFError:
                    res = None
                p.join(10)
                if res is None:
                    res = {"family": fam, "status": "fail", "failures": [f"crashed: exit status {p.exitcode}"]}
            elif not p.is_alive():
                res = {"family": fam, "status": "fail", "failures": [f"crashed: exit status {p.exitcode}"]}
            elif time.monotonic() - t0 > timeout:
                p.kill()
                p.join()
                res = {"family": fam, "status": "fail", "failures": [f"timeout: no result within {timeout:.0f} s"]}
            if res is not None:
                if p.is_alive():
                    p.kill()
                    p.join()
                res["seconds"] = round(time.monotonic() - t0, 1)
                res["table"] = table
                done[item] = res
                del running[item]
                log(f"[{len(done)}/{len(items)}] {fam} (table {table}): {res['status']}"
                    + (f" ({res.get('why') or '; '.join(res['failures'])})"[:300] if res["status"] != "ok" else ""))
    return [done[i] for i in items]


def _fmt(v: Any) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        return "0" if v == 0 else (f"{v:.1e}" if abs(v) < 1e-2 or abs(v) >= 1e4 else f"{v:.3g}")
    return str(v)


def _cell(r: dict, check: str) -> str:
    bad = [f for f in r.get("failures", []) if f.startswith(check + ":")]
    if check in ("generate", "static", "left_pad"):
        v = r.get("generate", {}).get(check, "")
        return "**" + v + "**" if bad else ("n/a" if v.startswith("n/a") else v)
    if check == "eval":
        return ("**" if bad else "") + (_fmt(r.get("eval_max_diff")) or ("error" if bad else "")) + ("**" if bad else "")
    if check == "train":
        if r.get("train", "").startswith("n/a"):
            return "n/a"
        v = _fmt(r.get("grad_max_rel_err")) or ("error" if bad else "")
        return f"**{v}**" if bad else v
    if check == "compile":
        if r.get("compile", "").startswith("n/a"):
            return "n/a"
        if bad:
            return "**fail**"
        g, o = r.get("compile_graphs"), r.get("compile_graphs_original")
        return (f"ok ({g} graph{'s' if g != 1 else ''}" + (f", original {o}" if o is not None else "") + ")") if g is not None else ""
    return ""


_TABLES = {"none": "no table (every op runs its vendor fallback through ops_adv)",
           "forced": "a forced table (each problem the converted model meets gets a non-vendor CPU winner: ops_adv's own "
                     "kernels run)"}


def markdown(all_rows: list[dict], meta: dict) -> str:
    tables = list(dict.fromkeys(r["table"] for r in all_rows))
    fams = list(dict.fromkeys(r["family"] for r in all_rows))
    skipped = {r["family"]: r for r in all_rows if r["status"] == "skip"}
    out = [f"# Conformance sweep: converted causal LMs against the originals ({meta['date']})", "",
           f"transformers {meta['transformers']}, torch {meta['torch']}, ops-adv at {meta['commit']}; CPU, 1 thread, "
           f"fp32; compile backend: {meta['compile_backend']}; {len(fams)} families in "
           f"`MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`, {len(skipped)} of which cannot be built or run tiny (listed at the end). "
           + " ".join(f"With {_TABLES[t]}: {sum(r['status'] == 'ok' for r in all_rows if r['table'] == t)} pass every "
                      f"check, {sum(r['status'] == 'fail' for r in all_rows if r['table'] == t)} fail one or more."
                      for t in tables), "",
           f"Command: `{meta['command']}` ({meta['wall_s']:.0f} s)", "",
           f"Sizes: hidden {HIDDEN}, {LAYERS} layers, {HEADS} heads ({KV_HEADS} K/V), head dim {HEAD_DIM}, FFN {FFN}, "
           f"vocab {VOCAB}, dropout 0. eval: max |diff| of the logits (batch 2 x 9; fails above {EVAL_TOL:g} x "
           f"max(1, max |logit|)); train: max relative gradient error of one step (fails above {GRAD_TOL:g}); generate: "
           f"{NEW} greedy tokens equal to the original's (default cache, static cache, left padding over 2 rows); "
           "compile: torch.compile of the converted model, eval logits against the original, graphs Dynamo made (a "
           "failure when more than the original's); n/a: the original "
           "itself cannot run that check. **Bold**: a failure."]
    for t in tables:
        rows = [r for r in all_rows if r["table"] == t and r["status"] != "skip"]
        failed = [r for r in rows if r["status"] == "fail"]
        out += ["", f"## With {_TABLES[t]}", "",
                "| family | converted / not | eval max diff | train grad rel err | generate | static cache | left pad | compile | s |",
                "|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            conv = f"{r.get('converted', '')} / {r.get('not_converted', '')}" if "converted" in r else "**error**"
            out.append(f"| {r['family']} | {conv} | {_cell(r, 'eval')} | {_cell(r, 'train')} | {_cell(r, 'generate')} | "
                       f"{_cell(r, 'static')} | {_cell(r, 'left_pad')} | {_cell(r, 'compile')} | {r.get('seconds', '')} |")
        out += ["", f"Failures with {t} table:" if failed else f"No failures with {t} table.", ""]
        for r in failed:
            out.append(f"- **{r['family']}** (`{r.get('class', '')}`): " + "; ".join(f"`{f}`" for f in r["failures"]))
    if skipped:
        out += ["", "## Not built or not run tiny", ""]
        for r in skipped.values():
            out.append(f"- {r['family']}: {r.get('why', '')[:240]}")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per family")
    ap.add_argument("--families", default="", help="comma-separated model types (default: every causal-LM family)")
    ap.add_argument("--table", default="none", help="none, forced, or both as none,forced")
    ap.add_argument("--compile-backend", default="aot_eager", choices=("aot_eager", "inductor", "eager"))
    a = ap.parse_args(argv)
    import subprocess

    import torch
    import transformers

    import ops_adv  # noqa: F401  (imported before the children fork)
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    families = [f.strip() for f in a.families.split(",") if f.strip()] or list(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    unknown = [f for f in families if f not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES]
    if unknown:
        print(f"not causal-LM families of transformers {transformers.__version__}: {', '.join(unknown)}", file=sys.stderr)
        return 2
    tables = [t.strip() for t in a.table.split(",") if t.strip()]
    if not tables or any(t not in _TABLES for t in tables):
        print(f"--table takes none, forced or none,forced, not {a.table!r}", file=sys.stderr)
        return 2
    os.makedirs(a.out, exist_ok=True)
    ops_adv.load_table("")
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory() as work:  # the forced tables
        rows = _run([(f, t) for f in families for t in tables], jobs=a.jobs, timeout=a.timeout, backend=a.compile_backend,
                    workdir=work, log=lambda s: print(s, flush=True))
    root = os.path.dirname(_here)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=root).stdout.strip()
    if subprocess.run(["git", "status", "--porcelain", "--", "ops_adv"], capture_output=True, text=True, cwd=root).stdout.strip():
        commit += " (with uncommitted changes under ops_adv/)"
    meta = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "transformers": transformers.__version__,
            "torch": torch.__version__, "commit": commit, "tables": tables, "compile_backend": a.compile_backend,
            "command": "python benchmarks/conformance_sweep.py " + " ".join(argv if argv is not None else sys.argv[1:]),
            "wall_s": round(time.monotonic() - t0, 1)}
    with open(os.path.join(a.out, "conformance.json"), "w") as f:
        json.dump({"meta": meta, "families": rows}, f, indent=1, default=str)
    with open(os.path.join(a.out, "conformance.md"), "w") as f:
        f.write(markdown(rows, meta))
    fails = [r for r in rows if r["status"] == "fail"]
    print(f"{len(families)} families x {len(tables)} table(s): {sum(r['status'] == 'ok' for r in rows)} ok, {len(fails)} failed, "
          f"{sum(r['status'] == 'skip' for r in rows)} skipped; {a.out}/conformance.md")
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
