"""Issue 14, item 8: fuzzed CLI arguments, shapes files, table files and database URLs end in success or one
line with exit 2: no traceback, no hang, no password in the output, no change to the database after an error."""
from __future__ import annotations

import hashlib
import json
import os
import warnings

import pytest
import torch
import yaml

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import db  # noqa: E402
import kernel_space  # noqa: E402
import ops_adv  # noqa: E402
from ops_adv import _table  # noqa: E402
from tuner import cli as tcli  # noqa: E402
from tuner.problems import ShapesFileError, load_shapes  # noqa: E402

MARK = "Fz9secretpw"
N = int(os.environ.get("OPS_ADV_FUZZ_EXAMPLES", "60"))  # raise it for a longer search (random seeds then)


def _settings(n: int = N):
    return settings(max_examples=n, deadline=None, suppress_health_check=list(HealthCheck), derandomize=N == 60)


FAST = _settings()


def _outcome(main, argv, capsys) -> tuple[int, str, str]:
    try:
        rc = main(argv)
    except SystemExit as e:
        rc = e.code
    out, err = capsys.readouterr()
    assert rc in (0, 2), (argv, rc, err[-2000:])
    assert "Traceback" not in err and MARK not in out + err, (argv, err[-2000:])
    if rc == 2:
        lines = err.strip().splitlines()
        assert len(lines) == 1 and len(lines[0]) <= 700, (argv, err[-2000:])
    return rc, out, err


@pytest.fixture(scope="module")
def fuzz_db(tmp_path_factory):
    d = tmp_path_factory.mktemp("fuzz")
    path = d / "tuning.db"
    db.open_db(f"sqlite:///{path}").dispose()
    return d, path


