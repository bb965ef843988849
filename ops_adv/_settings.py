"""Every OPS_ADV_ environment variable, read in one place."""
from __future__ import annotations

import os
import warnings


def table_path() -> str | None:
    """OPS_ADV_TABLE: exported table file(s) (os.pathsep-separated; ~ is expanded) or a database URL."""
    return os.environ.get("OPS_ADV_TABLE") or None


def db_url() -> str | None:
    """OPS_ADV_DB: the tuning database URL, used by the tuner and as the runtime's fallback table; a bare
    path is an SQLite file, as the tuner reads it."""
    url = os.environ.get("OPS_ADV_DB") or None
    if url and "://" not in url:  # quoted as the tuner quotes it: %, ? and # belong to the path
        path = os.path.abspath(os.path.expanduser(url))
        url = "sqlite:///" + path.replace("%", "%25").replace("?", "%3F").replace("#", "%23")
    return url


NEAREST_DEFAULT = 1.0
_nearest_seen: tuple[str | None, float] = (None, NEAREST_DEFAULT)


def nearest_max_distance() -> float:
    """OPS_ADV_NEAREST: how far (Σ |log2 ratio| of sizes) a tuned problem may be to stand in for a miss;
    a value that is not a number >= 0 (inf: any distance) warns once and the default (1.0) holds."""
    global _nearest_seen
    raw = os.environ.get("OPS_ADV_NEAREST")
    if raw is None or raw.strip() == "":
        return NEAREST_DEFAULT
    if raw == _nearest_seen[0]:
        return _nearest_seen[1]
    try:
        value = float(raw)
        ok = value >= 0  # nan fails too; inf: any distance
    except ValueError:
        ok = False
    if not ok:
        warnings.warn(f"OPS_ADV_NEAREST={raw[:40]!r} is not a number >= 0 (a distance in octaves, e.g. 1.0); "
                      f"using the default {NEAREST_DEFAULT}", RuntimeWarning, stacklevel=2)
        value = NEAREST_DEFAULT
    _nearest_seen = (raw, value)
    return value


def plugins() -> list[str]:
    """OPS_ADV_PLUGINS: comma-separated modules that register extra implementations."""
    return [m.strip() for m in os.environ.get("OPS_ADV_PLUGINS", "").split(",") if m.strip()]


def compile_keeps_operators() -> bool:
    """OPS_ADV_COMPILE_OPERATORS=1: under torch.compile every covered call is its `ops_adv::` operator, even
    where the table leaves the op to vendor kernels (the graph then never depends on the table). By default
    such ops trace as torch's own functions, which Inductor can fuse."""
    return os.environ.get("OPS_ADV_COMPILE_OPERATORS", "").strip().lower() in ("1", "true", "yes", "on")


def passthrough() -> bool:
    """OPS_ADV_PASSTHROUGH=0: converted models dispatch every call even where nothing is tuned for the device (so
    `misses()` counts them, and the dispatch paths run as they do with a table). By default such calls run the
    original module's code (ops_adv._dispatch.passthrough). Read when the tables or caches change."""
    return os.environ.get("OPS_ADV_PASSTHROUGH", "").strip().lower() not in ("0", "false", "no", "off")


def generate_graphs() -> bool | None:
    """OPS_ADV_GENERATE_GRAPHS: whether generate() on a converted model runs its decode steps in ops-adv's CUDA
    graphs (ops_adv.models.graphs) instead of transformers' torch.compile. 1: always; 0: never; unset: where a
    table with winners for the device is loaded (None)."""
    raw = os.environ.get("OPS_ADV_GENERATE_GRAPHS", "").strip().lower()
    if raw in ("1", "true", "yes", "on"):
        return True
    if raw in ("0", "false", "no", "off"):
        return False
    return None


DB_RETRY_DEFAULT = 60.0


def db_retry_s() -> float:
    """OPS_ADV_DB_RETRY_S: how long a running tune waits for its database to come back (a server restarting, a
    connection cut, SQLite busy) before it fails with one line; 0 fails at once. Default 60 s."""
    raw = os.environ.get("OPS_ADV_DB_RETRY_S", "").strip()
    try:
        value = float(raw) if raw else DB_RETRY_DEFAULT
    except ValueError:
        value = -1.0
    if not 0 <= value < float("inf"):
        warnings.warn(f"OPS_ADV_DB_RETRY_S={raw[:40]!r} is not a number of seconds >= 0; using {DB_RETRY_DEFAULT:g}",
                      RuntimeWarning, stacklevel=2)
        value = DB_RETRY_DEFAULT
    return value
