"""Kernel 5 of the backward, ``chunk_bwd_gate_kernel`` (token-parallel and split over the
key columns), and its launch: the reverse in-chunk cumsum of dG, the gate-activation
backward and per-chunk shares of dA_log and d dt_bias (the scalar gate's dg also as
column-block shares); the first column block's programs also complete dβ (the WY
kernel's part plus the pairs kernel's shares, then the beta sigmoid's backward): the
first kernel after all of them are written. Apart from the pairs kernel because its
reverse cumsum runs across the row blocks.
"""

import torch
import triton
import triton.language as tl

from kda_ops.kernels.chunk.backward.layout import Layout, key_columns
from kda_ops.kernels.chunk.backward.rows import load_beta_rows
from kda_ops.kernels.chunk.device import CHUNK, locate_chunk
from kda_ops.kernels.gate import gate_activation
from kda_ops.kernels.sizes import cdiv, next_power_of_2


@triton.jit
def _gate_input(
    g,
    dt_bias,
    tokens,
    rows_in,
    i_hv,
    HV: tl.constexpr,
    K: tl.constexpr,
    offs_k,
    BK: tl.constexpr,
    SCALAR_GATE: tl.constexpr,
    HAS_DT_BIAS: tl.constexpr,
):
    """``g (+ dt_bias)`` rows ``[R, BK]`` fp32; a scalar (GDN) gate is broadcast over the
    K channels."""
    mask_k = offs_k < K
    if SCALAR_GATE:
        x = tl.load(g + tokens * HV + i_hv, mask=rows_in, other=0.0).to(tl.float32)
        if HAS_DT_BIAS:
            x += tl.load(dt_bias + i_hv).to(tl.float32)
        x = x[:, None] + tl.zeros([1, BK], dtype=tl.float32)
    else:
        x = tl.load(
            g + (tokens * HV + i_hv)[:, None] * K + offs_k[None, :],
            mask=rows_in[:, None] & mask_k[None, :],
            other=0.0,
        ).to(tl.float32)
        if HAS_DT_BIAS:
            x += tl.load(dt_bias + i_hv * K + offs_k, mask=mask_k, other=0.0)[None, :]
    return x


@triton.jit
def _gate_activation_backward(dg, x, rate, lower_bound, USE_LOWER_BOUND: tl.constexpr):
    """(dx, the per-element term of dA_log) for the log-decay gradient dg."""
    if USE_LOWER_BOUND:  # g = lb σ(e^A x): ∂g/∂A_log = x ∂g/∂x
        s = tl.sigmoid(rate * x)
        dx = dg * lower_bound * s * (1.0 - s) * rate
        return dx, dx * x
    # g = -e^A softplus(x): ∂g/∂x = -e^A σ(x), ∂g/∂A_log = g
    dx = -dg * rate * tl.sigmoid(x)
    return dx, dg * gate_activation(x, rate, lower_bound, USE_LOWER_BOUND)


@triton.jit
def _column(x, sub, j):
    """Column j of a 2-D block, as a vector over its rows."""
    return tl.sum(tl.where(sub[None, :] == j, x, 0.0), axis=1)


@triton.jit
def _finish_dbeta(
    beta,
    dbeta_rows,
    dbeta_part,
    dbeta,
    tokens,
    rows_in,
    i_hv,
    HV: tl.constexpr,
    N_SHARES: tl.constexpr,
    USE_BETA_SIGMOID: tl.constexpr,
):
    """dβ of rows ``tokens`` (beta's dtype): kernel 3's part (``dbeta_rows``, fp32 ``[B, T,
    HV]``) plus the pairs kernel's shares (``dbeta_part``, fp32 ``[B, T, HV, N_SHARES]``),
    through the sigmoid's backward with ``USE_BETA_SIGMOID``."""
    row = tokens * HV + i_hv
    d = tl.load(dbeta_rows + row, mask=rows_in, other=0.0)
    for share in tl.static_range(N_SHARES):
        d += tl.load(dbeta_part + row * N_SHARES + share, mask=rows_in, other=0.0)
    if USE_BETA_SIGMOID:
        b = load_beta_rows(
            beta=beta,
            tokens=tokens,
            rows_in=rows_in,
            i_hv=i_hv,
            HV=HV,
            USE_BETA_SIGMOID=USE_BETA_SIGMOID,
        )
        d = d * b * (1.0 - b)
    tl.store(dbeta + row, d.to(dbeta.dtype.element_ty), mask=rows_in)


