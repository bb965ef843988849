"""add_rms_norm: `problem` (signature, inputs, reference), and one module per backend:
`vendor` (torch composite), `liger` (Liger-Kernel), `triton` (row-wise space, wrapper) over `_kernels`."""
from .problem import SPEC, AddRmsNormProblem, make_inputs, reference, signature
from . import triton, vendor, liger  # noqa: F401  (register the implementations)

__all__ = ["AddRmsNormProblem", "SPEC", "make_inputs", "reference", "signature"]
