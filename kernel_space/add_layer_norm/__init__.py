"""add_layer_norm: `problem` (signature, inputs, reference), and one module per backend:
`vendor` (torch composite), `triton` (row-wise space, wrapper) over `_kernels`."""
from .problem import SPEC, AddLayerNormProblem, make_inputs, reference, signature
from . import triton, vendor  # noqa: F401  (register the implementations)

__all__ = ["AddLayerNormProblem", "SPEC", "make_inputs", "reference", "signature"]