@triton.jit
def chunk_bwd_gate_kernel(
    g,
    A_log,
    dt_bias,
    beta,
    cu_seqlens,
    chunk_offsets,
    d_cum_rows,
    dbeta_rows,
    dbeta_part,
    lower_bound,
    length,
    n_seqs,
    dg,
    dA_log_part,
    ddt_part,
    dbeta,
    HV: tl.constexpr,
    K: tl.constexpr,
    BK: tl.constexpr,
    BN: tl.constexpr,
    CHUNK: tl.constexpr,
    N_SHARES: tl.constexpr,
    SCALAR_GATE: tl.constexpr,
    USE_GATE: tl.constexpr,
    HAS_DT_BIAS: tl.constexpr,
    USE_LOWER_BOUND: tl.constexpr,
    USE_BETA_SIGMOID: tl.constexpr,
    IS_VARLEN: tl.constexpr,
):
    """For chunk i_c, value head i_hv and the BK key columns of block i_k: from the
    complete dG (``d_cum_rows``, fp32 ``[B, T, HV, K]``; ``[B, T, HV]`` for the scalar
    gate, whose one program a chunk takes every column) the gate's backward: dg, the
    reverse cumsum of dG inside the chunk (G_i = Σ_{s <= i} g_s) through the gate
    activation (g's dtype and shape; fp32 ``[B, T, HV, 1]`` for the scalar gate), and at
    row ``i_c * HV + i_hv`` the shares of dA_log (``[.., N_K]``) and d dt_bias (``[.., K]``,
    or ``[.., 1]`` for the scalar gate). Block 0 also completes the chunk's dβ
    (``_finish_dbeta``)."""
    N_K: tl.constexpr = 1 if SCALAR_GATE else (K + BK - 1) // BK
    i_c, i_k, i_hv = tl.program_id(0) // N_K, tl.program_id(0) % N_K, tl.program_id(1)
    start, remaining = locate_chunk(
        i_c=i_c,
        cu_seqlens=cu_seqlens,
        chunk_offsets=chunk_offsets,
        n_seqs=n_seqs,
        length=length,
        BN=BN,
        IS_VARLEN=IS_VARLEN,
    )
    if remaining <= 0:
        return
    rows = tl.arange(0, CHUNK)
    tokens = start + rows
    rows_in = rows < remaining
    offs_k = i_k * BK + tl.arange(0, BK)
    mask_k = offs_k < K
    offsets = (tokens * HV + i_hv)[:, None] * K + offs_k[None, :]
    if SCALAR_GATE:  # one dG a row (the WY kernel summed its key columns)
        d_cum = tl.load(d_cum_rows + tokens * HV + i_hv, mask=rows_in, other=0.0)
        d_cum = d_cum[:, None] + tl.zeros([1, BK], dtype=tl.float32)
    else:
        d_cum = tl.load(d_cum_rows + offsets, mask=rows_in[:, None] & mask_k[None, :], other=0.0)
    if USE_GATE:
        x = _gate_input(
            g=g,
            dt_bias=dt_bias,
            tokens=tokens,
            rows_in=rows_in,
            i_hv=i_hv,
            HV=HV,
            K=K,
            offs_k=offs_k,
            BK=BK,
            SCALAR_GATE=SCALAR_GATE,
            HAS_DT_BIAS=HAS_DT_BIAS,
        )
        rate = tl.exp(tl.load(A_log + i_hv).to(tl.float32))
    # After the loads above: a load placed after a store (dβ's) would wait for it.
    if i_k == 0:
        _finish_dbeta(
            beta=beta,
            dbeta_rows=dbeta_rows,
            dbeta_part=dbeta_part,
            dbeta=dbeta,
            tokens=tokens,
            rows_in=rows_in,
            i_hv=i_hv,
            HV=HV,
            N_SHARES=N_SHARES,
            USE_BETA_SIGMOID=USE_BETA_SIGMOID,
        )
    d_raw = tl.cumsum(d_cum, axis=0, reverse=True)
    if SCALAR_GATE:  # every column holds the row's one gate: the first stands for it
        channel = tl.arange(0, BK) == 0
    else:
        channel = mask_k
    if USE_GATE:
        d_raw, d_rate = _gate_activation_backward(
            dg=d_raw, x=x, rate=rate, lower_bound=lower_bound, USE_LOWER_BOUND=USE_LOWER_BOUND
        )
        used = rows_in[:, None] & channel[None, :]
        chunk_id = (i_c * HV + i_hv).to(tl.int64)
        tl.store(dA_log_part + chunk_id * N_K + i_k, tl.sum(tl.where(used, d_rate, 0.0)))
        d_dt = tl.sum(tl.where(used, d_raw, 0.0), axis=0)
        if SCALAR_GATE:
            tl.store(ddt_part + chunk_id * N_K + i_k, tl.sum(d_dt, axis=0))
        else:
            tl.store(ddt_part + chunk_id * K + offs_k, d_dt, mask=mask_k)
    if SCALAR_GATE:
        tl.store(
            dg + (tokens * HV + i_hv) * N_K + i_k, _column(d_raw, tl.arange(0, BK), 0), mask=rows_in
        )
    else:
        tl.store(
            dg + offsets, d_raw.to(dg.dtype.element_ty), mask=rows_in[:, None] & mask_k[None, :]
        )


