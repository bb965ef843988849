"""Export winners as a read-only table file plus a Dockerfile that builds a runtime-only image around it."""
from __future__ import annotations

import json
import os
from datetime import datetime, timezone
from pathlib import Path

from sqlalchemy import select
from sqlalchemy.orm import Session

import kernel_space
from db import Device, Problem, Trial, Winner, open_db
from kernel_space import OpsAdvError
from ops_adv._table import FORMAT, FORMAT_VERSION, checksum

TABLE_NAME = "opsadv-table.json"


def _rows(device: str, db_url: str):
    engine = open_db(db_url, migrate=False)
    with Session(engine) as s:
        rows = s.execute(
            select(Winner, Problem, Device)
            .join(Problem, Winner.problem_id == Problem.id)
            .outerjoin(Device, Winner.device_id == Device.id)
            .where(Winner.device_class == device)
            .order_by(Problem.op, Problem.key)
        ).all()
    return rows


def winners_of(device: str, db_url: str) -> list[dict]:
    """The winners as the report shows them: the exported fields and the history of times behind each."""
    return [{**_winner_dict(w, p), "history": w.history or []} for w, p, _ in _rows(device, db_url)]


def _winner_dict(w: Winner, p: Problem) -> dict:
    return {
        "op": p.op, "problem": _ordered(p.op, json.loads(p.key)), "impl": w.impl, "params": w.params, "kernel_version": w.kernel_version,
        "median_ms": w.median_ms, "spread_ms": w.spread_ms, "vendor_impl": w.vendor_impl, "vendor_ms": w.vendor_ms,
        "speedup": w.speedup, "trials": w.trials, "conditions": _conditions(w.conditions),
    }


_CONDITION_KEYS = ("threads", "torch", "triton", "cuda", "cudnn", "cublas", "driver", "sm_clock_mhz", "power_limit_w", "ecc")


def _conditions(c: dict | None) -> dict:
    """What the winner was measured under (known keys only; {} for winners stored before conditions were recorded)."""
    return {k: c[k] for k in _CONDITION_KEYS if c and c.get(k) is not None}


def _ordered(op: str, problem: dict) -> dict:
    """The problem's fields in its signature's order (the stored key is sorted)."""
    try:
        return kernel_space.get_op(op).parse_problem(problem)._asdict()
    except OpsAdvError:
        return problem


def export(device: str, out_dir: str, db_url: str, with_wheel: bool = False) -> tuple[Path, Path, int]:
    rows = _rows(device, db_url)
    if not rows:
        raise OpsAdvError(f"the database has no winners for {device}; run opsadv-tune --device {device} first")
    winners, fingerprints, versions = [], {}, {}
    for w, p, d in rows:
        winners.append(_winner_dict(w, p))
        versions[f"{p.op}/{w.impl}"] = w.kernel_version
        if d is not None:
            fingerprints[d.fingerprint_hash] = d.fingerprint
    current = {f"{op}/{i.name}": i.version for op in kernel_space.ops() for i in kernel_space.impls(op)}
    stale = sorted(k for k, v in versions.items() if current.get(k) != v)
    if stale:
        raise OpsAdvError(
            f"winners for {', '.join(stale[:3])}{' ...' if len(stale) > 3 else ''} were tuned with kernels that have changed since; "
            f"re-run opsadv-tune --device {device} before exporting"
        )
    data = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "device_class": device,
        "fingerprint": next(iter(fingerprints.values())) if len(fingerprints) == 1 else {"machines": list(fingerprints.values())},
        "created_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "kernel_versions": versions,
        "winners": winners,
        "checksum": checksum(winners),
    }
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise OpsAdvError(f"--out {out_dir} is a file, not a folder; pass --out with a folder (it is created if missing)")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise OpsAdvError(f"cannot create output folder {out_dir}: {e.strerror}; pass --out with a writable folder") from None
    table, docker = out / TABLE_NAME, out / "Dockerfile.opsadv"
    publish(table, json.dumps(data, indent=1, sort_keys=True), 0o444)
    wheel = _build_wheel(out) if with_wheel else None
    publish(docker, dockerfile(device, len(winners), wheel), 0o644)
    return table, docker, len(winners)


