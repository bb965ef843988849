"""Buffers that outlive a call, made safely while a CUDA graph is being captured or recorded.

A buffer a launch keeps between calls (split-K arrival counters) must not come from a CUDA graph's
private memory pool: torch.cuda.graph frees that pool with the graph, and torch.compile's
reduce-overhead mode refuses pool tensors it does not own ("tensor(s) in the cudagraph pool not
tracked as outputs"). A capture sends its stream's allocations to the pool; reduce-overhead's warm-up
runs, which are no capture, send every allocation of the calling thread there (torch 2.11 refused a
tuned B=1 decode step on the H100 whose first split-K launch came in one). So on CUDA the buffer is
made on a side stream, which no capture's pool serves: inside a capture with this thread's capture mode
relaxed for the allocation and its zero-fill (checked on the H200: the capture stays valid and the buffer is
zero after replay), otherwise by a short-lived thread of its own, whose allocations no warm-up routes to a
pool. Once per buffer: buffers grow and are kept.
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
    """n zeros that belong to no CUDA graph pool, whether or not a capture or a recording is under way."""
    if device.type != "cuda":
        return torch.zeros(n, dtype=dtype, device=device)
    got: list = []
    with _lock:
        if torch.cuda.is_current_stream_capturing():  # a capture's pool serves its stream: a side stream, here
            _make(n, dtype, device, True, got)
        else:  # reduce-overhead's warm-up may send this thread's allocations to its pool: another thread
            t = threading.Thread(target=_make, args=(n, dtype, device, False, got), name="ops-adv-persistent-zeros",
                                 daemon=True)
            t.start()
            t.join()
    if isinstance(got[0], BaseException):
        raise got[0]
    return got[0]


def _make(n: int, dtype: torch.dtype, device: torch.device, relax: bool, got: list) -> None:
    try:
        with torch.cuda.device(device):
            prev = _exchange_mode(_RELAXED) if relax else None
            try:
                side = _side.get(device)
                if side is None:
                    side = _side[device] = torch.cuda.Stream(device)
                with torch.cuda.stream(side):
                    buf = torch.zeros(n, dtype=dtype, device=device)
                side.synchronize()
            finally:
                if prev is not None:
                    _exchange_mode(prev)
        got.append(buf)
    except BaseException as exc:  # noqa: BLE001 - raised again in the caller's thread
        got.append(exc)
