"""moe: routing and alignment by expert, the Triton grouped gemms (interpreter on the CPU), the vendors, the
runtime op (default, errors, autograd, compile), a real tune through `python -m tuner tune`, and the serving
engines' per-device config files that `opsadv-export --moe-configs` writes."""
from __future__ import annotations

import importlib.util
import json
import re

import pytest
import torch
from sqlalchemy.orm import Session

import db
import kernel_space
import ops_adv
from conftest import cli, run_cli
from kernel_space import get_impl, get_op, relative_error
from kernel_space.moe import MoeProblem
from kernel_space.moe.problem import align, padded_slots, route

try:
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st
except ImportError:  # the two property tests need it; the rest runs without
    given = None

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SPEC = get_op("moe")


def gpu(f):
    return pytest.mark.gpu(pytest.mark.skipif(DEVICE == "cpu", reason="needs a CUDA GPU")(f))


def _cfg(BLOCK_SIZE_M=16, BLOCK_SIZE_N=32, BLOCK_SIZE_K=32, GROUP_SIZE_M=1, num_warps=4, num_stages=2):
    return dict(BLOCK_SIZE_M=BLOCK_SIZE_M, BLOCK_SIZE_N=BLOCK_SIZE_N, BLOCK_SIZE_K=BLOCK_SIZE_K, GROUP_SIZE_M=GROUP_SIZE_M,
                num_warps=num_warps, num_stages=num_stages)


def _inputs(p: MoeProblem, seed=3, unused_expert=None, device=DEVICE):
    (x, logits, w13, w2), attrs = SPEC.make_inputs(p, device, seed=seed)
    assert tuple(SPEC.signature(x, logits, w13, w2, **attrs)) == tuple(p)
    if unused_expert is not None:  # no token picks it
        logits[:, unused_expert] = -30.0
    return (x, logits, w13, w2), attrs


# --------------------------------------------------------------------------- routing and alignment


def test_route_is_softmax_top_k_renormalised():
    logits = torch.tensor([[0.0, 2.0, 1.0, -1.0], [3.0, 0.0, 0.0, 2.5]])
    w, ids = route(logits, 2)
    assert ids.tolist() == [[1, 2], [0, 3]]
    p = torch.softmax(logits, -1)
    torch.testing.assert_close(w[0], p[0, [1, 2]] / p[0, [1, 2]].sum())
    torch.testing.assert_close(w.sum(-1), torch.ones(2))
    w_raw, _ = route(logits, 2, renormalize=False)
    torch.testing.assert_close(w_raw[1], p[1, [0, 3]])
    assert w.dtype == torch.float32 and route(logits.half(), 1)[0].dtype == torch.float32