def publish(path: Path, text: str | bytes, mode: int) -> None:
    """Write `text` to `path` whole or not at all: a temporary file of its own in the same folder (two exports into
    one folder never share one), flushed to disk, then renamed over `path` (a reader sees the old file or the new
    one). Any error, Ctrl-C included, removes the temporary file and leaves `path` as it was; an OSError becomes
    one line."""
    import tempfile

    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        with os.fdopen(fd, "wb" if isinstance(text, bytes) else "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
        tmp = None
    except OSError as e:
        why = e.strerror or type(e).__name__
        kept = (f"{path.name} there is unchanged" if path.name == TABLE_NAME  # the Dockerfile comes after the table
                else f"{TABLE_NAME} was written, {path.name} was left as it was")
        raise OpsAdvError(f"cannot write {path}: {why}; make the folder writable and free space there, or pass --out "
                          f"with another folder ({kept})") from None
    finally:
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass


BASE_IMAGE = "pytorch/pytorch:2.11.0-cuda12.8-cudnn9-runtime"  # any image with torch>=2.11: --build-arg BASE=...


def dockerfile(device: str, n: int, wheel: str | None) -> str:
    """A Dockerfile whose build context is the exported folder: torch from the base, the ops-adv runtime alone
    (no extras: no Ray, Optuna or SQLAlchemy), the table, OPS_ADV_TABLE pointing at it."""
    if wheel:
        install = (f"COPY {wheel} /tmp/{wheel}\n"
                   f"RUN python -m pip install --no-cache-dir /tmp/{wheel} && rm /tmp/{wheel}\n")
    else:
        install = ("# ops-adv itself: OPS_ADV is any pip requirement (opsadv-export --wheel puts a wheel here and installs that)\n"
                   "ARG OPS_ADV=ops-adv\n"
                   'RUN python -m pip install --no-cache-dir "$OPS_ADV"\n')
    return (
        f"# Runtime image with the tuned kernels for {device} from ops-adv ({n} problems).\n"
        f"# Build with this folder as the context: docker build -f Dockerfile.opsadv -t IMAGE .\n"
        f"ARG BASE={BASE_IMAGE}\n"
        f"FROM $BASE\n"
        f"{install}"
        f"COPY {TABLE_NAME} /opt/ops-adv/{TABLE_NAME}\n"
        f"ENV OPS_ADV_TABLE=/opt/ops-adv/{TABLE_NAME}\n"
    )


def _build_wheel(out: Path) -> str:
    """ops-adv's wheel built from its source (pip wheel --no-deps) into `out`; its name."""
    import subprocess
    import sys

    import ops_adv

    src = Path(ops_adv.__file__).resolve().parents[1]
    if not (src / "pyproject.toml").is_file():
        raise OpsAdvError(f"--wheel builds ops-adv from its source, and this ops-adv ({src}) has none; "
                          f"leave --wheel out and set --build-arg OPS_ADV=... to a pip requirement instead")
    import shutil
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:  # a copy: the build leaves no build/ or egg-info in the source
        for name in ("pyproject.toml", "README.md", "ops_adv", "kernel_space", "tuner", "workers", "db"):
            if (src / name).is_dir():
                shutil.copytree(src / name, Path(tmp) / "src" / name, ignore=shutil.ignore_patterns("__pycache__"))
            elif (src / name).exists():
                (Path(tmp) / "src").mkdir(exist_ok=True)
                shutil.copy2(src / name, Path(tmp) / "src" / name)
        # built beside the copy, then published like the table: an export running beside this one never sees half a wheel
        r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "--wheel-dir",
                            str(Path(tmp) / "wheels"), str(Path(tmp) / "src")], capture_output=True, text=True)
        wheels = sorted((Path(tmp) / "wheels").glob("ops_adv-*.whl"))
        if r.returncode or len(wheels) != 1:
            last = (r.stderr.strip().splitlines() or ["no wheel written"])[-1]
            raise OpsAdvError(f"pip wheel of {src} failed: {last[:300]}")
        publish(out / wheels[0].name, wheels[0].read_bytes(), 0o644)
    for old in out.glob("ops_adv-*.whl"):
        if old.name != wheels[0].name:
            old.unlink(missing_ok=True)
    return wheels[0].name


# --------------------------------------------------------------------------- moe configs for the serving engines

MOE_IMPL = "triton_fused_moe"
MOE_CONFIG_KEYS = ("BLOCK_SIZE_M", "BLOCK_SIZE_N", "BLOCK_SIZE_K", "GROUP_SIZE_M", "num_warps", "num_stages")
# The engines name a file by quantisation (",dtype=fp8_w8a8"); fp16 and bf16 share the file without one. Where a
# database holds several dtypes for one (E, N, device), the file takes the first of this order that is tuned.
MOE_DTYPE_SUFFIX = {"bf16": "", "fp16": "", "fp32": ""}


def moe_config_name(E: int, N: int, device_name: str, dtype: str) -> str:
    """The engines' file name for a config of E experts of intermediate size N on `device_name`, e.g.
    E=8,N=14336,device_name=NVIDIA_H200.json (as torch.cuda.get_device_name() gives it, spaces as underscores)."""
    return f"E={E},N={N},device_name={device_name.replace(' ', '_')}{MOE_DTYPE_SUFFIX[dtype]}.json"


