"""The ops behave as torch's functions whatever the table holds, and compose with autograd,
torch.compile, torch.export and jit.trace."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

import kernel_space
import ops_adv
from ops_adv import _table
from ops_adv.profiler import ProfileContext


def _winner(op: str, problem: dict, impl: str, params: dict) -> dict:
    return {"op": op, "problem": problem, "impl": impl, "params": params,
            "kernel_version": kernel_space.get_impl(op, impl).version, "median_ms": 1.0, "vendor_impl": "x",
            "vendor_ms": 2.0, "speedup": 2.0}


@pytest.fixture
def forced(tmp_path, monkeypatch):
    """Load a table whose winners are ops-adv's CPU kernels, near enough to stand in for every problem here."""
    winners = [
        _winner("gemm", {"M": 16, "N": 16, "K": 32, "dtype": "fp32", "trans_a": False, "trans_b": tb}, "cpu_blocked",
                {"block_m": 32, "block_n": 32, "block_k": 0})
        for tb in (False, True)
    ] + [
        _winner("attention", {"B": 2, "H": 2, "Sq": 16, "Skv": 16, "D": 16, "causal": c, "dtype": "fp32"}, "cpu_chunked",
                {"block_q": 16, "block_kv": 0})
        for c in (False, True)
    ]
    path = tmp_path / "forced.json"
    data = {"format": _table.FORMAT, "format_version": _table.FORMAT_VERSION, "device_class": "cpu", "fingerprint": {},
            "winners": winners, "checksum": _table.checksum(winners)}
    path.write_text(json.dumps(data))
    monkeypatch.setenv("OPS_ADV_NEAREST", "1000")
    ops_adv.load_table(str(path))
    yield
    ops_adv.load_table("")


def test_the_forced_table_really_runs_ops_adv_kernels(forced):
    a, b = torch.randn(20, 40), torch.randn(40, 24)
    assert ops_adv.explain("gemm", a, b)["impl"] == "cpu_blocked"
    q = torch.randn(1, 2, 24, 16)
    assert ops_adv.explain("attention", q, q, q)["impl"] == "cpu_chunked"


@pytest.mark.parametrize("shapes", [((5,), (5,)), ((3, 5), (5,)), ((2, 3, 5), (5, 4)), ((2, 3, 5), (2, 5, 4)), ((0, 5), (5, 3)),
                                    ((4, 0), (0, 3)), ((3, 5), (5, 0))])
def test_gemm_has_matmul_semantics(forced, shapes):
    a, b = torch.randn(*shapes[0]), torch.randn(*shapes[1])
    torch.testing.assert_close(ops_adv.gemm(a, b), torch.matmul(a, b))


def test_gemm_errors_are_torchs(forced):
    a, b = torch.randn(8, 5), torch.randn(6, 4)
    with pytest.raises(RuntimeError) as theirs:
        torch.matmul(a, b)
    with pytest.raises(RuntimeError) as ours:
        ops_adv.gemm(a, b)
    assert str(ours.value) == str(theirs.value)
    with pytest.raises(RuntimeError):
        ops_adv.gemm(torch.randn(4, 4), torch.randn(4, 4, dtype=torch.float64))


def test_float64_and_integers_run_torch(forced):
    a = torch.randn(16, 32, dtype=torch.float64)
    torch.testing.assert_close(ops_adv.gemm(a, a.t()), a @ a.t())
    i = torch.randint(0, 5, (4, 4))
    assert torch.equal(ops_adv.gemm(i, i), i @ i)
    x = torch.randn(3, 8, dtype=torch.float64)
    torch.testing.assert_close(ops_adv.softmax(x), torch.softmax(x, -1))


def test_rms_norm_default_eps_is_torchs():
    x = torch.randn(4, 64) * 1e-4
    w = torch.ones(64)
    torch.testing.assert_close(ops_adv.rms_norm(x, w), F.rms_norm(x, (64,), w))
    torch.testing.assert_close(ops_adv.rms_norm(x, w), torch.nn.RMSNorm(64)(x), rtol=1e-5, atol=1e-5)


