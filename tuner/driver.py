"""The tuning driver: Optuna asks, Ray workers measure, the database keeps every trial."""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import random
import socket
import sys
import threading
import time
import warnings
from datetime import datetime, timedelta, timezone
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

import optuna
from optuna.trial import TrialState
from sqlalchemy import delete, insert, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

import kernel_space
from db import Device, Problem, Run, Trial, Winner, normalize, open_db, redact
from db.models import Lease
from db.models import utcnow
from kernel_space import OpsAdvError, get_op, impls, problem_distance, problem_key
from workers.measure import OK, PRUNED

from ._pool import NODE_LOST, Pool, _probe, start_ray
from .devices import check_device
from .progress import MODES, Progress

SAMPLERS = ("tpe", "random", "grid")
# Invalid configurations are refused before compiling and do not count against --trials;
# a problem stops after this many times its budget of them (a space mostly invalid for it).
MAX_PRUNED = 40
RUN_ATTR = "opsadv_run"  # user attribute of an Optuna trial: the opsadv_runs id that asked it
STACK = ("threads", "torch", "triton", "cuda", "cudnn", "cublas", "driver")  # conditions a winner is revalidated on


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
    path = url.split(":///", 1)[1].split("?", 1)[0] if ":///" in url else ""  # never the query: it may hold a password
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


@dataclass
class Task:
    """One (op, problem) being tuned."""

    op: str
    problem: Any
    study_name: str
    problem_id: int
    study: optuna.Study
    tunables: list[Any]
    vendors: deque
    seeds: deque
    budget: int
    asked: int = 0  # configurations measured (the budget); a repeat proposal is answered, not counted
    repeats: int = 0
    space: int = 0  # valid configurations over the tunables: once all are measured, the search is over
    in_flight: int = 0
    results: list[dict] = field(default_factory=list)  # ok results: impl, params, vendor, median_ms, spread_ms
    seen: dict[str, tuple[str, float | None]] = field(default_factory=dict)
    failures: int = 0
    pruned: int = 0
    state: str = "search"  # search -> confirm -> done
    requeued: deque = field(default_factory=deque)  # jobs lost with a worker's node: handed out again first, still in_flight

    @property
    def label(self) -> str:
        from .report import _short_problem

        return f"{self.op} {_short_problem(self.problem._asdict())}"


def _params_key(impl: str, params: dict) -> str:
    return json.dumps([impl, sorted(params.items())], default=str)


REPEAT = "opsadv_repeat"  # user attribute of an Optuna trial that proposed a configuration again


def unseen_neighbour(impl: Any, params: dict, problem: Any, backend: str, seen: Any, rng: random.Random) -> dict | None:
    """A valid configuration one parameter away from `params` that `seen` lacks, or None.

    TPE over categorical spaces proposes measured configurations again (2 in 5 of its
    proposals in replays of the H200 gemm sweep): the search goes on next to such a proposal.
    """
    cands = [{**params, k: c} for k, choices in impl.space.items() for c in choices if c != params[k]]
    rng.shuffle(cands)
    for cfg in cands:
        if _params_key(impl.name, cfg) not in seen and impl.why_not(problem, cfg, backend) is None:
            return cfg
    return None


def kernel_set_version(op: str, backend: str) -> str:
    h = hashlib.sha256()
    for i in impls(op, backend=backend):
        h.update(f"{i.name}={i.version};".encode())
    return h.hexdigest()[:10]


def problem_label(problem: Any) -> str:
    """`M=4096,N=4096,K=4096,bf16,trans_b`: every field, dtype bare, true flags by name, false ones left out."""
    parts = []
    for k, v in problem._asdict().items():
        if isinstance(v, bool):
            if v:
                parts.append(k)
        else:
            parts.append(str(v) if k == "dtype" else f"{k}={v}")
    return ",".join(parts)


def study_name(device_class: str, op: str, problem: Any, backend: str) -> str:
    """`h200/gemm/M=4096,N=4096,K=4096,bf16@6b73fd40`: readable, and new when the op's kernels change."""
    return f"{device_class}/{op}/{problem_label(problem)}@{kernel_set_version(op, backend)[:8]}"


