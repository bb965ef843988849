"""Progress of a tune: a tqdm bar on a terminal, a plain line every 10 s elsewhere (CI, log files)."""
from __future__ import annotations

import os
import sys
import time
from typing import Any, Callable, TextIO

MODES = ("auto", "bar", "plain")
PLAIN_EVERY_S = 10.0


def wants_bar(mode: str, stream: TextIO) -> bool:
    """`bar` always, `plain` never, `auto` when `stream` is a terminal (and TERM is not dumb)."""
    if mode == "auto":
        try:
            tty = stream.isatty()
        except (AttributeError, ValueError):
            tty = False
        return tty and os.environ.get("TERM") != "dumb"
    return mode == "bar"


class Progress:
    """`update` is called every pass of the driver's loop; `log` prints a line above the bar, if any."""

    def __init__(self, mode: str, log: Callable[[str], None], stream: TextIO | None = None) -> None:
        self._log = log
        self.stream = stream or sys.stderr
        self.bar: Any = None
        self._last = time.monotonic()
        if wants_bar(mode, self.stream):
            try:
                from tqdm import tqdm
            except ImportError:  # the tune extra brings tqdm; without it, plain lines
                return
            try:
                sized = os.get_terminal_size(self.stream.fileno()).columns > 0
            except (AttributeError, OSError, ValueError):
                sized = False
            self.bar = tqdm(
                total=1, file=self.stream, desc="tuning", mininterval=0.5, dynamic_ncols=sized, ncols=None if sized else 100,
                bar_format="{desc} {percentage:3.0f}%|{bar}| {elapsed} elapsed, ETA {remaining}{postfix}",
            )

    def log(self, msg: str) -> None:
        if self.bar is None:
            self._log(msg)
            return
        with self.bar.external_write_mode(file=self.stream):
            self._log(msg)

    def update(self, elapsed_s: float, done: int, problems: int, trials: int, quota: int, steps: int, total: int,
               best: float | None) -> None:
        """done/problems finished, trials asked of quota, steps of total (trials plus one per problem) for the ETA."""
        if self.bar is not None:
            self.bar.total = max(total, 1)
            best_txt = f", best {best:.2f}x" if best is not None else ""
            self.bar.set_postfix_str(f"problems {done}/{problems}, trials {trials}/{quota}{best_txt}", refresh=False)
            self.bar.update(max(0, min(steps, self.bar.total) - self.bar.n))
            return
        if time.monotonic() - self._last > PLAIN_EVERY_S:
            self._last = time.monotonic()
            tail = f", best {best:.2f}x so far" if best is not None else ""
            self._log(f"[{elapsed_s:5.0f}s] {done}/{problems} problems done, {trials} trials asked{tail}")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
