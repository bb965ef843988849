"""Winners: the finalists of a problem, confirmed side by side, and the one stored.

The database only gets better: a time far from what the same configuration measured before
(in this run's search, earlier runs, or the stored winner) is measured again before it is
stored, each finalist keeps its least contended round, and a stored winner is replaced only by
a faster one measured under the same stack. A vendor time slower than every earlier measurement
of that vendor kernel for the problem (all its trials on this device, beyond their spread) is
contention, not a baseline: the speedup is taken against the vendor's history instead, and when
that decides the winner the finalists are measured again first. What was measured and not stored
is kept with the winner (opsadv_winners.history).

Tuner mixes Winners in; the methods use the run's engine, options (`o`), device_id, run_id,
conditions, leases and log.
"""
from __future__ import annotations

import statistics
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

import kernel_space
from db import Problem, Trial, Winner
from db.models import utcnow
from kernel_space import problem_key
from workers.measure import OK

from .leases import lease_s
from .study import Task, _params_key

FAR = 3.0  # a time this factor slower than the same configuration's earlier times is measured again
RECONFIRM = 2  # at most this many extra confirmation rounds
HISTORY = 20  # entries kept in a winner's history
# A vendor time agrees with an earlier measurement up to that measurement's spread (interquartile range), and at
# least this share of it: a measurement whose repetitions all but coincide leaves room for ordinary noise.
AGREE = 0.1


def far(ms: float, earlier: list[float]) -> float | None:
    """The median of `earlier` when `ms` is more than FAR times slower than it, else None.

    Only slower: contention (another process, a first call's set-up) makes a kernel slower, never
    faster, and a confirmation faster than the search's first measurement is the usual case.
    """
    earlier = [e for e in earlier if e and e > 0]
    if not earlier or not ms or ms <= 0:
        return None
    ref = statistics.median(earlier)
    return ref if ms > FAR * ref else None


def disagrees(ms: float, history: list[tuple[float, float | None]]) -> float | None:
    """The median of `history`'s times when `ms` is slower than every one of them beyond its spread, else None.

    `history` holds (median_ms, spread_ms) of a vendor kernel's earlier measurements of one problem. A vendor time
    past all of them is contention (another process, a neighbour's threads), and a speedup computed from it is
    contention too (issue 30: a vendor measured 50.75 ms against 0.1345 ms in the search made a "231x" winner).
    """
    hist = [(m, s or 0.0) for m, s in history if m and m > 0]
    if not hist or not ms or ms <= 0:
        return None
    if ms <= max(m + max(s, AGREE * m) for m, s in hist):
        return None
    return statistics.median(m for m, _ in hist)


def choose(rows: list[dict]) -> tuple[dict, dict] | None:
    """(best, vendor baseline): a tuned kernel replaces the vendor only when it wins beyond the noise."""
    vendors = sorted((r for r in rows if r["vendor"]), key=lambda r: r["median_ms"])
    tuned = sorted((r for r in rows if not r["vendor"]), key=lambda r: r["median_ms"])
    if not vendors and not tuned:
        return None
    best = vendors[0] if vendors else tuned[0]
    if vendors and tuned:
        v, t = vendors[0], tuned[0]
        noise = max(v["spread_ms"], t["spread_ms"], 0.01 * v["median_ms"])
        if v["median_ms"] - t["median_ms"] > noise:
            best = t
    return best, (vendors[0] if vendors else best)


def outliers(rows: list[dict], earlier: dict[str, list[float]]) -> list[tuple[dict, float]]:
    """(row, earlier median) for the best and the vendor baseline of `rows` far slower than their earlier times."""
    picked = choose(rows)
    if picked is None:
        return []
    out = []
    for r in {id(r): r for r in picked}.values():
        ref = far(r["median_ms"], earlier.get(r["key"], []))
        if ref is not None:
            out.append((r, ref))
    return out


def _entry(run_id: int, row: dict, vendor: dict, **extra: Any) -> dict:
    return {"run_id": run_id, "at": utcnow().isoformat(timespec="seconds"), "impl": row["impl"], "params": row["params"],
            "median_ms": row["median_ms"], "spread_ms": row["spread_ms"], "vendor_impl": vendor["impl"],
            "vendor_ms": vendor["median_ms"], **extra}


