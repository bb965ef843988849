"""conv2d: `problem` (signature, inputs, reference), and one module per backend:
`vendor` (F.conv2d in each memory format), `triton` (implicit GEMM) over `_kernels`."""
from .problem import SPEC, Conv2dProblem, make_inputs, out_hw, reference, signature
from . import triton, vendor  # noqa: F401  (register the implementations)

__all__ = ["Conv2dProblem", "SPEC", "make_inputs", "out_hw", "reference", "signature"]
