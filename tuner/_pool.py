"""A pool of measuring actors: one per device, replaced when a kernel hangs or kills one."""
from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import ray

from kernel_space import OpsAdvError
from workers.actor import make_actor_class
from workers.measure import CRASHED, TIMEOUT


class ClusterError(OpsAdvError):
    pass


@dataclass
class Slot:
    index: int
    actor: Any = None
    info: dict = field(default_factory=dict)
    job: Any = None
    ref: Any = None
    started: float = 0.0
    timeout: float = 0.0
    restarts: int = 0
    busy_s: float = 0.0


class Pool:
    """Runs jobs on actors; a job is (method, args, timeout_s); results come back via `poll`."""

    def __init__(self, device: str, n: int, *, accelerator_type: str | None, plugins: list[str], start_timeout_s: float = 120) -> None:
        self.device = device
        self.cls = make_actor_class(device, accelerator_type)
        self.plugins = plugins
        self.start_timeout_s = start_timeout_s
        self.slots = [Slot(i) for i in range(n)]
        for s in self.slots:
            self._start(s)

    def _start(self, slot: Slot) -> None:
        slot.actor = self.cls.remote(self.device, self.plugins, list(sys.path))
        try:
            slot.info = ray.get(slot.actor.info.remote(), timeout=self.start_timeout_s)
        except ray.exceptions.GetTimeoutError:
            ray.kill(slot.actor)
            raise ClusterError(
                f"no measuring worker for {self.device} started within {self.start_timeout_s:.0f} s: the cluster has no free "
                f"{'GPU of that class' if self.device != 'cpu' else 'CPU'}; check `ray status` or pass --workers"
            ) from None
        except ray.exceptions.RayActorError as e:
            raise ClusterError(f"measuring worker failed to start: {str(e).strip().splitlines()[-1]}") from None

    def restart(self, slot: Slot) -> None:
        try:
            ray.kill(slot.actor, no_restart=True)
        except Exception:
            pass
        slot.restarts += 1
        self._start(slot)

    def free(self) -> list[Slot]:
        return [s for s in self.slots if s.job is None]

    def submit(self, slot: Slot, job: Any, method: str, args: tuple, timeout_s: float) -> None:
        slot.job, slot.started, slot.timeout = job, time.monotonic(), timeout_s
        slot.ref = getattr(slot.actor, method).remote(*args)

    def busy(self) -> bool:
        return any(s.job is not None for s in self.slots)

    def poll(self, wait_s: float = 0.2) -> list[tuple[Any, dict | None, str | None]]:
        """Finished jobs as (job, result, failure) where failure is 'timeout' or 'crashed' with the result None."""
        active = [s for s in self.slots if s.job is not None]
        if not active:
            return []
        ready, _ = ray.wait([s.ref for s in active], num_returns=len(active), timeout=wait_s)
        ready_set = set(ready)
        done = []
        now = time.monotonic()
        for s in active:
            if s.ref in ready_set:
                try:
                    res, fail = ray.get(s.ref), None
                except (ray.exceptions.RayActorError, ray.exceptions.WorkerCrashedError) as e:
                    res, fail = {"error": f"worker crashed: {str(e).strip().splitlines()[0][:300]}"}, CRASHED
                    self.restart(s)
                if fail is None and res.get("context_lost"):
                    self.restart(s)  # a dead CUDA context poisons every later launch
            elif now - s.started > s.timeout:
                res, fail = {"error": f"no result after {s.timeout:.0f} s; worker killed"}, TIMEOUT
                self.restart(s)
            else:
                continue
            s.busy_s += now - s.started
            done.append((s.job, res, fail))
            s.job = s.ref = None
        return done

    def shutdown(self) -> None:
        for s in self.slots:
            try:
                ray.kill(s.actor, no_restart=True)
            except Exception:
                pass


def start_ray(address: str | None, *, num_cpus: int | None = None) -> bool:
    """Join `address` (or RAY_ADDRESS), else start a local instance bound to 127.0.0.1; True if we started it."""
    import logging

    if ray.is_initialized():
        return False
    address = address or os.environ.get("RAY_ADDRESS")
    kw: dict[str, Any] = {"include_dashboard": False, "log_to_driver": True, "logging_level": logging.WARNING}
    try:
        if address:
            ray.init(address=address, **kw)
        else:
            ray.init(num_cpus=num_cpus, _node_ip_address="127.0.0.1", **kw)
    except (ConnectionError, RuntimeError, ValueError) as e:
        raise ClusterError(f"cannot join the Ray cluster at {address or 'a local instance'}: {str(e).strip().splitlines()[0]}") from None
    return True