def test_zero_sized_inputs_follow_torch(forced):
    x = torch.randn(0, 8)
    w = torch.ones(8)
    assert ops_adv.softmax(x).shape == (0, 8)
    assert ops_adv.rms_norm(x, w).shape == (0, 8)
    assert ops_adv.layer_norm(torch.randn(3, 0), torch.ones(0)).shape == (3, 0)
    q = torch.randn(1, 2, 0, 16)
    assert ops_adv.attention(q, q, q).shape == (1, 2, 0, 16)


def test_attention_keeps_sdpa_semantics(forced):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 16, 16, generator=g)
    kv = torch.randn(2, 2, 16, 16, generator=g)  # grouped K/V heads
    torch.testing.assert_close(ops_adv.attention(q, kv, kv, enable_gqa=True),
                               F.scaled_dot_product_attention(q, kv, kv, enable_gqa=True))
    v8 = torch.randn(2, 4, 16, 8, generator=g)  # Dv != D
    torch.testing.assert_close(ops_adv.attention(q, q, v8), F.scaled_dot_product_attention(q, q, v8))
    mask = torch.rand(16, 16, generator=g) > 0.3
    torch.testing.assert_close(ops_adv.attention(q, q, q, attn_mask=mask), F.scaled_dot_product_attention(q, q, q, attn_mask=mask))
    torch.testing.assert_close(ops_adv.attention(q, q, q, scale=0.3), F.scaled_dot_product_attention(q, q, q, scale=0.3))
    torch.testing.assert_close(ops_adv.attention(q, q, q, is_causal=True), F.scaled_dot_product_attention(q, q, q, is_causal=True),
                               rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError):
        ops_adv.attention(q, kv, kv)  # torch refuses mismatched heads without enable_gqa
    with pytest.raises(RuntimeError):
        F.scaled_dot_product_attention(q, kv, kv)


def test_no_implementation_changes_the_thread_count(forced):
    before = torch.get_num_threads()
    a = torch.randn(64, 64)
    ops_adv.gemm(a, a)
    ops_adv.attention(a[None, None], a[None, None], a[None, None])
    assert torch.get_num_threads() == before
    for op in kernel_space.ops():
        for impl in kernel_space.impls(op, backend="cpu"):
            assert "threads" not in impl.space, f"{op}/{impl.name} tunes the process's thread count"