class Winners:
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
        st = task.stored
        if st and not kernel_space.get_impl(task.op, st["impl"]).vendor and any(t.name == st["impl"] for t in task.tunables):
            k = _params_key(st["impl"], st["params"])  # the stored winner is measured beside its challengers
            if k not in keys:
                picks.append({"impl": st["impl"], "params": st["params"], "vendor": False, "median_ms": st["median_ms"],
                              "spread_ms": st["spread_ms"], "key": k})
        picks += [{**r, "key": _params_key(r["impl"], r["params"])} for r in ven[:1]]
        return picks

    def _earlier(self, task: Task) -> dict[str, list[float]]:
        """Per configuration, its times before the confirmation: this run's search, earlier runs, the stored winner."""
        out: dict[str, list[float]] = {}
        for r in task.results:
            out.setdefault(_params_key(r["impl"], r["params"]), []).append(r["median_ms"])
        st = task.stored
        if st and st["same_stack"]:
            out.setdefault(_params_key(st["impl"], st["params"]), []).append(st["median_ms"])
            out.setdefault(_params_key(st["vendor_impl"], {}), []).append(st["vendor_ms"])
        for c in task.finalists:  # a vendor's whole history: earlier runs and other studies of the problem too
            if c["vendor"]:
                out[c["key"]] = [m for m, _ in self._vendor_history(task, c["impl"])] + out.get(c["key"], [])
        return out

    def _vendor_history(self, task: Task, impl: str) -> list[tuple[float, float | None]]:
        """(median_ms, spread_ms) of every ok measurement of vendor kernel `impl` for this problem on this device
        (same fingerprint, same kernel version), from any run or study: the search's own measurement included."""
        version = kernel_space.get_impl(task.op, impl).version
        with Session(self.engine) as s:
            return [tuple(r) for r in s.execute(
                select(Trial.median_ms, Trial.spread_ms).where(
                    Trial.problem_id == task.problem_id, Trial.device_id == self.device_id, Trial.impl == impl,
                    Trial.kernel_version == version, Trial.status == OK, Trial.median_ms.is_not(None)))]

    def _against_history(self, task: Task, rows: list[dict]) -> tuple[list[dict], dict | None]:
        """`rows` with the vendor baseline's time taken from its history when the measured one disagrees with it
        (see `disagrees`), and what was replaced ({"vendor", "measured_ms", "history_ms", "earlier"}) or None."""
        picked = choose(rows)
        if picked is None or not picked[1]["vendor"]:
            return rows, None
        if task.stored and not task.stored["same_stack"]:
            # revalidating under another stack (threads, say, which the device's fingerprint lacks): the vendor's
            # history was measured under the old one, and this run measures it in the confirmation alone
            return rows, None
        vendor = picked[1]
        hist = self._vendor_history(task, vendor["impl"])
        ref = disagrees(vendor["median_ms"], hist)
        if ref is None:
            return rows, None
        spread = statistics.median(s or 0.0 for _, s in hist)
        fixed = {**vendor, "median_ms": ref, "spread_ms": spread}
        times = sorted(m for m, _ in hist)
        return [fixed if r is vendor else r for r in rows], {
            "vendor": vendor["impl"], "measured_ms": vendor["median_ms"], "history_ms": ref, "earlier": times}

    def _confirmed(self, task: Task, times: dict) -> None:
        """One confirmation round done: measure again if the best or the vendor is an outlier, else store."""
        for c in task.finalists:
            if c["key"] in times:
                task.confirms.setdefault(c["key"], []).append(times[c["key"]])
        # each finalist at its least contended round: contention only ever makes a kernel slower
        rows = [{**c, **min(task.confirms[c["key"]], key=lambda t: t["median_ms"])} for c in task.finalists if c["key"] in task.confirms]
        rounds = max((len(v) for v in task.confirms.values()), default=0)
        odd = outliers(rows, self._earlier(task))
        if not odd and rounds <= RECONFIRM and (picked := choose(rows)) is not None:
            fixed, note = self._against_history(task, rows)
            if note and choose(fixed)[0]["key"] != picked[0]["key"]:  # the winner rests on a vendor time its history denies
                odd = [(picked[1], note["history_ms"])]
        if odd and rounds <= RECONFIRM:
            r, ref = odd[0]
            self.log(f"  {task.label}: {r['impl']} measured {r['median_ms']:.4g} ms against its {ref:.4g} ms before; "
                     f"measuring the finalists again")
            task.state = "confirm"
            return
        self._write_winner(task, rows)

    def _write_winner(self, task: Task, confirmed: list[dict] | None) -> None:
        """Store the winner, unless the stored one (same kernels, same stack) is as fast: then keep it and record this run's."""
        task.state = "done"
        rows, note = self._against_history(task, confirmed if confirmed is not None else task.results)
        picked = choose(rows)
        if picked is None:
            self.log(f"  {task.label}: no candidate ran correctly; nothing stored")
            return
        best, vendor = picked
        speedup = vendor["median_ms"] / best["median_ms"]
        if note:
            e = note["earlier"]
            span = f"{e[0]:.4g} ms" if len(e) == 1 else f"{e[0]:.4g}-{e[-1]:.4g} ms"
            self.log(
                f"  {task.label}: {note['vendor']} measured {note['measured_ms']:.4g} ms in the final re-measurement, slower "
                f"than its {len(e)} earlier measurement{'s' if len(e) > 1 else ''} ({span}) beyond their spread: contended, "
                f"so its history's {note['history_ms']:.4g} ms is its time"
                + ("; keeping the vendor kernel" if best["vendor"] else f"; the speedup is taken against that ({speedup:.2f}x)"))
        if not self.leases.holds(task.problem_id):
            self.log(f"  {task.label}: its lease passed to another tuner (no heartbeat for {lease_s():.0f} s); not storing")
            return
        rounds = {}
        if any(len(v) > 1 for v in task.confirms.values()):  # an outlier was measured again: every round is data
            rounds = {"rounds": {c["impl"] + (f" {c['params']}" if c["params"] else ""): [t["median_ms"] for t in task.confirms[c["key"]]]
                                 for c in task.finalists if c["key"] in task.confirms}}
        if note:  # what the vendor measured, beside the history time stored as vendor_ms
            rounds["vendor_measured_ms"] = note["measured_ms"]
        with Session(self.engine) as s:
            old = s.scalars(select(Winner).filter_by(device_class=self.o.device, problem_id=task.problem_id)).first()
            history = list((old.history or []) if old is not None else [])
            st = task.stored
            if old is not None and st and st["same_stack"] and old.study == task.study_name and old.median_ms <= best["median_ms"]:
                old.history = (history + [_entry(self.run_id, best, vendor, kept="stored", **rounds)])[-HISTORY:]
                old.trials = max(old.trials, task.asked)
                s.commit()
                self.log(f"  kept {task.label}: the stored {old.impl} {old.median_ms:.4g} ms is as fast as this run's "
                         f"{best['impl']} {best['median_ms']:.4g} ms (recorded with it)")
                return
            if old is not None:
                prev = {"impl": old.impl, "params": old.params, "median_ms": old.median_ms, "spread_ms": old.spread_ms}
                history.append(_entry(old.run_id, prev, {"impl": old.vendor_impl, "median_ms": old.vendor_ms},
                                      replaced_by=self.run_id, **({"study": old.study} if old.study != task.study_name else {})))
                if rounds:
                    history.append(_entry(self.run_id, best, vendor, **rounds))
                s.delete(old)
                s.flush()
            elif rounds:
                history.append(_entry(self.run_id, best, vendor, **rounds))
            self.best_speedup = max(speedup, self.best_speedup or 0.0)
            s.add(Winner(
                device_class=self.o.device, problem_id=task.problem_id, device_id=self.device_id, run_id=self.run_id,
                study=task.study_name, impl=best["impl"], kernel_version=kernel_space.get_impl(task.op, best["impl"]).version,
                params=best["params"], median_ms=best["median_ms"], spread_ms=best["spread_ms"],
                vendor_impl=vendor["impl"], vendor_ms=vendor["median_ms"], speedup=speedup,
                trials=task.asked, conditions=self.conditions or None, history=history[-HISTORY:] or None,
            ))
            s.commit()
        self.log(
            f"  done {task.label}: {best['impl']} {best['params']} {best['median_ms']:.4g} ms vs {vendor['impl']} "
            f"{vendor['median_ms']:.4g} ms ({speedup:.2f}x; {task.asked} trials, "
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
