"""The per-problem table of winners, grouped by where each winner comes from, and a plot of speedup
over the vendor kernel.

Sources (kernel_space.source_of): "ours" (ops-adv's Triton and CPU kernels), "library" (a kernel
library's candidate, e.g. Liger-Kernel), "torch" (the vendor kernel kept its place).
"""
from __future__ import annotations

import json
from typing import Any


def _num(v: Any, fmt: str = ".4g") -> str:
    """A number as `fmt`; anything else (a hand-edited table) as short text, never an exception."""
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return format(v, fmt)
    return str(v)[:20]


def _short_problem(problem: dict) -> str:
    parts = []
    for k, v in (problem.items() if isinstance(problem, dict) else []):
        if isinstance(v, bool):
            if v:
                parts.append(k)
        else:
            parts.append(f"{k}={v}")
    return " ".join(parts)


def source(row: dict[str, Any]) -> str:
    """Where a winner comes from: ours, library or torch; "unknown" for an implementation this install lacks."""
    from kernel_space import OpsAdvError, get_impl
    from kernel_space._registry import source_of

    try:
        return source_of(get_impl(str(row.get("op")), str(row.get("impl"))))
    except OpsAdvError:
        return "unknown"


def _by_source(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows ordered by source (ours, library, torch, unknown), each with its `source`; stable within a source."""
    from kernel_space._registry import SOURCES

    order = {s: i for i, s in enumerate(SOURCES)}
    tagged = [{**r, "source": source(r)} for r in rows]
    return sorted(tagged, key=lambda r: order.get(r["source"], len(order)))


def summarize_sources(rows: list[dict[str, Any]]) -> str:
    """One line per source: how many problems it wins, of which ops, and its median speedup over the vendor."""
    import statistics

    groups: dict[str, list[dict[str, Any]]] = {}
    for r in _by_source(rows):
        groups.setdefault(r["source"], []).append(r)
    out = ["wins by source:"]
    for src, rs in groups.items():
        ops = sorted({str(r.get("op")) for r in rs})
        sp = [r["speedup"] for r in rs if isinstance(r.get("speedup"), (int, float)) and not isinstance(r.get("speedup"), bool)]
        med = f", median speedup {statistics.median(sp):.2f}x" if sp else ""
        out.append(f"  {src}: {len(rs)} problem{'s' if len(rs) != 1 else ''} ({', '.join(ops)}){med}")
    return "\n".join(out)


def format_candidates(ops: list[str], backend: str) -> str:
    """Every implementation of `ops` with its source and whether it can run on `backend` (else why not):
    library candidates whose module is missing, or that need CUDA, show with the reason."""
    from kernel_space import impls
    from kernel_space._registry import source_of

    lines = [("op", "implementation", "source", f"on {backend}")]
    for op in ops:
        for impl in impls(op):
            why = impl.unavailable or (None if backend in impl.backends else f"needs {'/'.join(sorted(impl.backends))}")
            lines.append((op, impl.name, source_of(impl), why or "runs"))
    widths = [max(len(str(line[i])) for line in lines) for i in range(4)]
    out = ["  ".join(str(c).ljust(w) for c, w in zip(line, widths)).rstrip() for line in lines]
    out.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(out)


def library_candidates(ops: list[str], device_class: str) -> list[str]:
    """`op/impl: status` for each library implementation of `ops`: why it cannot run for `device_class`
    (its library does not import here, or it needs CUDA), else that it can."""
    from kernel_space import impls
    from kernel_space._registry import source_of

    backend = "cpu" if device_class == "cpu" else "cuda"
    out = []
    for op in ops:
        for impl in impls(op):
            if source_of(impl) == "library":
                why = impl.unavailable or (None if backend in impl.backends else f"needs {'/'.join(sorted(impl.backends))}")
                out.append(f"{op}/{impl.name}: {why or 'available'}")
    return out


def spread(row: dict[str, Any]) -> str:
    """The spread behind a winner: its own (± over the timed repetitions), then the range of the other times of
    this problem recorded with it (re-measurements not stored, the winners it replaced, confirmation rounds)."""
    sp = row.get("spread_ms")
    out = f"±{_num(sp, '.2g')}" if isinstance(sp, (int, float)) and not isinstance(sp, bool) else "-"
    hist = row.get("history")
    times = [h.get("median_ms") for h in hist if isinstance(h, dict)] if isinstance(hist, list) else []
    times = [t for t in times if isinstance(t, (int, float)) and not isinstance(t, bool)]
    if times:
        out += f" (others {_num(min(times))}-{_num(max(times))} ms, {len(times)} measured)"
    return out


def format_table(rows: list[dict[str, Any]]) -> str:
    """The winners grouped by source, then a summary line per source."""
    header = ("source", "op", "problem", "winner", "params", "ms", "spread", "vendor", "vendor ms", "speedup")
    lines = [header]
    rows = _by_source(rows)
    for r in rows:
        params = json.dumps(r.get("params"), separators=(",", ":"), default=str)[1:-1] or "-"
        lines.append((
            r["source"], r.get("op"), _short_problem(r.get("problem")), r.get("impl"), params, _num(r.get("median_ms")),
            spread(r), r.get("vendor_impl"), _num(r.get("vendor_ms")), f"{_num(r.get('speedup'), '.2f')}x",
        ))
    widths = [max(len(str(line[i])) for line in lines) for i in range(len(header))]
    out = []
    for n, line in enumerate(lines):
        out.append("  ".join(str(c).ljust(w) for c, w in zip(line, widths)).rstrip())
        if n == 0:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out) + ("\n\n" + summarize_sources(rows) if rows else "")


def format_markdown(rows: list[dict[str, Any]]) -> str:
    out = ["| source | op | problem | winner | params | ms | spread | vendor | vendor ms | speedup |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    rows = _by_source(rows)
    for r in rows:
        params = json.dumps(r.get("params"), separators=(",", ":"), default=str)[1:-1] or "-"
        out.append(
            f"| {r['source']} | {r.get('op')} | {_short_problem(r.get('problem'))} | {r.get('impl')} | {params} | "
            f"{_num(r.get('median_ms'))} | {spread(r)} | {r.get('vendor_impl')} | {_num(r.get('vendor_ms'))} | {_num(r.get('speedup'), '.2f')}x |"
        )
    if rows:
        out += ["", *(f"- {ln.strip()}" for ln in summarize_sources(rows).splitlines()[1:])]
    return "\n".join(out)


def plot(rows: list[dict[str, Any]], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = _by_source(rows)
    labels = [f"{r.get('op')} {_short_problem(r.get('problem'))}" for r in rows]
    speed = [r.get("speedup") if isinstance(r.get("speedup"), (int, float)) else 0.0 for r in rows]
    fig, ax = plt.subplots(figsize=(10, max(3, 0.32 * len(rows) + 1)))
    palette = {"ours": "tab:green", "library": "tab:blue", "torch": "tab:gray"}
    colors = [palette.get(r["source"], "tab:red") if s > 1.0 else "tab:gray" for r, s in zip(rows, speed)]
    ax.barh(range(len(rows)), speed, color=colors)
    from matplotlib.patches import Patch

    shown = [s for s in palette if any(r["source"] == s for r in rows)]
    if shown:
        ax.legend(handles=[Patch(color=palette[s], label=s) for s in shown], fontsize=7, loc="lower right")
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set_yticks(range(len(rows)), labels, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("speedup over the best vendor kernel (x)")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
