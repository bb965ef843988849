"""The tuning database: SQLAlchemy models and Alembic migrations shipped with the package."""
from __future__ import annotations

from ._engine import DatabaseError, check_schema, current, default_url, head, make_engine, normalize, open_db, redact, upgrade
from .models import Base, Device, Problem, Run, Trial, Winner

__all__ = [
    "Base", "DatabaseError", "Device", "Problem", "Run", "Trial", "Winner", "check_schema", "current",
    "default_url", "head", "make_engine", "normalize", "open_db", "redact", "upgrade",
]
