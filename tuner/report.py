"""The per-problem table of winners, and a plot of speedup over the vendor kernel."""
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


def format_table(rows: list[dict[str, Any]]) -> str:
    header = ("op", "problem", "winner", "params", "ms", "vendor", "vendor ms", "speedup")
    lines = [header]
    for r in rows:
        params = json.dumps(r.get("params"), separators=(",", ":"), default=str)[1:-1] or "-"
        lines.append((
            r.get("op"), _short_problem(r.get("problem")), r.get("impl"), params, _num(r.get("median_ms")),
            r.get("vendor_impl"), _num(r.get("vendor_ms")), f"{_num(r.get('speedup'), '.2f')}x",
        ))
    widths = [max(len(str(line[i])) for line in lines) for i in range(len(header))]
    out = []
    for n, line in enumerate(lines):
        out.append("  ".join(str(c).ljust(w) for c, w in zip(line, widths)).rstrip())
        if n == 0:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out)


def format_markdown(rows: list[dict[str, Any]]) -> str:
    out = ["| op | problem | winner | params | ms | vendor | vendor ms | speedup |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        params = json.dumps(r.get("params"), separators=(",", ":"), default=str)[1:-1] or "-"
        out.append(
            f"| {r.get('op')} | {_short_problem(r.get('problem'))} | {r.get('impl')} | {params} | {_num(r.get('median_ms'))} | "
            f"{r.get('vendor_impl')} | {_num(r.get('vendor_ms'))} | {_num(r.get('speedup'), '.2f')}x |"
        )
    return "\n".join(out)


def plot(rows: list[dict[str, Any]], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r.get('op')} {_short_problem(r.get('problem'))}" for r in rows]
    speed = [r.get("speedup") if isinstance(r.get("speedup"), (int, float)) else 0.0 for r in rows]
    fig, ax = plt.subplots(figsize=(10, max(3, 0.32 * len(rows) + 1)))
    colors = ["tab:green" if s > 1.0 else "tab:gray" for s in speed]
    ax.barh(range(len(rows)), speed, color=colors)
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set_yticks(range(len(rows)), labels, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("speedup over the best vendor kernel (x)")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
