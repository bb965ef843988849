"""attention forward: softmax(Q Kᵀ / √D) V. `problem` (signature, inputs, reference), and one
module per backend: `vendor` (SDPA and its CUDA backends), `cpu` (chunked), `triton` over `_kernels`."""
from .problem import SPEC, AttentionProblem, make_inputs, reference, signature
from . import cpu, triton, vendor  # noqa: F401  (register the implementations)

__all__ = ["AttentionProblem", "SPEC", "make_inputs", "reference", "signature"]
