"""How many op calls ran a tuned winner, a borrowed one or the default: `with ops_adv.census() as c: ...; print(c)`.

Unlike the profiler it does not synchronise: a call costs one counter increment. It counts calls that
reach dispatch, so eager ones (and opaque operators run by a compiled graph that is not a CUDA graph);
a CUDA graph's replays run no Python and are not counted.
"""
from __future__ import annotations

from typing import Any, Callable

from .. import _dispatch

SOURCES = ("tuned", "nearest", "twin", "default")


class Census:
    """Calls per (op, implementation, source) inside the block; source is where the implementation came
    from: `tuned` (the table's winner for this problem), `nearest` (a close problem's winner), `twin` (the
    winner of the same problem without a flag such as decode_attention's key mask), `default` (nothing
    tuned applies: the highest-priority implementation, normally the vendor's)."""

    def __init__(self) -> None:
        self.counts: dict[tuple[str, str, str], int] = {}
        self.problems: dict[tuple[str, str, str], set] = {}

    def __enter__(self) -> "Census":
        self._installed = self._wrap  # one bound method: removed by equality on exit
        _dispatch.add_wrapper(self._installed)
        return self

    def __exit__(self, *exc: Any) -> None:
        _dispatch.remove_wrapper(self._installed)

    def _wrap(self, op: str, problem: Any, impl: str, source: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        key = (op, impl, source)
        counts = self.counts
        counts.setdefault(key, 0)
        self.problems.setdefault(key, set()).add(tuple(problem))

        def run(*args: Any, **kwargs: Any) -> Any:
            counts[key] += 1
            return fn(*args, **kwargs)

        return run

    @property
    def calls(self) -> int:
        return sum(self.counts.values())

    def by_source(self) -> dict[str, int]:
        """{source: calls} over every op, each source present (0 where none)."""
        out = dict.fromkeys(SOURCES, 0)
        for (_op, _impl, source), n in self.counts.items():
            out[source] = out.get(source, 0) + n
        return out

    def by_op(self) -> dict[str, dict[str, int]]:
        """{op: {source: calls}}."""
        out: dict[str, dict[str, int]] = {}
        for (op, _impl, source), n in self.counts.items():
            d = out.setdefault(op, dict.fromkeys(SOURCES, 0))
            d[source] = d.get(source, 0) + n
        return out

    def rows(self) -> list[dict[str, Any]]:
        return [{"op": op, "impl": impl, "source": source, "calls": n, "problems": len(self.problems[(op, impl, source)])}
                for (op, impl, source), n in sorted(self.counts.items(), key=lambda kv: (kv[0][0], -kv[1]))]

    def __str__(self) -> str:
        total = self.calls
        src = self.by_source()
        head = f"{total} op calls: " + ", ".join(
            f"{s} {n} ({n / total:.0%})" if total else f"{s} 0" for s, n in src.items())
        lines = [head, f"{'op':<18} {'implementation':<24} {'source':<8} {'calls':>7} {'problems':>8}"]
        lines += [f"{r['op']:<18} {r['impl']:<24} {r['source']:<8} {r['calls']:>7} {r['problems']:>8}" for r in self.rows()]
        return "\n".join(lines)


def census() -> Census:
    """A context manager counting the op calls inside it by op, implementation and source."""
    return Census()
