"""One problem's study: its name, its Task, and setting it up (resume, grid, warm start); its trials recorded.

Tuner mixes StudySetup in; the methods use the run's engine, storage, options (`o`), backend,
device, conditions, run_id, leases and log.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import random
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

import optuna
from optuna.trial import TrialState
from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

import kernel_space
from db import Problem, Run, Trial, Winner
from kernel_space import OpsAdvError, get_op, impls, problem_distance, problem_key
from workers.measure import OK, PRUNED

RUN_ATTR = "opsadv_run"  # user attribute of an Optuna trial: the opsadv_runs id that asked it
REPEAT = "opsadv_repeat"  # user attribute of an Optuna trial that proposed a configuration again
STACK = ("threads", "torch", "triton", "cuda", "cudnn", "cublas", "driver")  # conditions a winner is revalidated on


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
    state: str = "search"  # search -> confirm -> confirming (-> confirm again for an outlier) -> done
    stored: dict | None = None  # the winner stored before this run (same study), kept unless beaten
    finalists: list[dict] = field(default_factory=list)  # what the confirmation rounds re-measure
    confirms: dict[str, list[dict]] = field(default_factory=dict)  # key -> its times over the confirmation rounds
    lost: bool = False  # its lease passed to another tuner (this one paused past it): nothing more is written
    checked_at: float = 0.0  # when this run last saw that it holds the lease
    requeued: deque = field(default_factory=deque)  # jobs lost with a worker's node: handed out again first, still in_flight

    @property
    def label(self) -> str:
        from .report import _short_problem

        return f"{self.op} {_short_problem(self.problem._asdict())}"


def _params_key(impl: str, params: dict) -> str:
    return json.dumps([impl, sorted(params.items())], default=str)


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


class StudySetup:
    """Claiming, opening and resuming one problem's study; recording its trials."""

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
        space = sum(t.why_not(problem, c, self.backend) is None for t in tunables for c in t.configs())
        # tuned: the budget measured, or every valid configuration (a space smaller than --trials; vendors only: none)
        want = space if o.sampler == "grid" else min(o.trials, space)

        def tuned() -> tuple[bool, list[str]]:
            with Session(self.engine) as s:
                w = s.scalars(select(Winner).filter_by(device_class=o.device, problem_id=pid)).first()
                if w is not None and w.study == name and w.trials >= want:
                    stale = self._stale(w) if o.revalidate else []
                    if not stale:
                        self.log(f"skip {op} {problem_key(problem)}: already tuned ({w.trials} trials)")
                    return True, stale
            return False, []

        done, stale = tuned()
        if done and not stale:
            return None
        if not self.leases.claim(pid):
            return "held"
        done, stale = tuned()  # another run may have finished it meanwhile
        if done and not stale:
            self.leases.release(pid)
            return None
        with Session(self.engine) as s:
            rows = s.scalars(select(Trial).filter_by(study=name)).all()
        study = optuna.create_study(
            study_name=name, storage=self.storage, direction="minimize", load_if_exists=True, sampler=_sampler(o.sampler, o.seed)
        )
        _set_attrs(study.set_user_attr, study.user_attrs, self._study_attrs(op, problem, fingerprint))
        task = Task(op, problem, name, pid, study, tunables, deque(), deque(), budget=o.trials, space=space)
        self._resume(task, rows)
        with Session(self.engine) as s:
            w = s.scalars(select(Winner).filter_by(device_class=o.device, problem_id=pid)).first()
            if w is not None and w.study == name:
                task.stored = {"impl": w.impl, "params": w.params, "median_ms": w.median_ms, "spread_ms": w.spread_ms,
                               "vendor_impl": w.vendor_impl, "vendor_ms": w.vendor_ms, "same_stack": not self._stale(w)}
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
                        live[rid] = rid != self.run_id and self.leases.run_alive(s.get(Run, rid))
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

    def _tell(self, task: Task, trial, status: str, value: float | None, again: bool = False) -> None:
        """Tell Optuna a trial's outcome; `again`: a retry after a database outage, which may have stored the first
        attempt before its answer was lost (then the trial is finished already and is not told twice)."""
        if trial is None:
            return
        if status == OK:
            task.study.tell(trial, value, skip_if_finished=again)
        elif status == PRUNED:
            task.study.tell(trial, state=TrialState.PRUNED, skip_if_finished=again)
        else:
            # crashed, hung, wrong, failed to compile: infinitely slow to TPE, which ignores FAIL trials and so proposed
            # them again and again (in replays: 205 of 300 asks near a failed region as FAIL, 30 as inf)
            task.study.tell(trial, float("inf"), skip_if_finished=again)

    def _record(self, task: Task, number: int | None, name: str, params: dict, res: dict) -> None:
        with Session(self.engine) as s:
            s.add(Trial(
                run_id=self.run_id, problem_id=task.problem_id, device_id=self.device_id, study=task.study_name,
                optuna_number=number, impl=name, kernel_version=kernel_space.get_impl(task.op, name).version,
                params=params, status=res["status"], error=res.get("error"), median_ms=res.get("median_ms"),
                spread_ms=res.get("spread_ms"), rel_error=res.get("rel_error"),
            ))
            s.commit()
