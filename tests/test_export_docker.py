"""opsadv-export's Dockerfile builds a runtime-only image from the exported folder (issue 22, item 7). No Docker
daemon runs here: the Dockerfile's paths are checked against the folder, and the wheel it installs is imported with
only torch beside it."""
from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import zipfile

import pytest
from sqlalchemy.orm import Session

import db
import kernel_space
from tuner.cli import export_main

PARAMS = {"block_m": 32, "block_n": 64, "block_k": 0}


@pytest.fixture
def tuned_db(tmp_path):
    url = f"sqlite:///{tmp_path / 'tuning.db'}"
    with Session(db.open_db(url)) as s:
        p = db.Problem(op="gemm", key=json.dumps({"K": 96, "M": 64, "N": 128, "dtype": "fp32", "trans_a": False, "trans_b": False},
                                                  sort_keys=True))
        s.add(p)
        s.flush()
        s.add(db.Winner(device_class="cpu", problem_id=p.id, study="s", impl="cpu_blocked", params=PARAMS,
                        kernel_version=kernel_space.get_impl("gemm", "cpu_blocked").version, median_ms=1.0, spread_ms=0.01,
                        vendor_impl="torch_matmul", vendor_ms=2.0, speedup=2.0, trials=4))
        s.commit()
    return url


def _instructions(text: str) -> list[tuple[str, str]]:
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1]) for line in text.splitlines()
            if line.strip() and not line.lstrip().startswith("#")]


def _check_paths(out) -> dict:
    """Every instruction known, ARG before FROM, every COPY source in the folder, ENV at the table's destination."""
    ins = _instructions((out / "Dockerfile.opsadv").read_text())
    assert {k for k, _ in ins} <= {"ARG", "FROM", "COPY", "RUN", "ENV"}, ins
    assert ins[0][0] == "ARG" and ins[1][0] == "FROM", ins
    args = dict(a.split("=", 1) for k, a in ins if k == "ARG")
    base = args["BASE"]
    assert ins[1][1] == "$BASE" and re.fullmatch(r"pytorch/pytorch:(\d+)\.(\d+)\.\d+-\S+-runtime", base), base
    assert tuple(map(int, re.match(r"pytorch/pytorch:(\d+)\.(\d+)", base).groups())) >= (2, 11)  # torch>=2.11
    copies = {}
    for k, a in ins:
        if k == "COPY":
            src, dst = shlex.split(a)
            assert (out / src).is_file() and not os.path.isabs(src), src  # the build context is the exported folder
            copies[src] = dst
    env = dict(a.split("=", 1) for k, a in ins if k == "ENV")
    assert env["OPS_ADV_TABLE"] == copies["opsadv-table.json"]
    return {"ins": ins, "args": args, "copies": copies}


def test_the_dockerfile_builds_from_the_exported_folder(tuned_db, tmp_path, capsys):
    out = tmp_path / "dist"
    assert export_main(["--device", "cpu", "--out", str(out), "--db", tuned_db]) == 0
    assert f"docker build -f {out / 'Dockerfile.opsadv'} {out}" in capsys.readouterr().out
    d = _check_paths(out)
    assert d["args"]["OPS_ADV"] == "ops-adv"  # the runtime alone: no [tune] extra
    assert [a for k, a in d["ins"] if k == "RUN"] == ['python -m pip install --no-cache-dir "$OPS_ADV"']


@pytest.mark.slow
def test_the_wheel_in_the_image_is_the_runtime_alone(tuned_db, tmp_path, capsys):
    out = tmp_path / "dist"
    assert export_main(["--device", "cpu", "--out", str(out), "--db", tuned_db, "--wheel"]) == 0
    d = _check_paths(out)
    wheel = next(src for src in d["copies"] if src.endswith(".whl"))
    assert [a for k, a in d["ins"] if k == "RUN"] == [f"python -m pip install --no-cache-dir {d['copies'][wheel]} && rm {d['copies'][wheel]}"]
    with zipfile.ZipFile(out / wheel) as z:
        meta = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    needs = [line.split(":", 1)[1].strip() for line in meta.splitlines() if line.startswith("Requires-Dist:")]
    plain = sorted(re.split(r"[<>=;\s\[]", n)[0] for n in needs if "extra ==" not in n)
    assert plain == ["torch", "triton"], needs  # pip install of the wheel brings no tuning stack
    # the image's Python: the wheel, torch, nothing of the tuning stack (a finder refuses it, as if not installed)
    code = (
        "import importlib.abc, sys\n"
        "class NoTuningStack(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in {'ray', 'optuna', 'sqlalchemy', 'alembic', 'yaml', 'psycopg'}:\n"
        "            raise ImportError(f'{name} is not installed')\n"
        "sys.meta_path.insert(0, NoTuningStack())\n"
        f"sys.path.insert(0, {str(out / wheel)!r})\n"
        "import json, torch, ops_adv\n"
        "a, b = torch.randn(64, 96), torch.randn(96, 128)\n"
        "assert torch.allclose(ops_adv.gemm(a, b), a @ b, atol=1e-4)\n"
        "print(json.dumps({'file': ops_adv.__file__, 'explain': ops_adv.explain('gemm', a, b)}))\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "OPS_ADV_DB", "OPS_ADV_TABLE_KEY")}
    env["OPS_ADV_TABLE"] = str(out / "opsadv-table.json")  # what ENV sets in the image
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["file"].startswith(str(out / wheel)), got["file"]  # imported from the wheel, not this checkout
    assert got["explain"]["source"] == "tuned" and got["explain"]["params"] == PARAMS
