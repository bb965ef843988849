"""moe's Triton kernels and their launch (needs triton; `triton.py` imports this on the first call).

Token slots (t * top_k + k) come sorted by expert and padded per expert to BLOCK_SIZE_M (`routing.align`), so
each row block of a launch belongs to one expert. Two grouped gemms over those blocks:
- `_w13_kernel`: x[t] @ w13[e].T as two accumulators (gate rows, up rows), silu(gate) * up in the epilogue,
  stored per slot: [T * top_k, N];
- `_w2_kernel`: that @ w2[e].T times the slot's routing weight, stored per slot: [T * top_k, K];
then a sum over top_k. Both take one configuration (as vLLM's fused_moe does).
"""
# No `from __future__ import annotations`: Triton reads the tl.constexpr annotations.
import torch
import triton
import triton.language as tl

from .problem import align, padded_slots, route


@triton.jit
def _tile(pid, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """(row block, column tile) of program `pid`: GROUP_M row blocks walked column by column share B in L2."""
    per_group = GROUP_M * num_pid_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(num_pid_m - first_m, GROUP_M)
    return first_m + (pid % per_group) % group_rows, (pid % per_group) // group_rows


@triton.jit
def _w13_kernel(
    x_ptr, w_ptr, out_ptr, sorted_ptr, expert_ptr, total_ptr,
    N, K, slots, padded,
    stride_xm, stride_xk, stride_we, stride_wn, stride_wk, stride_om, stride_on,
    TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, EVEN_K: tl.constexpr, PRECISION: tl.constexpr,
):
    pid_m, pid_n = _tile(tl.program_id(0), tl.cdiv(padded, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
    if pid_m * BLOCK_M >= tl.load(total_ptr):
        return
    slot = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = slot < slots
    tok = tl.where(valid, slot // TOP_K, 0)  # padding rows read token 0 and are never stored
    e = tl.load(expert_ptr + pid_m).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rn = offs_n % N  # columns past N wrap inside the weight; only the store is masked
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = x_ptr + tok[:, None] * stride_xm + offs_k[None, :] * stride_xk
    g_ptrs = w_ptr + e * stride_we + rn[None, :] * stride_wn + offs_k[:, None] * stride_wk
    u_ptrs = g_ptrs + N * stride_wn
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            a = tl.load(a_ptrs)
            g = tl.load(g_ptrs)
            u = tl.load(u_ptrs)
        else:
            left = K - k * BLOCK_K
            a = tl.load(a_ptrs, mask=offs_k[None, :] < left, other=0.0)
            g = tl.load(g_ptrs, mask=offs_k[:, None] < left, other=0.0)
            u = tl.load(u_ptrs, mask=offs_k[:, None] < left, other=0.0)
        acc_g = tl.dot(a, g, acc_g, input_precision=PRECISION)
        acc_u = tl.dot(a, u, acc_u, input_precision=PRECISION)
        a_ptrs += BLOCK_K * stride_xk
        g_ptrs += BLOCK_K * stride_wk
        u_ptrs += BLOCK_K * stride_wk
    y = acc_g * tl.sigmoid(acc_g) * acc_u
    out_ptrs = out_ptr + slot[:, None] * stride_om + offs_n[None, :] * stride_on
    tl.store(out_ptrs, y.to(out_ptr.dtype.element_ty), mask=valid[:, None] & (offs_n[None, :] < N))


@triton.jit
def _w2_kernel(
    a_ptr, w_ptr, out_ptr, weight_ptr, sorted_ptr, expert_ptr, total_ptr,
    N, K, slots, padded,
    stride_am, stride_an, stride_we, stride_wk, stride_wn, stride_om, stride_ok,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, EVEN_K: tl.constexpr, PRECISION: tl.constexpr,
):
    # out[slot, :K] = a[slot, :N] @ w2[e].T * weight[slot]: the output's columns run over K, the reduction over N
    pid_m, pid_n = _tile(tl.program_id(0), tl.cdiv(padded, BLOCK_M), tl.cdiv(K, BLOCK_N), GROUP_M)
    if pid_m * BLOCK_M >= tl.load(total_ptr):
        return
    slot = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = slot < slots
    row = tl.where(valid, slot, 0)
    e = tl.load(expert_ptr + pid_m).to(tl.int64)
    offs_c = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rc = offs_c % K
    offs_r = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + row[:, None] * stride_am + offs_r[None, :] * stride_an
    b_ptrs = w_ptr + e * stride_we + rc[None, :] * stride_wk + offs_r[:, None] * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for r in range(0, tl.cdiv(N, BLOCK_K)):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            left = N - r * BLOCK_K
            a = tl.load(a_ptrs, mask=offs_r[None, :] < left, other=0.0)
            b = tl.load(b_ptrs, mask=offs_r[:, None] < left, other=0.0)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
        a_ptrs += BLOCK_K * stride_an
        b_ptrs += BLOCK_K * stride_wn
    acc = acc * tl.load(weight_ptr + row, mask=valid, other=0.0)[:, None]
    out_ptrs = out_ptr + slot[:, None] * stride_om + offs_c[None, :] * stride_ok
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=valid[:, None] & (offs_c[None, :] < K))


@triton.jit
def _route_tokens(logits_ptr, weight_ptr, ids_ptr, T, E, stride_t, stride_e,
                  TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr, E_P2: tl.constexpr, ROWS: tl.constexpr):
    """`problem.route` for every token: softmax in fp32, TOP_K times the largest (the lowest expert of a tie),
    renormalised; weights and expert ids stored per slot (t * TOP_K + k)."""
    cols = tl.arange(0, E_P2)
    for t0 in range(0, T, ROWS):
        rows = t0 + tl.arange(0, ROWS)
        live = rows < T
        src = tl.minimum(rows, T - 1)  # rows past T read the last token and are never stored
        x = tl.load(logits_ptr + src[:, None] * stride_t + cols[None, :] * stride_e, mask=cols[None, :] < E,
                    other=float("-inf")).to(tl.float32)
        p = tl.exp(x - tl.max(x, axis=1)[:, None])
        p = p / tl.sum(p, axis=1)[:, None]
        denom = tl.zeros([ROWS], dtype=tl.float32) + 1.0
        if RENORMALIZE:
            q = p
            denom = tl.zeros([ROWS], dtype=tl.float32)
            for _k in tl.static_range(TOP_K):
                best = tl.max(q, axis=1)
                denom += best
                pick = tl.min(tl.where(q == best[:, None], cols[None, :], E_P2), axis=1)
                q = tl.where(cols[None, :] == pick[:, None], -1.0, q)
        q = p
        for k in tl.static_range(TOP_K):
            best = tl.max(q, axis=1)
            pick = tl.min(tl.where(q == best[:, None], cols[None, :], E_P2), axis=1)
            tl.store(weight_ptr + rows * TOP_K + k, best / denom, mask=live)
            tl.store(ids_ptr + rows * TOP_K + k, pick, mask=live)
            q = tl.where(cols[None, :] == pick[:, None], -1.0, q)


@triton.jit
def _align_kernel(ids_ptr, sorted_ptr, expert_ptr, total_ptr, slots, padded, blocks, E,
                  logits_ptr, weight_ptr, T, stride_t, stride_e,
                  E_P2: tl.constexpr, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr,
                  ROUTE: tl.constexpr, TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr, ROWS: tl.constexpr):
    """`problem.align` in one program (after `problem.route` with ROUTE): counts per expert, padded offsets, each
    block's expert, then each slot's place (its expert's start + the earlier slots of that expert)."""
    if ROUTE:
        _route_tokens(logits_ptr, weight_ptr, ids_ptr, T, E, stride_t, stride_e, TOP_K, RENORMALIZE, E_P2, ROWS)
        tl.debug_barrier()  # the ids are written before they are read
    experts = tl.arange(0, E_P2)
    lane = tl.arange(0, CHUNK)
    counts = tl.zeros([E_P2], dtype=tl.int32)
    for s0 in range(0, slots, CHUNK):
        ids = tl.load(ids_ptr + s0 + lane, mask=s0 + lane < slots, other=E_P2)
        counts += tl.sum((ids[:, None] == experts[None, :]).to(tl.int32), axis=0)
    rounded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    end = tl.cumsum(rounded, axis=0)
    tl.store(total_ptr, tl.sum(rounded, axis=0))
    for b0 in range(0, blocks, CHUNK):
        b = b0 + lane
        ex = tl.sum((end[None, :] <= (b * BLOCK_M)[:, None]).to(tl.int32), axis=1)
        tl.store(expert_ptr + b, tl.minimum(ex, E - 1), mask=b < blocks)
    for p0 in range(0, padded, CHUNK):
        tl.store(sorted_ptr + p0 + lane, tl.zeros([CHUNK], dtype=tl.int32) + slots, mask=p0 + lane < padded)
    tl.debug_barrier()  # the padding is written before any slot lands
    start = end - rounded
    for s0 in range(0, slots, CHUNK):
        ids = tl.load(ids_ptr + s0 + lane, mask=s0 + lane < slots, other=E_P2)
        hit = ids[:, None] == experts[None, :]
        base = tl.sum(tl.where(hit, start[None, :], 0), axis=1)
        earlier = tl.sum(((ids[:, None] == ids[None, :]) & (lane[None, :] < lane[:, None])).to(tl.int32), axis=1)
        tl.store(sorted_ptr + base + earlier, s0 + lane, mask=s0 + lane < slots)
        start += tl.sum(hit.to(tl.int32), axis=0)


# Up to this many slots (tokens x top_k) one program routes and aligns them (one launch instead of about 25 torch
# ops); beyond it, torch's parallel softmax, top-k and sort win over one program's loop.
ONE_PROGRAM_SLOTS = 1024


def _one_program(ids, slots, experts, block_m, logits=None, weights=None, top_k=1, renormalize=True):
    padded = padded_slots(slots, experts, block_m)
    blocks = triton.cdiv(padded, block_m)
    dev = ids.device
    sorted_slots = torch.empty((padded,), dtype=torch.int32, device=dev)
    block_expert = torch.empty((blocks,), dtype=torch.int32, device=dev)
    total = torch.empty((1,), dtype=torch.int32, device=dev)
    e_p2 = triton.next_power_of_2(max(experts, 2))
    route = logits is not None
    _align_kernel[(1,)](ids, sorted_slots, block_expert, total, slots, padded, blocks, experts,
                        logits if route else ids, weights if route else ids, logits.shape[0] if route else 0,
                        logits.stride(0) if route else 0, logits.stride(1) if route else 0,
                        E_P2=e_p2, BLOCK_M=block_m, CHUNK=128, ROUTE=route, TOP_K=top_k, RENORMALIZE=renormalize,
                        ROWS=max(1, 4096 // e_p2), num_warps=8)
    return sorted_slots, block_expert, total


def align_one_program(ids: torch.Tensor, experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`problem.align` as one Triton launch (same results)."""
    flat = ids.reshape(-1)
    return _one_program(flat, flat.numel(), experts, block_m)


def route_align_one_program(router_logits: torch.Tensor, top_k: int, renormalize: bool, experts: int,
                            block_m: int) -> tuple[torch.Tensor, torch.Tensor, tuple]:
    """`problem.route` then `problem.align` as one Triton launch: (weights fp32, ids int32, aligned)."""
    T = router_logits.shape[0]
    weights = torch.empty((T, top_k), dtype=torch.float32, device=router_logits.device)
    ids = torch.empty((T, top_k), dtype=torch.int32, device=router_logits.device)
    aligned = _one_program(ids, T * top_k, experts, block_m, router_logits, weights, top_k, renormalize)
    return weights, ids, aligned


def fused_moe(x: torch.Tensor, router_logits: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, top_k: int,
              renormalize: bool, BLOCK_SIZE_M: int, BLOCK_SIZE_N: int, BLOCK_SIZE_K: int, GROUP_SIZE_M: int,
              num_warps: int, num_stages: int) -> torch.Tensor:
    T, K = x.shape
    E, N = w13.shape[0], w2.shape[-1]
    if T * top_k <= ONE_PROGRAM_SLOTS:
        weights, _ids, (sorted_slots, block_expert, total) = route_align_one_program(router_logits, top_k, renormalize,
                                                                                     E, BLOCK_SIZE_M)
    else:
        weights, ids = route(router_logits, top_k, renormalize)
        sorted_slots, block_expert, total = align(ids, E, BLOCK_SIZE_M)
    slots, padded = T * top_k, sorted_slots.numel()
    blocks_m = triton.cdiv(padded, BLOCK_SIZE_M)
    # fp32: two chained tf32 gemms measured 2.4e-3 relative error on an H100, past fp32's 2e-3 tolerance
    launch = dict(BLOCK_M=BLOCK_SIZE_M, BLOCK_N=BLOCK_SIZE_N, BLOCK_K=BLOCK_SIZE_K, GROUP_M=GROUP_SIZE_M,
                  PRECISION="ieee" if x.dtype == torch.float32 else "tf32", num_warps=num_warps, num_stages=num_stages)
    inter = torch.empty((slots, N), dtype=x.dtype, device=x.device)
    _w13_kernel[(blocks_m * triton.cdiv(N, BLOCK_SIZE_N),)](
        x, w13, inter, sorted_slots, block_expert, total, N, K, slots, padded,
        x.stride(0), x.stride(1), w13.stride(0), w13.stride(1), w13.stride(2), inter.stride(0), inter.stride(1),
        TOP_K=top_k, EVEN_K=K % BLOCK_SIZE_K == 0, **launch)
    out = torch.empty((slots, K), dtype=x.dtype, device=x.device)
    _w2_kernel[(blocks_m * triton.cdiv(K, BLOCK_SIZE_N),)](
        inter, w2, out, weights, sorted_slots, block_expert, total, N, K, slots, padded,
        inter.stride(0), inter.stride(1), w2.stride(0), w2.stride(1), w2.stride(2), out.stride(0), out.stride(1),
        EVEN_K=N % BLOCK_SIZE_K == 0, **launch)
    return out.view(T, top_k, K).sum(dim=1) if top_k > 1 else out
