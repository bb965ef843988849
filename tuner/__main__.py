"""`python -m tuner tune|export|db|report ...`: the console scripts, without installing them."""
from __future__ import annotations

import sys

from .cli import db_main, export_main, report_main, tune_main

COMMANDS = {"tune": tune_main, "export": export_main, "db": db_main, "report": report_main}

if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] not in COMMANDS:
        print(f"usage: python -m tuner {{{','.join(COMMANDS)}}} ...", file=sys.stderr)
        sys.exit(2)
    sys.exit(COMMANDS[sys.argv[1]](sys.argv[2:]))
