"""The measuring the tuner's workers and the kernel benchmark share: gate, classification, timing options."""
from __future__ import annotations

import json

import pytest
import torch

import kernel_space
from conftest import ROOT, run_cli
from kernel_space import get_op
from workers.measure import Bench, check_graph, check_output, classify

PROBLEM = get_op("gemm").problem(48, 40, 32)
_registered: list[str] = []


def register(name: str, **kw):
    """Register a test gemm implementation for the CPU; removed after each test."""
    _registered.append(name)
    return kernel_space.register_impl("gemm", name=name, **kw)


@pytest.fixture(autouse=True)
def _unregister():
    yield
    while _registered:
        kernel_space.unregister_impl("gemm", _registered.pop())


def trial(impl: str, params: dict | None = None) -> dict:
    return {"op": "gemm", "problem": PROBLEM._asdict(), "impl": impl, "params": params or {}}


# ---- correctness gate: output left unwritten ----------------------------------------------


def test_part_of_out_left_unwritten_is_a_wrong_result():
    @register("half_out")
    def half_out(a, b, *, out=None):
        if out is None:  # right when it allocates, as when reused memory still holds an earlier result
            return torch.matmul(a, b)
        m = a.shape[0] // 2
        torch.matmul(a[:m], b, out=out[:m])
        return out

    res = Bench("cpu").run(trial("half_out"))
    assert res["status"] == "wrong_result" and res["poisoned_out"] is True
    assert res["rel_error"] == float("inf") and "relative error inf" in res["error"]
    assert "median_ms" not in res  # a wrong candidate is never timed


def test_fully_written_out_passes_and_is_timed():
    @register("full_out")
    def full_out(a, b, *, out=None):
        return torch.matmul(a, b, out=out)

    res = Bench("cpu").run(trial("full_out"))
    assert res["status"] == "ok" and res["poisoned_out"] is True and res["rel_error"] < 1e-5
    assert res["median_ms"] > 0 and res["reps"] >= 1 and res["first_call_s"] >= 0


def test_refused_out_is_noted_and_the_plain_call_checked():
    @register("no_out")
    def no_out(a, b, *, out=None):
        if out is not None:
            raise ValueError("out must be column-major")
        return torch.matmul(a, b)

    res = Bench("cpu").run(trial("no_out"))
    assert res["status"] == "ok" and res["poisoned_out"] is False
    assert "out= rejected" in res["note"] and "column-major" in res["note"]


def test_wrong_returned_tensor_fails_even_when_out_is_right():
    @register("bad_return")
    def bad_return(a, b, *, out=None):
        if out is not None:
            torch.matmul(a, b, out=out)
        return torch.matmul(a, b) * 2

    res = Bench("cpu").run(trial("bad_return"))
    assert res["status"] == "wrong_result" and 0.9 < res["rel_error"] < 1.1


def test_check_output_takes_the_worst_of_out_and_the_plain_call():
    a, b = torch.randn(8, 4), torch.randn(4, 6)
    ref = a.double() @ b.double()

    def rows_skipped(a, b, out=None):
        if out is None:
            return a @ b
        out[:-1] = a[:-1] @ b  # the last row is never written
        return out

    plain = check_output(rows_skipped, (a, b), {}, ref, device="cpu")
    poisoned = check_output(rows_skipped, (a, b), {}, ref, device="cpu", out=True)
    assert plain["rel_error"] < 1e-5 and plain["poisoned_out"] is False
    assert poisoned["rel_error"] == float("inf") and poisoned["poisoned_out"] is True


def test_check_on_fresh_inputs_catches_a_stale_result():
    stale: dict = {}

    @register("stale")
    def stale_result(a, b):
        return stale.setdefault(tuple(a.shape), torch.matmul(a, b))  # the first inputs' result, always

    bench = Bench("cpu")
    assert bench.run(trial("stale"))["status"] == "ok"
    assert bench.check(trial("stale"))["status"] == "ok"
    fresh = bench.check(trial("stale"), seed=1)
    assert fresh["status"] == "wrong_result" and fresh["rel_error"] > 0.5


def test_check_reports_failures_as_statuses():
    @register("raises", space={"n": (1, 2)}, check=lambda p, params: "n=2 is refused" if params["n"] == 2 else None)
    def raises(a, b, *, n=1):
        raise RuntimeError("boom")

    bench = Bench("cpu")
    failed = bench.check(trial("raises", {"n": 1}))
    assert failed["status"] == "runtime_error" and "boom" in failed["error"]
    assert bench.check(trial("raises", {"n": 2})) == {"status": "pruned", "error": "n=2 is refused", "context_lost": False}
    res = bench.check(trial("torch_matmul"), seed=7)
    assert res["status"] == "ok" and res["rel_error"] < 1e-5


# ---- graph-safe winners only: state kept between calls -------------------------------------


