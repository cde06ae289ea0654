"""``chunk_bwd_recompute_kernel`` and its launch: the rows G, w, qg, kd of
``SavedForBackward`` rebuilt from the inputs and the kept T, for the default training
path, which keeps all but those rows (``launch_chunk_kda_training`` without
``keep_rows``): the gate's cumsum and a whole-chunk product instead of the block solve.
Not u: only the recurrence reads it, and the training forward keeps that recurrence's
chunk states.

Rebuilding G, w, qg and kd costs a cumsum and a product a chunk, and writes G in the
backward instead of holding it from the forward; recomputing Aqk and T would cost the
whole of kernel 1, a large share of the step, so they are kept.
"""

from collections.abc import Sequence
from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from kda_ops.kernels.chunk.backward.layout import Layout
from kda_ops.kernels.chunk.backward.rows import load_beta_rows, load_normed_rows
from kda_ops.kernels.chunk.backward.saved import ROWS, SavedForBackward
from kda_ops.kernels.chunk.device import activate_gate, block_cumsum, locate_chunk
from kda_ops.kernels.chunk.planning import dot_block
from kda_ops.kernels.fast_exp import fast_exp
from kda_ops.kernels.gate import gate_parameters
from kda_ops.kernels.sizes import cdiv, next_power_of_2
from kda_ops.signature import DeltaRuleInputs, DeltaRuleOptions