def legacy_study_name(device_class: str, op: str, problem: Any, backend: str) -> str:
    """The name studies had before readable names; a database tuned then resumes under it."""
    pk = hashlib.sha256(problem_key(problem).encode()).hexdigest()[:12]
    return f"opsadv:{device_class}:{op}:{pk}:{kernel_set_version(op, backend)}"


def narrow(impl: Any, problem: Any, backend: str) -> Any | None:
    """`impl` with each parameter's choices cut to those some valid configuration for `problem` uses.

    Most of a space can be invalid for one problem (96% of gemm's for M <= 64): asking only
    within the valid choices keeps the sampler from spending its asks on refusals.  None when
    no configuration is valid.
    """
    used: dict[str, set] = {k: set() for k in impl.space}
    for cfg in impl.configs():
        if impl.why_not(problem, cfg, backend) is None:
            for k, v in cfg.items():
                used[k].add(v)
    if impl.space and not all(used.values()):
        return None
    return dataclasses.replace(impl, space={k: tuple(c for c in v if c in used[k]) for k, v in impl.space.items()})


def _suggest(trial: optuna.trial.BaseTrial, tunables: list[Any]) -> tuple[str, dict]:
    impl = tunables[0] if len(tunables) == 1 else None
    name = impl.name if impl else trial.suggest_categorical("impl", [t.name for t in tunables])
    impl = impl or next(t for t in tunables if t.name == name)
    params = {p: trial.suggest_categorical(f"{name}.{p}", list(choices)) for p, choices in impl.space.items()}
    return name, params


def _set_attrs(setter: Callable[[str, Any], None], current: dict, attrs: dict) -> None:
    for k, v in attrs.items():
        if current.get(k) != v:
            setter(k, v)


def _trial_attrs(name: str, res: dict) -> dict:
    """What optuna-dashboard shows about a trial beyond its parameters and value."""
    out = {"impl": name, "status": res["status"]}
    if res.get("error"):
        out["error"] = str(res["error"])[:2000]
    for k in ("rel_error", "spread_ms"):
        if res.get(k) is not None:
            out[k] = res[k]
    return out


def _sampler(kind: str, seed: int) -> optuna.samplers.BaseSampler:
    if kind == "tpe":
        return optuna.samplers.TPESampler(seed=seed, constant_liar=True, n_startup_trials=8, multivariate=True, group=True)
    return optuna.samplers.RandomSampler(seed=seed)  # grid enqueues every valid point, then needs no sampler


def _upsert(session: Session, model: type, where: dict, values: dict | None = None) -> Any:
    row = session.scalars(select(model).filter_by(**where)).first()
    if row is None:
        row = model(**where, **(values or {}))
        session.add(row)
        session.flush()
    return row