def _moe_candidates(device: str, db_url: str) -> dict[tuple, dict]:
    """(problem tuple, device name) -> {"params", "median_ms", "from"} for moe on `device`: the winner where it is the
    Triton kernel, else the fastest correct Triton trial of that problem (an engine always runs its Triton kernel)."""
    version = kernel_space.get_impl("moe", MOE_IMPL).version
    spec = kernel_space.get_op("moe")
    engine = open_db(db_url, migrate=False)
    found: dict[tuple, dict] = {}
    with Session(engine) as s:
        winners = s.execute(
            select(Winner, Problem, Device).join(Problem, Winner.problem_id == Problem.id)
            .outerjoin(Device, Winner.device_id == Device.id)
            .where(Winner.device_class == device, Problem.op == "moe")
        ).all()
        trials = s.execute(
            select(Trial, Problem, Device).join(Problem, Trial.problem_id == Problem.id)
            .join(Device, Trial.device_id == Device.id)
            .where(Device.device_class == device, Problem.op == "moe", Trial.impl == MOE_IMPL, Trial.status == "ok",
                   Trial.kernel_version == version, Trial.median_ms.is_not(None))
        ).all()
    def parse(key: str):
        try:
            return spec.parse_problem(json.loads(key))
        except OpsAdvError:  # a problem of an older moe signature: not exported
            return None

    tuned = set()
    for w, p, d in winners:
        problem = parse(p.key)
        if problem is None:
            continue
        tuned.add(problem)
        if w.impl == MOE_IMPL and w.kernel_version == version:
            found[(problem, _device_name(d, device))] = {"params": w.params, "median_ms": w.median_ms, "from": "winner"}
    for t, p, d in trials:
        problem = parse(p.key)
        key = (problem, _device_name(d, device))
        if problem not in tuned or found.get(key, {}).get("from") == "winner":
            continue
        if key not in found or t.median_ms < found[key]["median_ms"]:
            found[key] = {"params": t.params, "median_ms": t.median_ms, "from": "trial"}
    return found


def _device_name(d: Device | None, device: str) -> str:
    name = (d.fingerprint or {}).get("name") if d is not None else None
    return str(name) if name else device.upper()


def moe_configs(device: str, db_url: str) -> dict[str, dict[str, dict[str, int]]]:
    """File name -> {token count: config} of the engines' fused_moe, from the moe problems tuned on `device`.

    One file per (E, N, device name, dtype suffix). Its token counts come from one (dtype, K) pair: the first
    dtype of MOE_DTYPE_SUFFIX's order, then the hidden size K with the most token counts (ties: the largest K);
    renormalize=True where both were tuned.
    """
    groups: dict[tuple, dict[tuple, dict[int, tuple[bool, dict]]]] = {}
    for (p, name), c in _moe_candidates(device, db_url).items():
        if p.dtype not in MOE_DTYPE_SUFFIX:
            continue
        runs = groups.setdefault((p.E, p.N, name, MOE_DTYPE_SUFFIX[p.dtype]), {}).setdefault((p.dtype, p.K), {})
        config = {k: int(c["params"][k]) for k in MOE_CONFIG_KEYS}
        if p.T not in runs or (p.renormalize and not runs[p.T][0]):
            runs[p.T] = (p.renormalize, config)
    order = list(MOE_DTYPE_SUFFIX)
    out = {}
    for (E, N, name, _suffix), runs in sorted(groups.items()):
        dtype, K = min(runs, key=lambda dk: (order.index(dk[0]), -len(runs[dk]), -dk[1]))
        out[moe_config_name(E, N, name, dtype)] = {str(t): cfg for t, (_r, cfg) in sorted(runs[(dtype, K)].items())}
    return out


def export_moe_configs(device: str, out_dir: str, db_url: str) -> list[Path]:
    """Write `moe_configs` into `out_dir` (created if missing), one JSON file each; returns their paths."""
    files = moe_configs(device, db_url)
    if not files:
        raise OpsAdvError(f"the database has no moe problem tuned on {device} with a correct {MOE_IMPL} configuration; "
                          f"run opsadv-tune --device {device} --ops moe first")
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise OpsAdvError(f"--moe-configs {out_dir} is a file, not a folder; pass a folder (it is created if missing)")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise OpsAdvError(f"cannot create folder {out_dir}: {e.strerror}; pass --moe-configs with a writable folder") from None
    paths = []
    for name, configs in files.items():
        try:
            publish(out / name, json.dumps(configs, indent=4) + "\n", 0o644)
        except OpsAdvError:
            raise OpsAdvError(f"cannot write {out / name}; make the folder writable and free space there, or pass "
                              f"--moe-configs with another folder ({len(paths)} of {len(files)} files written)") from None
        paths.append(out / name)
    return paths
