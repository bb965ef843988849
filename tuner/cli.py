"""Command lines: opsadv-tune, opsadv-export, opsadv-db, opsadv-report."""
from __future__ import annotations

import argparse
import shlex
import sys
from typing import Callable

from kernel_space import OpsAdvError


def _run(prog: str, body: Callable[[], int]) -> int:
    """A user's mistake is one line on stderr and exit status 2, never a traceback."""
    try:
        return body()
    except OpsAdvError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{prog}: interrupted; finished trials are stored, re-run the same command to resume", file=sys.stderr)
        return 130


def _db_default() -> str:
    from db import default_url

    return default_url()


def _load_plugins(mods: list[str]) -> list[str]:
    import importlib

    from ops_adv import _settings

    mods = list(dict.fromkeys(_settings.plugins() + mods))
    for m in mods:
        try:
            importlib.import_module(m)
        except ImportError as e:
            raise OpsAdvError(f"cannot import plugin {m}: {e}") from None
    return mods


def tune_main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="opsadv-tune", description="Tune kernels for each (op, problem) on a device and store the winners.")
    ap.add_argument("--device", required=True, help="device class: cpu, h100, h200, a100, ...")
    ap.add_argument("--ops", required=True, help="comma-separated ops, e.g. gemm,attention")
    ap.add_argument("--shapes", help="YAML or JSON file of problems (default: the built-in set per op)")
    ap.add_argument("--trials", type=int, default=24, help="trials per problem (default 24)")
    ap.add_argument("--timeout", type=float, help="stop asking new trials after this many seconds; re-run to resume")
    ap.add_argument("--trial-timeout", type=float, default=60.0, help="seconds before a hung trial's worker is killed (default 60)")
    ap.add_argument("--db", help="database URL (default: OPS_ADV_DB or SQLite in ~/.local/share/ops-adv)")
    ap.add_argument("--ray-address", help="join this Ray cluster (default: RAY_ADDRESS, else a local instance)")
    ap.add_argument("--sampler", default="tpe", help="tpe (default), random or grid (exhaustive)")
    ap.add_argument("--workers", type=int, help="measuring actors (default: one per GPU; one for cpu)")
    ap.add_argument("--impls", help="comma-separated implementations to search (default: every one for the device)")
    ap.add_argument("--measure-budget", type=float, help="seconds of timing per trial (default 0.3 on cpu, 0.1 on GPUs)")
    ap.add_argument("--compile-workers", type=int,
                    help="Triton compile processes per GPU worker, compiling the next configurations ahead (default 4 on GPUs; 0: off)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--plugin", action="append", default=[], help="module registering extra implementations (repeatable)")
    args = ap.parse_args(argv)

    def body() -> int:
        import kernel_space

        from .driver import TuneOptions, Tuner
        from .problems import default_problems, load_shapes
        from .report import format_table

        plugins = _load_plugins(args.plugin)
        ops = [o.strip() for o in args.ops.split(",") if o.strip()]
        if not ops:
            raise OpsAdvError("--ops is empty; name ops such as gemm,attention")
        for op in ops:
            kernel_space.get_op(op)
        from .driver import SAMPLERS

        if args.sampler not in SAMPLERS:
            raise OpsAdvError(f"unknown sampler {args.sampler!r}; choose one of {', '.join(SAMPLERS)}")
        if args.trials < 1:
            raise OpsAdvError("--trials must be at least 1")
        if args.shapes:
            problems = load_shapes(args.shapes, ops)
        else:
            from .devices import check_device

            check_device(args.device, args.ray_address is not None)
            problems = default_problems(ops, args.device)
        opts = TuneOptions(
            device=args.device, problems=problems, db_url=args.db or _db_default(), trials=args.trials, timeout_s=args.timeout,
            trial_timeout_s=args.trial_timeout, sampler=args.sampler, workers=args.workers, ray_address=args.ray_address,
            seed=args.seed, plugins=plugins, only_impls=[i.strip() for i in (args.impls or "").split(",") if i.strip()],
            compile_workers=args.compile_workers,
            measure_budget_s=args.measure_budget or (0.3 if args.device == "cpu" else 0.1), command=shlex.join(["opsadv-tune", *(argv if argv is not None else sys.argv[1:])]),
        )
        rows = Tuner(opts).run()
        print(format_table(rows))
        return 0

    return _run("opsadv-tune", body)


def export_main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="opsadv-export", description="Write the winners for a device as a table file and a Dockerfile snippet.")
    ap.add_argument("--device", required=True)
    ap.add_argument("--out", required=True, help="output folder")
    ap.add_argument("--db", help="database URL (default: OPS_ADV_DB or the default SQLite file)")
    args = ap.parse_args(argv)

    def body() -> int:
        from .export import export

        table, docker, n = export(args.device, args.out, args.db or _db_default())
        print(f"wrote {n} winner(s) to {table} and {docker}")
        return 0

    return _run("opsadv-export", body)


def db_main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="opsadv-db", description="Create or migrate the tuning database.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name, text in (("upgrade", "migrate the database to the latest schema"), ("current", "print the schema revision")):
        p = sub.add_parser(name, help=text)
        p.add_argument("url", nargs="?", help="database URL (default: OPS_ADV_DB or the default SQLite file)")
    args = ap.parse_args(argv)

    def body() -> int:
        import db

        url = args.url or _db_default()
        engine = db.make_engine(url)
        if args.cmd == "upgrade":
            db.upgrade(engine)
            print(f"{db.redact(url)}: schema at {db.current(engine)}")
        else:
            cur = db.current(engine)
            print(f"{cur or 'none'}{' (head)' if cur == db.head() else f' (head is {db.head()}; run opsadv-db upgrade)'}")
        return 0

    return _run("opsadv-db", body)


def report_main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="opsadv-report", description="Print the winners per problem and plot speedup over the vendor kernel.")
    ap.add_argument("--device", required=True)
    ap.add_argument("--db", help="database URL")
    ap.add_argument("--table", help="read an exported table file instead of the database")
    ap.add_argument("--plot", help="write a PNG of speedup per problem here")
    ap.add_argument("--markdown", help="also write the table as markdown here")
    args = ap.parse_args(argv)

    def body() -> int:
        from .report import format_markdown, format_table, plot

        if args.table:
            from ops_adv._table import read_file

            t = read_file(args.table)
            if t.device_class != args.device:
                raise OpsAdvError(f"{args.table} holds winners for {t.device_class}, not {args.device}")
            rows = t.winners
        else:
            from .export import winners_of

            rows = winners_of(args.device, args.db or _db_default())
        if not rows:
            raise OpsAdvError(f"no winners for {args.device}; run opsadv-tune --device {args.device} first")
        print(format_table(rows))
        if args.markdown:
            with open(args.markdown, "w") as f:
                f.write(format_markdown(rows) + "\n")
        if args.plot:
            plot(rows, args.plot, f"ops-adv on {args.device}: tuned vs vendor")
            print(f"plot: {args.plot}")
        return 0

    return _run("opsadv-report", body)