@triton.jit
def chunk_bwd_recompute_kernel(
    q,
    k,
    g,
    beta,
    A_log,
    dt_bias,
    cu_seqlens,
    chunk_offsets,
    solve,
    q_norm,
    k_norm,
    scale,
    lower_bound,
    length,
    n_seqs,
    cum_g,
    w,
    qg,
    kd,
    H: tl.constexpr,
    HV: tl.constexpr,
    K: tl.constexpr,
    BK: tl.constexpr,
    BN: tl.constexpr,
    SCALAR_GATE: tl.constexpr,
    USE_GATE: tl.constexpr,
    HAS_DT_BIAS: tl.constexpr,
    USE_LOWER_BOUND: tl.constexpr,
    USE_L2NORM: tl.constexpr,
    USE_BETA_SIGMOID: tl.constexpr,
    IS_VARLEN: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """G (fp32; ``[B, T, HV]`` for the scalar gate) and w, qg, kd (input dtype) of chunk
    i_c and value head i_hv (notation in ``backward/__init__.py``; ``[B, T, HV, K]``) from
    the raw inputs and kernel 1's T, without the solve, for key columns block i_s (BK
    wide, the last possibly past K, masked): G as the forward's gate activation and a
    64-row cumsum (the forward sums by 16-row blocks: the same to fp32 rounding),
    ``w = T β (K̂ ⊙ Γ)`` as a 64-row product, ``qg = scale Q̂ ⊙ Γ``,
    ``kd = K̂ ⊙ Γ_C / Γ`` (every factor <= 1). The l2norm factors
    are kernel 1's (``q_norm``, ``k_norm``), so that a program needs only its columns; the
    beta sigmoid is the forward's (``beta_rows``). Each output is stored as soon as it is
    made, so that few tiles are live at once. Not u: only the recurrence reads it, and the
    training forward keeps that recurrence's chunk states."""
    i_c, i_hv, i_s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_h = i_hv // (HV // H)
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
    rows = tl.arange(0, 64)
    tokens = start + rows
    rows_in = rows < remaining
    offs_k = i_s * BK + tl.arange(0, BK)
    mask_k = rows_in[:, None] & (offs_k < K)[None, :]
    value_rows = (tokens * HV + i_hv)[:, None]
    chunk_id = (i_c * HV + i_hv).to(tl.int64)
    key_offsets = value_rows * K + offs_k[None, :]
    if SCALAR_GATE:
        raw_g = tl.load(g + tokens * HV + i_hv, mask=rows_in, other=0.0)
    else:
        raw_g = tl.load(g + key_offsets, mask=mask_k, other=0.0)
    gate_rate, gate_bias = gate_parameters(
        A_log=A_log,
        dt_bias=dt_bias,
        i_hv=i_hv,
        offs_k=offs_k,
        mask_k=offs_k < K,
        K=K,
        SCALAR_GATE=SCALAR_GATE,
        USE_GATE=USE_GATE,
        HAS_DT_BIAS=HAS_DT_BIAS,
    )
    # Padding rows add no decay, so the total is Γ_C: G at the last row, from the same
    # scan (its own order of additions, so equal to that row up to fp32 rounding).
    decay, decay_last = block_cumsum(
        activate_gate(
            raw_g=raw_g,
            rate=gate_rate,
            bias=gate_bias,
            lower_bound=lower_bound,
            in_seq=rows_in,
            mask_k=offs_k < K,
            BK=BK,
            ROWS=64,
            SCALAR_GATE=SCALAR_GATE,
            USE_GATE=USE_GATE,
            HAS_DT_BIAS=HAS_DT_BIAS,
            USE_LOWER_BOUND=USE_LOWER_BOUND,
        ),
        64,
        BK,
    )
    if not SCALAR_GATE:
        tl.store(cum_g + key_offsets, decay, mask=mask_k)
    elif i_s == 0:  # the scalar gate's G, one a row ([B, T, HV]): column 0's (padding has 0)
        first = (tl.arange(0, BK) == 0)[None, :]
        tl.store(
            cum_g + tokens * HV + i_hv, tl.sum(tl.where(first, decay, 0.0), axis=1), mask=rows_in
        )
    from_start = fast_exp(decay)
    r_q = load_normed_rows(
        x=q,
        norm=q_norm,
        tokens=tokens,
        rows_in=rows_in,
        i_h=i_h,
        i_hv=i_hv,
        H=H,
        HV=HV,
        K=K,
        offs_k=offs_k,
        USE_L2NORM=USE_L2NORM,
    )
    tl.store(qg + key_offsets, (scale * r_q * from_start).to(qg.dtype.element_ty), mask=mask_k)
    r_k = load_normed_rows(
        x=k,
        norm=k_norm,
        tokens=tokens,
        rows_in=rows_in,
        i_h=i_h,
        i_hv=i_hv,
        H=H,
        HV=HV,
        K=K,
        offs_k=offs_k,
        USE_L2NORM=USE_L2NORM,
    )
    # Γ_C from this scan, not kernel 1's chunk decays: at |G| ~ 100 (the safe gate's range)
    # an ulp of G is ~1e-5, and G's rounding cancels only within one summation.
    b_kd = r_k * fast_exp(decay_last[None, :] - decay)
    tl.store(kd + key_offsets, b_kd.to(kd.dtype.element_ty), mask=mask_k)
    # T's tiles above the diagonal are never written; inside the diagonal ones the
    # upper triangle is zero.
    t = tl.load(solve + (chunk_id * 64 + rows)[:, None] * 64 + rows[None, :])
    t = tl.where(rows[:, None] >= rows[None, :], t, 0.0)
    r_beta = load_beta_rows(
        beta=beta,
        tokens=tokens,
        rows_in=rows_in,
        i_hv=i_hv,
        HV=HV,
        USE_BETA_SIGMOID=USE_BETA_SIGMOID,
    )
    b_w = tl.dot(t, r_beta[:, None] * r_k * from_start, input_precision=DOT_PRECISION)
    tl.store(w + key_offsets, b_w.to(w.dtype.element_ty), mask=mask_k)


# The prepare flags chunk_bwd_recompute_kernel takes.
RECOMPUTE_FLAGS = (
    "SCALAR_GATE",
    "USE_GATE",
    "HAS_DT_BIAS",
    "USE_LOWER_BOUND",
    "USE_L2NORM",
    "USE_BETA_SIGMOID",
    "IS_VARLEN",
    "DOT_PRECISION",
)
# chunk_bwd_recompute_kernel's key columns a program and warps: 64 at 2 warps, faster than
# more warps or 32 or 128 columns although 2 warps take every register and a little stack
# (``benchmarks/launch_sweep.py --only rebuild``).
REBUILD_COLUMNS, REBUILD_WARPS = 64, 2


def rebuild_blocks(head_k: int) -> tuple[int, int]:
    """(programs a chunk, key columns a program) of ``chunk_bwd_recompute_kernel``: the
    key columns split into ``REBUILD_COLUMNS``-wide blocks."""
    splits = cdiv(head_k, REBUILD_COLUMNS)
    return splits, dot_block(cdiv(head_k, splits))


def rebuild_rows(
    inputs: DeltaRuleInputs,
    cu_seqlens: Optional[Tensor],
    options: DeltaRuleOptions,
    kept: Sequence[Tensor],
    layout: Layout,
) -> SavedForBackward:
    """``SavedForBackward`` from its fields but the rows (``kept``), the rows written by
    ``chunk_bwd_recompute_kernel`` into fresh tensors (contiguous inputs). Not u (``None``):
    only the recurrence reads it, and the kept chunk states are that recurrence's output."""
    q, k, v, g, beta, A_log, dt_bias = inputs
    scale, lower_bound = options.scale, options.lower_bound
    batch, length, heads, head_k = q.shape
    value_heads = v.shape[2]
    tokens_shape = (batch, length, value_heads)
    scalar_gate = layout.flags["SCALAR_GATE"]
    cum_g = q.new_empty(*tokens_shape, *(() if scalar_gate else (head_k,)), dtype=torch.float32)
    w, qg, kd = (q.new_empty(*tokens_shape, head_k) for _ in range(3))
    kept = SavedForBackward(*kept, *(None,) * len(ROWS))
    flags = layout.flags
    splits, block_k = rebuild_blocks(head_k)
    chunk_bwd_recompute_kernel[(layout.n_chunks, value_heads, splits)](
        q=q,
        k=k,
        g=g,
        beta=beta,
        A_log=A_log,
        dt_bias=dt_bias,
        cu_seqlens=cu_seqlens,
        chunk_offsets=layout.chunk_offsets,
        solve=kept.solve,
        q_norm=kept.q_norm,
        k_norm=kept.k_norm,
        scale=scale,
        lower_bound=0.0 if lower_bound is None else lower_bound,
        length=length,
        n_seqs=layout.n_seqs,
        cum_g=cum_g,
        w=w,
        qg=qg,
        kd=kd,
        H=heads,
        HV=value_heads,
        K=head_k,
        BK=block_k,
        BN=next_power_of_2(layout.n_seqs),
        **{name: flags[name] for name in RECOMPUTE_FLAGS},
        num_warps=REBUILD_WARPS,
    )
    return kept._replace(cum_g=cum_g, w=w, qg=qg, kd=kd)