def _digest(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# -- CLI arguments ----------------------------------------------------------------------------------

NUM = st.one_of(st.integers(-3, 3).map(str), st.sampled_from(["nan", "inf", "-inf", "1e400", "0.5", "x", "", "1_0", "0x10", "9" * 30]))
FLAGS = {
    "--workers": NUM, "--seed": NUM, "--trials": NUM, "--timeout": NUM, "--trial-timeout": NUM, "--measure-budget": NUM,
    "--compile-workers": NUM, "--threads": NUM, "--accuracy": NUM,
    "--sampler": st.sampled_from(["tpe", "random", "grid", "TPE", "", "x" * 300]),
    "--progress": st.sampled_from(["auto", "bar", "plain", "none", ""]),
    "--impls": st.sampled_from(["cpu_blocked", "torch_matmul,sdpa", "nope", ",", "", "x" * 200]),
    "--ops": st.sampled_from(["gemm", "gemm,attention", "", ",", "gemv", "x" * 500, "gemm,gemm"]),
    "--device": st.sampled_from(["cpu", "xyz", "h200", "", "CPU", "a" * 300, "cpu/../x"]),
    "--db": st.sampled_from([f"postgresql://u:{MARK}@127.0.0.1:x/d", f"mysql://u:{MARK}@h/d", f"postgresql://u:{MARK}@127.0.0.1:1/d",
                             f"postgresql://u@127.0.0.1:1/d?password={MARK}", "sqlite:///DB"]),
    "--shapes": st.sampled_from(["/dev/zero", "/nonexistent.yaml", "/", "SHAPES"]),
}


@st.composite
def tune_argv(draw):
    argv = []
    for flag in draw(st.lists(st.sampled_from(sorted(FLAGS)), max_size=6)):
        argv += [flag, draw(FLAGS[flag])]
    if draw(st.booleans()):
        argv += draw(st.sampled_from([["--device", "cpu"], ["--ops", "gemm"], ["--bogus"], ["--db"], ["-h"], []]))
    return argv


@FAST
@given(argv=tune_argv())
def test_fuzz_tune_arguments(argv, fuzz_db, capsys, monkeypatch, tmp_path_factory):
    d, path = fuzz_db
    shapes = d / "shapes.json"
    shapes.write_text(json.dumps({"gemm": [{"M": 16, "N": 16, "K": 16}]}))
    argv = [a.replace("sqlite:///DB", f"sqlite:///{path}").replace("SHAPES", str(shapes)) for a in argv]
    ran = []

    class FakeTuner:  # arguments are what is fuzzed here; a real tune is covered elsewhere
        def __init__(self, opts):
            ran.append(opts)

        def run(self):
            return []

    monkeypatch.setattr("tuner.driver.Tuner", FakeTuner)
    monkeypatch.setenv("XDG_DATA_HOME", str(d / "xdg"))
    before = _digest(path)
    if "-h" in argv:
        with pytest.raises(SystemExit):
            tcli.tune_main(argv)
        capsys.readouterr()
        return
    rc, out, err = _outcome(tcli.tune_main, argv, capsys)
    assert _digest(path) == before
    assert not (d / "xdg").exists()  # no default database created by a refused or fake run
    if rc == 0:
        (opts,) = ran
        assert MARK not in opts.command
        assert (opts.workers is None or opts.workers >= 1) and opts.seed >= 0 and opts.trials >= 1
        for t in (opts.timeout_s, opts.trial_timeout_s):
            assert t is None or (t > 0 and t != float("inf"))


@FAST
@given(cmd=st.sampled_from(["db", "export", "report"]), url=st.sampled_from(FLAGS["--db"].elements),
       extra=st.lists(st.sampled_from(["--device", "cpu", "h200", "--out", "/missing/x", "--plot", "/missing/p.png",
                                       "--table", "/dev/zero", "current", "upgrade", "--markdown", "OUT"]), max_size=5))
def test_fuzz_other_commands(cmd, url, extra, fuzz_db, capsys):
    d, path = fuzz_db
    url = url.replace("sqlite:///DB", f"sqlite:///{path}")
    extra = [e.replace("OUT", str(d / "out")) for e in extra]
    before = _digest(path)
    if cmd == "db":
        argv, main = [*(extra[:1] if extra[:1] in (["current"], ["upgrade"]) else ["current"]), url], tcli.db_main
    elif cmd == "export":
        argv, main = ["--device", "cpu", "--out", str(d / "out"), "--db", url, *extra], tcli.export_main
    else:
        argv, main = ["--device", "cpu", "--db", url, *extra], tcli.report_main
    _outcome(main, argv, capsys)
    assert _digest(path) == before


# -- database URLs ----------------------------------------------------------------------------------

PIECE = st.text(alphabet="ab:@/?#%&=+ ._-\\'\"", max_size=6)


@st.composite
def urls(draw):
    scheme = draw(st.sampled_from(["postgresql", "postgres", "postgresql+psycopg", "postgresql+asyncpg", "sqlite", "mysql", "", "p g"]))
    user = draw(st.sampled_from(["", "u", "u@x", "%75"]))
    pw = draw(st.sampled_from([MARK, f"a@{MARK}", f"{MARK}/x", f"{MARK}%40", f"{MARK}:{MARK}", f"a b{MARK}"]))
    host = draw(st.sampled_from(["127.0.0.1", "", "[::1]", "localhost", "127.0.0.1:1", "127.0.0.1:x", "127.0.0.1:99999", "127.0.0.1:-1"]))
    tail = draw(PIECE)
    form = draw(st.integers(0, 3))
    if form == 0:
        return f"{scheme}://{user}:{pw}@{host}/d{tail}"
    if form == 1:
        return f"{scheme}://{user}@{host}/d?sslmode=disable&password={pw}{tail}"
    if form == 2:
        return f"{scheme}://{host}/d?pass%77ord={pw}&connect_timeout=2"
    return f"{scheme}://{user}:{pw}@{host}{tail}?password={pw}"


@_settings(N + N // 3)
@given(url=urls())
def test_fuzz_database_urls(url, capsys, monkeypatch, tmp_path_factory):
    monkeypatch.chdir(tmp_path_factory.mktemp("urls"))  # relative SQLite paths land here
    if "localhost" in url or "[::1]" in url or "@/" in url or "//:" in url:
        url = url  # local names resolve without a network
    _outcome(tcli.db_main, ["current", url], capsys)
    try:
        ops_adv.load_table(url)
    except ops_adv.TableError as e:
        assert MARK not in str(e) and "\n" not in str(e)
    finally:
        ops_adv.load_table("")


# -- shapes files -----------------------------------------------------------------------------------

SCALAR = st.one_of(st.none(), st.booleans(), st.integers(-5, 1 << 40), st.floats(allow_nan=True),
                   st.sampled_from(["gemm", "attention", "M", "dtype", "bf16", "fp32", "op", "x" * 400]), st.text(max_size=8))
KEYS = st.sampled_from(["gemm", "attention", "op", "M", "N", "K", "B", "H", "Sq", "Skv", "D", "dtype", "causal", "trans_b", "zz"])
VALUES = st.recursive(SCALAR, lambda c: st.one_of(st.lists(c, max_size=4), st.dictionaries(KEYS, c, max_size=6)), max_leaves=25)


@FAST
@given(data=VALUES, kind=st.sampled_from(["json", "yaml", "YML"]))
def test_fuzz_shapes_structures(data, kind, tmp_path_factory):
    path = tmp_path_factory.mktemp("shapes") / f"s.{kind}"
    try:
        text = json.dumps(data) if kind == "json" else yaml.safe_dump(data)
    except (ValueError, yaml.YAMLError):
        return
    path.write_text(text)
    _load(path)


@FAST
@given(raw=st.binary(max_size=300), kind=st.sampled_from(["json", "yaml"]))
def test_fuzz_shapes_bytes(raw, kind, tmp_path_factory):
    path = tmp_path_factory.mktemp("shapes") / f"s.{kind}"
    path.write_bytes(raw)
    _load(path)


@FAST
@given(anchors=st.integers(1, 12), fan=st.integers(1, 12), depth=st.integers(1, 40))
def test_fuzz_yaml_aliases(anchors, fan, depth, tmp_path_factory):
    lines = ["a0: &a0 [" + ", ".join(["{op: gemm, M: 16, N: 16, K: 16}"] * fan) + "]"]
    for i in range(1, anchors):
        lines.append(f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * fan) + "]")
    lines.append("gemm: " + "[" * depth + "]" * depth)
    path = tmp_path_factory.mktemp("shapes") / "s.yaml"
    path.write_text("\n".join(lines) + "\n")
    _load(path)


def _load(path):
    try:
        got = load_shapes(str(path), ["gemm", "attention"])
    except ShapesFileError as e:
        msg = str(e)
        assert "\n" not in msg and len(msg) <= 500, msg[:2000]
        return
    assert got and len(set(got)) == len(got)


# -- table files ------------------------------------------------------------------------------------

PROB = {"M": 64, "N": 128, "K": 96, "dtype": "fp32", "trans_a": False, "trans_b": False}


def _table_data() -> dict:
    w = {"op": "gemm", "problem": dict(PROB), "impl": "cpu_blocked", "params": {"block_m": 32, "block_n": 64, "block_k": 0},
         "kernel_version": kernel_space.get_impl("gemm", "cpu_blocked").version, "median_ms": 1.0, "vendor_impl": "torch_matmul",
         "vendor_ms": 2.0, "speedup": 2.0, "conditions": {"threads": torch.get_num_threads(), "torch": torch.__version__}}
    return {"format": _table.FORMAT, "format_version": 1, "device_class": "cpu", "fingerprint": {}, "winners": [w]}


JSONV = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(-(1 << 70), 1 << 70), st.floats(), st.text(max_size=6)),
                     lambda c: st.one_of(st.lists(c, max_size=3), st.dictionaries(st.text(max_size=6), c, max_size=3)), max_leaves=8)


