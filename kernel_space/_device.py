"""Device classes: the one place where vendor name strings become the names users type."""
from __future__ import annotations

import re

# Ordered: the first pattern that matches a device name decides its class.
_CLASSES: tuple[tuple[str, str], ...] = (
    (r"\bH200\b", "h200"),
    (r"\bH100\b", "h100"),
    (r"\bH800\b", "h800"),
    (r"\bGH200\b", "gh200"),
    (r"\bB200\b", "b200"),
    (r"\bA100\b", "a100"),
    (r"\bA800\b", "a800"),
    (r"\bL40S\b", "l40s"),
    (r"\bL4\b", "l4"),
    (r"\bA10G?\b", "a10"),
    (r"\bV100\b", "v100"),
    (r"\bT4\b", "t4"),
    (r"RTX\s*4090", "rtx4090"),
)
KNOWN_CLASSES = ("cpu",) + tuple(dict.fromkeys(c for _, c in _CLASSES))
# Ray's accelerator_type label for each class (what `ray start --resources` nodes advertise).
RAY_ACCELERATOR = {"h200": "H200", "h100": "H100", "a100": "A100", "l4": "L4", "a10": "A10G", "v100": "V100", "t4": "T4"}


def device_class_of(name: str) -> str:
    """'NVIDIA H200 NVL' -> 'h200'; an unknown GPU name becomes a lower-case slug."""
    if name == "cpu":
        return "cpu"
    for pat, cls in _CLASSES:
        if re.search(pat, name, re.IGNORECASE):
            return cls
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower().replace("nvidia", "")).strip("-")
    return slug or "unknown-gpu"


def local_device_class(device: str = "cuda:0") -> str:
    import torch

    d = torch.device(device)
    if d.type == "cpu":
        return "cpu"
    return device_class_of(torch.cuda.get_device_name(d))
