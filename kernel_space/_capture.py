"""Buffers that outlive a call, made safely while a CUDA graph is being captured.

A buffer a launch keeps between calls (split-K arrival counters) must not come from a capture's
private memory pool: torch.cuda.graph frees that pool with the graph, and torch.compile's
reduce-overhead mode refuses pool tensors it does not own ("tensor(s) in the cudagraph pool not
tracked as outputs", seen on the H200 with torch 2.11). Outside a capture this is a plain
allocation; inside one it is made on a side stream, which the pool does not serve, with this
thread's capture mode relaxed for the allocation and its zero-fill (both checked on the H200:
the capture stays valid and the buffer is zero after replay).
"""
from __future__ import annotations

import ctypes
import threading

import torch

_RELAXED = 2  # CU_STREAM_CAPTURE_MODE_RELAXED
_libcuda: ctypes.CDLL | None = None
_side: dict[torch.device, torch.cuda.Stream] = {}
_lock = threading.Lock()


def _exchange_mode(mode: int) -> int:
    global _libcuda
    if _libcuda is None:
        _libcuda = ctypes.CDLL("libcuda.so.1")
    m = ctypes.c_int(mode)
    err = _libcuda.cuThreadExchangeStreamCaptureMode(ctypes.byref(m))
    if err:
        raise RuntimeError(f"cuThreadExchangeStreamCaptureMode failed with CUDA error {err}")
    return m.value


def persistent_zeros(n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """n zeros that belong to no CUDA graph pool, whether or not a capture is under way."""
    if device.type != "cuda" or not torch.cuda.is_current_stream_capturing():
        return torch.zeros(n, dtype=dtype, device=device)
    with _lock:
        prev = _exchange_mode(_RELAXED)
        try:
            side = _side.get(device)
            if side is None:
                side = _side[device] = torch.cuda.Stream(device)
            with torch.cuda.stream(side):
                buf = torch.zeros(n, dtype=dtype, device=device)
            side.synchronize()
        finally:
            _exchange_mode(prev)
    return buf
