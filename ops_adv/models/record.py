"""Recording the problems a real run hits, and tuning a model for the machine it runs on."""
from __future__ import annotations

import contextlib
import json
from typing import Any, Iterator

from kernel_space import OpsAdvError, get_op

from .. import _dispatch


class Recording:
    """The problems seen inside a `record()` block, per op (also written as a shapes file)."""

    def __init__(self, seen: dict) -> None:
        self._seen = seen

    def problems(self) -> list[tuple[str, Any]]:
        return [(op, get_op(op).problem._make(p)) for op, p in self._seen]

    def shapes(self) -> dict[str, list[dict]]:
        out: dict[str, list[dict]] = {}
        for op, p in self.problems():
            out.setdefault(op, []).append(p._asdict())
        return out

    def write(self, path: str) -> int:
        shapes = self.shapes()
        with open(path, "w") as f:
            json.dump(shapes, f, indent=1)
        return sum(len(v) for v in shapes.values())


@contextlib.contextmanager
def record(path: str | None = None) -> Iterator[Recording]:
    """Collect the problems every ops-adv op meets inside the block; write them to `path` as a
    shapes file for `opsadv-tune --shapes` when given."""
    seen = _dispatch.start_recording()
    rec = Recording(seen)
    try:
        yield rec
    finally:
        _dispatch.stop_recording(seen)
        if path:
            rec.write(path)


def _device_class(device: str) -> str:
    import torch

    from kernel_space._device import device_class_of

    d = torch.device(device)
    return "cpu" if d.type == "cpu" else device_class_of(torch.cuda.get_device_name(d))


