"""Stops what is left of a local Ray instance once the tuner that started it is gone, even after kill -9.

The tuner starts this process with a pipe on its stdin and the pids of Ray's head processes as arguments; when the
pipe closes (the tuner exited or was killed) every tracked process still running is killed. Ray kills its head
processes with the driver, but the agents the raylet started (dashboard and runtime-env agents) lived on for 60-90 s.
The raylet's children are followed every second while the tuner runs. Only processes tracked here are touched, each
known by its pid and start time (a reused pid is never killed). Stdlib only: it starts in milliseconds."""
from __future__ import annotations

import os
import select
import signal
import sys
import time


def _stat(pid: int) -> tuple[int, int] | None:
    """(parent pid, start time) of a live process, None when it is gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            rest = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if rest[0] in "ZX" else (int(rest[1]), int(rest[19]))


def _children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            st = _stat(int(name))
            if st:
                kids.setdefault(st[0], []).append(int(name))
    return kids


def _track(tracked: dict[int, int]) -> None:
    """Add the live descendants of the tracked processes."""
    kids = _children()
    todo = list(tracked)
    while todo:
        for c in kids.get(todo.pop(), ()):
            st = _stat(c)
            if c not in tracked and st:
                tracked[c] = st[1]
                todo.append(c)


def _kill(tracked: dict[int, int]) -> None:
    _track(tracked)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        alive = [p for p, t in tracked.items() if (_stat(p) or (0, None))[1] == t]
        for p in alive:
            try:
                os.kill(p, sig)
            except OSError:
                pass
        deadline = time.monotonic() + 2
        while alive and time.monotonic() < deadline:
            time.sleep(0.05)
            alive = [p for p in alive if (_stat(p) or (0, None))[1] == tracked[p]]
        if not alive:
            return


def main(pids: list[int]) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C in the tuner's terminal is the tuner's to handle
    tracked = {p: st[1] for p in pids if (st := _stat(p))}
    while True:
        r, _, _ = select.select([sys.stdin], [], [], 1.0)
        if r and not os.read(sys.stdin.fileno(), 4096):
            break  # the tuner is gone
        _track(tracked)
    _kill(tracked)


if __name__ == "__main__":
    main([int(a) for a in sys.argv[1:]])