@st.composite
def mutated_tables(draw):
    data = _table_data()
    for _ in range(draw(st.integers(1, 4))):
        node, key = data, None
        path = []
        while True:  # walk down to a random place
            keys = list(node) if isinstance(node, dict) else list(range(len(node))) if isinstance(node, list) else []
            if not keys or (path and draw(st.booleans())):
                break
            key = draw(st.sampled_from(keys))
            path.append((node, key))
            node = node[key]
        if not path:
            continue
        parent, key = path[-1]
        action = draw(st.sampled_from(["replace", "delete", "insert"]))
        if action == "replace":
            parent[key] = draw(JSONV)
        elif action == "delete":
            del parent[key]
        elif isinstance(parent, dict):
            parent[draw(st.text(max_size=6))] = draw(JSONV)
        else:
            parent.insert(0, draw(JSONV))
    recompute = draw(st.booleans())
    return data, recompute


@_settings(2 * N)
@given(case=mutated_tables())
def test_fuzz_table_files(case, tmp_path_factory, capsys):
    data, recompute = case
    if recompute and isinstance(data, dict) and isinstance(data.get("winners"), list):
        try:
            data["checksum"] = _table.checksum(data["winners"])
        except (TypeError, ValueError):
            pass
    elif isinstance(data, dict) and "checksum" not in data:
        data["checksum"] = "0"
    path = tmp_path_factory.mktemp("tables") / "t.json"
    path.write_text(json.dumps(data))
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ops_adv.load_table(str(path))
        for w in caught:
            assert "\n" not in str(w.message) and len(str(w.message)) < 1500
        # whatever the table says, the result is torch's
        a, b = torch.randn(64, 96), torch.randn(96, 128)
        torch.testing.assert_close(ops_adv.gemm(a, b), a @ b, rtol=1e-4, atol=1e-4)
    except ops_adv.TableError as e:
        assert "\n" not in str(e) and len(str(e)) < 700
    finally:
        ops_adv.load_table("")
    _outcome(tcli.report_main, ["--device", "cpu", "--table", str(path)], capsys)  # the report reads it too
