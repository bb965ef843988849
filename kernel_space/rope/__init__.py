"""rope: rotary position embedding of q and k in one call. `problem` (signature, inputs, reference), and one
module per backend: `vendor` (the eager torch composite), `liger` (Liger-Kernel), `triton` (space, check, wrapper) over `_kernels`."""
from .problem import SPEC, RopeProblem, make_inputs, reference, signature
from . import triton, vendor, liger  # noqa: F401  (register the implementations)

__all__ = ["RopeProblem", "SPEC", "make_inputs", "reference", "signature"]
