"""softmax: `problem` (signature, inputs, reference), and one module per backend:
`vendor` (torch), `triton` (row-wise space, wrapper) over `_kernels`."""
from .problem import SPEC, SoftmaxProblem, make_inputs, reference, signature
from . import triton, vendor  # noqa: F401  (register the implementations)

__all__ = ["SPEC", "SoftmaxProblem", "make_inputs", "reference", "signature"]