class Block(torch.nn.Module):
    """Every op once, the way a model calls them."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(32, 32)
        self.w = torch.nn.Parameter(torch.ones(32) + 0.1 * torch.randn(32))
        self.b = torch.nn.Parameter(0.1 * torch.randn(32))
        self.conv = torch.nn.Parameter(torch.randn(4, 2, 3, 3) * 0.3)

    def forward(self, x: torch.Tensor, img: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = ops_adv.layer_norm(x, self.w, self.b)
        h = ops_adv.linear(h, self.lin.weight, self.lin.bias)
        h = ops_adv.rms_norm(h, self.w, 1e-6)
        B, S, _ = h.shape
        q = h.view(B, S, 2, 16).transpose(1, 2)
        a = ops_adv.attention(q, q, q, is_causal=True).transpose(1, 2).reshape(B, S, 32)
        y = ops_adv.softmax(ops_adv.gemm(a.reshape(-1, 32), self.lin.weight.t()))
        return y, ops_adv.conv2d(img, self.conv, None, 1, 1)


def _reference(m: Block, x, img):
    h = F.layer_norm(x, (32,), m.w, m.b)
    h = F.rms_norm(F.linear(h, m.lin.weight, m.lin.bias), (32,), m.w, 1e-6)
    B, S, _ = h.shape
    q = h.view(B, S, 2, 16).transpose(1, 2)
    a = F.scaled_dot_product_attention(q, q, q, is_causal=True).transpose(1, 2).reshape(B, S, 32)
    return torch.softmax(a.reshape(-1, 32) @ m.lin.weight.t(), -1), F.conv2d(img, m.conv, None, 1, 1)


def _inputs(B: int, S: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, S, 32, generator=g), torch.randn(B, 2, 8, 8, generator=g)


def test_backward_matches_torch(forced):
    torch.manual_seed(0)
    m = Block()
    x, img = _inputs(2, 16)
    xs = [x.clone().requires_grad_(), x.clone().requires_grad_()]
    imgs = [img.clone().requires_grad_(), img.clone().requires_grad_()]
    outs = m(xs[0], imgs[0])
    (outs[0].square().sum() + outs[1].sum()).backward()
    ours = [xs[0].grad, imgs[0].grad] + [p.grad.clone() for p in m.parameters()]
    m.zero_grad()
    refs = _reference(m, xs[1], imgs[1])
    (refs[0].square().sum() + refs[1].sum()).backward()
    theirs = [xs[1].grad, imgs[1].grad] + [p.grad for p in m.parameters()]
    for o, t in zip(ours, theirs):
        torch.testing.assert_close(o, t, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("dynamic", [False, True])
def test_compile_fullgraph_without_graph_breaks(forced, dynamic):
    torch._dynamo.reset()
    torch.manual_seed(0)
    m = Block().eval()
    x, img = _inputs(2, 16)
    explained = torch._dynamo.explain(m)(x, img)
    assert explained.graph_break_count == 0 and explained.graph_count == 1
    compiled = torch.compile(m, fullgraph=True, dynamic=dynamic)
    with torch.no_grad():
        for B, S in ((2, 16), (3, 24), (2, 16)):  # cold, another shape, warm
            x, img = _inputs(B, S, seed=B * S)
            for o, r in zip(compiled(x, img), _reference(m, x, img)):
                torch.testing.assert_close(o, r, rtol=1e-4, atol=1e-5)
    assert ops_adv.explain("gemm", x.reshape(-1, 32), m.lin.weight.t())["impl"] == "cpu_blocked"


def test_export_with_dynamic_dims(forced):
    from torch.export import Dim, export

    torch.manual_seed(0)
    m = Block().eval()
    x, img = _inputs(2, 16)
    ep = export(m, (x, img), dynamic_shapes={"x": {0: Dim("b", max=64), 1: Dim("s", min=2, max=512)}, "img": {0: Dim("n", max=64)}})
    names = {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}
    assert any("ops_adv" in n for n in names), names
    x2, img2 = _inputs(3, 24, seed=1)
    for o, r in zip(ep.module()(x2, img2), _reference(m, x2, img2)):
        torch.testing.assert_close(o, r, rtol=1e-4, atol=1e-5)


def test_jit_trace_works_for_other_shapes(forced):
    torch.manual_seed(0)
    m = Block().eval()
    traced = torch.jit.trace(m, _inputs(2, 16), check_trace=False)
    x2, img2 = _inputs(4, 8, seed=3)
    for o, r in zip(traced(x2, img2), _reference(m, x2, img2)):
        torch.testing.assert_close(o, r, rtol=1e-4, atol=1e-5)


def test_misses_count_calls():
    ops_adv.load_table("")
    a = torch.randn(7, 9)
    b = torch.randn(9, 11)
    before = ops_adv.misses().get(("gemm", (7, 11, 9, "fp32", False, False)), 0)
    for _ in range(5):
        ops_adv.gemm(a, b)
    assert ops_adv.misses()[("gemm", (7, 11, 9, "fp32", False, False))] == before + 5


def test_record_writes_a_shapes_file_opsadv_tune_reads(tmp_path):
    from tuner.problems import load_shapes

    m = Block().eval()
    path = tmp_path / "shapes.json"
    with torch.no_grad(), ops_adv.record(str(path)) as rec:
        m(*_inputs(2, 16))
    ops = {op for op, _ in rec.problems()}
    assert ops == {"gemm", "layer_norm", "rms_norm", "attention", "softmax", "conv2d"}
    loaded = load_shapes(str(path), sorted(ops))
    assert sorted(map(repr, loaded)) == sorted(map(repr, rec.problems()))


def test_nearest_search_over_many_winners_picks_the_closest(tmp_path, monkeypatch):
    import random

    from kernel_space import get_op, problem_distance

    rng = random.Random(0)
    spec = get_op("gemm")
    version = kernel_space.get_impl("gemm", "torch_matmul").version
    winners, seen = [], set()
    while len(winners) < 5000:
        p = (rng.randint(1, 4096), rng.randint(1, 4096), rng.randint(1, 4096), "fp32", False, rng.random() < 0.5)
        if p not in seen:
            seen.add(p)
            winners.append({"op": "gemm", "problem": spec.problem._make(p)._asdict(), "impl": "torch_matmul", "params": {},
                            "kernel_version": version, "median_ms": 1.0, "vendor_impl": "torch_matmul", "vendor_ms": 1.0,
                            "speedup": 1.0 + len(winners)})
    path = tmp_path / "many.json"
    path.write_text(json.dumps({"format": _table.FORMAT, "format_version": _table.FORMAT_VERSION, "device_class": "cpu",
                                "fingerprint": {}, "winners": winners, "checksum": _table.checksum(winners)}))
    monkeypatch.setenv("OPS_ADV_NEAREST", "3.0")
    tuned = ops_adv.load_table(str(path))["cpu"]["gemm"]
    from ops_adv import _dispatch

    try:
        for _ in range(20):
            q = (rng.randint(1, 4096), rng.randint(1, 4096), rng.randint(1, 4096), "fp32", False, rng.random() < 0.5)
            best = min(((problem_distance(spec, q, o), w["speedup"]) for o, w in tuned.items()
                        if problem_distance(spec, q, o) is not None), default=None)
            got = _dispatch._nearest(spec, q, ("cpu", "gemm"), tuned)
            if best is None or best[0] > 3.0:
                assert got is None
            else:
                assert problem_distance(spec, q, spec.parse_problem(got["problem"])) == pytest.approx(best[0])
    finally:
        ops_adv.load_table("")


def test_benchmark_profiler_and_check_nan(forced):
    a, b = torch.randn(24, 48), torch.randn(48, 20)
    rows = ops_adv.benchmark("gemm", a, b)
    by = {r["impl"]: r for r in rows}
    assert by["torch_matmul"]["status"] == "ok" and by["torch_matmul"]["speedup"] == 1.0
    assert by["triton"]["status"].startswith("refused")  # a CUDA-only candidate says why
    chosen = [r for r in rows if r["chosen"]]
    assert len(chosen) == 1 and chosen[0]["impl"] == "cpu_blocked" and chosen[0]["status"] == "ok"
    assert "cpu_blocked" in str(rows)

    from ops_adv.profiler import ProfileContext

    m = Block().eval()
    with torch.no_grad(), ProfileContext() as prof:
        m(*_inputs(2, 16))
    ops = [c["op"] for c in prof.calls]
    assert ops == ["layer_norm", "gemm", "rms_norm", "attention", "gemm", "softmax", "conv2d"]
    gemm_calls = [c for c in prof.calls if c["op"] == "gemm"]
    assert all(c["impl"] == "cpu_blocked" and c["source"] == "nearest" and c["ms"] > 0 and c["flops"] > 0 for c in gemm_calls)
    assert "cpu_blocked" in str(prof)

    class Bad(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ok = torch.nn.Linear(8, 8)
            self.bad = torch.nn.LayerNorm(8, eps=0.0)  # a constant row: 0 * rsqrt(0) = NaN

        def forward(self, x):
            return self.bad(self.ok(x))

    bad = ops_adv.convert_model(Bad())
    assert ops_adv.debug.check_nan(bad, torch.randn(4, 8)) is None
    with torch.no_grad():
        bad.ok.weight.zero_()
        bad.ok.bias.fill_(1.0)
    found = ops_adv.debug.check_nan(bad, torch.randn(4, 8))
    assert found["module"] == "bad" and found["module_type"] == "LayerNorm" and found["op"] == "layer_norm"


def test_a_token_stream_maps_to_few_problems(tmp_path):
    from kernel_space._registry import bucket_dim

    assert [bucket_dim(v) for v in (1, 16, 17, 100, 1000, 1025, 4097)] == [1, 16, 20, 112, 1024, 1280, 5120]
    assert len({bucket_dim(v) for v in range(1, 131073)}) == 68
    from ops_adv import _dispatch

    ops_adv.load_table("")
    _dispatch._misses.clear()  # earlier tests' misses would outrank these
    with torch.no_grad(), ops_adv.record() as rec:
        for skv in range(1, 300):  # one decode step per length of the KV cache
            q = torch.randn(1, 2, 1, 16)
            kv = torch.randn(1, 2, skv, 16)
            ops_adv.attention(q, kv, kv)
    problems = [p for op, p in rec.problems() if op == "attention"]
    assert len(problems) == len({bucket_dim(v) for v in range(1, 300)}) == 33
    big = torch.randn(300, 64)
    for _ in range(3):
        ops_adv.gemm(big, big.t())
    n = ops_adv.write_misses(str(tmp_path / "misses.json"), top=2)
    data = json.loads((tmp_path / "misses.json").read_text())
    assert n == 2 and data["gemm"][0]["M"] == 320  # the costliest first, bucketed


def test_grouped_attention_with_few_queries_runs_the_decode_op():
    """SDPA's enable_gqa semantics (query head h reads K/V head h // (Hq/Hkv)), through decode_attention."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 8, 3, 16, generator=g)
    k, v = torch.randn(2, 2, 37, 16, generator=g), torch.randn(2, 2, 37, 16, generator=g)
    with ProfileContext() as prof:
        got = ops_adv.attention(q, k, v, enable_gqa=True)
    torch.testing.assert_close(got, F.scaled_dot_product_attention(q, k, v, enable_gqa=True), atol=1e-5, rtol=1e-5)
    assert [c["op"] for c in prof.calls] == ["decode_attention"]
    # a causal or long-query grouped call keeps SDPA's own semantics (top-left causal)
    for kw, sq in (({"is_causal": True}, 3), ({}, 40)):
        qq = torch.randn(2, 8, sq, 16, generator=g)
        with ProfileContext() as prof:
            got = ops_adv.attention(qq, k, v, enable_gqa=True, **kw)
        torch.testing.assert_close(got, F.scaled_dot_product_attention(qq, k, v, enable_gqa=True, **kw))
        assert prof.calls == []