def _check_alignment(ids: torch.Tensor, E: int, bm: int) -> None:
    """Every slot once; each block one expert's slots, padding only at the end of a run; counts as bincount."""
    slots = ids.numel()
    sorted_slots, block_expert, total = align(ids, E, bm)
    n = int(total)
    assert sorted_slots.numel() == padded_slots(slots, E, bm) >= n and n % bm == 0
    assert block_expert.numel() == -(-sorted_slots.numel() // bm)
    assert (sorted_slots[n:] == slots).all()
    body = sorted_slots[:n].view(-1, bm)
    real = body[body < slots]
    assert sorted(real.tolist()) == list(range(slots))
    flat = ids.reshape(-1)
    counts = torch.bincount(flat, minlength=E)
    for b in range(n // bm):
        row = body[b]
        kept = row[row < slots]
        assert (flat[kept.long()] == block_expert[b]).all(), (b, row, block_expert)
        assert (row[: kept.numel()] == kept).all(), "padding comes after a block's slots"
        assert kept.tolist() == sorted(kept.tolist()), "slots keep their order within an expert"
    blocks_per_expert = torch.bincount(block_expert[: n // bm].long(), minlength=E)
    assert blocks_per_expert.tolist() == ((counts + bm - 1) // bm).tolist()
    try:
        from kernel_space.moe._kernels import align_one_program
    except ImportError:  # no triton
        return
    one = align_one_program(ids.to(DEVICE), E, bm)  # the Triton kernel for small slot counts: the same three tensors
    assert all(torch.equal(a.cpu(), b) for a, b in zip(one, (sorted_slots, block_expert, total)))


@pytest.mark.parametrize("T,E,top_k,bm", [(1, 8, 2, 16), (1, 4, 4, 16), (5, 4, 4, 16), (33, 6, 2, 16), (70, 3, 1, 64)])
def test_alignment_edges(T, E, top_k, bm):
    g = torch.Generator().manual_seed(T * 100 + E)
    ids = torch.stack([torch.randperm(E, generator=g)[:top_k] for _ in range(T)])
    _check_alignment(ids, E, bm)


def test_alignment_with_empty_experts():
    ids = torch.tensor([[2, 5], [5, 2], [2, 7]])  # experts 0, 1, 3, 4, 6 get nothing
    sorted_slots, block_expert, total = align(ids, 8, 16)
    assert int(total) == 48 and block_expert[:3].tolist() == [2, 5, 7]
    assert sorted_slots[:3].tolist() == [0, 3, 4] and sorted_slots[16:18].tolist() == [1, 2] and sorted_slots[32] == 5
    _check_alignment(ids, 8, 16)


def _property(strategies: dict, examples: int):
    """A hypothesis property test, or a skipped test where hypothesis is not installed."""
    if given is None:
        return lambda f: pytest.mark.skip(reason="needs hypothesis")(lambda: None)
    return lambda f: settings(max_examples=examples, deadline=None, suppress_health_check=[HealthCheck.too_slow])(
        given(**{k: v() for k, v in strategies.items()})(f))


@_property({"T": lambda: st.integers(1, 40), "E": lambda: st.integers(1, 12), "k": lambda: st.integers(1, 12),
            "bm": lambda: st.sampled_from([16, 32, 64]), "seed": lambda: st.integers(0, 2**16),
            "skew": lambda: st.booleans()}, 60)
def test_alignment_property(T, E, k, bm, seed, skew):
    top_k = min(k, E)
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(T, E, generator=g)
    if skew:  # most tokens on the same few experts, others empty
        logits[:, : max(1, E // 3)] += 10.0
    weights, ids = route(logits, top_k, renormalize=not skew)
    _check_alignment(ids, E, bm)
    if T * top_k <= 1024 and importlib.util.find_spec("triton"):  # the Triton path routes and aligns in one program: the same experts, slots and weights
        from kernel_space.moe._kernels import route_align_one_program

        w, i, aligned = (t.cpu() if isinstance(t, torch.Tensor) else tuple(a.cpu() for a in t)
                         for t in route_align_one_program(logits.to(DEVICE), top_k, not skew, E, bm))
        assert torch.equal(i, ids.int()) and torch.allclose(w, weights, rtol=1e-6, atol=1e-7)
        assert all(torch.equal(a, b) for a, b in zip(aligned, align(ids, E, bm)))


# --------------------------------------------------------------------------- kernels against the reference

# (problem, configs): partial column tiles (N=40, K=24 under BLOCK 32), K not a multiple of BLOCK_SIZE_K, one token,
# top_k = E, top-1, grouped tile order over 8 row blocks, renormalize off.
CASES = [
    (MoeProblem(5, 4, 2, 32, 48), [_cfg(), _cfg(BLOCK_SIZE_N=64, BLOCK_SIZE_K=64, num_warps=2)]),
    (MoeProblem(1, 4, 4, 32, 48), [_cfg()]),
    (MoeProblem(9, 6, 1, 40, 24), [_cfg(BLOCK_SIZE_K=16)]),
    (MoeProblem(40, 3, 2, 32, 32), [_cfg(GROUP_SIZE_M=8), _cfg(BLOCK_SIZE_M=32, BLOCK_SIZE_K=16)]),
    (MoeProblem(6, 5, 3, 32, 32, renormalize=False), [_cfg()]),
]


def _check_triton(p: MoeProblem, params: dict, unused_expert=None) -> float:
    impl = get_impl("moe", "triton_fused_moe")
    assert impl.check(p, params) is None, (p, params)
    args, attrs = _inputs(p, unused_expert=unused_expert)
    out = impl.fn(*args, **attrs, **params)
    assert out.shape == args[0].shape and out.dtype == args[0].dtype
    err = relative_error(out, SPEC.reference(*args, **attrs))
    assert err <= SPEC.tolerance(p.dtype), (p, params, err)
    return err


@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_triton_against_reference(dtype):
    pytest.importorskip("triton")
    for p, configs in CASES:
        for params in configs:
            _check_triton(p._replace(dtype=dtype), params)


def test_triton_expert_without_tokens():
    pytest.importorskip("triton")
    _check_triton(MoeProblem(7, 4, 2, 32, 32), _cfg(), unused_expert=1)
    _check_triton(MoeProblem(7, 4, 2, 32, 32), _cfg(), unused_expert=3)  # the last expert: its blocks are past the end


@gpu
@pytest.mark.parametrize("p", [MoeProblem(1, 8, 2, 1024, 512, "bf16"), MoeProblem(300, 16, 4, 384, 256, "bf16"),
                               MoeProblem(64, 128, 8, 768, 2048, "bf16")])
def test_triton_bf16_on_gpu(p):
    impl = get_impl("moe", "triton_fused_moe")
    valid = [c for c in impl.configs() if impl.check(p, c) is None]
    for params in [impl.default_params()] * (impl.check(p, impl.default_params()) is None) + valid[:: max(1, len(valid) // 6)]:
        _check_triton(p, params)


@pytest.mark.parametrize("name", ["torch_experts_loop", "torch_grouped_mm"])
@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
def test_vendors_against_reference(name, dtype):
    impl = get_impl("moe", name)
    for p in (MoeProblem(5, 4, 2, 32, 48), MoeProblem(1, 4, 4, 24, 16), MoeProblem(12, 6, 1, 40, 24)):
        p = p._replace(dtype=dtype)
        if impl.why_not(p, {}, kernel_space.backend_of(torch.device(DEVICE))):
            continue
        for unused in (None, 0):
            args, attrs = _inputs(p, unused_expert=unused)
            err = relative_error(impl.fn(*args, **attrs), SPEC.reference(*args, **attrs))
            assert err <= SPEC.tolerance(dtype), (name, p, err)


@_property({"T": lambda: st.integers(1, 24), "E": lambda: st.integers(1, 9), "k": lambda: st.integers(1, 9),
            "N": lambda: st.integers(1, 24).map(lambda v: 4 * v), "K": lambda: st.integers(1, 24).map(lambda v: v if v % 3 else 4 * v),
            "renormalize": lambda: st.booleans(), "seed": lambda: st.integers(0, 1000)}, 25)
def test_grouped_mm_agrees_with_the_loop(T, E, k, N, K, renormalize, seed):
    """Any sizes (fp32, CPU): the two vendors compute the same function."""
    p = MoeProblem(T, E, min(k, E), N, K, renormalize=renormalize)
    (x, logits, w13, w2), attrs = SPEC.make_inputs(p, "cpu", seed=seed)
    ref = SPEC.reference(x, logits, w13, w2, **attrs)
    for name in ("torch_experts_loop", "torch_grouped_mm"):
        impl = get_impl("moe", name)
        if impl.why_not(p, {}, "cpu") is None:  # grouped_mm: rows of 16 bytes
            assert relative_error(impl.fn(x, logits, w13, w2, **attrs), ref) <= 1e-5


def test_checks_refuse_what_cannot_run():
    impl = get_impl("moe", "triton_fused_moe")
    assert "top_k 5 exceeds the 4 experts" in impl.check(MoeProblem(8, 4, 5, 32, 32), _cfg())
    assert "BLOCK_SIZE_M 64 is larger" in impl.check(MoeProblem(8, 4, 2, 32, 32), _cfg(BLOCK_SIZE_M=64))
    assert "GROUP_SIZE_M 16" in impl.check(MoeProblem(8, 4, 2, 32, 32), _cfg(GROUP_SIZE_M=16))
    big = MoeProblem(4096, 8, 2, 14336, 4096, "bf16")
    assert "shared memory" in impl.check(big, _cfg(128, 256, 256, 8, 8, 5))
    assert "registers" in impl.check(big, _cfg(256, 256, 64, 8, 4, 2))
    for dc in ("h200", "cpu"):
        for p in SPEC.default_problems(dc):
            assert any(impl.check(p, c) is None for c in impl.configs()), p


def test_default_problems_are_the_model_dims():
    dims = {(p.E, p.top_k, p.N, p.K) for p in SPEC.default_problems("h200")}
    assert dims == {(8, 2, 14336, 4096), (128, 8, 768, 2048)}
    assert sorted({p.T for p in SPEC.default_problems("h100")}) == [1, 8, 64, 512, 4096]
    assert SPEC.parse_problem({"T": 3, "E": 8, "top_k": 2, "N": 64, "K": 32, "dtype": "bfloat16"}).dtype == "bf16"
    with pytest.raises(kernel_space.OpsAdvError, match="activation='gelu' must be one of silu"):
        SPEC.parse_problem({"T": 3, "E": 8, "top_k": 2, "N": 64, "K": 32, "activation": "gelu"})


# --------------------------------------------------------------------------- the runtime op


def test_runtime_defaults_to_the_expert_loop_and_keeps_shapes():
    p = MoeProblem(6, 4, 2, 32, 48)
    (x, logits, w13, w2), attrs = _inputs(p)
    out = ops_adv.moe(x.view(2, 3, 48), logits.view(2, 3, 4), w13, w2, 2)
    assert out.shape == (2, 3, 48)
    assert relative_error(out.view(6, 48), SPEC.reference(x, logits, w13, w2, **attrs)) <= 1e-5
    why = ops_adv.explain("moe", x, logits, w13, w2, top_k=2)
    assert why["impl"] == "torch_experts_loop" and why["source"] == "default" and why["problem"]["T"] == 6
    torch.testing.assert_close(ops_adv.dispatch("moe", x, logits, w13, w2, top_k=2), out.view(6, 48))
    assert ops_adv.moe(x[:0], logits[:0], w13, w2, 2).shape == (0, 48)


@pytest.mark.parametrize("change,message", [
    (lambda a: {**a, "w13": a["w13"][:, :-1]}, r"w13 must be \[E, 2N, K\]"),
    (lambda a: {**a, "w13": a["w13"][..., :-1]}, r"w13 must be \[E, 2N, K\]"),
    (lambda a: {**a, "w2": a["w2"][..., :-1]}, r"w2 must be \[E, K, N\] = \(4, 48, 32\)"),
    (lambda a: {**a, "router_logits": a["router_logits"][:, :3]}, "router_logits must be .tokens, E. with E=4"),
    (lambda a: {**a, "router_logits": a["router_logits"][:5]}, "the 6 tokens of hidden_states"),
    (lambda a: {**a, "top_k": 5}, "top_k must be an int from 1 to the 4 experts"),
    (lambda a: {**a, "top_k": 0}, "top_k must be an int"),
    (lambda a: {**a, "top_k": 2.0}, "top_k must be an int"),
    (lambda a: {**a, "activation": "gelu"}, "activation 'gelu' is not supported"),
])
def test_bad_shapes_are_one_value_error_tuned_or_not(change, message, tmp_path):
    (x, logits, w13, w2), _ = _inputs(MoeProblem(6, 4, 2, 32, 48))
    args = change({"hidden_states": x, "router_logits": logits, "w13": w13, "w2": w2, "top_k": 2, "activation": "silu"})
    with pytest.raises(ValueError, match=message):
        ops_adv.moe(**args)
    table = tmp_path / "t.json"  # the same error when the table holds a winner for the problem
    _write_table(table, MoeProblem(6, 4, 2, 32, 48), "torch_grouped_mm", {})
    try:
        ops_adv.load_table(str(table))
        with pytest.raises(ValueError, match=message):
            ops_adv.moe(**args)
    finally:
        ops_adv.load_table("")


def _write_table(path, p: MoeProblem, impl: str, params: dict) -> None:
    from ops_adv._table import FORMAT, FORMAT_VERSION, checksum

    winners = [{"op": "moe", "problem": p._asdict(), "impl": impl, "params": params,
                "kernel_version": get_impl("moe", impl).version, "median_ms": 1.0, "speedup": 1.5}]
    path.write_text(json.dumps({"format": FORMAT, "format_version": FORMAT_VERSION, "device_class": "cpu",
                                "winners": winners, "checksum": checksum(winners)}))


def test_a_tuned_winner_runs_and_mixed_calls_still_work(tmp_path):
    p = MoeProblem(6, 4, 2, 32, 48)
    (x, logits, w13, w2), attrs = _inputs(p, device="cpu")  # the table's device class; fp32 _grouped_mm runs there
    ref = SPEC.reference(x, logits, w13, w2, **attrs)
    table = tmp_path / "t.json"
    _write_table(table, p, "torch_grouped_mm", {})
    try:
        ops_adv.load_table(str(table))
        why = ops_adv.explain("moe", x, logits, w13, w2, top_k=2)
        assert (why["impl"], why["source"]) == ("torch_grouped_mm", "tuned")
        assert relative_error(ops_adv.moe(x, logits, w13, w2, 2), ref) <= 1e-5
        assert ops_adv.explain("moe", x, logits, w13, w2, top_k=2, renormalize=False)["source"] == "twin"
        # float64 logits, or weights of another dtype: the loop runs it as transformers would (or fails as it does)
        assert relative_error(ops_adv.moe(x, logits.double(), w13, w2, 2), ref) <= 1e-5
        with pytest.raises(RuntimeError) as ours:
            ops_adv.moe(x, logits, w13.half(), w2, 2)
        with pytest.raises(RuntimeError) as loop:
            get_impl("moe", "torch_experts_loop").fn(x, logits, w13.half(), w2, **attrs)
        assert str(ours.value) == str(loop.value)
    finally:
        ops_adv.load_table("")


def test_gradients_and_compile():
    p = MoeProblem(6, 4, 2, 32, 48)
    (x, logits, w13, w2), attrs = _inputs(p)
    leaves = [t.double().requires_grad_() for t in (x, logits, w13, w2)]
    SPEC.reference(*leaves, **attrs).square().sum().backward()
    mine = [t.clone().requires_grad_() for t in (x, logits, w13, w2)]
    ops_adv.moe(*mine, 2).square().sum().backward()
    for a, b in zip(mine, leaves):
        assert relative_error(a.grad, b.grad) <= 1e-5
    compiled = torch.compile(lambda *t: ops_adv.moe(*t, 2), fullgraph=True)
    assert relative_error(compiled(x, logits, w13, w2), SPEC.reference(x, logits, w13, w2, **attrs)) <= 1e-5


# --------------------------------------------------------------------------- tune, export, engines' configs

SHAPES = """\
moe:
  - {T: 3, E: 4, top_k: 2, N: 32, K: 24, dtype: fp32}
  - {T: 16, E: 4, top_k: 4, N: 16, K: 24, dtype: fp32, renormalize: false}
"""

CHECK = """
import json, sys, ops_adv
from kernel_space import get_op, relative_error
out = []
for w in json.load(open(sys.argv[1]))["winners"]:
    spec = get_op(w["op"])
    p = spec.parse_problem(w["problem"])
    tensors, attrs = spec.make_inputs(p, "cpu", seed=5)
    why = ops_adv.explain("moe", *tensors, **attrs)
    err = relative_error(ops_adv.moe(*tensors, **attrs), spec.reference(*tensors, **attrs))
    out.append({"source": why["source"], "impl": why["impl"], "winner": w["impl"], "err": err})
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    """A real CPU tune of two moe problems (the vendors compete there: Triton is CUDA's)."""
    tmp = tmp_path_factory.mktemp("moe_tune")
    url = f"sqlite:///{tmp / 'db.sqlite'}"
    (tmp / "shapes.yaml").write_text(SHAPES)
    r = run_cli("-m", "tuner", "tune", "--device", "cpu", "--ops", "moe", "--shapes", str(tmp / "shapes.yaml"),
                "--trials", "2", "--db", url, cwd=str(tmp))
    assert r.returncode == 0, r.stderr[-3000:]
    return tmp, url


def test_tune_export_and_dispatch(tuned):
    tmp, url = tuned
    out = tmp / "export"
    r = cli("opsadv-export", "--device", "cpu", "--out", str(out), "--db", url)
    assert r.returncode == 0, r.stderr
    table = out / "opsadv-table.json"
    winners = json.loads(table.read_text())["winners"]
    assert len(winners) == 2 and {w["impl"] for w in winners} <= {"torch_experts_loop", "torch_grouped_mm"}
    r = run_cli("-c", CHECK, str(table), env={"OPS_ADV_TABLE": str(table)})
    assert r.returncode == 0, r.stderr[-3000:]
    for row in json.loads(r.stdout):
        assert row["source"] == "tuned" and row["impl"] == row["winner"] and row["err"] <= 1e-5, row
    # no Triton configuration on the CPU: nothing for the engines, said in one line, no folder made
    r = cli("opsadv-export", "--device", "cpu", "--moe-configs", str(tmp / "engines"), "--db", url)
    assert r.returncode == 2 and "no moe problem tuned on cpu with a correct triton_fused_moe" in r.stderr
    assert not (tmp / "engines").exists()


# The serving engines' file: E=<E>,N=<N>,device_name=<torch.cuda.get_device_name() with _ for spaces>[,dtype=<quant>].json
ENGINE_FILE = re.compile(r"E=(\d+),N=(\d+),device_name=([A-Za-z0-9_.\-]+)(,dtype=(fp8_w8a8|int8_w8a16|int8_w8a8|int4_w4a16))?\.json")
ENGINE_KEYS = {"BLOCK_SIZE_M", "BLOCK_SIZE_N", "BLOCK_SIZE_K", "GROUP_SIZE_M", "num_warps", "num_stages"}


def _engine_configs(path) -> dict[int, dict]:
    """A config file read as the engines read one ({int(token count): config}), checked against their format."""
    m = ENGINE_FILE.fullmatch(path.name)
    assert m, path.name
    data = json.loads(path.read_text())
    assert isinstance(data, dict) and data
    configs = {}
    for key, cfg in data.items():
        assert re.fullmatch(r"[1-9][0-9]*", key), key
        assert set(cfg) == ENGINE_KEYS and all(type(v) is int and v > 0 for v in cfg.values()), cfg
        for k in ("BLOCK_SIZE_M", "BLOCK_SIZE_N", "BLOCK_SIZE_K", "num_warps"):
            assert cfg[k] & (cfg[k] - 1) == 0, (k, cfg)
        configs[int(key)] = cfg
    return configs


def _nearest(configs: dict[int, dict], M: int) -> dict:
    """The engines' pick for M tokens: the config of the nearest token count."""
    return configs[min(configs, key=lambda t: abs(t - M))]


def test_export_moe_configs_in_the_engines_format(tuned):
    tmp, url = tuned
    impl = get_impl("moe", "triton_fused_moe")
    mixtral = {t: MoeProblem(t, 8, 2, 14336, 4096, "bf16") for t in (1, 8, 64, 512)}
    cfg = {1: _cfg(16, 64, 128, 1, 4, 4), 8: _cfg(16, 128, 128, 1, 4, 3), 64: _cfg(64, 64, 64, 1, 4, 3),
           512: _cfg(64, 128, 64, 8, 8, 3)}
    slower = _cfg(64, 64, 128, 1, 8, 2)
    with Session(db.open_db(url)) as s:
        run = db.Run(device_class="h200", command="opsadv-tune --device h200 --ops moe", sampler="tpe")
        dev = db.Device(device_class="h200", fingerprint={"name": "NVIDIA H200", "capability": "9.0"}, fingerprint_hash="h200a")
        s.add_all([run, dev])
        s.flush()

        def problem(p):
            row = db.Problem(op="moe", key=kernel_space.problem_key(p))
            s.add(row)
            s.flush()
            return row

        def winner(prow, impl_name, params):
            s.add(db.Winner(device_class="h200", problem_id=prow.id, device_id=dev.id, run_id=run.id, study="s",
                            impl=impl_name, params=params, kernel_version=get_impl("moe", impl_name).version,
                            median_ms=1.0, spread_ms=0.01, vendor_impl="torch_grouped_mm", vendor_ms=1.5, speedup=1.5,
                            trials=20))

        def trial(prow, params, ms, status="ok", version=impl.version):
            s.add(db.Trial(run_id=run.id, problem_id=prow.id, device_id=dev.id, study="s", impl="triton_fused_moe",
                           kernel_version=version, params=params, status=status, median_ms=ms))

        rows = {t: problem(p) for t, p in mixtral.items()}
        for t in (1, 8, 64):
            winner(rows[t], "triton_fused_moe", cfg[t])
        # at 512 tokens torch won: the engines get the fastest correct Triton trial (not a failed, stale or slower one)
        winner(rows[512], "torch_grouped_mm", {})
        trial(rows[512], cfg[512], 2.0)
        trial(rows[512], slower, 2.5)
        trial(rows[512], _cfg(256, 256, 64, 8, 8, 2), 1.0, status="out_of_resources")
        trial(rows[512], _cfg(128, 128, 64, 8, 8, 2), 0.5, version="0" * 16)
        # fp32 of the same (E, N): the bf16 file stands (no suffix tells them apart); renormalize off: a twin
        winner(problem(mixtral[64]._replace(dtype="fp32")), "triton_fused_moe", slower)
        winner(problem(mixtral[8]._replace(renormalize=False)), "triton_fused_moe", slower)
        # Qwen3-30B-A3B dims, one token count
        winner(problem(MoeProblem(4096, 128, 8, 768, 2048, "bf16")), "triton_fused_moe", cfg[512])
        s.commit()
    out = tmp / "engines"
    r = run_cli("-m", "tuner", "export", "--device", "h200", "--moe-configs", str(out), "--db", url)
    assert r.returncode == 0, r.stderr
    names = sorted(p.name for p in out.iterdir())
    assert names == ["E=128,N=768,device_name=NVIDIA_H200.json", "E=8,N=14336,device_name=NVIDIA_H200.json"], names
    assert "wrote 2 moe config file(s)" in r.stdout
    configs = _engine_configs(out / "E=8,N=14336,device_name=NVIDIA_H200.json")
    assert configs == {t: cfg[t] for t in (1, 8, 64, 512)}
    assert _nearest(configs, 2) == cfg[1] and _nearest(configs, 48) == cfg[64] and _nearest(configs, 4096) == cfg[512]
    for t, c in configs.items():  # each is a point of our space that our check accepts for its problem
        assert impl.check(mixtral[t], c) is None and all(c[k] in impl.space[k] for k in c)
    assert _engine_configs(out / "E=128,N=768,device_name=NVIDIA_H200.json") == {4096: cfg[512]}
    # the files the engines read, and nothing else, are in the folder (no temporary files left)
    assert all(ENGINE_FILE.fullmatch(p.name) for p in out.iterdir())
    from tuner.export import moe_config_name

    assert moe_config_name(8, 14336, "NVIDIA H100 80GB HBM3", "fp16") == "E=8,N=14336,device_name=NVIDIA_H100_80GB_HBM3.json"


def test_export_needs_out_or_moe_configs(capsys):
    from tuner.cli import export_main

    with pytest.raises(SystemExit) as e:
        export_main(["--device", "cpu"])
    assert e.value.code == 2 and "--out (or --moe-configs)" in capsys.readouterr().err
