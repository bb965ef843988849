"""The tuning driver: Optuna asks, Ray workers measure, the database keeps every trial.

This module is the scheduling loop. Leasing problems between tuners is in leases.py, one
problem's study (set-up, resume, grid, warm start, its trials) in study.py, and the
confirmation and storing of winners in winners.py.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import socket
import sys
import time
import warnings
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

import optuna
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

import kernel_space
from db import DatabaseError, Device, Run, normalize, open_db, redact
from db._engine import DatabaseFile, DatabaseGone, Outage, driver_error, write_error
from db.models import utcnow
from kernel_space import OpsAdvError, get_op, impls, problem_key
from ops_adv._settings import db_retry_s
from workers.measure import OK, PRUNED

from ._pool import NODE_LOST, Pool, _probe, start_ray
from .devices import check_device
from .leases import Leases, lease_s, schema_lock  # noqa: F401  (schema_lock, lease_s: imported from here)
from .progress import MODES, Progress
from .study import (  # noqa: F401  (names tests and tools import from here)
    REPEAT, RUN_ATTR, STACK, StudySetup, Task, _params_key, _sampler, _set_attrs, _suggest, _trial_attrs, _upsert,
    kernel_set_version, legacy_study_name, narrow, problem_label, study_name, unseen_neighbour,
)
from .winners import Winners

SAMPLERS = ("tpe", "random", "grid")
# Invalid configurations are refused before compiling and do not count against --trials;
# a problem stops after this many times its budget of them (a space mostly invalid for it).
MAX_PRUNED = 40


@dataclass
class TuneOptions:
    device: str
    problems: list[tuple[str, Any]]
    db_url: str
    trials: int = 24
    timeout_s: float | None = None
    trial_timeout_s: float = 60.0
    sampler: str = "tpe"
    workers: int | None = None
    ray_address: str | None = None
    seed: int = 0
    plugins: list[str] = field(default_factory=list)
    measure_budget_s: float = 0.3
    finalists: int = 3
    only_impls: list[str] = field(default_factory=list)  # search only these (vendors are always measured)
    # Compile processes per GPU worker, each compiling one asked-ahead configuration (0: off;
    # None: 4 on GPUs, where Triton compiles in ~0.4 s what times in ~0.05 s; 0 on cpu).
    compile_workers: int | None = None
    warm_start: bool = True
    threads: int | None = None  # CPU threads per measuring worker (None: what a plain process here uses)
    accuracy: float | None = 2.0  # a candidate may be at most this times less accurate than the vendor kernel
    revalidate: bool = False  # re-measure the top-k of winners measured under another stack instead of skipping them
    command: str = ""
    progress: str = "plain"  # auto (a bar on a terminal), bar or plain (a line every 10 s)
    log: Callable[[str], None] = lambda s: print(s, file=sys.stderr, flush=True)


def _no_fallback_warning(record: logging.LogRecord) -> bool:
    """A filter for optuna's RDBStorage logger. When a trial-loading query fails, optuna warns with the error, its
    whole SQL statement and "Falling back to a slower alternative", then queries again. A cut connection (a database
    outage) fails that query too, and the Outage says what happened in its own line; otherwise the fallback worked
    and there is nothing to do. The warning is left out either way."""
    msg = record.msg if isinstance(record.msg, str) else ""
    return not (msg.startswith("Caught an error from sqlalchemy") and "Falling back to a slower alternative" in msg)


def _sigterm_as_interrupt() -> Callable[[], None]:
    """SIGTERM (kill, a scheduler's stop) ends the run as Ctrl-C does: finished trials kept, the run marked
    interrupted. Returns what restores the previous handler."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        return lambda: None

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    before = signal.signal(signal.SIGTERM, interrupt)
    return lambda: signal.signal(signal.SIGTERM, before if before is not None else signal.SIG_DFL)


class Tuner(StudySetup, Winners):
    """One tuning run: its problems leased, their studies asked in turn, their winners stored."""

    def __init__(self, opts: TuneOptions) -> None:
        for name in opts.only_impls:
            if not any(name == i.name for op in {op for op, _ in opts.problems} for i in impls(op)):
                raise OpsAdvError(f"--impls names {name!r}, which no requested op has")
        if opts.sampler not in SAMPLERS:
            raise OpsAdvError(f"unknown sampler {opts.sampler!r}; choose one of {', '.join(SAMPLERS)}")
        if opts.progress not in MODES:
            raise OpsAdvError(f"unknown progress display {opts.progress!r}; choose one of {', '.join(MODES)}")
        if opts.threads is not None and not 1 <= opts.threads <= 4096:
            raise OpsAdvError(f"--threads must be between 1 and 4096, not {str(opts.threads)[:20]}")
        if opts.accuracy is not None and not (opts.accuracy >= 1.0 and opts.accuracy < float("inf")):
            raise OpsAdvError(f"--accuracy must be a finite factor of at least 1, not {str(opts.accuracy)[:20]}")
        self.o = opts
        self.log = opts.log
        self.backend = "cpu" if opts.device == "cpu" else "cuda"
        self._rr = 0
        self._rng = random.Random(opts.seed)
        self.best_speedup: float | None = None  # of the winners this run stored
        self.stats: dict = {}  # after run(): wall_s and per worker slot busy_s, jobs, restarts (see Pool.stats)
        self.timed_out: tuple[int, int] | None = None  # after run(): problems --timeout left unstarted, and cut short
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        rdb_log = logging.getLogger("optuna.storages._rdb.storage")
        if _no_fallback_warning not in rdb_log.filters:
            rdb_log.addFilter(_no_fallback_warning)
        warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)

    # ---- set-up -------------------------------------------------------------------------------
    def run(self) -> list[dict]:
        try:
            return self._run_all()
        except DatabaseGone as e:
            raise self._gone_error(str(e)) from None
        except Exception as e:
            if isinstance(e, OpsAdvError) or driver_error(e) is None:
                raise
            gone = self._db_file.changed() if getattr(self, "_db_file", None) is not None else None
            if gone:  # the file went first; the write error is its consequence
                raise self._gone_error(gone) from None
            raise self._write_error(e) from None  # one line, never the driver's chain of tracebacks
        finally:
            if getattr(self, "_db_file", None) is not None:
                self._db_file.close()

    def _db(self, fn, *args, **kw):
        """fn(*args, **kw), a database operation that may run again: waits out a database outage (see Outage)."""
        return self.outage.run(fn, *args, **kw)

    def _told(self, task: Task, trial, status: str, value: float | None) -> None:
        """_tell, riding out a database outage: a retry never tells a trial twice."""
        tries = 0

        def once():
            nonlocal tries
            tries += 1
            self._tell(task, trial, status, value, again=tries > 1)

        self._db(once)

    def _suggested(self, task: Task, trial) -> tuple[str, dict]:
        """_suggest(trial, task.tunables), riding out a database outage: suggesting reads the study's trials (the
        sampler) and writes each parameter. A retry first reloads the trial: a parameter whose write went through
        before its answer was lost is then taken as stored, not sampled again (optuna ignores a second write of a
        trial's parameter, so a value sampled again would be measured while the first one stays stored)."""
        tries = 0

        def once():
            nonlocal tries
            tries += 1
            if tries > 1 and hasattr(trial, "_cached_frozen_trial"):
                trial._cached_frozen_trial = trial.storage.get_trial(trial._trial_id)
            return _suggest(trial, task.tunables)

        return self._db(once)

    def _setter(self, trial):
        """trial.set_user_attr, each call riding out a database outage."""
        return lambda key, value: self._db(trial.set_user_attr, key, value)

    def _settle(self, fn, task: Task, *args) -> None:
        """fn(task, *args): confirming or storing a task's winner, which changes the task before it writes; run again
        after a database outage from the task as it was."""
        saved = ({k: list(v) for k, v in task.confirms.items()}, task.state, list(task.finalists))

        def once():
            task.confirms, task.state, task.finalists = {k: list(v) for k, v in saved[0].items()}, saved[1], list(saved[2])
            fn(task, *args)

        self._db(once)

    def _check_db_file(self) -> None:
        """Stop when the SQLite file this run opened was deleted or replaced: writing on would lose every result."""
        f = getattr(self, "_db_file", None)
        what = f.changed() if f is not None else None
        if what:
            raise DatabaseGone(what)

    def _gone_error(self, what: str) -> DatabaseError:
        """One line for a database file deleted or replaced under the run: what is lost, where it was saved."""
        f = self._db_file
        rescued = f.rescue()
        run_id = getattr(self, "run_id", None)
        state = f"run {run_id}'s trials and winners" if run_id is not None else "what this run wrote"
        if rescued:  # beside the old path: its name alone says where
            kept = (f"{state} were saved beside it as {os.path.basename(rescued)}: move that back to "
                    f"{os.path.basename(f.path)} and re-run the same command to resume")
        else:
            kept = f"{state} could not be saved and are lost; re-run the same command to tune again"
        return DatabaseError(f"the database file {f.path} {what} while opsadv-tune was writing to it; {kept}")

    def _run_all(self) -> list[dict]:
        o = self.o
        placement = check_device(o.device, o.ray_address is not None)
        if o.ray_address:
            _probe(o.ray_address)  # before the database is touched: nothing listening is one line at once
        url = normalize(o.db_url)
        kw = {"connect_args": {"timeout": 30}} if url.startswith("sqlite") else {"pool_pre_ping": True}
        with schema_lock(o.db_url):  # concurrent tuners on a fresh database: one creates the schema
            self.engine = open_db(o.db_url)
            self._db_file = DatabaseFile.of(o.db_url)  # an SQLite file deleted mid-run must stop the run, not lose it
            self.storage = optuna.storages.RDBStorage(url, engine_kwargs=kw)
        # From here on a database that goes away (a server restart) is waited for, up to OPS_ADV_DB_RETRY_S: new
        # connections wait in connect, and each operation cut mid-way runs again (see _db).
        self.outage = Outage(o.db_url, lambda line: self.log(line), db_retry_s())
        self.outage.watch(self.engine)
        self.outage.watch(self.storage.engine)
        ops = ", ".join(dict.fromkeys(op for op, _ in o.problems))
        self.log(f"tuning {len(o.problems)} problem(s) of {ops} on {o.device} into {redact(o.db_url)}")
        owned = start_ray(o.ray_address, num_cpus=None)
        restore = _sigterm_as_interrupt()  # after ray.init, which installs its own (a dump, and the run marked failed)
        try:
            n = o.workers or placement.count()
            self.log(f"starting {n} measuring worker(s) for {o.device}")
            cw = o.compile_workers if o.compile_workers is not None else (4 if self.backend == "cuda" else 0)
            if self.backend == "cpu":
                import torch

                threads = o.threads or torch.get_num_threads()  # this process is a plain one: its default
            else:
                threads = o.threads
            self.pool = Pool(self.backend, n, accelerator_type=placement.accelerator_type, plugins=o.plugins,
                             compile_workers=cw, threads=threads, accuracy=o.accuracy)
            t = time.monotonic()
            try:
                rows = self._run()
                if not rows:
                    raise OpsAdvError(
                        f"no winner stored for any of the {len(o.problems)} problem(s): every candidate failed or the time "
                        f"limit came first; see the errors above"
                    )
                return rows
            finally:
                self.stats = {"wall_s": round(time.monotonic() - t, 3), "workers": self.pool.stats()}
                self.pool.shutdown()
        finally:
            restore()
            if owned:
                import ray

                from ._pool import stop_reaper

                ray.shutdown()
                stop_reaper()

    def _run(self) -> list[dict]:
        o = self.o
        info = self.pool.slots[0].info
        if info["device_class"] != o.device:
            raise OpsAdvError(f"the workers run on {info['fingerprint'].get('name')} ({info['device_class']}), not {o.device}")
        fp = info["fingerprint"]
        self.conditions = dict(info.get("conditions") or {})
        items = self._prepare(fp)
        fp_hash = hashlib.sha256(json.dumps(fp, sort_keys=True).encode()).hexdigest()
        def device() -> int:
            with Session(self.engine) as s:
                did = _upsert(s, Device, {"fingerprint_hash": fp_hash}, {"device_class": o.device, "fingerprint": fp}).id
                s.commit()
                return did

        for _ in range(3):  # two tuners may add the same device at once
            try:
                self.device_id = self._db(device)
                break
            except IntegrityError:
                continue

        def start() -> int:
            with Session(self.engine) as s:
                run = Run(device_class=o.device, command=o.command, sampler=o.sampler, host=socket.gethostname()[:255],
                          pid=os.getpid(), heartbeat_at=utcnow())
                s.add(run)
                s.commit()
                return run.id

        self.run_id = self._db(start)
        self.leases = Leases(self.engine, o.device, self.run_id, lambda line: self.log(line))
        self._db(self.leases.reap)
        self.fingerprint = fp
        self.tasks: list[Task] = []
        self._left = 0
        self.leases.start()
        status = "failed"
        t0 = time.monotonic()
        try:
            self._loop(items, t0)
            cut = sum(1 for t in self.tasks if not (t.state == "done" and not t.lost and self._spent(t)))
            complete = not self._left and not cut
            status = "finished" if complete else "interrupted"
            if o.timeout_s is not None and not complete:
                self.timed_out = (self._left, cut)
        except KeyboardInterrupt:
            status = "interrupted"
            raise
        finally:
            self.leases.stop()
            self.final_status = status
            self.status_error = self._record_status(status)
        self._check_db_file()  # a file deleted after the last look in the loop: its winners went with it
        if self.status_error is not None:  # the run itself ended well
            raise self.status_error
        return self._db(self.summary)

    def _record_status(self, status: str) -> BaseException | None:
        """Write the run's final state and free its leases; the error when even that cannot be written (on a full
        SQLite disk a checkpoint may first make room in the write-ahead log)."""
        def write() -> None:
            with Session(self.engine) as s:
                self.leases.release_all(s)
                run = s.get(Run, self.run_id)
                run.status = status
                run.finished_at = utcnow()
                s.commit()

        # a window of its own: the run may be ending because an outage outlasted the first
        self.outage.again(f"to mark run {self.run_id} {status} and release its leases")
        err = None
        for attempt in range(2):
            try:
                self._db(write)
                return None
            except Exception as e:  # a full disk, a server gone: reported by run()
                err = e
                if attempt or not self.engine.url.drivername.startswith("sqlite"):
                    break
                try:
                    with self.engine.connect() as c:
                        c.exec_driver_sql("PRAGMA wal_checkpoint(TRUNCATE)")
                except Exception:
                    break
        return err

    def _write_error(self, e: BaseException) -> OpsAdvError:
        run_id = getattr(self, "run_id", None)
        if run_id is None:
            state = "no run was recorded"
        elif getattr(self, "status_error", None) is None:
            state = f"run {run_id} is marked failed"
        else:
            state = (f"run {run_id} could not be marked {getattr(self, 'final_status', 'failed')} either: it shows as running until the next opsadv-tune on this "
                     f"database marks it interrupted")
        return write_error(e, self.o.db_url, state)

    def _prepare(self, fingerprint: dict) -> list[tuple[str, Any]]:
        """The problems to tune, duplicates merged, each checked to fit the device."""
        o = self.o
        items = list({(op, problem_key(p)): (op, p) for op, p in reversed(o.problems)}.values())[::-1]
        if len(items) < len(o.problems):
            self.log(f"merged {len(o.problems) - len(items)} duplicate problem(s)")
        mem = fingerprint.get("memory_bytes")
        for op, problem in items:
            need = 3 * get_op(op).bytes_moved(problem)  # inputs, output and the reference
            if mem and need > 0.9 * mem:
                raise OpsAdvError(
                    f"{op} {problem_key(problem)} needs about {need / 2**30:.1f} GiB, more than the "
                    f"{mem / 2**30:.0f} GiB of {fingerprint.get('name')}; drop it from the shapes file"
                )
        self.existing = set(self._db(optuna.study.get_all_study_names, self.storage))
        return items

    # ---- the loop -----------------------------------------------------------------------------
    def _loop(self, items: list[tuple[str, Any]], t0: float) -> None:
        prog = Progress(self.o.progress, self.o.log)
        self.log = prog.log  # lines go above the bar
        try:
            self._loop_with(items, t0, prog)
        finally:
            prog.close()
            self.log = self.o.log

    def _show(self, tasks: list[Task], t0: float, prog: Progress) -> None:
        quota = [min(t.budget, t.space) if t.tunables else 0 for t in tasks]
        done = [t.state == "done" for t in tasks]
        trials = sum(t.asked for t in tasks)
        # one step per trial of the budget plus one per problem (its vendors and the confirmation)
        steps = sum(q + 1 if d else min(t.asked, q) for t, q, d in zip(tasks, quota, done))
        # problems against the run's total: those skipped as tuned count as done, those not yet started as to do
        total = max(self._total, len(tasks) + self._skipped)
        prog.update(time.monotonic() - t0, sum(done) + self._skipped, total, trials, sum(quota), steps,
                    sum(quota) + len(tasks), self.best_speedup)

    def _loop_with(self, items: list[tuple[str, Any]], t0: float, prog: Progress) -> None:
        o = self.o
        tasks = self.tasks
        pending = deque(items)  # (op, problem) not yet claimed
        self._total, self._skipped = len(items), 0
        waiting: list = []  # leased to another live run: tried again now and then
        retry_at, said = 0.0, False
        active: list[Task] = []
        window = len(self.pool.slots) + 1  # few problems at once keeps inputs resident on the device
        ready: deque = deque()  # jobs asked ahead (in flight for their task), next to be submitted
        while pending or active or waiting:
            self._check_db_file()  # one stat a round (the loop polls every 0.2 s)
            out_of_time = o.timeout_s is not None and time.monotonic() - t0 > o.timeout_s
            if out_of_time and (pending or waiting):
                self._left = len(pending) + len(waiting)
                self.log(f"time limit of {o.timeout_s:.0f} s reached: {self._left} problem(s) left for the next run of the same command")
                pending.clear()
                waiting.clear()
            if waiting and not pending and len(active) < window and time.monotonic() >= retry_at:
                if not said:
                    self.log(f"{len(waiting)} problem(s) leased to other running tuners: waiting for them")
                    said = True
                pending.extend(waiting)
                waiting.clear()
                retry_at = time.monotonic() + min(5.0, lease_s() / 4)
            while pending and len(active) < window:
                op, problem = pending.popleft()
                task = self._db(self._claim_task, op, problem)
                if task == "held":
                    waiting.append((op, problem))
                elif task is None:
                    self._skipped += 1
                else:
                    tasks.append(task)
                    active.append(task)
            for slot in self.pool.free():
                job = ready.popleft() if ready else self._pick(active, out_of_time)
                if job is None:
                    break
                self.pool.submit(slot, job[3], job[0], job[1], job[2])
            # compile ahead: one asked-ahead measurement per compile process, compiling while others are timed
            while self.pool.compile_workers and len(ready) < len(self.pool.slots) * self.pool.compile_workers:
                job = self._pick(active, out_of_time)
                if job is None:
                    break
                if job[0] == "measure":
                    self.pool.prefetch(len(ready), job[1][0])
                ready.append(job)
            if not self.pool.busy() and not ready and waiting and not pending:
                time.sleep(0.2)
            for job, res, fail in self.pool.poll(0.2):
                self._finish(job, res, fail)
            for task in list(active):
                if task.state == "search" and task.in_flight == 0 and self._exhausted(task, out_of_time):
                    task.state = "confirm"
                if task.state == "done":
                    active.remove(task)
                    self._db(self.leases.release, task.problem_id)
                    if task.lost:  # another tuner has it now: wait for that one, as for a problem held at the start
                        tasks.remove(task)
                        waiting.append((task.op, task.problem))
            self._show(tasks, t0, prog)
        self._show(tasks, t0, prog)

    def _pick(self, active: list[Task], out_of_time: bool):
        """The next job, taking the active problems in turn."""
        for k in range(len(active)):
            i = (self._rr + k) % len(active)
            job = self._next_job(active[i], out_of_time)
            if job is not None:
                self._rr = (i + 1) % len(active)
                return job
        return None

    def _exhausted(self, task: Task, out_of_time: bool) -> bool:
        return not task.vendors and (out_of_time or self._spent(task))

    def _spent(self, task: Task) -> bool:
        cap = MAX_PRUNED * max(1, task.budget)
        return (task.asked >= min(task.budget, task.space) or task.pruned >= cap or task.repeats >= cap) and not task.seeds

    def _holds(self, task: Task, every_s: float = 0.0) -> bool:
        """Whether this run still holds `task`'s lease (asked of the database at most every `every_s`); when another
        tuner has taken it over (this one paused past its expiry), says so once and stops writing the problem."""
        if task.lost:
            return False
        now = time.monotonic()
        if now - task.checked_at < every_s:
            return True
        if self._db(self.leases.holds, task.problem_id):
            task.checked_at = now
            return True
        self._lose(task)
        return False

    def _lose(self, task: Task) -> None:
        task.lost, task.state = True, "done"
        task.requeued.clear()
        self.log(f"  {task.label}: its lease passed to another tuner (this one was paused past {lease_s():.0f} s); "
                 f"leaving it to that tuner")

    def _next_job(self, task: Task, out_of_time: bool):
        o = self.o
        if not self._holds(task, every_s=1.0):
            return None
        if task.requeued:
            return task.requeued.popleft()
        if task.state == "confirm":
            if task.in_flight:
                return None
            if not task.finalists:
                task.finalists = self._finalists(task)
            cands = task.finalists
            task.state = "confirming"
            if not cands:
                self._settle(self._write_winner, task, None)
                return None
            task.in_flight += 1
            args = (task.op, task.problem._asdict(), cands, 5)
            return ("confirm", args, o.trial_timeout_s * 4, ("confirm", task, cands))
        if task.state != "search":
            return None
        if task.vendors:
            name = task.vendors.popleft()
            task.in_flight += 1
            return self._measure_job(task, name, {}, None)
        if out_of_time:
            return None
        for _ in range(50):  # skip over pruned and duplicate configurations without a worker
            if self._spent(task):
                return None
            if task.seeds:
                name, params = task.seeds.popleft()
                fixed = {"impl": name} if len(task.tunables) > 1 else {}
                fixed.update({f"{name}.{k}": v for k, v in params.items()})
                self._db(task.study.enqueue_trial, fixed, skip_if_exists=False)
            trial = self._db(task.study.ask)
            self._db(trial.set_user_attr, RUN_ATTR, self.run_id)
            name, params = self._suggested(task, trial)
            impl = kernel_space.get_impl(task.op, name)
            key = _params_key(name, params)
            if key in task.seen:
                status, value = task.seen[key]
                if status == PRUNED:
                    task.pruned += 1
                else:
                    task.repeats += 1
                    self._db(trial.set_user_attr, REPEAT, True)
                    tun = next(t for t in task.tunables if t.name == name)
                    nb = unseen_neighbour(tun, params, task.problem, self.backend, task.seen, self._rng)
                    if nb is not None and not task.seeds and task.asked < task.budget:
                        task.seeds.append((name, nb))
                _set_attrs(self._setter(trial), {}, {"impl": name, "status": status})
                self._told(task, trial, status, value)
                continue
            why = impl.why_not(task.problem, params, self.backend)
            if why:
                task.seen[key] = (PRUNED, None)
                task.pruned += 1
                self._db(self._record, task, trial.number, name, params, {"status": PRUNED, "error": why})
                _set_attrs(self._setter(trial), {}, _trial_attrs(name, {"status": PRUNED, "error": why}))
                self._told(task, trial, PRUNED, None)
                continue
            task.in_flight += 1
            task.asked += 1
            return self._measure_job(task, name, params, trial)
        return None

    def _measure_job(self, task: Task, name: str, params: dict, trial):
        trial_spec = {"op": task.op, "problem": task.problem._asdict(), "impl": name, "params": params}
        return ("measure", (trial_spec, self.o.measure_budget_s), self.o.trial_timeout_s, ("measure", task, name, params, trial))

    def _finish(self, job, res: dict, fail: str | None) -> None:
        kind, task = job[0], job[1]
        if fail == NODE_LOST:  # not the kernel's doing: the same job (same Optuna trial) runs again, nothing is recorded
            task.requeued.append((*res["retry"], job))
            self.log(f"  {task.label}: {res['error']}; running its {kind} job again")
            return
        task.in_flight -= 1
        if not self._holds(task):  # taken over while this job ran: its result is not ours to write
            return
        if kind == "confirm":
            if fail:
                self._settle(self._write_winner, task, None)  # the search's own times
            else:
                self._settle(self._confirmed, task, res)
            return
        _, _, name, params, trial = job
        if fail:
            res = {"status": fail, "error": res.get("error")}
        status = res["status"]
        key = _params_key(name, params)
        task.seen[key] = (status, res.get("median_ms"))
        impl = kernel_space.get_impl(task.op, name)
        if status == OK:
            task.results.append({"impl": name, "params": params, "vendor": impl.vendor, "median_ms": res["median_ms"], "spread_ms": res["spread_ms"]})
        elif status == PRUNED:
            task.pruned += 1
        else:
            task.failures += 1
            self.log(f"  {task.label}: {name} {params} -> {status}: {(res.get('error') or '').splitlines()[0][:160] if res.get('error') else ''}")
        self._db(self._record, task, trial.number if trial is not None else None, name, params, res)
        try:
            if trial is not None:
                _set_attrs(self._setter(trial), {}, _trial_attrs(name, res))
            self._told(task, trial, status, res.get("median_ms"))
        except optuna.exceptions.UpdateFinishedTrialError:  # ended by the tuner that took the problem over
            self._lose(task)
