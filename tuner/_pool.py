"""A pool of measuring actors: one per device, replaced when a kernel hangs or kills one, or its node leaves."""
from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import ray

from kernel_space import OpsAdvError
from workers.actor import make_actor_class
from workers.measure import CRASHED, TIMEOUT

NODE_LOST = "node_lost"  # the actor's node left the cluster: not the job's fault, run it again (never a trial status)


class ClusterError(OpsAdvError):
    pass


@dataclass(eq=False)  # a slot is itself: list.remove and `in` go by identity
class Slot:
    index: int
    actor: Any = None
    info: dict = field(default_factory=dict)
    job: Any = None
    ref: Any = None
    call: tuple = ()  # (method, args, timeout_s) of the job, to run it again elsewhere
    started: float = 0.0
    timeout: float = 0.0
    restarts: int = 0
    busy_s: float = 0.0
    jobs: int = 0


class Pool:
    """Runs jobs on actors; a job is (method, args, timeout_s); results come back via `poll`."""

    def __init__(
        self, device: str, n: int, *, accelerator_type: str | None, plugins: list[str], start_timeout_s: float = 120,
        node_grace_s: float = 60, compile_workers: int = 0, threads: int | None = None, accuracy: float | None = 2.0,
    ) -> None:
        self.threads, self.accuracy = threads, accuracy
        self.device = device
        self.compile_workers = compile_workers
        self.accelerator_type = accelerator_type
        self.cls = make_actor_class(device, accelerator_type, compile_ahead=compile_workers > 0)
        self.plugins = plugins
        self.start_timeout_s = start_timeout_s
        self.node_grace_s = node_grace_s  # how long the GCS may take to mark a silent node dead
        self.slots = [Slot(i) for i in range(n)]
        self.lost: list[Slot] = []  # slots dropped when their node left and no other node had room
        for s in self.slots:
            self._start(s)

    def _start(self, slot: Slot) -> None:
        slot.actor = self.cls.remote(self.device, self.plugins, list(sys.path), self.compile_workers, self.threads, self.accuracy)
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
        slot.job, slot.started, slot.timeout, slot.call = job, time.monotonic(), timeout_s, (method, args, timeout_s)
        slot.ref = getattr(slot.actor, method).remote(*args)

    def prefetch(self, index: int, trial: dict) -> None:
        """Ask worker `index` (mod the pool) to compile `trial` ahead; fire and forget."""
        if self.compile_workers and self.slots:
            self.slots[index % len(self.slots)].actor.prefetch.remote(trial)

    def busy(self) -> bool:
        return any(s.job is not None for s in self.slots)

    def poll(self, wait_s: float = 0.2) -> list[tuple[Any, dict | None, str | None]]:
        """Finished jobs as (job, result, failure).

        failure is None, 'timeout' or 'crashed' (result {"error": ...}), or NODE_LOST when the actor went with its
        node: result {"error": what happened to the worker, "retry": (method, args, timeout_s)} to submit again.
        Raises ClusterError when no worker is left.
        """
        active = [s for s in self.slots if s.job is not None]
        if not active:
            return []
        refs = [s.ref for s in active]
        ready, _ = ray.wait(refs, num_returns=1, timeout=wait_s)  # back as soon as one worker is free
        if ready and len(refs) > 1:
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)  # and every other one done by then
        ready_set = set(ready)
        done = []
        now = time.monotonic()
        for s in active:
            if s.ref in ready_set:
                try:
                    res, fail = ray.get(s.ref), None
                except (ray.exceptions.RayActorError, ray.exceptions.WorkerCrashedError) as e:
                    if self._node_lost(s, e):
                        res, fail = self._replace_lost(s), NODE_LOST
                    else:
                        res, fail = {"error": f"worker crashed: {str(e).strip().splitlines()[0][:300]}"}, CRASHED
                        self.restart(s)
                if fail is None and res.get("context_lost"):
                    self.restart(s)  # a dead CUDA context poisons every later launch
            elif now - s.started > s.timeout:
                if not self._node_alive(s):
                    res, fail = self._replace_lost(s), NODE_LOST
                else:
                    res, fail = {"error": f"no result after {s.timeout:.0f} s; worker killed"}, TIMEOUT
                    self.restart(s)
            else:
                continue
            s.busy_s += now - s.started
            s.jobs += 1
            done.append((s.job, res, fail))
            s.job = s.ref = None
        if not self.slots:
            raise ClusterError(
                "every measuring worker's node left the Ray cluster; finished trials are stored: "
                "bring nodes back and re-run the same command to resume"
            )
        return done

    # ---- node loss ----------------------------------------------------------------------------
    def _node_alive(self, slot: Slot) -> bool:
        """Whether the GCS still lists the node of the slot's actor as alive (True when the GCS cannot say)."""
        node = slot.info.get("node")
        try:
            nodes = ray.nodes()
        except Exception:
            return True
        return any(n.get("NodeID") == node and n.get("Alive") for n in nodes)

    def _node_lost(self, slot: Slot, err: Exception) -> bool:
        """Did the actor die with its node, rather than by the kernel it ran?

        A kernel that kills its worker gives ActorDiedError at once, its node still alive.  A lost node gives
        ActorDiedError saying so, or (when the worker's connection broke before the GCS noticed) ActorUnavailableError;
        the GCS marks a silent node dead only after missed health checks, so that case waits up to node_grace_s.
        """
        if "its node has died" in str(err):
            return True
        grace = self.node_grace_s if isinstance(err, ray.exceptions.ActorUnavailableError) else 0.0
        deadline = time.monotonic() + grace
        while True:
            if not self._node_alive(slot):
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.5)

    def _has_room(self) -> bool:
        """Whether the cluster has the resources of one more measuring actor."""
        need = {"CPU": 1.0} if self.device == "cpu" else {"CPU": 1.0, "GPU": 1.0}
        if self.device != "cpu" and self.accelerator_type:
            need[f"accelerator_type:{self.accelerator_type}"] = 0.001
        try:
            free = ray.available_resources()
        except Exception:
            return False
        return all(free.get(k, 0.0) >= v for k, v in need.items())

    def _replace_lost(self, slot: Slot) -> dict:
        """The slot's node is gone: start its actor on a surviving node, or drop the slot if none has room."""
        what = f"worker {slot.index} lost with its node {str(slot.info.get('node'))[:12]}"
        retry = {"retry": slot.call}
        if self._has_room():
            try:
                self.restart(slot)
                return {"error": f"{what}; replaced on node {str(slot.info.get('node'))[:12]}", **retry}
            except ClusterError:
                pass
        try:
            ray.kill(slot.actor, no_restart=True)
        except Exception:
            pass
        self.slots.remove(slot)
        self.lost.append(slot)
        return {"error": f"{what}; no node has room for another, going on with {len(self.slots)} worker(s)", **retry}

    def stats(self) -> list[dict]:
        """Per slot: its node, seconds busy with jobs, jobs finished (any outcome), actor restarts, whether it was lost."""
        return [
            {"slot": s.index, "node": s.info.get("node"), "busy_s": round(s.busy_s, 3), "jobs": s.jobs, "restarts": s.restarts,
             "lost": s in self.lost}
            for s in sorted(self.slots + self.lost, key=lambda s: s.index)
        ]

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
    # Ray's driver-side warnings (e.g. at start-up) are not ours to show; its errors are. RAY_LOGGER_LEVEL overrides.
    level = os.environ.get("RAY_LOGGER_LEVEL") or logging.ERROR
    kw: dict[str, Any] = {"include_dashboard": False, "log_to_driver": True, "logging_level": level}
    if address:
        _probe(address)
    box: dict[str, Any] = {}

    def init() -> None:
        try:
            if address:
                ray.init(address=address, **kw)
            else:
                ray.init(num_cpus=num_cpus, _node_ip_address="127.0.0.1", **kw)
        except BaseException as e:  # handed to the caller's thread
            box["error"] = e

    if not address:
        init()
    else:  # Ray retries an unreachable GCS for minutes: give up after JOIN_TIMEOUT_S
        import threading

        th = threading.Thread(target=init, daemon=True)
        th.start()
        th.join(JOIN_TIMEOUT_S)
        if th.is_alive():
            raise ClusterError(f"cannot join the Ray cluster at {address}: no answer within {JOIN_TIMEOUT_S:.0f} s; check the address and `ray status` there")
    e = box.get("error")
    if e is not None:
        if isinstance(e, (ConnectionError, RuntimeError, ValueError, TimeoutError)):
            raise ClusterError(f"cannot join the Ray cluster at {address or 'a local instance'}: {str(e).strip().splitlines()[0][:300]}") from None
        raise e
    if not address:
        _start_reaper()
    return True


