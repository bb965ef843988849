"""Tuned tables: the exported file format, loading and validation (stdlib only)."""
from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
import stat
from dataclasses import dataclass
from urllib.parse import unquote

from kernel_space import OpsAdvError

FORMAT = "ops-adv-table"
FORMAT_VERSION = 1


class TableError(OpsAdvError):
    pass


class RefusedWinners(RuntimeWarning):
    """Winners of a table the runtime does not use (changed kernels, parameters outside the space, a failed check)."""


_URL = re.compile(r"[\w+.-]*://[^\s'\"<>]*")
_QUERY_SECRET = re.compile(r"(?i)(?:^|[?&;=\s])(password|passwd|pwd|pass|sslpassword)=([^&]*)")
_SECRET_KEYS = {"password", "passwd", "pwd", "pass", "sslpassword"}
_KV = re.compile(r"(?i)\b(password|passwd|pwd|sslpassword)(\s*[=:]\s*)('[^']*'|\"[^\"]*\"|[^\s&;,]*)")


def _pieces(secret: str) -> list[str]:
    return [secret, unquote(secret), *re.split(r"[@:/?#&\s]", secret), *re.split(r"[@:/?#&\s]", unquote(secret))]


def _redact_url(url: str, secrets: set[str]) -> str:
    scheme, rest = url.split("://", 1)
    query = unquote(rest.partition("?")[2])  # read as if the first ? starts the query (a password may hold @)
    for m in _QUERY_SECRET.finditer(query):
        secrets.update(_pieces(m.group(2)))
    at, start = rest.rfind("@"), 0  # userinfo ends at the last @: a password may hold @, / or ?
    if at >= 0 and ":" in rest[:at] and "/" not in rest[:at].split(":", 1)[0]:
        user, pw = rest[:at].split(":", 1)
        secrets.update(_pieces(pw))  # a driver may split it at any of @ : / ?
        rest = f"{user}:***{rest[at:]}"
        start = len(user) + 5
    q = rest.find("?", start)
    if q >= 0:
        parts = []
        for kv in rest[q + 1:].split("&"):
            k, eq, v = kv.partition("=")
            if eq and re.sub(r"[^a-z]", "", unquote(k).lower()) in _SECRET_KEYS:
                secrets.update(_pieces(v))
                kv = f"{k}=***"
            parts.append(kv)
        rest = rest[:q + 1] + "&".join(parts)
    return f"{scheme}://{rest}"


def redact(text: str, *urls: str) -> str:
    """`text` with every password hidden: URL userinfo (empty user, @ or / in it, percent-encoded),
    password query parameters, libpq key=value pairs, and any other copy of a password found in
    `text` or in `urls` (a driver's error text may carry it decoded)."""
    text = str(text)
    secrets: set[str] = set()
    for u in urls:
        if u and "://" in u:
            _redact_url(str(u), secrets)
        for m in _KV.finditer(str(u or "")):
            secrets.add(m.group(3).strip("'\""))
    if _one_url(text):  # one URL, whole (a password may hold a space or a quote)
        text = _redact_url(text, secrets)
    else:
        text = _URL.sub(lambda m: _redact_url(m.group(0), secrets), text)
    text = _replace(text, secrets)  # before key=value below cuts a password with a space in two
    for m in _KV.finditer(text):
        secrets.add(m.group(3).strip("'\""))
    text = _KV.sub(lambda m: f"{m.group(1)}{m.group(2)}***" if m.group(3) != "***" else m.group(0), text)
    return _replace(text, secrets)


