"""swiglu: silu(gate) * up, from two tensors or one merged [..., 2I] gate_up tensor. `problem` (signature,
inputs, reference), and one module per backend: `vendor` (torch composite), `liger` (Liger-Kernel), `triton` over `_kernels`."""
from .problem import SPEC, SwigluProblem, make_inputs, reference, signature
from . import triton, vendor, liger  # noqa: F401  (register the implementations)

__all__ = ["SPEC", "SwigluProblem", "make_inputs", "reference", "signature"]
