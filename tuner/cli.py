"""Command lines: opsadv-tune, opsadv-export, opsadv-db, opsadv-report."""
from __future__ import annotations

import argparse
import shlex
import sys
from typing import Callable


TIMED_OUT = 3  # opsadv-tune's exit status when --timeout left problems unstarted or cut short (2: an error, 130: Ctrl-C)


def _error(message: str) -> Exception:
    """kernel_space.OpsAdvError (a user's mistake: one line, exit 2), imported when raised: kernel_space loads torch,
    and a Ctrl-C while it loads must meet _run's handler rather than interrupt this module's import."""
    from kernel_space import OpsAdvError

    return OpsAdvError(message)


class _Parser(argparse.ArgumentParser):
    """argparse whose errors are one line (no usage block), the echoed value redacted and cut short."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {_one_line(message)}; see {self.prog} --help\n")


def _one_line(message: object, n: int = 500) -> str:
    from ops_adv._table import redact

    text = " ".join(redact(str(message)).split())
    return text if len(text) <= n else text[: n - 3] + "..."


def _check_args(args: argparse.Namespace) -> None:
    """Numbers a run cannot use are refused before anything starts (no database is touched)."""
    import math

    def need(name: str, ok: bool, what: str) -> None:
        if not ok:
            raise _error(f"--{name.replace('_', '-')} {_one_line(getattr(args, name), 40)} is invalid: it must be {what}")

    for name in ("timeout", "trial_timeout", "measure_budget"):
        v = getattr(args, name, None)
        if v is not None:
            need(name, math.isfinite(v) and v > 0, "a positive number of seconds")
    for name, low in (("workers", 1), ("compile_workers", 0), ("threads", 1), ("trials", 1)):
        v = getattr(args, name, None)
        if v is not None:
            need(name, low <= v <= 1_000_000, f"a whole number from {low} to 1000000")
    need("seed", 0 <= args.seed < 2**32, "a whole number from 0 to 4294967295")
    acc = getattr(args, "accuracy", None)
    if acc is not None:
        need("accuracy", math.isfinite(acc) and acc >= 1, "a finite factor of at least 1")


def _run(prog: str, body: Callable[[], int], interrupted: str = "interrupted") -> int:
    """A user's mistake is one line on stderr and exit status 2, never a traceback; Ctrl-C is the line
    `interrupted` (what was kept, what to do) and exit status 130."""
    try:
        from kernel_space import OpsAdvError as error  # inside: a Ctrl-C while torch loads is one line too

        try:
            return body()
        except error as e:
            print(f"{prog}: error: {_one_line(e)}", file=sys.stderr)
            return 2
    except KeyboardInterrupt:
        print(f"{prog}: {interrupted}", file=sys.stderr)
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
        except (ImportError, ValueError, TypeError) as e:
            raise _error(f"cannot import plugin {_one_line(m, 80)}: {_one_line(e, 200)}") from None
    return mods


def tune_main(argv: list[str] | None = None) -> int:
    ap = _Parser(prog="opsadv-tune", description="Tune kernels for each (op, problem) on a device and store the winners.")
    ap.add_argument("--device", help="device class: cpu, h100, h200, a100, ... (see --list)")
    ap.add_argument("--ops", help="comma-separated ops, e.g. gemm,attention (see --list)")
    ap.add_argument("--list", action="store_true", help="print the device classes, the ops and their implementations, and exit")
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
    ap.add_argument("--progress", default="auto",
                    help="auto (default: a progress bar on a terminal, else a line every 10 s), bar or plain")
    ap.add_argument("--plugin", action="append", default=[], help="module registering extra implementations (repeatable)")
    ap.add_argument("--threads", type=int, help="CPU threads each trial runs with (default: what a plain process here uses)")
    ap.add_argument("--accuracy", type=float, default=2.0,
                    help="a candidate may be at most this times less accurate than the vendor kernel (default 2.0)")
    ap.add_argument("--revalidate", action="store_true",
                    help="re-measure the stored finalists of winners measured under another torch/Triton/CUDA/driver/threads")
    args = ap.parse_args(argv)
    if args.list:
        return _run("opsadv-tune", lambda: _list(args.plugin))
    missing = [f for f in ("--device", "--ops") if getattr(args, f[2:]) is None]
    if missing:
        ap.error(f"the following arguments are required: {', '.join(missing)}")

    def body() -> int:
        import kernel_space

        from .driver import TuneOptions, Tuner
        from .problems import default_problems, load_shapes
        from .report import format_table

        from .devices import check_device

        _check_args(args)
        check_device(args.device, args.ray_address is not None)  # before any database is created or migrated
        plugins = _load_plugins(args.plugin)
        ops = [o.strip() for o in args.ops.split(",") if o.strip()]
        if not ops:
            raise _error("--ops is empty; name ops such as gemm,attention")
        for op in ops:
            kernel_space.get_op(op)
        from .driver import SAMPLERS

        if args.sampler not in SAMPLERS:
            raise _error(f"unknown sampler {args.sampler!r}; choose one of {', '.join(SAMPLERS)}")
        from .progress import MODES

        if args.progress not in MODES:
            raise _error(f"unknown --progress {args.progress!r}; choose one of {', '.join(MODES)}")
        names = [i.strip() for i in (args.impls or "").split(",") if i.strip()]
        for name in names:
            if not any(name in {i.name for i in kernel_space.impls(op)} for op in ops):
                raise _error(f"--impls: no implementation {_one_line(name, 60)} for {', '.join(ops)}")
        if args.shapes:
            problems = load_shapes(args.shapes, ops)
        else:
            problems = default_problems(ops, args.device)
        from db._engine import check_url

        check_url(args.db or _db_default())
        opts = TuneOptions(
            device=args.device, problems=problems, db_url=args.db or _db_default(), trials=args.trials, timeout_s=args.timeout,
            trial_timeout_s=args.trial_timeout, sampler=args.sampler, workers=args.workers, ray_address=args.ray_address,
            seed=args.seed, plugins=plugins, only_impls=[i.strip() for i in (args.impls or "").split(",") if i.strip()],
            compile_workers=args.compile_workers, progress=args.progress, threads=args.threads, accuracy=args.accuracy,
            revalidate=args.revalidate,
            measure_budget_s=args.measure_budget or (0.3 if args.device == "cpu" else 0.1), command=_command(argv),
        )
        tuner = Tuner(opts)
        rows = tuner.run()
        print(format_table(rows))
        if getattr(tuner, "timed_out", None):  # a clear last line and its own status: a script must not take this for a whole tune
            unstarted, cut = tuner.timed_out
            what = " and ".join(x for x in (f"{unstarted} problem(s) not started" if unstarted else "",
                                            f"{cut} cut short of their trials" if cut else "") if x)
            print(f"opsadv-tune: stopped by --timeout {args.timeout:g} s with {what}; re-run the same command to tune "
                  f"them (exit status {TIMED_OUT})", file=sys.stderr)
            return TIMED_OUT
        return 0

    return _run("opsadv-tune", body, "interrupted; finished trials are stored, re-run the same command to resume")


def _list(plugins: list[str]) -> int:
    """`opsadv-tune --list`: the device classes, then each op with its implementations (source, backends)."""
    import kernel_space
    from kernel_space._device import KNOWN_CLASSES
    from kernel_space._registry import source_of

    _load_plugins(plugins)
    print(f"devices: {', '.join(KNOWN_CLASSES)}")
    print("ops (implementation: source, backends; * the vendor kernel):")
    for op in kernel_space.ops():
        print(f"  {op}")
        for i in kernel_space.impls(op):
            why = f"; {i.unavailable}" if i.unavailable else ""
            print(f"    {i.name}{'*' if i.vendor else ''}: {source_of(i)}, {'/'.join(sorted(i.backends))}{why}")
    return 0


def _command(argv: list[str] | None) -> str:
    """The command line as stored with the run: every password redacted."""
    from ops_adv._table import redact

    return shlex.join(["opsadv-tune", *(redact(a) for a in (argv if argv is not None else sys.argv[1:]))])


def export_main(argv: list[str] | None = None) -> int:
    ap = _Parser(prog="opsadv-export", description="Write the winners for a device as a table file and a Dockerfile for a runtime-only image.")
    ap.add_argument("--device", required=True)
    ap.add_argument("--out", help="output folder of the table and Dockerfile (needed unless --moe-configs is given)")
    ap.add_argument("--moe-configs", metavar="DIR",
                    help="also (or only) write moe winners as the serving engines' fused_moe configs, one JSON file per "
                         "(E, N, device, dtype) such as E=8,N=14336,device_name=NVIDIA_H200.json (docs/moe.md)")
    ap.add_argument("--db", help="database URL (default: OPS_ADV_DB or the default SQLite file)")
    ap.add_argument("--wheel", action="store_true",
                    help="also build ops-adv's wheel into the folder (pip wheel --no-deps) and install that in the image")
    args = ap.parse_args(argv)
    if args.out is None and args.moe_configs is None:
        ap.error("the following arguments are required: --out (or --moe-configs)")

    def body() -> int:
        import signal
        import threading

        from .export import export, export_moe_configs

        def stop(signum, frame):  # SIGTERM as Ctrl-C: the temporary file is removed, the old table stays
            raise KeyboardInterrupt

        main = threading.current_thread() is threading.main_thread()
        before = signal.signal(signal.SIGTERM, stop) if main else None
        try:
            if args.out is not None:
                table, docker, n = export(args.device, args.out, args.db or _db_default(), with_wheel=args.wheel)
                print(f"wrote {n} winner(s) to {table} and {docker}; build: docker build -f {docker} {docker.parent}")
            if args.moe_configs is not None:
                paths = export_moe_configs(args.device, args.moe_configs, args.db or _db_default())
                print(f"wrote {len(paths)} moe config file(s) to {args.moe_configs}: {', '.join(p.name for p in paths)}")
        finally:
            if main:
                signal.signal(signal.SIGTERM, before if before is not None else signal.SIG_DFL)
        return 0

    return _run("opsadv-export", body, "interrupted; any table in the folder is whole (the previous one, or this export's if already published)")


def db_main(argv: list[str] | None = None) -> int:
    ap = _Parser(prog="opsadv-db", description="Create or migrate the tuning database.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name, text in (("upgrade", "migrate the database to the latest schema"), ("current", "print the schema revision")):
        p = sub.add_parser(name, help=text)
        p.add_argument("url", nargs="?", help="database URL (default: OPS_ADV_DB or the default SQLite file)")
    args = ap.parse_args(argv)

    def body() -> int:
        import db

        url = args.url or _db_default()
        engine = db.make_engine(url, must_exist=args.cmd == "current")  # current only reads: a mistyped path is an error
        if args.cmd == "upgrade":
            db.upgrade(engine)
            print(f"{db.redact(url)}: schema at {db.current(engine)}")
        else:
            cur = db.current(engine)
            if cur is not None and not db._engine.known(cur):
                print(f"{_one_line(cur, 40)} (newer than this ops-adv, whose head is {db.head()}; upgrade ops-adv)")
            else:
                print(f"{cur or 'none'}{' (head)' if cur == db.head() else f' (head is {db.head()}; run opsadv-db upgrade)'}")
        return 0

    return _run("opsadv-db", body)


def report_main(argv: list[str] | None = None) -> int:
    ap = _Parser(prog="opsadv-report", description="Print the winners per problem and plot speedup over the vendor kernel.")
    ap.add_argument("--device", required=True)
    ap.add_argument("--db", help="database URL")
    ap.add_argument("--table", help="read an exported table file instead of the database")
    ap.add_argument("--plot", help="write a PNG of speedup per problem here")
    ap.add_argument("--markdown", help="also write the table as markdown here")
    args = ap.parse_args(argv)

    def body() -> int:
        import os

        from .report import format_markdown, format_table, library_candidates, plot

        for flag, path in (("--plot", args.plot), ("--markdown", args.markdown)):
            folder = os.path.dirname(os.path.abspath(path)) if path else None
            if folder and not os.path.isdir(folder):
                raise _error(f"{flag} {_one_line(path, 120)}: folder {_one_line(folder, 120)} does not exist; create it or write elsewhere")
        if args.table:
            from ops_adv._table import read_file

            t = read_file(args.table)
            if t.device_class != args.device:
                raise _error(f"{args.table} holds winners for {t.device_class}, not {args.device}")
            rows = t.winners
        else:
            from .export import winners_of

            rows = winners_of(args.device, args.db or _db_default())
        if not rows:
            raise _error(f"no winners for {args.device}; run opsadv-tune --device {args.device} first")
        print(format_table(rows))
        libs = library_candidates(sorted({r.get("op") for r in rows if r.get("op")}), args.device)
        if libs:
            print("\nlibrary candidates of these ops (tuned beside ours where they can run):")
            print("\n".join(f"  {line}" for line in libs))
        try:
            if args.markdown:
                with open(args.markdown, "w") as f:
                    f.write(format_markdown(rows) + "\n")
            if args.plot:
                plot(rows, args.plot, f"ops-adv on {args.device}: tuned vs vendor")
                print(f"plot: {args.plot}")
        except OSError as e:
            raise _error(f"cannot write {_one_line(e.filename or args.plot, 120)}: {e.strerror or e}") from None
        except ValueError as e:  # matplotlib: an unknown image format
            raise _error(f"cannot write the plot: {_one_line(e, 200)}") from None
        return 0

    return _run("opsadv-report", body)