def left_padding(batch_size: int, seq_len: int, device: Any = None) -> Any:
    """A (batch, seq_len) attention mask with left padding: row i has 1 + (15 + 37 i) % (seq_len / 2 - 1) pad
    tokens (16, 53, 90, ... of 512), so rows differ and none is empty."""
    import torch

    mask = torch.ones(batch_size, seq_len, dtype=torch.long, device=device)
    for i in range(batch_size):
        mask[i, :1 + (15 + 37 * i) % max(1, seq_len // 2 - 1)] = 0
    return mask


def _sizes(v: Any, what: str) -> list[int]:
    vals = [v] if isinstance(v, int) else list(v)
    if not vals or any(isinstance(x, bool) or not isinstance(x, int) or x < 1 for x in vals):
        raise OpsAdvError(f"{what} must be a positive integer or a list of them, not {v!r}")
    return vals


PADDINGS = ("none", "left")


def generate_workload(model: Any, *, batch_sizes: Any = 1, prompt_lens: Any = 128, max_new_tokens: int = 128,
                      padding: Any = PADDINGS, device: Any = None, generate_kwargs: dict | None = None,
                      seed: int = 0) -> list[dict]:
    """Run `model.generate()` eagerly as a user would, once per batch size x prompt length x padding: greedy,
    exactly `max_new_tokens` new tokens (so the same caches, static cache lengths included, as the user's
    calls), with the user's `generate_kwargs` (`cache_implementation="static"`, ...). Returns what ran.

    `padding`: "none" (an all-ones mask) and/or "left" (left padding, a different length per row): a padded
    batch's decode steps are their own problems (decode_attention's key mask). transformers' own compile
    is turned off (ops only reach dispatch eagerly); the problems are the ones the compiled run has.
    """
    import torch

    if not callable(getattr(model, "generate", None)):
        raise OpsAdvError(f"a {type(model).__name__} has no generate(); record a forward instead "
                          "(tune_for_hardware without max_new_tokens)")
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    if not vocab:
        raise OpsAdvError(f"{type(model).__name__}.config has no vocab_size to draw prompt tokens from")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise OpsAdvError(f"max_new_tokens must be a positive integer, not {max_new_tokens!r}")
    pads = [padding] if isinstance(padding, str) else list(padding)
    bad = [p for p in pads if p not in PADDINGS]
    if bad or not pads:
        raise OpsAdvError(f"padding must be one or more of {', '.join(PADDINGS)}, not {padding!r}")
    if device is None:
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
    gc = getattr(model, "generation_config", None)
    pad_id = getattr(gc, "pad_token_id", None)
    pad_id = 0 if pad_id is None else pad_id
    kw = dict(generate_kwargs or {})
    kw.update(max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False, disable_compile=True)
    kw.setdefault("pad_token_id", pad_id)
    g = torch.Generator().manual_seed(seed)
    ran = []
    # generate() sizes a static cache to the largest of this call's and every earlier call's length (to spare
    # compile a recompile): each call here starts fresh, so every (batch, prompt) pair meets its own cache
    # length, and the model's own memory of it is put back after.
    had = "_previous_max_cache_length" in model.__dict__
    kept = model.__dict__.get("_previous_max_cache_length")
    try:
        for B in _sizes(batch_sizes, "batch_size"):
            for S in sorted(_sizes(prompt_lens, "seq_len")):
                ids = torch.randint(1, vocab, (B, S), generator=g).to(device)
                for pad in pads:
                    mask = left_padding(B, S, device) if pad == "left" else torch.ones(B, S, dtype=torch.long, device=device)
                    model.__dict__.pop("_previous_max_cache_length", None)
                    with torch.no_grad():
                        model.generate(ids.masked_fill(mask == 0, pad_id), attention_mask=mask, **kw)
                    ran.append({"batch_size": B, "prompt_len": S, "max_new_tokens": max_new_tokens, "padding": pad})
    finally:
        model.__dict__.pop("_previous_max_cache_length", None)
        if had:
            model.__dict__["_previous_max_cache_length"] = kept
    return ran


def record_generate(model: Any, path: str | None = None, **workload: Any) -> Recording:
    """The problems `generate_workload(model, **workload)` meets (prefill and every decode step), written to
    `path` as a shapes file for `opsadv-tune --shapes` when given."""
    with record(path) as rec:
        generate_workload(model, **workload)
    return rec


def _example_inputs(model: Any, batch_size: int, seq_len: int, device: Any) -> tuple[tuple, dict]:
    import torch

    config = getattr(model, "config", None)
    vocab = getattr(config, "vocab_size", None)
    if vocab:
        ids = torch.randint(0, vocab, (batch_size, seq_len), device=device)
        return (), {"input_ids": ids}
    raise OpsAdvError(
        f"tune_for_hardware cannot make inputs for a {type(model).__name__}; pass example_inputs=(tensor, ...)"
    )


def tune_for_hardware(model: Any, device: str = "cuda:0", batch_size: Any = 1, example_inputs: Any = None, *,
                      seq_len: Any = 128, max_new_tokens: int | None = None, padding: Any = PADDINGS,
                      generate_kwargs: dict | None = None, training: bool = False, trials: int = 16,
                      db: str | None = None, timeout_s: float | None = None, shapes_path: str | None = None,
                      verify: bool = True, **tune_options: Any) -> dict:
    """Record the problems `model` meets on `device`, tune them with opsadv-tune's tuner into `db`, and load
    the winners.

    - With `max_new_tokens`: what `model.generate()` runs, for each of `batch_size` x `seq_len` (prompt
      lengths; each an int or a list) x `padding`, the prefill and every decode step with the caches
      generate makes (pass `generate_kwargs={"cache_implementation": "static"}` and the like as you call it).
    - Else one forward (and, with `training`, a backward) of `example_inputs` (a tuple of positional or a
      dict of keyword inputs), or for a language model of random token ids (batch_size, seq_len).

    With `verify` the workload runs again after the winners load, under `ops_adv.census()`. Returns
    {"problems": n, "winners": [...], "db": url, "census_before": {source: calls}, "census_after": ...}.
    """
    import torch

    from tuner.cli import _db_default  # the tuning stack, only now
    from tuner.driver import TuneOptions, Tuner

    def workload() -> None:
        if max_new_tokens is not None:
            if example_inputs is not None:
                raise OpsAdvError("tune_for_hardware: give max_new_tokens (a generate workload) or example_inputs, not both")
            generate_workload(model, batch_sizes=batch_size, prompt_lens=seq_len, max_new_tokens=max_new_tokens,
                              padding=padding, device=device, generate_kwargs=generate_kwargs)
            return
        for args, kwargs in _forward_inputs(model, batch_size, seq_len, example_inputs, device):
            if training:
                loss = _scalar(model(*args, **kwargs))
                loss.backward()
            else:
                with torch.no_grad():
                    model(*args, **kwargs)

    with record(shapes_path) as rec, _dispatch.Census() as before:
        workload()
    problems = rec.problems()
    url = db or _db_default()
    out: dict[str, Any] = {"problems": len(problems), "winners": [], "db": url, "census_before": before.by_source()}
    if not problems:
        return out
    opts = TuneOptions(device=_device_class(device), problems=problems, db_url=url, trials=trials, timeout_s=timeout_s,
                       command="model.tune_for_hardware", **tune_options)
    out["winners"] = Tuner(opts).run()
    _dispatch.load_table(url)
    if verify:
        with _dispatch.Census() as after:
            workload()
        out["census_after"] = after.by_source()
        out["census"] = str(after)
    return out


def _forward_inputs(model: Any, batch_size: Any, seq_len: Any, example_inputs: Any, device: Any):
    if example_inputs is None:
        return [_example_inputs(model, B, S, device) for B in _sizes(batch_size, "batch_size")
                for S in _sizes(seq_len, "seq_len")]
    if isinstance(example_inputs, dict):
        return [((), example_inputs)]
    return [(tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else (example_inputs,), {})]


def _scalar(out: Any) -> Any:
    """A loss to run backward from: the model's own loss, else the sum of its first floating output."""
    loss = getattr(out, "loss", None)
    if loss is not None:
        return loss
    for t in (getattr(out, "logits", None), out[0] if isinstance(out, (tuple, list)) else out):
        if t is not None and hasattr(t, "is_floating_point") and t.is_floating_point():
            return t.float().sum()
    raise OpsAdvError("tune_for_hardware(training=True) found no floating-point output to run backward from")
