"""conv2d_bn_relu: inference Conv2d + BatchNorm2d (+ ReLU) as one op on the folded weight and bias.
`problem` (signature, inputs, reference), `vendor` (cuDNN conv then in-place ReLU, per memory
format), `triton` (conv2d's implicit GEMM with a bias + ReLU epilogue) over `_kernels`."""
from .problem import SPEC, ConvBnReluProblem, make_inputs, reference, signature
from . import triton, vendor  # noqa: F401  (register the implementations)

__all__ = ["ConvBnReluProblem", "SPEC", "make_inputs", "reference", "signature"]
