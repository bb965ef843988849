"""Engines, migrations and schema checks for ops-adv's database."""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import TYPE_CHECKING

from kernel_space import OpsAdvError
from ops_adv._table import redact, short, sqlite_path, sqlite_url

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
    return sqlite_url(str(base / "tuning.db"))


# Messages start with "the database ..." (a habit kept from before redact() told prose around a URL from a URL
# whose password holds a space; it now keeps the prose either way).


def _url_error(url: str, why: str, fix: str) -> "DatabaseError":
    return DatabaseError(f"{why} ({redact(url)}); {fix}")


def classify(e: BaseException, url: str, doing: str = "use") -> "DatabaseError":
    """One line with the fix for a driver or migration error (never the driver's multi-line text)."""
    orig = getattr(e, "orig", None) or e
    reason = redact(str(orig).strip().splitlines()[0] if str(orig).strip() else type(orig).__name__, url)[:200]
    low = reason.lower()
    sqlite = normalize(url).startswith("sqlite")
    where = f"database {redact(url)}"
    if "file is not a database" in low or "database disk image is malformed" in low:
        return DatabaseError(f"the {where} is not an SQLite database (or is damaged); pass --db with another path, or move the file away")
    if "readonly" in low or "read-only" in low or "read only" in low:
        return DatabaseError(f"the {where} is read-only ({reason}); tuning writes to it: pass --db with a writable database")
    if sqlite and ("unable to open" in low or "disk i/o" in low or "permission" in low):
        return DatabaseError(f"cannot open {where}: {reason}; check that the path and its folder exist and are writable")
    if "password authentication" in low or "authentication failed" in low or "no password supplied" in low:
        return DatabaseError(f"cannot log in to {where}: {reason}; check the user name and password")
    if "does not exist" in low and "database" in low:
        return DatabaseError(f"cannot {doing} {where}: {reason}; create the database first (createdb)")
    if not sqlite and ("connection" in low or "connect" in low or "timeout" in low or "resolve" in low or "host" in low):
        return DatabaseError(f"cannot reach {where}: {reason}; check the URL and that the server is running")
    return DatabaseError(f"cannot {doing} {where}: {reason}")


def driver_error(e: BaseException) -> BaseException | None:
    """The database driver's (or the OS's) error behind `e`: SQLAlchemy and optuna wrap it, optuna's in a vague
    StorageInternalError whose cause is the SQLAlchemy error. None when `e` is not a database error."""
    from sqlalchemy.exc import SQLAlchemyError

    seen: set[int] = set()
    cur: BaseException | None = e
    found = None
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if isinstance(cur, SQLAlchemyError):
            found = getattr(cur, "orig", None) or cur
            break
        if type(cur).__name__ == "StorageInternalError" and found is None:
            found = cur
        cur = cur.__cause__ or cur.__context__
    return found


_FULL = ("database or disk is full", "no space left", "disk full", "diskfull", "could not extend file", "file too large",
         "disk i/o error", "quota", "could not write")


def write_error(e: BaseException, url: str, run_state: str) -> DatabaseError:
    """One line for a database error in the middle of a run: what failed, where, what to do and the run's state."""
    orig = driver_error(e) or e
    first = str(orig).strip().splitlines()[0] if str(orig).strip() else type(orig).__name__
    code = getattr(orig, "sqlite_errorname", None) or getattr(orig, "sqlstate", None)
    reason = redact(first + (f" ({code})" if code else ""), url)[:200]
    where = f"the database {redact(url)}"
    if any(k in reason.lower() for k in _FULL):
        fix = "its disk is full or refuses writes: free space there (or pass --db with another database) and re-run the same command to resume"
    elif not normalize(url).startswith("sqlite") and any(k in reason.lower() for k in ("connect", "server", "timeout", "terminat")):
        fix = "the server went away: check that it runs, then re-run the same command to resume"
    else:
        fix = "fix the database, then re-run the same command to resume"
    return DatabaseError(f"writing to {where} failed: {reason}; {fix}; {run_state}")


_KEY_VALUE = re.compile(r"(^|\s)[A-Za-z_]+\s*=")  # libpq's "host=... dbname=... password=..."
_DB_SUFFIXES = (".db", ".sqlite", ".sqlite3")


