"""Tuned-table files with winners chosen by a benchmark (the format opsadv-export writes).

For benchmarks that need dispatch to run a given implementation through the public path
(`ops_adv.load_table`), without a tuning database.
"""
from __future__ import annotations

import hashlib
import json
from typing import Any

import kernel_space

FORMAT, FORMAT_VERSION = "ops-adv-table", 1


def device_class(device: Any) -> str:
    import torch

    dev = torch.device(device)
    if dev.type != "cuda":
        return "cpu"
    from kernel_space._device import device_class_of

    return device_class_of(torch.cuda.get_device_name(dev))


def winner(op: str, problem: dict, impl: str, params: dict | None = None) -> dict:
    """A table row: `problem` is the op's problem as a dict (what ops_adv.record() writes)."""
    return {"op": op, "problem": problem, "impl": impl, "params": dict(params or {}),
            "kernel_version": kernel_space.get_impl(op, impl).version, "median_ms": 1.0, "vendor_impl": impl,
            "vendor_ms": 1.0, "speedup": 1.0}


def write(path: str, winners: list[dict], device_cls: str) -> str:
    canon = json.dumps(winners, sort_keys=True, separators=(",", ":"))
    data = {"format": FORMAT, "format_version": FORMAT_VERSION, "device_class": device_cls, "fingerprint": {},
            "winners": winners, "checksum": hashlib.sha256(canon.encode()).hexdigest()}
    with open(path, "w") as f:
        json.dump(data, f, indent=1)
    return path


def first_ours(op: str, problem: dict, backend: str) -> tuple[str, dict] | None:
    """The first (implementation, config) of ops-adv's own (not a vendor's) that can run `problem`."""
    spec = kernel_space.get_op(op)
    p = spec.parse_problem(problem)
    for impl in kernel_space.impls(op, backend=backend):
        if impl.vendor or impl.unavailable:
            continue
        if impl.why_not(p, None, backend) is None:
            return impl.name, impl.default_params()
        for cfg in impl.configs():
            if impl.why_not(p, cfg, backend) is None:
                return impl.name, cfg
    return None
