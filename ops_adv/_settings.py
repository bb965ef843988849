"""Every OPS_ADV_ environment variable, read in one place."""
from __future__ import annotations

import os


def table_path() -> str | None:
    """OPS_ADV_TABLE: exported table file(s) (os.pathsep-separated) or a database URL."""
    return os.environ.get("OPS_ADV_TABLE") or None


def db_url() -> str | None:
    """OPS_ADV_DB: the tuning database URL, used by the tuner and as the runtime's fallback table."""
    return os.environ.get("OPS_ADV_DB") or None


def nearest_max_distance() -> float:
    """OPS_ADV_NEAREST: how far (Σ |log2 ratio| of sizes) a tuned problem may be to stand in for a miss."""
    return float(os.environ.get("OPS_ADV_NEAREST", "1.0"))


def plugins() -> list[str]:
    """OPS_ADV_PLUGINS: comma-separated modules that register extra implementations."""
    return [m.strip() for m in os.environ.get("OPS_ADV_PLUGINS", "").split(",") if m.strip()]
