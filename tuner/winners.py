"""Winners: the finalists of a problem, confirmed side by side, and the one stored.

Tuner mixes Winners in; the methods use the run's engine, options (`o`), device_id, run_id,
conditions, leases and log.
"""
from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session

import kernel_space
from db import Problem, Winner
from kernel_space import problem_key

from .leases import lease_s
from .study import Task, _params_key


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
        if not self.leases.holds(task.problem_id):
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