def normalize(url: str) -> str:
    if "://" not in url:  # a bare path means SQLite
        if _KEY_VALUE.search(url):
            raise DatabaseError("the database is given as libpq key=value pairs, which ops-adv does not read; "
                                "write it as a URL: postgresql://USER:PASSWORD@HOST:PORT/DB")
        if not (os.sep in url or "/" in url or url.startswith("~") or url.lower().endswith(_DB_SUFFIXES)):
            shown = f"{url!r} " if re.fullmatch(r"[\w.\-]{1,40}", url) else ""
            raise DatabaseError(f"the database {shown}is neither a URL nor a path to an SQLite file; write sqlite:///PATH, "
                                f"postgresql://USER@HOST/DB, or a path such as ./tuning.db")
        return sqlite_url(str(Path(url).expanduser().resolve()))  # %, ? and # quoted: SQLAlchemy reads back this path
    scheme, rest = url.split("://", 1)
    if scheme == "sqlite" and rest.startswith("/~"):  # sqlite:///~/x.db: the home folder, as the runtime reads it
        return sqlite_url(os.path.expanduser(sqlite_path(url))) + (f"?{rest.split('?', 1)[1]}" if "?" in rest else "")
    if scheme in ("postgres", "postgresql"):
        return f"postgresql+psycopg://{rest}"
    if not (scheme.startswith("sqlite") or scheme.startswith("postgresql")):
        raise DatabaseError(f"unsupported database URL scheme {short(scheme, 30)} in {redact(url)[:200]}; use sqlite:///PATH or postgresql://USER@HOST/DB")
    return url


