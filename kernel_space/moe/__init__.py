"""moe: a sparse mixture-of-experts block's routed experts. `problem` (signature, inputs, reference, and the
routing: softmax top-k, alignment by expert), and one module per backend: `vendor` (transformers' expert loop,
torch._grouped_mm), `triton` over `_kernels` (grouped gemms)."""
from .problem import SPEC, MoeProblem, make_inputs, reference, signature
from . import triton, vendor  # noqa: F401  (register the implementations)

__all__ = ["SPEC", "MoeProblem", "make_inputs", "reference", "signature"]