def test_autocast_gives_torchs_dtypes():
    """Under autocast every op is torch's own function, so the output dtypes are autocast's."""
    g = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(6, 16, generator=g), torch.randn(8, 16, generator=g), torch.randn(8, generator=g)
    img, k = torch.randn(1, 3, 8, 8, generator=g), torch.randn(4, 3, 3, 3, generator=g)
    q = torch.randn(1, 2, 5, 8, generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        cases = [
            (ops_adv.linear(x, w, b), F.linear(x, w, b)),
            (ops_adv.gemm(x, w.t()), torch.matmul(x, w.t())),
            (ops_adv.conv2d(img, k, padding=1), F.conv2d(img, k, padding=1)),
            (ops_adv.attention(q, q, q), F.scaled_dot_product_attention(q, q, q)),
            (ops_adv.layer_norm(x, torch.ones(16), None), F.layer_norm(x, (16,), torch.ones(16))),
            (ops_adv.softmax(x), torch.softmax(x, -1)),
        ]
    for got, want in cases:
        assert got.dtype == want.dtype
        torch.testing.assert_close(got, want)


def test_autograd_runs_torchs_own_graph_unless_a_tuned_kernel_applies(forced):
    """With no tuned or near winner the call is torch's function (its graph, its backward, no custom operator);
    with one the custom operator runs the kernel and its backward gives torch's gradients."""
    g = torch.Generator().manual_seed(0)
    x, img, k = torch.randn(6, 16, generator=g), torch.randn(1, 3, 8, 8, generator=g), torch.randn(4, 3, 3, 3, generator=g)
    w = torch.ones(16)
    for fn, ref, args in (
        (ops_adv.conv2d, F.conv2d, (img, k)),
        (ops_adv.softmax, torch.softmax, (x, -1)),
        (lambda t, ww: ops_adv.layer_norm(t, ww), lambda t, ww: F.layer_norm(t, (16,), ww), (x, w)),
        (lambda t, ww: ops_adv.rms_norm(t, ww), lambda t, ww: F.rms_norm(t, (16,), ww), (x, w)),
    ):
        ins = [a.clone().requires_grad_() if isinstance(a, torch.Tensor) else a for a in args]
        out = fn(*ins)
        assert type(out.grad_fn).__name__ == type(ref(*ins).grad_fn).__name__  # torch's own node
    a, b = torch.randn(20, 40, requires_grad=True), torch.randn(40, 24, requires_grad=True)
    out = ops_adv.gemm(a, b)  # the forced table's cpu_blocked winner applies: the custom operator
    assert type(out.grad_fn).__name__ != type(torch.matmul(a, b).grad_fn).__name__
    out.sum().backward()
    ga, gb = a.grad.clone(), b.grad.clone()
    a.grad = b.grad = None
    torch.matmul(a, b).sum().backward()
    torch.testing.assert_close((ga, gb), (a.grad, b.grad))
