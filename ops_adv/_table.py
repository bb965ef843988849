"""Tuned tables: the exported file format, loading and validation (stdlib only)."""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass

from kernel_space import OpsAdvError

FORMAT = "ops-adv-table"
FORMAT_VERSION = 1


class TableError(OpsAdvError):
    pass


def redact(url: str) -> str:
    import re

    return re.sub(r"(://[^:/@]+:)[^@]*@", r"\1***@", url)


def checksum(winners: list[dict]) -> str:
    return hashlib.sha256(json.dumps(winners, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


@dataclass(frozen=True)
class Table:
    device_class: str
    fingerprint: dict
    winners: list[dict]  # op, problem (dict), impl, params, kernel_version, median_ms, vendor_impl, vendor_ms, speedup
    source: str


def read_file(path: str) -> Table:
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise TableError(f"cannot read tuned table {path}: {e.strerror}; check OPS_ADV_TABLE") from None
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise TableError(f"tuned table {path} is corrupt (not JSON); export it again with opsadv-export") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise TableError(f"{path} is not an ops-adv tuned table; export one with opsadv-export")
    if data.get("format_version") != FORMAT_VERSION:
        raise TableError(f"tuned table {path} has format {data.get('format_version')}, this ops-adv reads {FORMAT_VERSION}; export it again")
    winners = data.get("winners")
    if not isinstance(winners, list) or data.get("checksum") != checksum(winners):
        raise TableError(f"tuned table {path} is corrupt (checksum mismatch); export it again with opsadv-export")
    return Table(str(data.get("device_class")), data.get("fingerprint") or {}, winners, path)


def read_database(url: str) -> list[Table]:
    """Winners straight from a tuning database (SQLite through the stdlib; PostgreSQL needs psycopg)."""
    query = (
        "select w.device_class, p.op, p.key, w.impl, w.params, w.kernel_version, w.median_ms, w.vendor_impl, w.vendor_ms, w.speedup "
        "from opsadv_winners w join opsadv_problems p on p.id = w.problem_id"
    )
    try:
        if url.startswith("sqlite:///"):
            import sqlite3

            path = url[len("sqlite:///"):]
            if not os.path.exists(path):
                raise TableError(f"tuning database {path} does not exist; run opsadv-tune first or fix the URL")
            con = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
            try:
                rows = con.execute(query).fetchall()
            finally:
                con.close()
        elif url.startswith(("postgresql", "postgres")):
            import psycopg  # optional: only for a runtime that reads a shared fleet database

            with psycopg.connect(url.replace("postgresql+psycopg://", "postgresql://")) as con:
                rows = con.execute(query).fetchall()
        else:
            raise TableError(f"OPS_ADV_TABLE {url!r} is neither a table file nor a sqlite:/// or postgresql:// URL")
    except TableError:
        raise
    except Exception as e:
        raise TableError(f"cannot read winners from {redact(url)}: {redact(str(e).strip().splitlines()[0])}") from None
    by_class: dict[str, list[dict]] = {}
    for dc, op, key, impl, params, kv, med, vimpl, vms, sp in rows:
        by_class.setdefault(dc, []).append({
            "op": op, "problem": json.loads(key), "impl": impl, "params": json.loads(params) if isinstance(params, str) else params,
            "kernel_version": kv, "median_ms": med, "vendor_impl": vimpl, "vendor_ms": vms, "speedup": sp,
        })
    return [Table(dc, {}, ws, url) for dc, ws in by_class.items()]


def load(spec: str) -> list[Table]:
    if "://" in spec:
        return read_database(spec)
    return [read_file(p) for p in spec.split(os.pathsep) if p]
