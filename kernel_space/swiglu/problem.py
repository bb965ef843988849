"""swiglu(gate, up) = act(gate) * up over rows x I, act SiLU (SwiGLU) or GeLU-tanh (`activation="gelu_tanh"`,
GeGLU: Gemma's MLP). With `merged`, one [..., 2I] tensor holds gate in its first half and up in its second
(what a merged gate_up projection produces; vLLM's SiluAndMul). The problem, its inputs and reference."""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from .. import _rowwise
from .._common import DTYPE_CODE, ITEMSIZE, generator, randn
from .._registry import define_op

# The gate's activation: "silu" (every winner tuned before this field existed) or F.gelu(approximate="tanh").
ACTIVATIONS = ("silu", "gelu_tanh")


class _SwigluProblem(NamedTuple):
    rows: int
    cols: int  # I, the width of the output
    merged: bool = False
    dtype: str = "fp32"
    activation: str = "silu"  # last, defaulted: problems and tables written before it read as SiLU


class SwigluProblem(_rowwise.DefaultsLeftOut, _SwigluProblem):
    """Its dict form leaves `activation` out at its default: every problem known before the field keeps its key."""
    __slots__ = ()
    _left_out = ("activation",)


def signature(gate: torch.Tensor, up: torch.Tensor | None = None, activation: str = "silu") -> tuple:
    n = gate.shape[-1]
    rows = gate.numel() // n if n else 0
    if up is None:
        return (rows, n // 2, True, DTYPE_CODE[gate.dtype], activation)
    return (rows, n, False, DTYPE_CODE[gate.dtype], activation)


def make_inputs(p: SwigluProblem, device, seed: int = 0):
    g = generator(seed)
    attrs = {} if p.activation == "silu" else {"activation": p.activation}  # SiLU's call is the one it always was
    if p.merged:
        return (randn((p.rows, 2 * p.cols), p.dtype, device, g, 2.0),), attrs
    return (randn((p.rows, p.cols), p.dtype, device, g, 2.0), randn((p.rows, p.cols), p.dtype, device, g)), attrs


def split(gate: torch.Tensor, up: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate, up), halves of a merged tensor when `up` is None."""
    if up is None:
        n = gate.shape[-1] // 2
        return gate[..., :n], gate[..., n:]
    return gate, up


def act(g: torch.Tensor, activation: str) -> torch.Tensor:
    """torch's own gate activation, by name."""
    if activation == "silu":
        return F.silu(g)
    if activation == "gelu_tanh":
        return F.gelu(g, approximate="tanh")
    raise ValueError(f"swiglu activation {activation!r} is not one of {', '.join(ACTIVATIONS)}")


def gelu_tanh_only(p, params) -> str | None:
    """Check of the GeGLU implementations; the others run SiLU gates."""
    return None if p.activation == "gelu_tanh" else f"runs GeLU-tanh gates only (this one is {p.activation})"


# the check of an implementation written before `activation` (see _rowwise.plain_only_for)
plain_only = _rowwise.plain_only_for(lambda p: p.activation != "silu", "computes SiLU gates only: the *geglu implementations run GeLU-tanh")


def reference(gate, up=None, activation: str = "silu") -> torch.Tensor:
    g, u = split(gate, up)
    return act(_rowwise.hi(g), activation) * _rowwise.hi(u)


def bytes_moved(p: SwigluProblem) -> float:
    return float(3 * p.rows * p.cols * ITEMSIZE[p.dtype])


# _rowwise.register's fields, with the activation's choices
SPEC = define_op("swiglu", SwigluProblem, signature, make_inputs, reference, size_fields=("rows", "cols"),
                 streaming=("rows",), flops=lambda p: 5.0 * p.rows * p.cols, bytes_moved=bytes_moved,
                 default_problems=lambda device_class: default_problems(device_class),
                 choices={"activation": ACTIVATIONS})


def default_problems(device_class: str) -> list[SwigluProblem]:
    if device_class == "cpu":
        return [SwigluProblem(256, 1024), SwigluProblem(64, 2816, True)]
    # Llama-3-8B / Mistral-7B (I 14336) and Qwen2-7B (I 18944), prefill and decode rows
    return [SwigluProblem(r, i, m, "bf16") for i in (14336, 18944) for r in (4096, 32) for m in (False, True)]
