"""Engines, migrations and schema checks for ops-adv's database."""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import TYPE_CHECKING

from kernel_space import OpsAdvError

if TYPE_CHECKING:
    from sqlalchemy.engine import Engine

MIGRATIONS = Path(__file__).resolve().parent / "migrations"
VERSION_TABLE = "opsadv_alembic_version"


class DatabaseError(OpsAdvError):
    pass


def default_url() -> str:
    """OPS_ADV_DB, else SQLite under $XDG_DATA_HOME/ops-adv (~/.local/share/ops-adv)."""
    url = os.environ.get("OPS_ADV_DB")
    if url:
        return url
    base = Path(os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share") / "ops-adv"
    return f"sqlite:///{base / 'tuning.db'}"


def redact(url: str) -> str:
    """The URL with any password replaced by ***."""
    return re.sub(r"(://[^:/@]+:)[^@]*@", r"\1***@", url)


def normalize(url: str) -> str:
    if "://" not in url:  # a bare path means SQLite
        return f"sqlite:///{Path(url).expanduser().resolve()}"
    scheme, rest = url.split("://", 1)
    if scheme in ("postgres", "postgresql"):
        return f"postgresql+psycopg://{rest}"
    if not (scheme.startswith("sqlite") or scheme.startswith("postgresql")):
        raise DatabaseError(f"unsupported database URL scheme {scheme!r} in {redact(url)}; use sqlite:///PATH or postgresql://USER@HOST/DB")
    return url


def make_engine(url: str, *, create_dir: bool = True) -> "Engine":
    from sqlalchemy import create_engine, event, text
    from sqlalchemy.exc import ArgumentError, NoSuchModuleError, OperationalError

    url = normalize(url)
    if url.startswith("sqlite:///") and create_dir:
        path = url[len("sqlite:///"):]
        if path and path != ":memory:":
            try:
                Path(path).parent.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise DatabaseError(f"cannot create the folder for {path}: {e.strerror}; pass --db with a writable path") from None
    try:
        kw = {"connect_args": {"timeout": 30}} if url.startswith("sqlite") else {"pool_pre_ping": True}
        engine = create_engine(url, **kw)
    except (ArgumentError, NoSuchModuleError) as e:
        hint = "; install the postgres extra: pip install 'ops-adv[postgres]'" if "psycopg" in str(e) else ""
        raise DatabaseError(f"bad database URL {redact(url)}: {str(e).splitlines()[0]}{hint}") from None
    except ModuleNotFoundError as e:
        raise DatabaseError(f"no driver for {redact(url)} ({e.name} missing); install the postgres extra: pip install 'ops-adv[postgres]'") from None
    if url.startswith("sqlite"):
        @event.listens_for(engine, "connect")
        def _pragmas(dbapi_conn, _rec):  # WAL: the tuner writes while optuna reads
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA foreign_keys=ON")
            cur.close()
    try:
        with engine.connect() as conn:
            conn.execute(text("select 1"))
    except OperationalError as e:
        reason = str(e.orig).strip().splitlines()[0] if e.orig else str(e).splitlines()[0]
        raise DatabaseError(f"cannot reach database {redact(url)}: {redact(reason)}; check the URL and that the server is running") from None
    return engine


def _alembic_config(engine: "Engine"):
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    cfg.set_main_option("sqlalchemy.url", engine.url.render_as_string(hide_password=False).replace("%", "%%"))
    return cfg


def upgrade(engine: "Engine", revision: str = "head") -> None:
    from alembic import command

    cfg = _alembic_config(engine)
    with engine.begin() as conn:
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, revision)


def current(engine: "Engine") -> str | None:
    from alembic.runtime.migration import MigrationContext

    with engine.connect() as conn:
        ctx = MigrationContext.configure(conn, opts={"version_table": VERSION_TABLE})
        return ctx.get_current_revision()


def head() -> str:
    from alembic.script import ScriptDirectory

    return ScriptDirectory(str(MIGRATIONS)).get_current_head()


def check_schema(engine: "Engine", url: str) -> None:
    """Refuse a database whose schema is not at head, naming the command that fixes it."""
    cur, want = current(engine), head()
    if cur != want:
        raise DatabaseError(
            f"database {redact(url)} is at schema {cur or 'none'}, this ops-adv needs {want}; "
            f"back it up, then run: opsadv-db upgrade {redact(url)}"
        )


def open_db(url: str, *, migrate: bool = True) -> "Engine":
    """Engine for `url`, migrated to head when `migrate` (a fresh SQLite file is created)."""
    engine = make_engine(url)
    if migrate:
        upgrade(engine)
    else:
        check_schema(engine, url)
    return engine
