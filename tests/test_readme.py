"""README runs as written: its Python snippets run on the CPU with every name defined, each command
line names a real command and only flags that command takes, and the dashboard command opens the
database the tuner really uses by default."""
from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", README, flags=re.S)


def _env(tmp_path: Path) -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")]),
            "XDG_DATA_HOME": str(tmp_path / "data"), "OPS_ADV_DB": "", "OPS_ADV_TABLE": "", "RAY_DISABLE_USAGE_STATS": "1"}


@pytest.mark.parametrize("n", range(len(blocks("python"))))
def test_python_snippet_runs(n, tmp_path):
    code = blocks("python")[n]
    env = _env(tmp_path)
    env.pop("OPS_ADV_TABLE")
    env.pop("OPS_ADV_DB")
    if "dist/opsadv-table.json" in code:  # what opsadv-export writes (here with no winners: every op runs torch's)
        import json

        from ops_adv import _table

        (tmp_path / "dist").mkdir()
        (tmp_path / "dist" / "opsadv-table.json").write_text(json.dumps({
            "format": _table.FORMAT, "format_version": _table.FORMAT_VERSION, "device_class": "cpu", "fingerprint": {},
            "winners": [], "checksum": _table.checksum([])}))
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, f"README python block {n} failed:\n{code}\n{r.stderr[-3000:]}"


# README command -> how to ask it for its flags
_HELP = {"opsadv-tune": ["-m", "tuner", "tune"], "opsadv-export": ["-m", "tuner", "export"],
         "opsadv-report": ["-m", "tuner", "report"], "opsadv-db": ["-m", "tuner", "db"],
         "opsadv-record": ["-m", "tuner.record_cli"]}


def command_lines() -> list[list[str]]:
    """The command lines of README's 'Using it' block, continuations joined, environment prefixes dropped."""
    text = next(b for b in blocks("sh") if b.startswith("opsadv-tune --device"))
    text = text.replace("\\\n", " ")
    out = []
    for line in text.splitlines():
        line = line.split("  #")[0].split(" # ")[0].strip()
        if not line or line.startswith("#"):
            continue
        words = [w for w in shlex.split(line) if not re.match(r"^[A-Z_]+=", w)]
        out.append(words)
    return out


def test_using_it_lists_one_command_per_line():
    for words in command_lines():
        assert "|" not in words and "&&" not in words, f"one command per line: {' '.join(words)}"


@pytest.mark.parametrize("words", command_lines(), ids=lambda w: " ".join(w[:3]))
def test_command_lines_name_real_commands_and_flags(words):
    if words[0] == "python":
        prog = words[1:4] if words[2] == "tuner" else words[1:3]
        sub = words[3] if words[2] == "tuner" else None
        if words[2] == "ops_adv":  # python -m ops_adv check|sign FILE
            r = subprocess.run([sys.executable, "-m", "ops_adv", "--help"], capture_output=True, text=True, env=_env(Path("/tmp")))
            assert words[3] in r.stdout + r.stderr, r.stdout + r.stderr
            return
        argv = prog[1:]
    else:
        argv = _HELP[words[0]][1:] + ([words[1]] if words[0] == "opsadv-db" else [])
        sub = None
    r = subprocess.run([sys.executable, "-m", *argv, "--help"], capture_output=True, text=True, cwd=ROOT,
                       env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120)
    assert r.returncode == 0, r.stderr
    flags = {w.split("=")[0] for w in re.findall(r"(--[a-z][a-z-]*)", " ".join(words))}
    missing = [f for f in flags if f not in r.stdout]
    assert not missing, f"{' '.join(words[:3])}: README names {missing}, --help does not ({sub or ''})"


def test_dashboard_command_opens_the_default_database(tmp_path):
    line = next(l for b in blocks("sh") for l in b.splitlines() if l.startswith("optuna-dashboard"))
    url = shlex.split(line)[1]
    env = {"XDG_DATA_HOME": str(tmp_path / "xdg"), "HOME": str(tmp_path / "home")}
    expanded = subprocess.run(["bash", "-c", f'echo "{url}"'], capture_output=True, text=True, env=env).stdout.strip()
    default = subprocess.run([sys.executable, "-c", "from db import default_url; print(default_url())"], cwd=ROOT,
                             capture_output=True, text=True, env={**os.environ, **env, "OPS_ADV_DB": "", "PYTHONPATH": str(ROOT)})
    assert default.returncode == 0, default.stderr
    assert expanded == default.stdout.strip()
    env.pop("XDG_DATA_HOME")
    expanded = subprocess.run(["bash", "-c", f'echo "{url}"'], capture_output=True, text=True, env=env).stdout.strip()
    default = subprocess.run([sys.executable, "-c", "from db import default_url; print(default_url())"], cwd=ROOT,
                             capture_output=True, text=True, env={**{k: v for k, v in os.environ.items() if k != "XDG_DATA_HOME"},
                                                                  **env, "OPS_ADV_DB": "", "PYTHONPATH": str(ROOT)})
    assert expanded == default.stdout.strip()