def _one_url(text: str) -> bool:
    """Whether `text` must be read as a single URL: it starts with one (a scheme of one or two words) and either
    ends with it or its first token cannot be a whole URL (a user:password cut by a space, a port that is not
    a number, a password in the query). 'database postgresql://u:***@h/d is old' is prose around a URL."""
    m = re.match(r"[^:/\s]*(\s[^:/\s]*)?://(\S*)(\s?)", text)
    if not m:
        return False
    token, after = m.group(2), text[m.end():]
    if not m.group(3):
        return True
    if "@" not in token and "@" in after:
        return True
    host = re.sub(r"\[[^\]]*\]", "", re.split(r"[/?#]", token.rpartition("@")[2], maxsplit=1)[0])
    if ":" in host and not re.fullmatch(r"[^:]*:\d*", host):
        return True
    return bool(_QUERY_SECRET.search(unquote(token.partition("?")[2])))


def _replace(text: str, secrets: set[str]) -> str:
    for sec in sorted((s for s in secrets if len(s) >= 3 and s != "***"), key=len, reverse=True):
        text = text.replace(sec, "***")
    return text


def short(value, n: int = 60) -> str:
    """repr(value) cut to n characters: messages never echo a large user value."""
    try:
        r = repr(value) if not isinstance(value, (dict, list)) else json.dumps(value, default=str)[: n + 1]
    except Exception:
        r = f"<{type(value).__name__}>"
    return r if len(r) <= n else r[: n - 3] + "..."