_REAPER: Any = None


def _start_reaper() -> None:
    """A watcher that kills this local Ray's processes once this process is gone (kill -9 included): tuner/_reaper.py."""
    global _REAPER
    import subprocess

    try:
        node = ray._private.worker._global_node
        pids = [i.process.pid for infos in node.all_processes.values() for i in infos if getattr(i, "process", None)]
        script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_reaper.py")  # stdlib only: not the package
        _REAPER = subprocess.Popen([sys.executable, "-I", script, *map(str, pids)], stdin=subprocess.PIPE, start_new_session=True)
    except Exception:  # Ray's internals moved, or no /proc: Ray's own clean-up is left
        _REAPER = None


def stop_reaper() -> None:
    """After ray.shutdown(): the watcher kills whatever is left and exits."""
    global _REAPER
    if _REAPER is not None:
        _REAPER.stdin.close()
        try:
            _REAPER.wait(10)
        except Exception:
            pass
        _REAPER = None


JOIN_TIMEOUT_S = 45.0


def _probe(address: str, timeout_s: float = 10.0) -> None:
    """Fail at once, with one line, when nothing listens at HOST:PORT (ray:// and 'auto' are left to Ray)."""
    import socket

    if address == "auto" or "://" in address:
        return
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise ClusterError(f"bad --ray-address {address[:100]!r}: expected HOST:PORT")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            pass
    except (OSError, OverflowError, ValueError) as e:
        raise ClusterError(f"cannot join the Ray cluster at {address}: {getattr(e, 'strerror', None) or e.__class__.__name__}; is `ray start --head` running there?") from None
