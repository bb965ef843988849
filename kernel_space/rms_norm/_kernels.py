"""rms_norm's Triton kernels: layer_norm's kernels with RMS=True (no mean, no bias), and their launch."""
from ..layer_norm._kernels import launch, norm_looped, norm_single  # noqa: F401