def checksum(winners: list[dict]) -> str:
    return hashlib.sha256(json.dumps(winners, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


@dataclass(frozen=True)
class Table:
    device_class: str
    fingerprint: dict
    winners: list[dict]  # op, problem (dict), impl, params, kernel_version, median_ms, vendor_impl, vendor_ms, speedup
    source: str


MAX_BYTES = 512 << 20
# An exported table nests 5 levels (table, winners, winner, params, a value); JSON nested deeper than this is refused
# by the same rule everywhere (load, check, sign). Python's own limit depends on how deep the caller's stack is: a
# 985-level table loaded in one process and was "corrupt" in another.
MAX_DEPTH = 32


def too_deep(obj, limit: int = MAX_DEPTH) -> bool:
    """Whether `obj` (parsed JSON) nests lists and objects more than `limit` levels (iterative: no recursion)."""
    if not isinstance(obj, (dict, list)):
        return False
    stack = [(obj, 1)]
    while stack:
        o, d = stack.pop()
        if d > limit:
            return True
        for v in (o.values() if isinstance(o, dict) else o):
            if isinstance(v, (dict, list)):
                stack.append((v, d + 1))
    return False


def parse_json(raw: bytes | str, shown: str, what: str = "tuned table") -> object:
    """JSON text as data, or a one-line TableError: not JSON, or nested deeper than MAX_DEPTH."""
    deep = False
    try:
        data = json.loads(raw)
    except RecursionError:
        deep = True
    except (ValueError, UnicodeDecodeError):
        raise TableError(f"{what} {shown} is corrupt (not JSON); export it again with opsadv-export") from None
    if deep or too_deep(data):
        raise TableError(f"{what} {shown} nests JSON more than {MAX_DEPTH} levels deep, which no exported table does; "
                         f"export it again with opsadv-export")
    return data


def sqlite_url(path: str) -> str:
    """sqlite:/// URL of a file path, as SQLAlchemy reads it back: %, ? and # quoted (a path is a path, never a
    query or a percent-escape)."""
    return "sqlite:///" + path.replace("%", "%25").replace("?", "%3F").replace("#", "%23")


def sqlite_path(url: str) -> str:
    """The file a sqlite:/// URL names, read as SQLAlchemy reads it (the path ends at ?, then is percent-decoded)."""
    path = unquote(url.split(":///", 1)[1].split("?", 1)[0])
    return os.path.expanduser(path) if path.startswith("~") else path  # as the tuner reads it


def signature(data: dict, key: str) -> str:
    """HMAC-SHA256 with `key` over the table's canonical JSON (everything but the signature). A key that is
    not UTF-8 (undecodable bytes in the environment) is its raw bytes."""
    body = json.dumps({k: v for k, v in data.items() if k != "signature"}, sort_keys=True, separators=(",", ":"))
    return hmac.new(key.encode("utf-8", "surrogateescape"), body.encode("utf-8", "surrogateescape"),
                    hashlib.sha256).hexdigest()


def signed_by(data: dict, key: str) -> bool:
    """Whether `data`'s signature is `key`'s (a signature that is not 64 hex digits never is)."""
    sig = data.get("signature")
    if not isinstance(sig, str) or not sig.isascii():
        return False
    return hmac.compare_digest(sig, signature(data, key))


def key() -> str | None:
    """OPS_ADV_TABLE_KEY, the key tables must be signed with (None: not set)."""
    return os.environ.get("OPS_ADV_TABLE_KEY") or None


def _structure(path: str, data: dict) -> None:
    """A one-line TableError for a table whose shape the runtime cannot use."""
    where = f"tuned table {path}"
    if not isinstance(data.get("device_class"), str) or not data["device_class"]:
        raise TableError(f"{where} has no device_class; export it again with opsadv-export")
    if not isinstance(data.get("fingerprint", {}), dict):
        raise TableError(f"{where}: fingerprint must be an object; export it again with opsadv-export")
    for n, w in enumerate(data["winners"]):
        structure_of_winner(where, n, w)


def structure_of_winner(where: str, n: int, w) -> None:
    if not isinstance(w, dict):
        raise TableError(f"{where}: winner {n} is not an object; export it again with opsadv-export")
    for key, kind, name in (("op", str, "text"), ("impl", str, "text"), ("problem", dict, "an object"), ("params", dict, "an object")):
        if not isinstance(w.get(key), kind):
            raise TableError(f"{where}: winner {n} has no {key} (it must be {name}); export it again with opsadv-export")
    for key, kind, name in (("kernel_version", str, "text"), ("conditions", dict, "an object")):
        if w.get(key) is not None and not isinstance(w[key], kind):
            raise TableError(f"{where}: winner {n}: {key} must be {name}; export it again with opsadv-export")


def read_file(path: str) -> Table:
    shown = short(path, 200).strip("'")
    try:
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode):
            raise TableError(f"tuned table {shown} is not a regular file; check OPS_ADV_TABLE")
        with open(path, "rb") as f:
            raw = f.read(MAX_BYTES + 1)
    except OSError as e:
        raise TableError(f"cannot read tuned table {shown}: {e.strerror}; check OPS_ADV_TABLE") from None
    if len(raw) > MAX_BYTES:
        raise TableError(f"tuned table {shown} is larger than {MAX_BYTES >> 20} MiB; check OPS_ADV_TABLE")
    data = parse_json(raw, shown)
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise TableError(f"{shown} is not an ops-adv tuned table; export one with opsadv-export")
    if data.get("format_version") != FORMAT_VERSION:
        raise TableError(f"tuned table {shown} has format {short(data.get('format_version'), 20)}, this ops-adv reads {FORMAT_VERSION}; export it again")
    winners = data.get("winners")
    try:
        ok = isinstance(winners, list) and data.get("checksum") == checksum(winners)
    except (TypeError, ValueError, RecursionError):
        ok = False
    if not ok:
        raise TableError(f"tuned table {shown} is corrupt (checksum mismatch); export it again with opsadv-export")
    k = key()
    if k:
        sig = data.get("signature")
        if not signed_by(data, k):
            raise TableError(
                f"tuned table {shown} is {'not signed' if sig is None else 'signed with another key or changed since'} "
                f"(OPS_ADV_TABLE_KEY is set); sign it with: python -m ops_adv sign {shown}"
            )
    _structure(shown, data)
    return Table(data["device_class"], data.get("fingerprint") or {}, winners, path)


def read_database(url: str) -> list[Table]:
    """Winners straight from a tuning database (SQLite through the stdlib; PostgreSQL needs psycopg)."""
    query = (
        "select w.device_class, p.op, p.key, w.impl, w.params, w.kernel_version, w.median_ms, w.vendor_impl, w.vendor_ms, w.speedup "
        "from opsadv_winners w join opsadv_problems p on p.id = w.problem_id"
    )
    try:
        if url.startswith("sqlite:///"):
            import sqlite3

            path = sqlite_path(url)
            if os.path.isdir(path):
                raise TableError(f"tuning database {redact(url)[:200]} is a folder, not an SQLite file; "
                                 f"name the database file in it (such as {os.path.join(short(path, 120).strip(chr(39)), 'tuning.db')})")
            if not os.path.isfile(path):
                raise TableError(f"tuning database {redact(url)[:200]} does not exist; run opsadv-tune first or fix the URL")
            if not os.access(path, os.R_OK):
                raise TableError(f"tuning database {redact(url)[:200]} is not readable by this user (permission denied); "
                                 f"fix its permissions or export a table (opsadv-export) and point OPS_ADV_TABLE at it")
            from urllib.parse import quote

            con = sqlite3.connect(f"file:{quote(os.path.abspath(path))}?mode=ro", uri=True)  # quoted: # ? % are the path's
            try:
                rows = con.execute(query).fetchall()
            finally:
                con.close()
        elif url.startswith(("postgresql", "postgres")):
            import psycopg  # optional: only for a runtime that reads a shared fleet database

            with psycopg.connect(url.replace("postgresql+psycopg://", "postgresql://")) as con:
                rows = con.execute(query).fetchall()
        else:
            raise TableError(f"OPS_ADV_TABLE {redact(url)[:200]} is neither a table file nor a sqlite:/// or postgresql:// URL")
    except TableError:
        raise
    except Exception as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise TableError(f"cannot read winners from {redact(url)[:200]}: {redact(first, url)[:200]}") from None
    by_class: dict[str, list[dict]] = {}
    for n, (dc, op, key, impl, params, kv, med, vimpl, vms, sp) in enumerate(rows):
        try:
            w = {
                "op": op, "problem": json.loads(key), "impl": impl, "params": json.loads(params) if isinstance(params, str) else params,
                "kernel_version": kv, "median_ms": med, "vendor_impl": vimpl, "vendor_ms": vms, "speedup": sp,
            }
            deep = too_deep(w["problem"], MAX_DEPTH - 3) or too_deep(w["params"], MAX_DEPTH - 3)
        except (TypeError, ValueError, RecursionError):
            deep = True
        if deep:
            raise TableError(f"tuning database {redact(url)[:200]}: winner {n} is not readable JSON; re-tune it") from None
        structure_of_winner(f"tuning database {redact(url)[:200]}", n, w)
        by_class.setdefault(str(dc), []).append(w)
    return [Table(dc, {}, ws, url) for dc, ws in by_class.items()]


class UnsignedSource(RuntimeWarning):
    """A table source that cannot be signed (a database) while OPS_ADV_TABLE_KEY is set: it is not used."""


def load(spec: str) -> list[Table]:
    if "://" in spec:
        if key():
            import warnings

            warnings.warn(
                f"OPS_ADV_TABLE_KEY is set, but winners read from a database ({redact(spec)[:200]}) cannot be signed: "
                "they are not used and calls run the vendor kernels; export a table (opsadv-export), sign it "
                "(python -m ops_adv sign FILE) and point OPS_ADV_TABLE at the file",
                UnsignedSource, stacklevel=3)
            return []
        return read_database(spec)
    paths = [os.path.expanduser(p) for p in spec.split(os.pathsep) if p.strip()]
    if not paths:
        raise TableError(f"OPS_ADV_TABLE={short(spec, 40)} names no file; set it to a table file (several separated by "
                         f"{os.pathsep!r}) or a database URL, or unset it")
    out: list[Table] = []
    for p in paths:
        if _is_sqlite(p):  # a tuning database given as a path, as the tuner takes it
            out += load(sqlite_url(os.path.abspath(p)))
        else:
            out.append(read_file(p))
    return out


def _is_sqlite(path: str) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(16) == b"SQLite format 3\x00"
    except OSError:
        return False