def check_url(url: str):
    """The parsed URL, or a one-line DatabaseError (scheme, syntax, a non-numeric port); connects to nothing."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    url = normalize(url)
    try:
        parsed = make_url(url)
    except ValueError:
        raise _url_error(url, "bad database URL: its port is not a number", "write postgresql://USER@HOST:5432/DB") from None
    except ArgumentError:
        raise _url_error(url, "bad database URL", "write sqlite:///PATH or postgresql://USER@HOST[:PORT]/DB") from None
    return parsed


def make_engine(url: str, *, create_dir: bool = True, must_exist: bool = False) -> "Engine":
    """An engine for `url`, checked by one query; `must_exist`: an SQLite file that is not there is an error, not created
    (what read-only commands want: a mistyped path is not a new empty database)."""
    from sqlalchemy import create_engine, event, text
    from sqlalchemy.exc import ArgumentError, NoSuchModuleError, SQLAlchemyError

    url = normalize(url)
    parsed = check_url(url)
    if must_exist and url.startswith("sqlite"):
        path = parsed.database or ""
        if path and path != ":memory:" and not path.startswith("file:") and not os.path.exists(path):
            raise DatabaseError(f"there is no database at {redact(path)}; check the path (opsadv-tune creates the database)")
    if url.startswith("sqlite:///") and create_dir:
        path = parsed.database or ""
        if path and path != ":memory:" and not path.startswith("file:"):
            if os.path.exists(path) and not os.path.isfile(path):
                raise DatabaseError(f"the database {redact(url)} is not a file; pass --db with the path of an SQLite file")
            try:
                Path(path).parent.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise DatabaseError(f"cannot create the folder for {redact(path)}: {e.strerror}; pass --db with a writable path") from None
    try:
        kw = {"connect_args": {"timeout": 30}} if url.startswith("sqlite") else {"pool_pre_ping": True}
        engine = create_engine(url, **kw)
    except (ArgumentError, NoSuchModuleError) as e:
        hint = "; install the postgres extra: pip install 'ops-adv[postgres]'" if "psycopg" in str(e) else ""
        raise DatabaseError(f"bad database URL {redact(url)}: {redact(str(e).splitlines()[0], url)[:200]}{hint}") from None
    except ModuleNotFoundError as e:
        raise DatabaseError(f"no driver for {redact(url)} ({e.name} missing); install the postgres extra: pip install 'ops-adv[postgres]'") from None
    except (ValueError, TypeError) as e:
        raise _url_error(url, f"bad database URL: {redact(str(e), url)[:120]}", "check its query parameters") from None
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
    except (SQLAlchemyError, OSError, ValueError, TypeError) as e:
        raise classify(e, url, "open") from None
    return engine


def _alembic_config(engine: "Engine"):
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    cfg.set_main_option("sqlalchemy.url", engine.url.render_as_string(hide_password=False).replace("%", "%%"))
    return cfg


def upgrade(engine: "Engine", revision: str = "head") -> None:
    from alembic import command
    from alembic.util.exc import CommandError
    from sqlalchemy.exc import SQLAlchemyError

    url = engine.url.render_as_string(hide_password=False)
    _refuse_unknown(engine, url)
    cfg = _alembic_config(engine)
    try:
        with engine.begin() as conn:
            cfg.attributes["connection"] = conn
            command.upgrade(cfg, revision)
    except CommandError as e:
        raise DatabaseError(f"cannot migrate database {redact(url)}: {redact(str(e), url)[:200]}") from None
    except SQLAlchemyError as e:
        raise classify(e, url, "migrate") from None


def current(engine: "Engine") -> str | None:
    from alembic.runtime.migration import MigrationContext
    from sqlalchemy.exc import SQLAlchemyError

    try:
        with engine.connect() as conn:
            ctx = MigrationContext.configure(conn, opts={"version_table": VERSION_TABLE})
            return ctx.get_current_revision()
    except SQLAlchemyError as e:
        raise classify(e, engine.url.render_as_string(hide_password=False), "read") from None


def head() -> str:
    from alembic.script import ScriptDirectory

    return ScriptDirectory(str(MIGRATIONS)).get_current_head()


def known(revision: str) -> bool:
    from alembic.script import ScriptDirectory

    try:
        return ScriptDirectory(str(MIGRATIONS)).get_revision(revision) is not None
    except Exception:
        return False


def _refuse_unknown(engine: "Engine", url: str) -> None:
    """A schema newer than this code, or ops-adv tables without their version table: no migration fixes these."""
    from sqlalchemy import inspect
    from sqlalchemy.exc import SQLAlchemyError

    cur = current(engine)
    if cur is not None and not known(cur):
        raise DatabaseError(
            f"the database {redact(url)} is at schema {cur[:40]}, newer than this ops-adv (head {head()}); "
            f"upgrade ops-adv (pip install -U ops-adv) or pass --db with another database"
        )
    if cur is None:
        try:
            names = inspect(engine).get_table_names()
        except SQLAlchemyError as e:
            raise classify(e, url, "read") from None
        if any(n.startswith("opsadv_") and n != VERSION_TABLE for n in names):
            raise DatabaseError(
                f"the database {redact(url)} has ops-adv tables but no {VERSION_TABLE} table, so its schema is unknown; "
                f"pass --db with another database, or move this one away and tune again"
            )


def check_schema(engine: "Engine", url: str) -> None:
    """Refuse a database whose schema is not at head, naming the command that fixes it."""
    _refuse_unknown(engine, url)
    cur, want = current(engine), head()
    if cur != want:
        raise DatabaseError(
            f"the database {redact(url)} is at schema {cur or 'none'}, this ops-adv needs {want}; "
            f"back it up, then run: opsadv-db upgrade {redact(url)}"
        )


def check_writable(engine: "Engine", url: str) -> None:
    """Refuse a read-only database now, not at the first stored trial."""
    from sqlalchemy import text
    from sqlalchemy.exc import SQLAlchemyError

    try:
        with engine.connect() as conn:
            conn.execute(text(f"update {VERSION_TABLE} set version_num = version_num"))
            conn.rollback()
    except SQLAlchemyError as e:
        raise classify(e, url, "write to") from None


def open_db(url: str, *, migrate: bool = True) -> "Engine":
    """Engine for `url`, migrated to head when `migrate` (a fresh SQLite file is created)."""
    engine = make_engine(url, must_exist=not migrate)
    if migrate:
        upgrade(engine)
        check_writable(engine, url)
    else:
        check_schema(engine, url)
    return engine


class DatabaseFile:
    """The SQLite file a run opened, watched for the run's whole length.

    Deleting or replacing the file under a running tuner does not stop SQLite: it keeps writing to the unlinked
    file, and everything stored since is gone when the process exits (a tune ended with rc=0 and its winners
    lost). `changed()` compares the path's device and inode with those opened; `rescue()` copies what the run
    wrote, through a connection held open since the start, to a new file beside the old path.
    """

    def __init__(self, path: str) -> None:
        import sqlite3
        from urllib.parse import quote

        self.path = os.path.abspath(path)
        st = os.stat(self.path)
        self.ident = (st.st_dev, st.st_ino)
        # mode=rw: never creates a file; WAL readers see every commit of the run's other connections
        self._conn = sqlite3.connect(f"file:{quote(self.path)}?mode=rw", uri=True, check_same_thread=False)
        # a first read opens the write-ahead log and its index now: once unlinked they cannot be opened by name
        # (a backup through a connection that never read failed with "disk I/O error")
        self._conn.execute("select count(*) from sqlite_master").fetchall()
        st = os.stat(self.path)
        if (st.st_dev, st.st_ino) != self.ident:  # replaced between the two looks: watch nothing rather than the wrong file
            self._conn.close()
            self._conn = None

    @classmethod
    def of(cls, url: str) -> "DatabaseFile | None":
        """The watched file of an SQLite URL (None for PostgreSQL, memory or URI-form databases)."""
        url = normalize(url)
        if not url.startswith("sqlite:///"):
            return None
        path = sqlite_path(url)
        if not path or path == ":memory:" or path.startswith("file:"):
            return None
        try:
            return cls(path)
        except Exception:
            return None

    def changed(self) -> str | None:
        """What happened to the file since it was opened ("was deleted", ...), or None while it is the same file."""
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return "was deleted"
        except OSError as e:
            return f"can no longer be found ({e.strerror})"
        if (st.st_dev, st.st_ino) != self.ident:
            return "was replaced by another file"
        return None

    def rescue(self) -> str | None:
        """Copy the database the run wrote (the file it opened, deleted or not) to a new file beside its old path;
        that file's path, or None when it cannot be written."""
        import sqlite3

        if self._conn is None:
            return None
        base = f"{self.path}.rescued"
        for n in range(100):
            dst = base if n == 0 else f"{base}-{n}"
            try:
                fd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)  # never over an existing file
            except FileExistsError:
                continue
            except OSError:
                return None
            os.close(fd)
            try:
                out = sqlite3.connect(dst)
                try:
                    self._conn.backup(out)
                finally:
                    out.close()
                return dst
            except Exception:
                try:
                    os.unlink(dst)
                except OSError:
                    pass
                return None
        return None

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None


