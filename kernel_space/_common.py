"""Helpers shared by the op modules: dtype codes, tolerances, errors, inputs."""
from __future__ import annotations

import torch

DTYPES: dict[str, torch.dtype] = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
DTYPE_CODE: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}
ITEMSIZE = {"fp16": 2, "bf16": 2, "fp32": 4}
# ‖out − ref‖ / ‖ref‖ allowed per dtype; fp32 leaves room for tf32 matrix units.
TOLERANCE = {"fp16": 5e-3, "bf16": 2e-2, "fp32": 2e-3}


def dtype_code(t: torch.Tensor) -> str:
    try:
        return DTYPE_CODE[t.dtype]
    except KeyError:
        raise TypeError(f"dtype {t.dtype} is not supported; use one of {', '.join(DTYPES)}") from None


def tolerance(dtype: str) -> float:
    return TOLERANCE[dtype]


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """‖out − ref‖ / ‖ref‖ in float64; NaN/inf or unwritten poison gives inf."""
    o = out.detach().to(torch.float64)
    r = ref.detach().to(device=o.device, dtype=torch.float64)
    if o.shape != r.shape:
        return float("inf")
    if not torch.isfinite(o).all():
        return float("inf")
    denom = torch.linalg.vector_norm(r).item()
    err = torch.linalg.vector_norm(o - r).item()
    return err / denom if denom > 0 else err


def randn(shape, dtype: str, device, gen: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    x = torch.randn(shape, generator=gen, dtype=torch.float32, device="cpu") * scale
    return x.to(device=device, dtype=DTYPES[dtype])


def generator(seed: int) -> torch.Generator:
    g = torch.Generator(device="cpu")
    g.manual_seed(seed)
    return g


def pow2_at_least(x: int, lo: int = 16) -> int:
    p = lo
    while p < x:
        p *= 2
    return p


_DTYPE_SPELLINGS = {
    "fp16": ("fp16", "float16", "half", "f16"),
    "bf16": ("bf16", "bfloat16"),
    "fp32": ("fp32", "float32", "float", "f32"),
}
_DTYPE_ALIASES = {s: code for code, names in _DTYPE_SPELLINGS.items() for s in names}


def canonical_dtype(name: object) -> str | None:
    """fp16/bf16/fp32 for a spelling such as `float16`, `half`, `BF16`, `torch.bfloat16` (or a torch.dtype); else None."""
    if isinstance(name, torch.dtype):
        return DTYPE_CODE.get(name)
    if not isinstance(name, str):
        return None
    text = name.strip().lower()
    return _DTYPE_ALIASES.get(text[6:] if text.startswith("torch.") else text)


def conv_fp32(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, **kw) -> torch.Tensor:
    """F.conv2d in float64 on the CPU, or in true float32 on a GPU (no TF32), for references.

    cuDNN's TF32 switch is set through its flags() context: with torch's test utilities loaded,
    assigning the global flag raises.
    """
    import torch.nn.functional as F

    if x.device.type == "cpu":
        return F.conv2d(x.double(), weight.double(), None if bias is None else bias.double(), **kw)
    c = torch.backends.cudnn
    with c.flags(enabled=c.enabled, benchmark=c.benchmark, deterministic=c.deterministic, allow_tf32=False):
        return F.conv2d(x.float(), weight.float(), None if bias is None else bias.float(), **kw)