# The prepare flags chunk_bwd_gate_kernel takes.
GATE_FLAGS = (
    "SCALAR_GATE",
    "USE_GATE",
    "HAS_DT_BIAS",
    "USE_LOWER_BOUND",
    "USE_BETA_SIGMOID",
    "IS_VARLEN",
)
# Key columns a program and warps: 32 columns at 1 warp, the fastest of 16 to 128 columns
# at 1 to 4 warps (``launch_sweep.py --only gate``).
GATE_COLUMNS, GATE_WARPS = 32, 1


def gate_columns(block_k: int, device: torch.device) -> int:
    """Key columns a program of ``chunk_bwd_gate_kernel`` takes (``key_columns``)."""
    return key_columns(block_k, GATE_COLUMNS, device)


def gate_blocks(head_k: int, layout: Layout, device: torch.device) -> int:
    """Key-column blocks of ``chunk_bwd_gate_kernel``: of ``gate_columns`` each, one for
    the scalar gate (its dG comes one a row)."""
    if layout.flags["SCALAR_GATE"]:
        return 1
    return cdiv(head_k, gate_columns(layout.block_k, device))


def launch_gate_backward(
    g,
    A_log,
    dt_bias,
    beta,
    cu_seqlens,
    d_cum,
    dbeta_rows,
    dbeta_part,
    lower,
    length,
    layout: Layout,
    dg,
    dA_log_part,
    ddt_part,
    dbeta,
    head_k: int,
) -> None:
    """``chunk_bwd_gate_kernel`` over every key-column block (``gate_blocks``), chunk and
    value head; dβ's shares (``dbeta_part``) one a column block of the pairs kernel
    (none for the scalar gate, whose pair terms the WY kernel adds)."""
    value_heads = dbeta_rows.shape[2]
    n_seqs, offsets, n_chunks, flags = (
        layout.n_seqs,
        layout.chunk_offsets,
        layout.n_chunks,
        layout.flags,
    )
    gate_k = gate_columns(layout.block_k, d_cum.device)
    n_gate_k, n_pair_k = gate_blocks(head_k, layout, d_cum.device), dbeta_part.shape[-1]
    chunk_bwd_gate_kernel[(n_chunks * n_gate_k, value_heads)](
        g=g,
        A_log=A_log,
        dt_bias=dt_bias,
        beta=beta,
        cu_seqlens=cu_seqlens,
        chunk_offsets=offsets,
        d_cum_rows=d_cum,
        dbeta_rows=dbeta_rows,
        dbeta_part=dbeta_part,
        lower_bound=lower,
        length=length,
        n_seqs=n_seqs,
        dg=dg,
        dA_log_part=dA_log_part,
        ddt_part=ddt_part,
        dbeta=dbeta,
        HV=value_heads,
        K=head_k,
        BK=gate_k,
        BN=next_power_of_2(n_seqs),
        CHUNK=CHUNK,
        N_SHARES=n_pair_k,
        **{name: flags[name] for name in GATE_FLAGS},
        num_warps=GATE_WARPS,
    )
