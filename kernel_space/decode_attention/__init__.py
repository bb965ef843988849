"""decode attention: a few query rows per sequence against a (ragged, grouped-head) K/V cache.

`problem` (signature, inputs, reference), and one module per backend: `vendor` (SDPA and its
CUDA backends), `triton` over `_kernels` (flash-decoding: split K/V, then a log-sum-exp combine).
Its dispatch key is its own, so decode and prefill (`attention`) problems never mix.
"""
from .problem import SPEC, DecodeAttentionProblem, make_inputs, reference, signature
from . import triton, vendor  # noqa: F401  (register the implementations)

__all__ = ["DecodeAttentionProblem", "SPEC", "make_inputs", "reference", "signature"]
