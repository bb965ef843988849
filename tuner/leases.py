"""Several tuners, one database: each problem is leased to one run at a time.

A run renews its heartbeat and its leases every lease_s()/6 seconds; a lease not renewed for
lease_s() (or held by a run whose process is gone) is taken over by the next tuner that wants it.
"""
from __future__ import annotations

import contextlib
import os
import socket
import threading
from datetime import datetime, timedelta, timezone
from typing import Callable

from sqlalchemy import delete, insert, select, update
from sqlalchemy.engine import Engine
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from db import Run, normalize, redact
from db._engine import transient
from db.models import Lease, utcnow
from ops_adv._table import sqlite_path


def lease_s() -> float:
    """Seconds a problem's lease lasts without a heartbeat (OPS_ADV_LEASE_S, default 60)."""
    try:
        return max(2.0, float(os.environ.get("OPS_ADV_LEASE_S", "60")))
    except ValueError:
        return 60.0


def _aware(t: datetime | None) -> datetime | None:
    return t.replace(tzinfo=timezone.utc) if t is not None and t.tzinfo is None else t


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


@contextlib.contextmanager
def schema_lock(url: str):
    """Serialise schema creation between tuner processes: an advisory lock (PostgreSQL) or a lock file (SQLite)."""
    url = normalize(url)
    if url.startswith("postgresql"):
        from sqlalchemy import create_engine, text

        try:
            eng = create_engine(url)
        except Exception:  # a malformed URL (say, a non-numeric port): open_db reports it in one line
            yield
            return
        try:
            conn = eng.connect()
        except Exception:
            eng.dispose()
            yield  # open_db reports the connection error
            return
        try:
            conn.execute(text("select pg_advisory_lock(7290514)"))
            conn.commit()
            yield
        finally:
            try:
                conn.execute(text("select pg_advisory_unlock(7290514)"))
                conn.commit()
                conn.close()
            finally:
                eng.dispose()
        return
    path = sqlite_path(url) if ":///" in url else ""  # as SQLAlchemy reads it; never the query: it may hold a password
    if not path or path == ":memory:" or path.startswith("file:"):
        yield
        return
    import fcntl

    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        fd = os.open(path + ".lock", os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:
        yield  # open_db reports an unwritable path
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


class Leases:
    """The leases of one run (`run_id`) on one device class: claim, hold, renew, release; reap dead runs."""

    def __init__(self, engine: Engine, device_class: str, run_id: int, log: Callable[[str], None]) -> None:
        self.engine, self.device_class, self.run_id, self.log = engine, device_class, run_id, log
        self._stop = threading.Event()
        self._beat: threading.Thread | None = None

    # ---- heartbeat --------------------------------------------------------------------------------
    def start(self) -> None:
        """Renew this run's heartbeat and leases in a thread until stop()."""
        self._beat = threading.Thread(target=self._heartbeat, daemon=True)
        self._beat.start()

    def stop(self) -> None:
        self._stop.set()
        if self._beat is not None:
            self._beat.join(5)

    def _heartbeat(self) -> None:
        every = lease_s() / 6
        while not self._stop.wait(every):
            try:
                now = utcnow()
                with self.engine.begin() as c:
                    # running again: a run paused past its lease was marked interrupted by the tuner that took over
                    c.execute(update(Run).where(Run.id == self.run_id).values(heartbeat_at=now, status="running"))
                    c.execute(update(Lease).where(Lease.run_id == self.run_id).values(expires_at=now + timedelta(seconds=lease_s())))
            except Exception as e:  # a busy database: try again at the next beat
                if not transient(e):  # a database gone for a while is the main thread's to say (Outage)
                    self.log(f"  heartbeat failed: {redact(str(e).splitlines()[0])[:200]}")

    # ---- runs -------------------------------------------------------------------------------------
    def run_alive(self, run: Run | None) -> bool:
        """Whether `run` is a live tuner: running, a fresh heartbeat and, on this host, its process exists."""
        if run is None or run.status != "running":
            return False
        if run.id == self.run_id:
            return True
        seen = _aware(run.heartbeat_at or run.started_at)
        if seen is None or utcnow() - seen > timedelta(seconds=lease_s()):
            return False
        return not (run.host == socket.gethostname()[:255] and run.pid and not _pid_alive(run.pid))

    def reap(self) -> None:
        """Mark runs whose process is gone as interrupted."""
        with Session(self.engine) as s:
            dead = [r for r in s.scalars(select(Run).where(Run.status == "running", Run.id != self.run_id)) if not self.run_alive(r)]
            ids = [r.id for r in dead]
            for r in dead:
                r.status, r.finished_at = "interrupted", utcnow()
            s.commit()
        if ids:
            self.log(f"marked {len(ids)} run(s) whose process is gone as interrupted: {', '.join(map(str, ids[:10]))}")

    # ---- one problem's lease ----------------------------------------------------------------------
    def claim(self, problem_id: int) -> bool:
        """Take the lease of `problem_id`: free, expired, ours already, or held by a dead run."""
        where = {"device_class": self.device_class, "problem_id": problem_id}
        for _ in range(5):
            now = utcnow()
            exp = now + timedelta(seconds=lease_s())
            try:
                with self.engine.begin() as c:
                    c.execute(insert(Lease).values(**where, run_id=self.run_id, expires_at=exp))
                return True
            except IntegrityError:
                pass
            with Session(self.engine) as s:
                lease = s.scalars(select(Lease).filter_by(**where)).first()
                if lease is None:
                    continue  # released meanwhile: insert again
                if lease.run_id == self.run_id:
                    return True
                holder = s.get(Run, lease.run_id)
                if _aware(lease.expires_at) > now and self.run_alive(holder):
                    return False
                n = s.execute(update(Lease).where(Lease.id == lease.id, Lease.run_id == lease.run_id)
                              .values(run_id=self.run_id, expires_at=exp)).rowcount
                if n == 1 and holder is not None and holder.status == "running":
                    holder.status, holder.finished_at = "interrupted", utcnow()
                s.commit()
                return n == 1
        return False

    def holds(self, problem_id: int) -> bool:
        with Session(self.engine) as s:
            lease = s.scalars(select(Lease).filter_by(device_class=self.device_class, problem_id=problem_id)).first()
            return lease is not None and lease.run_id == self.run_id

    def release(self, problem_id: int) -> None:
        with self.engine.begin() as c:
            c.execute(delete(Lease).where(Lease.device_class == self.device_class, Lease.problem_id == problem_id,
                                          Lease.run_id == self.run_id))

    def release_all(self, session: Session) -> None:
        """Drop every lease of this run (in `session`, committed with the run's final status)."""
        session.execute(delete(Lease).where(Lease.run_id == self.run_id))