def test_a_kernel_that_changes_on_its_second_call_is_a_wrong_result():
    calls = {"n": 0}

    @register("stateful")
    def stateful(a, b):
        calls["n"] += 1  # as a workspace or counter left dirty by the first call would
        return torch.matmul(a, b) * calls["n"]

    res = Bench("cpu").run(trial("stateful"))
    assert res["status"] == "wrong_result" and 0.9 < res["rel_error"] < 1.1
    assert "median_ms" not in res and calls["n"] == 2  # never timed, so never stored
    assert Bench("cpu").check(trial("stateful"))["status"] == "wrong_result"


def test_each_call_of_the_gate_gets_fresh_output():
    kept: list = []

    @register("keeps_out")
    def keeps_out(a, b, *, out=None):
        res = torch.matmul(a, b, out=out)
        kept.append(res)
        return res

    res = Bench("cpu").run(trial("keeps_out"))
    assert res["status"] == "ok" and len(kept) >= 3  # out=, then two plain calls
    assert len({t.data_ptr() for t in kept[:3]}) == 3


def test_graph_safe_defaults():
    assert kernel_space.get_impl("gemm", "triton").graph_safe  # ours: declared capturable
    assert not kernel_space.get_impl("gemm", "torch_matmul").graph_safe  # vendor: checked, but may not capture
    assert all(i.graph_safe == (not i.vendor) for op in kernel_space.ops() for i in kernel_space.impls(op))


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@CUDA
def test_graph_replay_catches_state_kept_between_calls():
    """Right on every eager call, wrong on the second replay: its buffer is reset on the host, which a graph skips."""
    state: dict = {}

    @register("host_reset", backends=("cuda",))
    def host_reset(a, b):
        buf = state.setdefault("acc", torch.zeros(a.shape[0], b.shape[1], device=a.device, dtype=torch.float32))
        buf.add_(torch.matmul(a.float(), b.float()))
        out = buf.to(a.dtype, copy=True)
        state["acc"] = torch.zeros_like(buf)  # host-side reset: the captured kernels keep the old buffer
        return out

    bench = Bench("cuda")
    res = bench.run(trial("host_reset"))
    assert res["status"] == "wrong_result" and "CUDA graph" in res["error"], res
    assert 0.9 < res["graph_rel_error"] < 1.1 and res["rel_error"] < 1e-3
    assert Bench("cuda", graphs=False).run(trial("host_reset"))["status"] == "ok"  # eager calls alone miss it


_SYNCS = """
import json, sys, torch, kernel_space
from kernel_space import get_op
from workers.measure import Bench

def syncs(a, b):
    torch.cuda.synchronize()  # not allowed while a stream is being captured
    return torch.matmul(a, b)

vendor = sys.argv[1] == "vendor"
kernel_space.register_impl("gemm", name="syncs", backends=("cuda",), vendor=vendor)(syncs)
p = get_op("gemm").problem(48, 40, 32)
print(json.dumps(Bench("cuda").run({"op": "gemm", "problem": p._asdict(), "impl": "syncs", "params": {}})))
"""