class DatabaseGone(DatabaseError):
    """The SQLite file of a running tune was deleted or replaced (see DatabaseFile)."""


# ---- a database that goes away for a while (a server restart) ----------------------------------------------------

def transient(e: BaseException) -> bool:
    """Whether waiting may cure database error `e`: a connection cut or refused (a PostgreSQL restart, a network
    blip) or SQLite busy. A login refused, a missing database, a full disk or a bad query are not.

    A connection cut inside a transaction that is then used again raises SQLAlchemy's PendingRollbackError "Can't
    reconnect until invalid transaction is rolled back" (code 8s2b, raised only for an invalidated connection), which
    names no driver error: optuna's trial loading does this (it catches the cut's OperationalError, queries again on
    the same session, then rolls the session back and raises StorageInternalError). The cut is usually still in its
    chain (__context__), but it counts on its own: a retry runs on a fresh session (optuna's, like ours, is rolled back
    and closed when an operation fails, and the next one checks out a new connection)."""
    from sqlalchemy.exc import DBAPIError, DisconnectionError, PendingRollbackError

    seen: set[int] = set()
    cur: BaseException | None = e
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if isinstance(cur, DisconnectionError) or (isinstance(cur, DBAPIError) and cur.connection_invalidated):
            return True
        if isinstance(cur, PendingRollbackError) and getattr(cur, "code", None) == "8s2b":
            return True
        orig = getattr(cur, "orig", None)
        if isinstance(orig, BaseException) and id(orig) not in seen:
            cur = orig
            continue
        kind, text = type(cur), str(cur).lower()
        if kind.__module__.startswith("psycopg") and any(c.__name__ == "OperationalError" for c in kind.__mro__):
            state = getattr(cur, "sqlstate", None) or ""
            if state.startswith(("08", "57P")):  # connection exception; admin shutdown, crash shutdown, cannot connect now
                return True
            refused = ("authentication", "password", "does not exist", "permission denied", "no pg_hba", "not permitted")
            return not state and not any(k in text for k in refused)  # connecting failed: refused, reset, shutting down
        if kind.__module__ == "sqlite3" and ("database is locked" in text or "database is busy" in text):
            return True
        cur = cur.__cause__ or cur.__context__
    return False


