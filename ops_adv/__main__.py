"""`python -m ops_adv check [TABLE]`: load a tuned table as the runtime would, and summarise it.
`python -m ops_adv sign TABLE`: sign a table with OPS_ADV_TABLE_KEY (HMAC-SHA256)."""
from __future__ import annotations

import argparse
import sys

from kernel_space import OpsAdvError


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {' '.join(message.split())[:300]}\n")


def _sign(path: str) -> int:
    import json
    import os

    from . import _table

    key = os.environ.get("OPS_ADV_TABLE_KEY")
    if not key:
        raise OpsAdvError("set OPS_ADV_TABLE_KEY to the key production will check tables with")
    os.environ.pop("OPS_ADV_TABLE_KEY")
    try:
        _table.read_file(path)  # only a sound table is signed
    finally:
        os.environ["OPS_ADV_TABLE_KEY"] = key
    import tempfile

    with open(path, "rb") as f:
        data = _table.parse_json(f.read(), _table.short(path, 200).strip("'"))  # changed since the check: still one line
    if not isinstance(data, dict):
        raise OpsAdvError(f"{_table.short(path, 200)} changed while it was being signed; sign it again")
    data["signature"] = _table.signature(data, key)
    tmp = None
    try:  # a temporary file of its own beside the table (never another signer's or exporter's), then one rename
        fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=os.path.dirname(os.path.abspath(path)))
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(data, indent=1, sort_keys=True))
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o444)
        os.replace(tmp, path)
        tmp = None
    except OSError as e:
        raise OpsAdvError(f"cannot write {_table.short(path, 200)}: {e.strerror}; the table is unchanged") from None
    finally:
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass
    print(f"signed {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = _Parser(prog="python -m ops_adv", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("check", help="validate a tuned table file (default: OPS_ADV_TABLE); exit 1 if any winner is refused")
    c.add_argument("table", nargs="?")
    c.add_argument("--any-device", action="store_true", help="check a table for a device class this machine lacks")
    s = sub.add_parser("sign", help="add an HMAC-SHA256 signature with OPS_ADV_TABLE_KEY to a table file")
    s.add_argument("table")
    args = ap.parse_args(argv)
    refused = False
    try:
        if args.cmd == "sign":
            return _sign(args.table)
        import warnings

        from . import _table
        from ._dispatch import load_table

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            tuned = load_table(args.table, any_device=args.any_device)
        for w in caught:
            print(f"warning: {w.message}", file=sys.stderr)
            refused |= issubclass(w.category, _table.RefusedWinners)
    except OpsAdvError as e:
        from ._table import redact

        print(f"ops_adv: error: {' '.join(redact(str(e)).split())[:500]}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"ops_adv: interrupted{'; the table is unchanged' if args.cmd == 'sign' else ''}", file=sys.stderr)
        return 130
    if args.any_device:
        load_table("")  # checked, not for use here
    for dc, ops in sorted(tuned.items()):
        for op, entries in sorted(ops.items()):
            print(f"{dc} {op}: {len(entries)} tuned problem(s)")
    if not tuned:
        print("no tuned problems: every op runs its default implementation")
    return 1 if refused else 0


if __name__ == "__main__":
    sys.exit(main())