@pytest.mark.gpu
@CUDA
@pytest.mark.parametrize("kind", ["graph_safe", "vendor"])
def test_capture_failure_fails_only_what_is_declared_graph_safe(kind):
    """Each in a process of its own, as a worker is: after a failed capture its process cannot run CUDA
    work (torch 2.11 on the H200), so the result says context_lost and the tuner replaces the worker."""
    r = run_cli("-c", _SYNCS, kind, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    if kind == "graph_safe":  # checked before timing: never timed, never a winner
        assert res["status"] == "runtime_error" and "CUDA graph capture failed" in res["error"], res
    else:  # vendor kernels are timed first and only noted
        assert res["status"] == "ok" and res["graph_error"] and res["median_ms"] > 0, res
    assert res["context_lost"], res


@pytest.mark.gpu
@CUDA
@pytest.mark.parametrize("name", [f"{op}/{i.name}" for op in kernel_space.ops() for i in kernel_space.impls(op)
                                  if "cuda" in i.backends and i.graph_safe])
def test_graph_safe_impls_replay_correctly(name):
    """Each implementation declared graph-safe, default parameters, on the first of this GPU's default problems it takes."""
    from kernel_space._device import local_device_class

    op, impl_name = name.split("/")
    impl, spec = kernel_space.get_impl(op, impl_name), get_op(op)
    problems = [p for p in spec.default_problems(local_device_class()) if impl.why_not(p, backend="cuda") is None]
    if not problems:
        pytest.skip(f"{name} takes none of the default problems with its default parameters")
    args, attrs = spec.make_inputs(problems[0], "cuda", seed=0)
    res = check_graph(impl.bind(impl.default_params()), args, attrs, spec.reference(*args, **attrs), device="cuda")
    assert "graph_error" not in res, res
    assert res["graph_rel_error"] <= spec.tolerance(problems[0].dtype), res


# ---- classification ---------------------------------------------------------------------


def test_out_of_memory_is_out_of_resources():
    assert classify(torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB")) == ("out_of_resources", False)
    assert classify(RuntimeError("CUDA error: out of memory")) == ("out_of_resources", False)


def test_compile_errors_by_name_and_text():
    assert classify(type("CompileTimeAssertionFailure", (Exception,), {})("x")) == ("compile_error", False)
    assert classify(RuntimeError("ptxas fatal: Unresolved extern function")) == ("compile_error", False)
    assert classify(RuntimeError("wrapped: CompilationError at 3:4")) == ("compile_error", False)


def test_triton_exception_on_the_first_call_is_a_compile_error():
    errors = pytest.importorskip("triton.runtime.errors")
    exc = errors.InterpreterError("unsupported operand")
    assert classify(exc, first_call=True) == ("compile_error", False)
    assert classify(exc) == ("runtime_error", False)


def test_first_call_reaches_classification_through_bench():
    errors = pytest.importorskip("triton.runtime.errors")
    calls = {"n": 0}

    @register("triton_first")
    def triton_first(a, b):
        raise errors.InterpreterError("cannot lower tl.dot here")

    @register("triton_later")
    def triton_later(a, b):
        calls["n"] += 1
        if calls["n"] > 1:
            raise errors.InterpreterError("fails once warm")
        return torch.matmul(a, b)

    bench = Bench("cpu")
    first = bench.run(trial("triton_first"))
    later = bench.run(trial("triton_later"))
    assert first["status"] == "compile_error" and "cannot lower" in first["error"]
    assert later["status"] == "runtime_error" and "fails once warm" in later["error"]
    assert not first["context_lost"] and not later["context_lost"]


def test_torchs_hint_about_device_side_assertions_is_not_a_fault():
    """Every CUDA error torch raises ends with its TORCH_USE_CUDA_DSA hint; only a triggered assert is a fault. The
    hint read as one made check_graph raise a vendor's failed capture, and the vendor lost its timing (H100)."""
    hint = ("CUDA error: operation failed\nCUDA kernel errors might be asynchronously reported at some other API call"
            "\nCompile with `TORCH_USE_CUDA_DSA` to enable device-side assertions.\n")
    assert classify(RuntimeError(hint)) == ("runtime_error", False)
    assert classify(RuntimeError("CUDA error: device-side assert triggered\n" + hint.split("\n", 1)[1])) == ("runtime_error", True)


def test_an_invalidated_capture_is_named_and_replaces_the_worker():
    """The H200's words (torch 2.11) for a capture a host sync invalidated, read by whichever CUDA call came next:
    wherever such an error reaches the gate, the record says it was a capture failure and the worker is replaced."""
    text = "CUDA error: operation failed due to a previous error during capture"
    assert classify(RuntimeError(text), "cpu") == ("runtime_error", True)
    assert classify(RuntimeError("CUDA error: operation not permitted when stream is capturing")) == ("runtime_error", True)

    @register("reads_capture_error")
    def reads_capture_error(a, b):
        raise RuntimeError(text)

    res = Bench("cpu").run(trial("reads_capture_error"))
    assert res["status"] == "runtime_error" and res["context_lost"] is True
    assert res["error"].startswith("CUDA graph capture failed: ") and "during capture" in res["error"], res


def test_context_is_never_lost_off_cuda():
    assert classify(ValueError("x"), "cpu") == ("runtime_error", False)
    assert classify(RuntimeError("CUDA error: an illegal memory access was encountered"), "cpu") == ("runtime_error", True)


# ---- timing options ---------------------------------------------------------------------


def test_warmup_and_reps_reach_the_timer():
    calls = {"n": 0}

    @register("counted")
    def counted(a, b):
        calls["n"] += 1
        return torch.matmul(a, b)

    res = Bench("cpu").run(trial("counted"), reps=3, warmup=1, budget_s=60)
    assert res["status"] == "ok" and res["reps"] == 3
    assert calls["n"] == 2 + 1 + 3  # the gate's two calls, one warm-up, three timed


def test_confirm_takes_rounds_and_reps():
    bench = Bench("cpu")
    res = bench.confirm("gemm", PROBLEM._asdict(), [{"key": "v", "impl": "torch_matmul"}], rounds=2, reps=3, warmup=0, budget_s=60)
    assert res["v"]["reps"] == 6 and res["v"]["median_ms"] > 0


# ---- the kernel benchmark measures through the same Bench ---------------------------------


def test_kernel_benchmark_smoke(tmp_path):
    out = run_cli(str(ROOT / "benchmarks" / "kernels.py"), "--device", "cpu", "--quick", "--ops", "gemm",
                  "--out", str(tmp_path), timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    (jp,) = tmp_path.glob("*-kernels.json")
    (mp,) = tmp_path.glob("*-kernels.md")
    report = json.loads(jp.read_text())
    (row,) = report["problems"]
    assert row["op"] == "gemm" and row["vendor"]["impl"] == "torch_matmul"
    ok = [c for c in row["candidates"] if c["status"] == "ok"]
    assert ok and all(c["ms"] > 0 and c["reps"] >= 1 and "first_call_s" in c for c in ok)
    checked = [c for c in ok if "check" in c]
    assert checked and all(c["check"]["ok"] and c["check"]["rel_err"] < c["check"]["tol"] for c in checked)
    assert "| op | problem |" in mp.read_text()
