"""`python -m ops_adv check [TABLE]`: load a tuned table as the runtime would, and summarise it."""
from __future__ import annotations

import argparse
import sys

from kernel_space import OpsAdvError


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ops_adv", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("check", help="validate a tuned table file (default: OPS_ADV_TABLE)")
    c.add_argument("table", nargs="?")
    args = ap.parse_args(argv)
    try:
        import warnings

        from ._dispatch import load_table

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            tuned = load_table(args.table)
        for w in caught:
            print(f"warning: {w.message}", file=sys.stderr)
    except OpsAdvError as e:
        print(f"ops_adv: error: {e}", file=sys.stderr)
        return 2
    for dc, ops in sorted(tuned.items()):
        for op, entries in sorted(ops.items()):
            print(f"{dc} {op}: {len(entries)} tuned problem(s)")
    if not tuned:
        print("no tuned problems: every op runs its default implementation")
    return 0


if __name__ == "__main__":
    sys.exit(main())
