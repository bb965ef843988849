"""The Ray actor that owns one device and measures trials on it."""
from __future__ import annotations

import importlib
import os
import sys
from typing import Any

import ray


class Measurer:
    """Measures trials for one device; the tuner kills and replaces it when a kernel hangs or crashes it."""

    def __init__(
        self, device: str, plugins: list[str] | None = None, sys_path: list[str] | None = None, compile_workers: int = 0,
        threads: int | None = None, accuracy: float | None = 2.0,
    ) -> None:
        for p in reversed(sys_path or []):
            if p not in sys.path:
                sys.path.insert(0, p)
        for mod in plugins or []:
            importlib.import_module(mod)
        from .measure import WARM_S, Bench

        if threads:
            # Ray's num_cpus=1 sets OMP_NUM_THREADS=1 here; measure with the threads a production process uses.
            import torch

            torch.set_num_threads(int(threads))
            os.environ["OMP_NUM_THREADS"] = str(int(threads))
        if device.startswith("cuda"):
            import torch

            # Ray sets CUDA_VISIBLE_DEVICES to this actor's GPU: it is cuda:0 here.
            torch.cuda.set_device(0)
            device = "cuda:0"
        self.device = device
        self.bench = Bench(device, accuracy, warm_s=WARM_S)  # its first timing warms up by time
        self.ahead = None
        if compile_workers and device.startswith("cuda"):
            from .compile_ahead import CompileAhead

            self.ahead = CompileAhead(device, compile_workers, list(sys.path), list(plugins or []))

    def info(self) -> dict[str, Any]:
        from kernel_space._device import local_device_class

        from .measure import conditions, fingerprint

        return {
            "conditions": conditions(self.device),
            "pid": os.getpid(),
            "node": ray.get_runtime_context().get_node_id(),
            "device_class": local_device_class(self.device),
            "fingerprint": fingerprint(self.device),
        }

    def measure(self, trial: dict[str, Any], budget_s: float = 0.5) -> dict[str, Any]:
        res = self.bench.run(trial, budget_s=budget_s)
        res["pid"] = os.getpid()
        return res

    def prefetch(self, trial: dict[str, Any]) -> None:
        """Compile `trial`'s kernels in the background while this actor measures another."""
        if self.ahead is not None:
            self.ahead.submit(trial)

    def confirm(self, op: str, problem: dict, candidates: list[dict], rounds: int = 5) -> dict[str, dict]:
        return self.bench.confirm(op, problem, candidates, rounds=rounds)


def make_actor_class(device: str, accelerator_type: str | None = None, compile_ahead: bool = False):
    """A Ray actor class reserving one CPU (CPU device) or one GPU of the given accelerator type."""
    opts: dict[str, Any] = {"max_restarts": 0, "max_task_retries": 0}
    if device == "cpu":
        opts["num_cpus"] = 1
    else:
        opts.update(num_cpus=1, num_gpus=1)
        if compile_ahead:
            opts["max_concurrency"] = 2  # a prefetch call is taken while a measurement runs
        if accelerator_type:
            opts["accelerator_type"] = accelerator_type
    return ray.remote(**opts)(Measurer)
