"""The tuning driver: Optuna asks, Ray workers measure, the database keeps every trial."""
from __future__ import annotations

import dataclasses
import hashlib
import json
import random
import sys
import time
import warnings
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

import optuna
from optuna.trial import TrialState
from sqlalchemy import select
from sqlalchemy.orm import Session

import kernel_space
from db import Device, Problem, Run, Trial, Winner, normalize, open_db, redact
from db.models import utcnow
from kernel_space import OpsAdvError, get_op, impls, problem_distance, problem_key
from workers.measure import OK, PRUNED

from ._pool import NODE_LOST, Pool, start_ray
from .devices import check_device

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
    command: str = ""
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


def study_name(device_class: str, op: str, problem: Any, backend: str) -> str:
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
        self.o = opts
        self.log = opts.log
        self.backend = "cpu" if opts.device == "cpu" else "cuda"
        self._rr = 0
        self._rng = random.Random(opts.seed)
        self.stats: dict = {}  # after run(): wall_s and per worker slot busy_s, jobs, restarts (see Pool.stats)
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)

    # ---- set-up -------------------------------------------------------------------------------
    def run(self) -> list[dict]:
        o = self.o
        self.engine = open_db(o.db_url)
        url = normalize(o.db_url)
        kw = {"connect_args": {"timeout": 30}} if url.startswith("sqlite") else {"pool_pre_ping": True}
        self.storage = optuna.storages.RDBStorage(url, engine_kwargs=kw)
        placement = check_device(o.device, o.ray_address is not None)
        ops = ", ".join(dict.fromkeys(op for op, _ in o.problems))
        self.log(f"tuning {len(o.problems)} problem(s) of {ops} on {o.device} into {redact(o.db_url)}")
        owned = start_ray(o.ray_address, num_cpus=None)
        try:
            n = o.workers or placement.count()
            self.log(f"starting {n} measuring worker(s) for {o.device}")
            cw = o.compile_workers if o.compile_workers is not None else (4 if self.backend == "cuda" else 0)
            self.pool = Pool(self.backend, n, accelerator_type=placement.accelerator_type, plugins=o.plugins,
                             compile_workers=cw)
            t = time.monotonic()
            try:
                return self._run()
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
        tasks = self._make_tasks(fp)
        fp_hash = hashlib.sha256(json.dumps(fp, sort_keys=True).encode()).hexdigest()
        with Session(self.engine) as s:
            self.device_id = _upsert(s, Device, {"fingerprint_hash": fp_hash}, {"device_class": o.device, "fingerprint": fp}).id
            run = Run(device_class=o.device, command=o.command, sampler=o.sampler)
            s.add(run)
            s.commit()
            self.run_id = run.id
        status = "failed"
        t0 = time.monotonic()
        try:
            self._loop(tasks, t0)
            complete = all(t.state == "done" and self._spent(t) for t in tasks)
            status = "finished" if complete else "interrupted"
        except KeyboardInterrupt:
            status = "interrupted"
            raise
        finally:
            with Session(self.engine) as s:
                run = s.get(Run, self.run_id)
                run.status = status
                run.finished_at = utcnow()
                s.commit()
        return self.summary()

    def _make_tasks(self, fingerprint: dict) -> list[Task]:
        o = self.o
        tasks = []
        mem = fingerprint.get("memory_bytes")
        for op, problem in o.problems:
            need = 3 * get_op(op).bytes_moved(problem)  # inputs, output and the reference
            if mem and need > 0.9 * mem:
                raise OpsAdvError(
                    f"{op} {problem_key(problem)} needs about {need / 2**30:.1f} GiB, more than the "
                    f"{mem / 2**30:.0f} GiB of {fingerprint.get('name')}; drop it from the shapes file"
                )
        for op, problem in o.problems:
            tunables = [i for i in impls(op, backend=self.backend) if not i.vendor and not i.unavailable]
            if o.only_impls:
                tunables = [i for i in tunables if i.name in o.only_impls]
            tunables = [n for n in (narrow(i, problem, self.backend) for i in tunables) if n is not None]
            vendors = [i for i in impls(op, backend=self.backend) if i.vendor and i.why_not(problem, backend=self.backend) is None]
            if not vendors and not tunables:
                raise OpsAdvError(f"no {op} implementation runs on {o.device}; pick other --ops")
            name = study_name(o.device, op, problem, self.backend)
            with Session(self.engine) as s:
                pid = _upsert(s, Problem, {"op": op, "key": problem_key(problem)}).id
                s.commit()
                w = s.scalars(select(Winner).filter_by(device_class=o.device, problem_id=pid)).first()
                if w is not None and w.study == name and w.trials >= o.trials:
                    self.log(f"skip {op} {problem_key(problem)}: already tuned ({w.trials} trials)")
                    continue
                done = s.scalars(select(Trial).filter_by(study=name)).all()
            study = optuna.create_study(
                study_name=name, storage=self.storage, direction="minimize", load_if_exists=True, sampler=_sampler(o.sampler, o.seed)
            )
            task = Task(op, problem, name, pid, study, tunables, deque(), deque(), budget=o.trials,
                        space=sum(t.why_not(problem, c, self.backend) is None for t in tunables for c in t.configs()))
            self._resume(task, done)
            measured_vendors = {r["impl"] for r in task.results if r["vendor"]}
            task.vendors.extend(v.name for v in vendors if v.name not in measured_vendors)
            if not tunables:
                task.budget = 0
            elif o.sampler == "grid":
                self._enqueue_grid(task)
            elif o.warm_start and task.asked == 0:
                self._enqueue_warm_start(task)
            tasks.append(task)
        return tasks

    def _resume(self, task: Task, rows: list[Trial]) -> None:
        """Pick up an interrupted study: finished trials count, running ones are failed."""
        for r in rows:
            key = _params_key(r.impl, r.params)
            value = r.median_ms if r.status == OK else None
            task.seen.setdefault(key, (r.status, value))
            if r.status == OK:
                task.results.append(
                    {"impl": r.impl, "params": r.params, "vendor": kernel_space.get_impl(task.op, r.impl).vendor,
                     "median_ms": r.median_ms, "spread_ms": r.spread_ms or 0.0}
                )
        for t in task.study.get_trials(deepcopy=False):
            if t.state == TrialState.RUNNING:
                task.study.tell(t.number, state=TrialState.FAIL)
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
    def _loop(self, tasks: list[Task], t0: float) -> None:
        o = self.o
        pending = deque(tasks)
        active: list[Task] = []
        window = len(self.pool.slots) + 1  # few problems at once keeps inputs resident on the device
        last_report = time.monotonic()
        ready: deque = deque()  # jobs asked ahead (in flight for their task), next to be submitted
        while pending or active:
            out_of_time = o.timeout_s is not None and time.monotonic() - t0 > o.timeout_s
            if out_of_time and pending:
                self.log(f"time limit of {o.timeout_s:.0f} s reached: {len(pending)} problem(s) left for the next run of the same command")
                pending.clear()
            while pending and len(active) < window:
                active.append(pending.popleft())
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
            for job, res, fail in self.pool.poll(0.2):
                self._finish(job, res, fail)
            for task in list(active):
                if task.state == "search" and task.in_flight == 0 and self._exhausted(task, out_of_time):
                    task.state = "confirm"
                if task.state == "done":
                    active.remove(task)
            if time.monotonic() - last_report > 10:
                last_report = time.monotonic()
                done = sum(t.state == "done" for t in tasks)
                trials = sum(t.asked for t in tasks)
                self.log(f"[{time.monotonic() - t0:5.0f}s] {done}/{len(tasks)} problems done, {trials} trials asked")

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
                self._tell(task, trial, status, value)
                continue
            why = impl.why_not(task.problem, params, self.backend)
            if why:
                task.seen[key] = (PRUNED, None)
                task.pruned += 1
                self._record(task, trial.number, name, params, {"status": PRUNED, "error": why})
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
        else:
            task.study.tell(trial, state=TrialState.PRUNED if status == PRUNED else TrialState.FAIL)

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
                trials=task.asked,
            ))
            s.commit()
        self.log(
            f"  done {task.label}: {best['impl']} {best['params']} {best['median_ms']:.4g} ms vs {vendor['impl']} "
            f"{vendor['median_ms']:.4g} ms ({vendor['median_ms'] / best['median_ms']:.2f}x; {task.asked} trials, "
            f"{task.pruned} pruned, {task.failures} failed)"
        )

    def summary(self) -> list[dict]:
        """Winners of this run's problems, in the order given."""
        out = []
        with Session(self.engine) as s:
            for op, problem in self.o.problems:
                p = s.scalars(select(Problem).filter_by(op=op, key=problem_key(problem))).first()
                w = p and s.scalars(select(Winner).filter_by(device_class=self.o.device, problem_id=p.id)).first()
                if w:
                    out.append({"op": op, "problem": problem._asdict(), "impl": w.impl, "params": w.params, "median_ms": w.median_ms,
                                "spread_ms": w.spread_ms, "vendor_impl": w.vendor_impl, "vendor_ms": w.vendor_ms, "speedup": w.speedup,
                                "trials": w.trials})
        return out