def _reason(e: BaseException) -> str:
    """The first line of the first error in `e`'s chain that says something (a cut connection's may be empty)."""
    seen: set[int] = set()
    cur: BaseException | None = driver_error(e) or e
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        lines = str(cur).strip().splitlines()
        if lines and re.search(r"[A-Za-z]{3}", lines[0]):
            return re.sub(r"^\([\w.]+\) ", "", lines[0])  # without SQLAlchemy's "(psycopg.OperationalError) "
        cur = getattr(cur, "orig", None) or cur.__cause__ or cur.__context__
    return "the connection was cut"


class Outage:
    """How a running tune rides out its database going away: every operation that fails transiently waits with
    backoff (0.5 s doubling to 5 s) and runs again, until the outage has lasted `window_s`; then the error stands.
    One line when it starts and one when it ends, whatever the number of threads and operations waiting."""

    def __init__(self, url: str, log, window_s: float) -> None:
        import threading

        self.url, self.log, self.window_s = url, log, window_s
        self._lock = threading.Lock()
        self._since: float | None = None
        self._what = ""

    def again(self, what: str) -> None:
        """A fresh window for one last thing to write (`what`, said in the line when it has to wait)."""
        with self._lock:
            self._since, self._what = None, f" {what}"

    def wait(self, e: BaseException, attempt: int) -> None:
        """Sleep before attempt `attempt` + 1 of an operation that failed with `e`; re-raises `e` when it is not
        transient or the outage has outlasted the window."""
        import time

        if not transient(e):
            raise e
        now = time.monotonic()
        with self._lock:
            if self._since is None:
                self._since = now
                first = _reason(e)
                self.log(f"the database {redact(self.url)} is unavailable ({redact(first, self.url)[:160]}); waiting up to "
                         f"{self.window_s:g} s for it (OPS_ADV_DB_RETRY_S){self._what}")
            since = self._since
        if now - since >= self.window_s:
            raise e
        time.sleep(min(0.5 * 2 ** attempt, 5.0, max(0.05, since + self.window_s - now)))

    def over(self) -> None:
        """An operation went through: the outage, if any, is over."""
        import time

        if self._since is None:
            return
        with self._lock:
            if self._since is not None:
                self.log(f"the database is back after {time.monotonic() - self._since:.1f} s; going on")
                self._since = None

    def run(self, fn, *args, **kw):
        """fn(*args, **kw), run again while it fails transiently (see wait)."""
        attempt = 0
        while True:
            try:
                out = fn(*args, **kw)
            except Exception as e:
                self.wait(e, attempt)
                attempt += 1
                continue
            self.over()
            return out

    def watch(self, engine: "Engine") -> None:
        """New connections of `engine` wait out the outage too (pool_pre_ping drops the dead ones first)."""
        import logging

        from sqlalchemy import event

        # the pool logs each dead connection it fails to roll back ("Exception during reset or similar") with a
        # traceback through logging's last resort; the outage's own two lines say it (a configured logger still sees it)
        pool_log = logging.getLogger("sqlalchemy.pool")
        if not any(isinstance(h, logging.NullHandler) for h in pool_log.handlers):
            pool_log.addHandler(logging.NullHandler())

        @event.listens_for(engine, "do_connect")
        def _connect(dialect, _rec, cargs, cparams):
            attempt = 0
            while True:
                try:
                    return dialect.connect(*cargs, **cparams)
                except Exception as e:
                    self.wait(e, attempt)
                    attempt += 1
