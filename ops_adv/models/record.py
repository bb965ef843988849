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


def tune_for_hardware(model: Any, device: str = "cuda:0", batch_size: int = 1, example_inputs: Any = None, *,
                      seq_len: int = 128, training: bool = False, trials: int = 16, db: str | None = None,
                      timeout_s: float | None = None, shapes_path: str | None = None, **tune_options: Any) -> dict:
    """Record the problems a forward (and, with `training`, a backward) of `model` hits on `device`,
    tune them with opsadv-tune's tuner into `db`, and load the winners.

    `example_inputs`: a tuple of positional inputs or a dict of keyword inputs; without it, a
    model with a `config.vocab_size` (a language model) gets random token ids of
    (batch_size, seq_len). Returns {"problems": n, "winners": [...], "db": url}.
    """
    import torch

    from tuner.cli import _db_default  # the tuning stack, only now
    from tuner.driver import TuneOptions, Tuner

    if example_inputs is None:
        args, kwargs = _example_inputs(model, batch_size, seq_len, device)
    elif isinstance(example_inputs, dict):
        args, kwargs = (), example_inputs
    else:
        args, kwargs = tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else (example_inputs,), {}
    with record(shapes_path) as rec:
        if training:
            out = model(*args, **kwargs)
            loss = _scalar(out)
            loss.backward()
        else:
            with torch.no_grad():
                model(*args, **kwargs)
    problems = rec.problems()
    url = db or _db_default()
    if not problems:
        return {"problems": 0, "winners": [], "db": url}
    opts = TuneOptions(device=_device_class(device), problems=problems, db_url=url, trials=trials, timeout_s=timeout_s,
                       command="model.tune_for_hardware", **tune_options)
    rows = Tuner(opts).run()
    _dispatch.load_table(url)
    return {"problems": len(problems), "winners": rows, "db": url}


def _scalar(out: Any) -> Any:
    """A loss to run backward from: the model's own loss, else the sum of its first floating output."""
    loss = getattr(out, "loss", None)
    if loss is not None:
        return loss
    for t in (getattr(out, "logits", None), out[0] if isinstance(out, (tuple, list)) else out):
        if t is not None and hasattr(t, "is_floating_point") and t.is_floating_point():
            return t.float().sum()
    raise OpsAdvError("tune_for_hardware(training=True) found no floating-point output to run backward from")