class Tuner:
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
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)

    # ---- set-up -------------------------------------------------------------------------------
    def run(self) -> list[dict]:
        o = self.o
        placement = check_device(o.device, o.ray_address is not None)
        if o.ray_address:
            _probe(o.ray_address)  # before the database is touched: nothing listening is one line at once
        url = normalize(o.db_url)
        kw = {"connect_args": {"timeout": 30}} if url.startswith("sqlite") else {"pool_pre_ping": True}
        with schema_lock(o.db_url):  # concurrent tuners on a fresh database: one creates the schema
            self.engine = open_db(o.db_url)
            self.storage = optuna.storages.RDBStorage(url, engine_kwargs=kw)
        ops = ", ".join(dict.fromkeys(op for op, _ in o.problems))
        self.log(f"tuning {len(o.problems)} problem(s) of {ops} on {o.device} into {redact(o.db_url)}")
        owned = start_ray(o.ray_address, num_cpus=None)
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
            if owned:
                import ray

                ray.shutdown()

    def _run(self) -> list[dict]:
        o = self.o
        info = self.pool.slots[0].info
        if info["device_class"] != o.device:
            raise OpsAdvError(f"the workers run on {info['fingerprint'].get('name')} ({info['device_class']}), not {o.device}")
        fp = info["fingerprint"]
        self.conditions = dict(info.get("conditions") or {})
        items = self._prepare(fp)
        fp_hash = hashlib.sha256(json.dumps(fp, sort_keys=True).encode()).hexdigest()
        for _ in range(3):  # two tuners may add the same device at once
            try:
                with Session(self.engine) as s:
                    self.device_id = _upsert(s, Device, {"fingerprint_hash": fp_hash}, {"device_class": o.device, "fingerprint": fp}).id
                    s.commit()
                break
            except IntegrityError:
                continue
        with Session(self.engine) as s:
            run = Run(device_class=o.device, command=o.command, sampler=o.sampler, host=socket.gethostname()[:255],
                      pid=os.getpid(), heartbeat_at=utcnow())
            s.add(run)
            s.commit()
            self.run_id = run.id
        self._reap()
        self.fingerprint = fp
        self.tasks: list[Task] = []
        self._left = 0
        stop = threading.Event()
        beat = threading.Thread(target=self._heartbeat, args=(stop,), daemon=True)
        beat.start()
        status = "failed"
        t0 = time.monotonic()
        try:
            self._loop(items, t0)
            complete = not self._left and all(t.state == "done" and self._spent(t) for t in self.tasks)
            status = "finished" if complete else "interrupted"
        except KeyboardInterrupt:
            status = "interrupted"
            raise
        finally:
            stop.set()
            beat.join(5)
            with Session(self.engine) as s:
                s.execute(delete(Lease).where(Lease.run_id == self.run_id))
                run = s.get(Run, self.run_id)
                run.status = status
                run.finished_at = utcnow()
                s.commit()
        return self.summary()

    # ---- several tuners, one database -------------------------------------------------------------
    def _heartbeat(self, stop: threading.Event) -> None:
        """Renew this run's heartbeat and leases until `stop`."""
        every = lease_s() / 6
        while not stop.wait(every):
            try:
                now = utcnow()
                with self.engine.begin() as c:
                    c.execute(update(Run).where(Run.id == self.run_id).values(heartbeat_at=now))
                    c.execute(update(Lease).where(Lease.run_id == self.run_id).values(expires_at=now + timedelta(seconds=lease_s())))
            except Exception as e:  # a busy database: try again at the next beat
                self.log(f"  heartbeat failed: {redact(str(e).splitlines()[0])[:200]}")

    def _run_alive(self, run: Run | None) -> bool:
        """Whether `run` is a live tuner: running, a fresh heartbeat and, on this host, its process exists."""
        if run is None or run.status != "running":
            return False
        if run.id == getattr(self, "run_id", None):
            return True
        seen = _aware(run.heartbeat_at or run.started_at)
        if seen is None or utcnow() - seen > timedelta(seconds=lease_s()):
            return False
        return not (run.host == socket.gethostname()[:255] and run.pid and not _pid_alive(run.pid))

    def _reap(self) -> None:
        """Mark runs whose process is gone as interrupted."""
        with Session(self.engine) as s:
            dead = [r for r in s.scalars(select(Run).where(Run.status == "running", Run.id != self.run_id)) if not self._run_alive(r)]
            ids = [r.id for r in dead]
            for r in dead:
                r.status, r.finished_at = "interrupted", utcnow()
            s.commit()
        if ids:
            self.log(f"marked {len(ids)} run(s) whose process is gone as interrupted: {', '.join(map(str, ids[:10]))}")

    def _claim(self, problem_id: int) -> bool:
        """Take the lease of `problem_id`: free, expired, ours already, or held by a dead run."""
        where = {"device_class": self.o.device, "problem_id": problem_id}
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
                if _aware(lease.expires_at) > now and self._run_alive(holder):
                    return False
                n = s.execute(update(Lease).where(Lease.id == lease.id, Lease.run_id == lease.run_id)
                              .values(run_id=self.run_id, expires_at=exp)).rowcount
                if n == 1 and holder is not None and holder.status == "running":
                    holder.status, holder.finished_at = "interrupted", utcnow()
                s.commit()
                return n == 1
        return False

    def _holds(self, problem_id: int) -> bool:
        with Session(self.engine) as s:
            lease = s.scalars(select(Lease).filter_by(device_class=self.o.device, problem_id=problem_id)).first()
            return lease is not None and lease.run_id == self.run_id

    def _release(self, problem_id: int) -> None:
        with self.engine.begin() as c:
            c.execute(delete(Lease).where(Lease.device_class == self.o.device, Lease.problem_id == problem_id,
                                          Lease.run_id == self.run_id))

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
        self.existing = set(optuna.study.get_all_study_names(self.storage))
        return items

    def _problem_id(self, op: str, problem: Any) -> int:
        for _ in range(3):  # two tuners may add the same problem at once
            try:
                with Session(self.engine) as s:
                    pid = _upsert(s, Problem, {"op": op, "key": problem_key(problem)}).id
                    s.commit()
                    return pid
            except IntegrityError:
                continue
        raise OpsAdvError(f"cannot store problem {op} {problem_key(problem)[:200]}")

    def _stale(self, w: Winner) -> list[str]:
        """The stack conditions under which `w` was measured that differ from this run's."""
        old = w.conditions or {}
        return [k for k in STACK if old.get(k) != self.conditions.get(k)]

    def _claim_task(self, op: str, problem: Any) -> Task | str | None:
        """A Task for `problem` if this run holds its lease; None when there is nothing to do; "held" by another run."""
        o = self.o
        fingerprint = self.fingerprint
        tunables = [i for i in impls(op, backend=self.backend) if not i.vendor and not i.unavailable]
        if o.only_impls:
            tunables = [i for i in tunables if i.name in o.only_impls]
        tunables = [n for n in (narrow(i, problem, self.backend) for i in tunables) if n is not None]
        vendors = [i for i in impls(op, backend=self.backend) if i.vendor and i.why_not(problem, backend=self.backend) is None]
        if not vendors and not tunables:
            raise OpsAdvError(f"no {op} implementation runs on {o.device}; pick other --ops")
        name = study_name(o.device, op, problem, self.backend)
        legacy = legacy_study_name(o.device, op, problem, self.backend)
        if name not in self.existing and legacy in self.existing:
            name = legacy  # tuned before studies had readable names: resume under the old name
        pid = self._problem_id(op, problem)

        def tuned() -> tuple[bool, list[str]]:
            with Session(self.engine) as s:
                w = s.scalars(select(Winner).filter_by(device_class=o.device, problem_id=pid)).first()
                if w is not None and w.study == name and w.trials >= o.trials:
                    stale = self._stale(w) if o.revalidate else []
                    if not stale:
                        self.log(f"skip {op} {problem_key(problem)}: already tuned ({w.trials} trials)")
                    return True, stale
            return False, []

        done, stale = tuned()
        if done and not stale:
            return None
        if not self._claim(pid):
            return "held"
        done, stale = tuned()  # another run may have finished it meanwhile
        if done and not stale:
            self._release(pid)
            return None
        with Session(self.engine) as s:
            rows = s.scalars(select(Trial).filter_by(study=name)).all()
        study = optuna.create_study(
            study_name=name, storage=self.storage, direction="minimize", load_if_exists=True, sampler=_sampler(o.sampler, o.seed)
        )
        _set_attrs(study.set_user_attr, study.user_attrs, self._study_attrs(op, problem, fingerprint))
        task = Task(op, problem, name, pid, study, tunables, deque(), deque(), budget=o.trials,
                    space=sum(t.why_not(problem, c, self.backend) is None for t in tunables for c in t.configs()))
        self._resume(task, rows)
        if stale:  # measured under another stack: re-measure its stored finalists against the vendor, no new search
            self.log(f"revalidate {task.label}: measured under another {', '.join(stale)}")
            task.budget = task.asked
            task.state = "confirm"
            return task
        measured_vendors = {r["impl"] for r in task.results if r["vendor"]}
        task.vendors.extend(v.name for v in vendors if v.name not in measured_vendors)
        if not tunables:
            task.budget = 0
        elif o.sampler == "grid":
            self._enqueue_grid(task)
        elif o.warm_start and task.asked == 0:
            self._enqueue_warm_start(task)
        return task

    def _study_attrs(self, op: str, problem: Any, fp: dict) -> dict:
        """What optuna-dashboard shows about a study: the problem, the device, the kernels."""
        summary = ", ".join(f"{k} {fp[k]}" if k != "name" else str(fp[k])
                            for k in ("name", "torch", "triton", "cuda", "driver", "cpus") if fp.get(k) is not None)
        return {
            "op": op, "problem": problem._asdict(), "device_class": self.o.device, "fingerprint": summary,
            "fingerprint_hash": hashlib.sha256(json.dumps(fp, sort_keys=True).encode()).hexdigest()[:12],
            "kernel_set": kernel_set_version(op, self.backend),
            "kernel_versions": {i.name: i.version for i in impls(op, backend=self.backend)},
        }

    def _resume(self, task: Task, rows: list[Trial]) -> None:
        """Pick up an interrupted study: finished trials count, running ones of dead runs are failed."""
        for r in rows:
            key = _params_key(r.impl, r.params)
            value = r.median_ms if r.status == OK else None
            task.seen.setdefault(key, (r.status, value))
            if r.status == OK:
                task.results.append(
                    {"impl": r.impl, "params": r.params, "vendor": kernel_space.get_impl(task.op, r.impl).vendor,
                     "median_ms": r.median_ms, "spread_ms": r.spread_ms or 0.0}
                )
        live: dict[int, bool] = {}
        for t in task.study.get_trials(deepcopy=False):
            if t.state == TrialState.RUNNING:
                rid = t.user_attrs.get(RUN_ATTR)
                if rid is not None and rid not in live:
                    with Session(self.engine) as s:
                        live[rid] = rid != self.run_id and self._run_alive(s.get(Run, rid))
                if rid is not None and live[rid]:
                    continue  # a live run's trial in flight: not ours to end
                try:
                    task.study.tell(t.number, state=TrialState.FAIL)
                except (ValueError, RuntimeError):  # finished by its run meanwhile
                    pass
            elif t.state == TrialState.WAITING:
                continue
            elif t.state == TrialState.PRUNED:
                task.pruned += 1
                continue
            elif t.user_attrs.get(REPEAT):
                task.repeats += 1
                continue
            task.asked += 1
        if rows or task.asked:
            self.log(f"resume {task.label}: {task.asked} trials done")

    def _enqueue_grid(self, task: Task) -> None:
        n = 0
        for impl in task.tunables:
            for cfg in impl.configs():
                if impl.why_not(task.problem, cfg, self.backend) is None:
                    task.seeds.append((impl.name, cfg))
                    n += 1
        task.budget = n

    def _enqueue_warm_start(self, task: Task) -> None:
        """The winners of the nearest tuned problems are the first configurations tried."""
        spec = get_op(task.op)
        with Session(self.engine) as s:
            rows = s.execute(
                select(Winner, Problem).join(Problem, Winner.problem_id == Problem.id)
                .where(Winner.device_class == self.o.device, Problem.op == task.op)
            ).all()
        near = []
        names = {t.name for t in task.tunables}
        for w, p in rows:
            other = spec.problem(**json.loads(p.key))
            d = problem_distance(spec, tuple(task.problem), tuple(other))
            if d is None or p.id == task.problem_id or w.impl not in names:
                continue
            near.append((d, w.impl, w.params))
        for _, impl, params in sorted(near, key=lambda x: x[0])[:3]:
            if kernel_space.get_impl(task.op, impl).why_not(task.problem, params, self.backend) is None:
                task.seeds.append((impl, params))

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
        prog.update(time.monotonic() - t0, sum(done), len(tasks), trials, sum(quota), steps, sum(quota) + len(tasks),
                    self.best_speedup)

    def _loop_with(self, items: list[tuple[str, Any]], t0: float, prog: Progress) -> None:
        o = self.o
        tasks = self.tasks
        pending = deque(items)  # (op, problem) not yet claimed
        waiting: list = []  # leased to another live run: tried again now and then
        retry_at, said = 0.0, False
        active: list[Task] = []
        window = len(self.pool.slots) + 1  # few problems at once keeps inputs resident on the device
        ready: deque = deque()  # jobs asked ahead (in flight for their task), next to be submitted
        while pending or active or waiting:
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
                task = self._claim_task(op, problem)
                if task == "held":
                    waiting.append((op, problem))
                elif task is not None:
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
                    self._release(task.problem_id)
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

    def _next_job(self, task: Task, out_of_time: bool):
        o = self.o
        if task.requeued:
            return task.requeued.popleft()
        if task.state == "confirm":
            if task.in_flight:
                return None
            cands = self._finalists(task)
            task.state = "confirming"
            if len(cands) < 2:
                self._write_winner(task, None)
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
                task.study.enqueue_trial(fixed, skip_if_exists=False)
            trial = task.study.ask()
            trial.set_user_attr(RUN_ATTR, self.run_id)
            name, params = _suggest(trial, task.tunables)
            impl = kernel_space.get_impl(task.op, name)
            key = _params_key(name, params)
            if key in task.seen:
                status, value = task.seen[key]
                if status == PRUNED:
                    task.pruned += 1
                else:
                    task.repeats += 1
                    trial.set_user_attr(REPEAT, True)
                    tun = next(t for t in task.tunables if t.name == name)
                    nb = unseen_neighbour(tun, params, task.problem, self.backend, task.seen, self._rng)
                    if nb is not None and not task.seeds and task.asked < task.budget:
                        task.seeds.append((name, nb))
                _set_attrs(trial.set_user_attr, {}, {"impl": name, "status": status})
                self._tell(task, trial, status, value)
                continue
            why = impl.why_not(task.problem, params, self.backend)
            if why:
                task.seen[key] = (PRUNED, None)
                task.pruned += 1
                self._record(task, trial.number, name, params, {"status": PRUNED, "error": why})
                _set_attrs(trial.set_user_attr, {}, _trial_attrs(name, {"status": PRUNED, "error": why}))
                self._tell(task, trial, PRUNED, None)
                continue
            task.in_flight += 1
            task.asked += 1
            return self._measure_job(task, name, params, trial)
        return None

    def _measure_job(self, task: Task, name: str, params: dict, trial):
        trial_spec = {"op": task.op, "problem": task.problem._asdict(), "impl": name, "params": params}
        return ("measure", (trial_spec, self.o.measure_budget_s), self.o.trial_timeout_s, ("measure", task, name, params, trial))

    def _tell(self, task: Task, trial, status: str, value: float | None) -> None:
        if trial is None:
            return
        if status == OK:
            task.study.tell(trial, value)
        elif status == PRUNED:
            task.study.tell(trial, state=TrialState.PRUNED)
        else:
            # crashed, hung, wrong, failed to compile: infinitely slow to TPE, which ignores FAIL trials and so proposed
            # them again and again (in replays: 205 of 300 asks near a failed region as FAIL, 30 as inf)
            task.study.tell(trial, float("inf"))

    def _finish(self, job, res: dict, fail: str | None) -> None:
        kind, task = job[0], job[1]
        if fail == NODE_LOST:  # not the kernel's doing: the same job (same Optuna trial) runs again, nothing is recorded
            task.requeued.append((*res["retry"], job))
            self.log(f"  {task.label}: {res['error']}; running its {kind} job again")
            return
        task.in_flight -= 1
        if kind == "confirm":
            self._write_winner(task, None if fail else (job[2], res))
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
        self._record(task, trial.number if trial is not None else None, name, params, res)
        if trial is not None:
            _set_attrs(trial.set_user_attr, {}, _trial_attrs(name, res))
        self._tell(task, trial, status, res.get("median_ms"))

    def _record(self, task: Task, number: int | None, name: str, params: dict, res: dict) -> None:
        with Session(self.engine) as s:
            s.add(Trial(
                run_id=self.run_id, problem_id=task.problem_id, device_id=self.device_id, study=task.study_name,
                optuna_number=number, impl=name, kernel_version=kernel_space.get_impl(task.op, name).version,
                params=params, status=res["status"], error=res.get("error"), median_ms=res.get("median_ms"),
                spread_ms=res.get("spread_ms"), rel_error=res.get("rel_error"),
            ))
            s.commit()

    # ---- winners ------------------------------------------------------------------------------
    def _finalists(self, task: Task) -> list[dict]:
        tun = sorted((r for r in task.results if not r["vendor"]), key=lambda r: r["median_ms"])
        ven = sorted((r for r in task.results if r["vendor"]), key=lambda r: r["median_ms"])
        picks, keys = [], set()
        for r in tun:
            k = _params_key(r["impl"], r["params"])
            if k not in keys:
                keys.add(k)
                picks.append({**r, "key": k})
            if len(picks) >= self.o.finalists:
                break
        picks += [{**r, "key": _params_key(r["impl"], r["params"])} for r in ven[:1]]
        return picks

    def _write_winner(self, task: Task, confirmed: tuple[list[dict], dict] | None) -> None:
        """Store the winner; a tuned kernel replaces the vendor only when it wins beyond the noise."""
        task.state = "done"
        if confirmed:
            cands, times = confirmed
            rows = [{**c, "median_ms": times[c["key"]]["median_ms"], "spread_ms": times[c["key"]]["spread_ms"]} for c in cands]
        else:
            rows = task.results
        vendors = sorted((r for r in rows if r["vendor"]), key=lambda r: r["median_ms"])
        tuned = sorted((r for r in rows if not r["vendor"]), key=lambda r: r["median_ms"])
        if not vendors and not tuned:
            self.log(f"  {task.label}: no candidate ran correctly; nothing stored")
            return
        best = vendors[0] if vendors else tuned[0]
        if vendors and tuned:
            v, t = vendors[0], tuned[0]
            noise = max(v["spread_ms"], t["spread_ms"], 0.01 * v["median_ms"])
            if v["median_ms"] - t["median_ms"] > noise:
                best = t
        vendor = vendors[0] if vendors else best
        speedup = vendor["median_ms"] / best["median_ms"]
        if not self._holds(task.problem_id):
            self.log(f"  {task.label}: its lease passed to another tuner (no heartbeat for {lease_s():.0f} s); not storing")
            return
        self.best_speedup = max(speedup, self.best_speedup or 0.0)
        with Session(self.engine) as s:
            old = s.scalars(select(Winner).filter_by(device_class=self.o.device, problem_id=task.problem_id)).first()
            if old is not None:
                s.delete(old)
                s.flush()
            s.add(Winner(
                device_class=self.o.device, problem_id=task.problem_id, device_id=self.device_id, run_id=self.run_id,
                study=task.study_name, impl=best["impl"], kernel_version=kernel_space.get_impl(task.op, best["impl"]).version,
                params=best["params"], median_ms=best["median_ms"], spread_ms=best["spread_ms"],
                vendor_impl=vendor["impl"], vendor_ms=vendor["median_ms"], speedup=vendor["median_ms"] / best["median_ms"],
                trials=task.asked, conditions=self.conditions or None,
            ))
            s.commit()
        self.log(
            f"  done {task.label}: {best['impl']} {best['params']} {best['median_ms']:.4g} ms vs {vendor['impl']} "
            f"{vendor['median_ms']:.4g} ms ({vendor['median_ms'] / best['median_ms']:.2f}x; {task.asked} trials, "
            f"{task.pruned} pruned, {task.failures} failed)"
        )

    def summary(self) -> list[dict]:
        """Winners of this run's problems, in the order given."""
        out, seen = [], set()
        with Session(self.engine) as s:
            for op, problem in self.o.problems:
                if (op, problem_key(problem)) in seen:
                    continue
                seen.add((op, problem_key(problem)))
                p = s.scalars(select(Problem).filter_by(op=op, key=problem_key(problem))).first()
                w = p and s.scalars(select(Winner).filter_by(device_class=self.o.device, problem_id=p.id)).first()
                if w:
                    out.append({"op": op, "problem": problem._asdict(), "impl": w.impl, "params": w.params, "median_ms": w.median_ms,
                                "spread_ms": w.spread_ms, "vendor_impl": w.vendor_impl, "vendor_ms": w.vendor_ms, "speedup": w.speedup,
                                "trials": w.trials})
        return out
