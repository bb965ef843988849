"""gemm: C = A @ B. `problem` (signature, inputs, reference), and one module per backend:
`vendor` (torch.matmul), `cpu` (blocked), `triton` (spaces, checks, wrappers of the tiled,
split-K decode and persistent TMA kernels) over `_kernels`."""
from .problem import GemmProblem, SPEC, make_inputs, reference, signature
from . import cpu, triton, vendor  # noqa: F401  (register the implementations)

__all__ = ["GemmProblem", "SPEC", "make_inputs", "reference", "signature"]
