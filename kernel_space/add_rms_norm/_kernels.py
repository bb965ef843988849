"""add_rms_norm's Triton kernels: add_layer_norm's kernels with RMS=True (no mean, no bias), and their launch."""
from ..add_layer_norm._kernels import add_norm_looped, add_norm_single, launch  # noqa: F401
