"""linear: y = activation(x @ W.T + b), W as nn.Linear stores it (N, K). `problem` (signature,
inputs, reference), `vendor` (F.linear + activation, torch._addmm_activation), `triton` (gemm's
tiled and split-K decode kernels with the bias and activation fused into their epilogue)."""
from .problem import ACTIVATIONS, SPEC, LinearProblem, activate, make_inputs, reference, signature
from . import triton, vendor  # noqa: F401  (register the implementations)

__all__ = ["ACTIVATIONS", "LinearProblem", "SPEC", "activate", "make_inputs", "reference", "signature"]
