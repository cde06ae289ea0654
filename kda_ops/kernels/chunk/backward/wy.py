"""Kernel 3 of the backward, ``chunk_bwd_wy_kernel`` (token-parallel, on all 64 rows of a
chunk, grid: chunks × value heads), and its launch: everything that goes through S, dS'
and T, in two passes. By value blocks: recomputes ``u = T β V`` and ``v_new = u - w S``,
computes ``dRu = Tᵀ dv_new`` (so ``dv = β dRu``) and accumulates ``dAqk = dO v_newᵀ``,
``dA = -dRu v_newᵀ`` and dRu's term of dbeta. Then by key blocks, contracting over all of
V at once: ``dqg = dO Sᵀ``, ``dkd = v_new dS'ᵀ``, ``dRw = Tᵀ dw = -dRu Sᵀ``, the decay
term of Γ_C and dRw's term of dbeta; writes dv and the row-local parts of dq, dk, dG,
dbeta, which the pairs kernel (``pairs.py``) completes.

dA is ``-(dRu uᵀ + dRw wᵀ)``; with ``dRw = -dRu Sᵀ`` that is ``-dRu (u - w S)ᵀ = -dRu
v_newᵀ``, one product in pass 1 and none in pass 2, whose key loop then holds no
``[C, C]`` accumulator (with one there it spilled).

u and v_new are recomputed here (one C × C and one C × K product per value block) rather
than stored. The first pass hands v_new and dRu to the second through memory (input
dtype, as the products that read them): one pass over V with the three ``[C, K]`` row
gradients accumulated in registers does not fit the registers and spills; by key blocks
each is one dot.
"""

from typing import NamedTuple

import triton
import triton.language as tl

from kda_ops.kernels.chunk.backward.layout import Layout
from kda_ops.kernels.chunk.backward.rows import (
    load_beta_rows,
    load_cum_rows,
    load_unit_rows,
    stored_norms,
)
from kda_ops.kernels.chunk.device import BLOCK, CHUNK, locate_chunk
from kda_ops.kernels.sizes import next_power_of_2


@triton.jit
def _normed_query_key_rows(
    q_chunk,
    k_chunk,
    q_factors,
    k_factors,
    rows,
    in_seq,
    i_h,
    H: tl.constexpr,
    K: tl.constexpr,
    offs_k,
):
    """The chunk's rows of q and k on the key columns ``offs_k``, fp32, times their whole
    rows' l2norm factors (``stored_norms``, loaded once a program)."""
    b_q = load_unit_rows(
        x=q_chunk, tokens=rows, rows_in=in_seq, i_h=i_h, H=H, K=K, offs_k=offs_k, USE_L2NORM=False
    )
    b_k = load_unit_rows(
        x=k_chunk, tokens=rows, rows_in=in_seq, i_h=i_h, H=H, K=K, offs_k=offs_k, USE_L2NORM=False
    )
    return b_q * q_factors[:, None], b_k * k_factors[:, None]


@triton.jit
def _scalar_pairs(
    d_a, d_aqk, cum_chunk, rows, in_seq, last, i_hv, HV: tl.constexpr, dot_dtype: tl.constexpr
):
    """A scalar gate's pair matrices, for pass 2 to take by key blocks. With one decay a
    row the pair factor E_ij = e^{G_i - G_j} (<= 1 for i >= j) scales whole ``[C, C]``
    entries, so the pair terms are plain products with the rows: dq̂ += (dAqk ⊙ E) k̂,
    dk̂ += β (dA ⊙ E) k̂ + (dA ⊙ E)ᵀ (β k̂) + (dAqk ⊙ E)ᵀ q̂ (no per-column split, no
    dyadic diagonal, no pairs kernel). Returns dA ⊙ E and scale·dAqk ⊙ E off the diagonal
    (dot dtype), and that diagonal ``[C]`` fp32 (no decay: elementwise terms).
    ``d_a``, ``d_aqk``: fp32, dA strictly lower, scale·dAqk lower."""
    cum = tl.load(cum_chunk + rows * HV + i_hv, mask=in_seq, other=0.0)
    cum = tl.where(in_seq, cum, tl.sum(tl.where(rows == last, cum, 0.0), axis=0))
    lower = rows[:, None] >= rows[None, :]
    decay = tl.where(lower, tl.exp(tl.minimum(cum[:, None] - cum[None, :], 0.0)), 0.0)
    d_aqk = d_aqk * decay
    diagonal = rows[:, None] == rows[None, :]
    d_aqk_diag = tl.sum(tl.where(diagonal, d_aqk, 0.0), axis=1)
    d_aqk = tl.where(diagonal, 0.0, d_aqk)
    return (d_a * decay).to(dot_dtype), d_aqk.to(dot_dtype), d_aqk_diag


@triton.jit
def _scalar_pair_grads(
    d_a,
    d_aqk,
    d_aqk_diag,
    b_beta,
    b_q,
    b_k,
    d_q,
    d_k,
    d_beta,
    d_g,
    dot_dtype: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Adds the pair terms of one key block (``b_q``, ``b_k``: its q̂, k̂ rows fp32) to the
    row gradients (``_scalar_pairs`` made ``d_a``, ``d_aqk``, ``d_aqk_diag``). dG's pair
    part comes from the block's share of P = β (dA ⊙ E) ⊙ (k̂ k̂ᵀ) + (dAqk ⊙ E) ⊙ (q̂ k̂ᵀ)
    as ``rowsum(P) - colsum(P)``: each term enters at its row and, negated, at its column
    from the same fp32 value, so both ends cancel exactly in the reverse cumsum (the
    diagonal, whose two ends are one term, is left out).

    The pair loop takes 64 key columns a step (``WyLaunch.pair_step``): at 16 or 32 with 4
    warps, Triton 3.6's bundled ptxas (12.8.93) assembles it wrong or faulting on Hopper
    (``benchmarks/results/wy_probe_ptxas_h100.log``: exact with CUDA 13.4's ptxas at every
    step; with the bundled one, steps of 64 and 2-warp launches pass, narrower steps do
    not; triton-lang/triton#11366)."""
    k_low, q_low = b_k.to(dot_dtype), b_q.to(dot_dtype)
    a_rows = tl.dot(d_a, k_low, input_precision=DOT_PRECISION)
    d_q += tl.dot(d_aqk, k_low, input_precision=DOT_PRECISION) + d_aqk_diag[:, None] * b_k
    d_k += b_beta[:, None] * a_rows + d_aqk_diag[:, None] * b_q
    d_k += tl.dot(
        tl.trans(d_a), (b_beta[:, None] * b_k).to(dot_dtype), input_precision=DOT_PRECISION
    )
    d_k += tl.dot(tl.trans(d_aqk), q_low, input_precision=DOT_PRECISION)
    d_beta += tl.sum(b_k * a_rows, axis=1)
    key_key = tl.dot(k_low, tl.trans(k_low), input_precision=DOT_PRECISION)
    query_key = tl.dot(q_low, tl.trans(k_low), input_precision=DOT_PRECISION)
    pairs = b_beta[:, None] * d_a.to(tl.float32) * key_key + d_aqk.to(tl.float32) * query_key
    d_g += tl.sum(pairs, axis=1) - tl.sum(pairs, axis=0)
    return d_q, d_k, d_beta, d_g


@triton.jit
def chunk_bwd_wy_kernel(
    q,
    k,
    v,
    beta,
    cu_seqlens,
    chunk_offsets,
    cum_g,
    q_norm,
    k_norm,
    w,
    chunk_states,
    dstates,
    grad_o,
    dv_new,
    scale,
    length,
    n_seqs,
    solve,
    d_aqk_tiles,
    d_a_tiles,
    d_aqk_low,
    d_a_low,
    v_new_rows,
    d_ru_rows,
    dq_rows,
    dk_rows,
    d_cum_rows,
    dv,
    dbeta,
    H: tl.constexpr,
    HV: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    BV_STEP: tl.constexpr,
    BK_STEP: tl.constexpr,
    BN: tl.constexpr,
    CHUNK: tl.constexpr,
    USE_L2NORM: tl.constexpr,
    USE_BETA_SIGMOID: tl.constexpr,
    IS_VARLEN: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    SCALAR_GATE: tl.constexpr,
    PAIR_STEP: tl.constexpr,
    PAIR_STAGES: tl.constexpr,
):
    """For chunk i_c and value head i_hv, on all 64 rows: everything that goes through S,
    dS' and T, in two passes so that no ``[C, K]`` accumulator lives across a loop:

    1. by value blocks of BV_STEP: u = T β V, v_new = u - w S, dRu = Tᵀ dv_new (both
       stored for pass 2 in ``v_new_rows`` / ``d_ru_rows``, q's dtype ``[B, T, HV, V]``),
       dv = β dRu, dAqk = dO v_newᵀ, dA = -dRu v_newᵀ (v_new before rounding) and dRu's
       term of dbeta;
    2. by key blocks of BK_STEP, contracting over all of V (BV, padded) at once:
       dqg = dO Sᵀ, dkd = v_new dS'ᵀ, dRw = -dRu Sᵀ, the decay term of Γ_C, dRw's term of
       dbeta, and the row gradients of these key columns.

    Writes dv (v's dtype, final), the row-local parts of dq, dk (of the l2-normalised
    rows, per value head), dG (all three fp32 ``[B, T, HV, K]``) and dbeta (fp32
    ``[B, T, HV]``), dA into ``d_a_tiles`` and scale·dAqk into ``d_aqk_tiles`` (both
    ``[C, C]`` fp32 a chunk, zero above the diagonal, strictly lower for dA; they may be
    the buffers of T (``solve``, read once, first) and of Aqk, which it does not read) and,
    when given, both again in the dot dtype into ``d_a_low`` / ``d_aqk_low`` (the pairs
    kernel's off-diagonal tiles; dA's fp32 buffer then gets only its diagonal 16 × 16
    tiles), both stored between the passes."""
    i_c, i_hv = tl.program_id(0), tl.program_id(1)
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
    offs_k = tl.arange(0, BK)
    mask_k = offs_k < K
    dot_dtype = q.dtype.element_ty
    chunk_id = (i_c * HV + i_hv).to(tl.int64)
    last = tl.minimum(remaining, CHUNK) - 1
    rows = tl.arange(0, CHUNK)
    in_seq = rows < remaining
    # 64-bit scalar bases and 32-bit offsets within the chunk: 64-bit offset tiles, hoisted
    # out of the loops, would hold two registers an element.
    state = chunk_id * K * V  # this chunk's [K, V] state and its gradient
    square = chunk_id * CHUNK * CHUNK
    value_base = (start * HV + i_hv) * V
    key_base = (start * HV + i_hv) * K
    row_offsets = (rows * HV)[:, None]
    in_square = rows[:, None] * CHUNK + rows[None, :]
    b_beta = load_beta_rows(
        beta=beta + start * HV,
        tokens=rows,
        rows_in=in_seq,
        i_hv=i_hv,
        HV=HV,
        USE_BETA_SIGMOID=USE_BETA_SIGMOID,
    )
    b_t = tl.load(solve + square + in_square, mask=rows[:, None] >= rows[None, :], other=0.0)
    b_w = tl.load(
        w + key_base + row_offsets * K + offs_k[None, :],
        mask=in_seq[:, None] & mask_k[None, :],
        other=0.0,
    ).to(dot_dtype)
    d_aqk = tl.zeros([CHUNK, CHUNK], dtype=tl.float32)
    d_a = tl.zeros([CHUNK, CHUNK], dtype=tl.float32)
    d_beta = tl.zeros([CHUNK], dtype=tl.float32)
    for i_v in range(0, tl.cdiv(V, BV_STEP)):
        offs_v = i_v * BV_STEP + tl.arange(0, BV_STEP)
        mask_v = offs_v < V
        mask_rows_v = in_seq[:, None] & mask_v[None, :]
        value_offsets = row_offsets * V + offs_v[None, :]
        b_s = tl.load(
            chunk_states + state + offs_k[:, None] * V + offs_v[None, :],
            mask=mask_k[:, None] & mask_v[None, :],
            other=0.0,
        )
        b_v = tl.load(v + value_base + value_offsets, mask=mask_rows_v, other=0.0).to(tl.float32)
        b_do = tl.load(grad_o + value_base + value_offsets, mask=mask_rows_v, other=0.0).to(
            dot_dtype
        )
        b_dvn = tl.load(dv_new + value_base + value_offsets, mask=mask_rows_v, other=0.0)
        b_u = tl.dot(b_t, b_beta[:, None] * b_v, input_precision=DOT_PRECISION)
        v_new_f32 = b_u - tl.dot(b_w, b_s.to(dot_dtype), input_precision=DOT_PRECISION)
        v_new = v_new_f32.to(dot_dtype)
        d_aqk += tl.dot(b_do, tl.trans(v_new), input_precision=DOT_PRECISION)
        d_ru = tl.dot(tl.trans(b_t), b_dvn, input_precision=DOT_PRECISION)
        tl.store(
            dv + value_base + value_offsets,
            (b_beta[:, None] * d_ru).to(dv.dtype.element_ty),
            mask=mask_rows_v,
        )
        tl.store(v_new_rows + value_base + value_offsets, v_new, mask=mask_rows_v)
        tl.store(d_ru_rows + value_base + value_offsets, d_ru.to(dot_dtype), mask=mask_rows_v)
        d_beta += tl.sum(d_ru * b_v, axis=1)
        d_a -= tl.dot(d_ru, tl.trans(v_new_f32), input_precision=DOT_PRECISION)
    tl.debug_barrier()  # pass 2 reads what other threads stored; T is not read again
    d_aqk = tl.where(rows[:, None] >= rows[None, :], scale * d_aqk, 0.0)
    d_a = tl.where(rows[:, None] > rows[None, :], d_a, 0.0)
    q_chunk = q + start * H * K
    k_chunk = k + start * H * K
    cum_chunk = cum_g + start * HV * (1 if SCALAR_GATE else K)  # G one a row if scalar
    q_factors = stored_norms(
        norm=q_norm + start * HV,
        tokens=rows,
        rows_in=in_seq,
        i_hv=i_hv,
        HV=HV,
        USE_L2NORM=USE_L2NORM,
    )
    k_factors = stored_norms(
        norm=k_norm + start * HV,
        tokens=rows,
        rows_in=in_seq,
        i_hv=i_hv,
        HV=HV,
        USE_L2NORM=USE_L2NORM,
    )
    if SCALAR_GATE:  # the pair terms here (``_scalar_pair_grads``), not in the pairs kernel
        d_a, d_aqk, d_aqk_diag = _scalar_pairs(
            d_a=d_a,
            d_aqk=d_aqk,
            cum_chunk=cum_chunk,
            rows=rows,
            in_seq=in_seq,
            last=last,
            i_hv=i_hv,
            HV=HV,
            dot_dtype=dot_dtype,
        )
        d_g = tl.zeros([CHUNK], dtype=tl.float32)
        # The pair terms by key blocks into the row gradients, before pass 2 adds its own:
        # the pair matrices are dead by then, leaving pass 2's value tiles the registers.
        for i_k in tl.range(0, tl.cdiv(K, PAIR_STEP), num_stages=PAIR_STAGES):
            offs_kb = i_k * PAIR_STEP + tl.arange(0, PAIR_STEP)
            mask_rows_kb = in_seq[:, None] & (offs_kb < K)[None, :]
            key_offsets = row_offsets * K + offs_kb[None, :]
            b_q, b_k = _normed_query_key_rows(
                q_chunk=q_chunk,
                k_chunk=k_chunk,
                q_factors=q_factors,
                k_factors=k_factors,
                rows=rows,
                in_seq=in_seq,
                i_h=i_h,
                H=H,
                K=K,
                offs_k=offs_kb,
            )
            zeros = tl.zeros([CHUNK, PAIR_STEP], dtype=tl.float32)
            d_q, d_k, d_beta, d_g = _scalar_pair_grads(
                d_a=d_a,
                d_aqk=d_aqk,
                d_aqk_diag=d_aqk_diag,
                b_beta=b_beta,
                b_q=b_q,
                b_k=b_k,
                d_q=zeros,
                d_k=zeros,
                d_beta=d_beta,
                d_g=d_g,
                dot_dtype=dot_dtype,
                DOT_PRECISION=DOT_PRECISION,
            )
            tl.store(dq_rows + key_base + key_offsets, d_q, mask=mask_rows_kb)
            tl.store(dk_rows + key_base + key_offsets, d_k, mask=mask_rows_kb)
        tl.debug_barrier()  # pass 2 reads what other threads stored
    else:
        tl.store(d_aqk_tiles + square + in_square, d_aqk)
        if d_aqk_low is not None:
            tl.store(d_aqk_low + square + in_square, d_aqk.to(dot_dtype))
        if d_a_low is None:
            tl.store(d_a_tiles + square + in_square, d_a)
        else:  # fp32 only where the pairs kernel reads it: the diagonal tiles
            diagonal = rows[:, None] // BLOCK == rows[None, :] // BLOCK
            tl.store(d_a_tiles + square + in_square, d_a, mask=diagonal)
            tl.store(d_a_low + square + in_square, d_a.to(dot_dtype))

    offs_v = tl.arange(0, BV)
    mask_v = offs_v < V
    mask_rows_v = in_seq[:, None] & mask_v[None, :]
    value_offsets = row_offsets * V + offs_v[None, :]
    b_do = tl.load(grad_o + value_base + value_offsets, mask=mask_rows_v, other=0.0).to(dot_dtype)
    v_new = tl.load(v_new_rows + value_base + value_offsets, mask=mask_rows_v, other=0.0)
    d_ru = tl.load(d_ru_rows + value_base + value_offsets, mask=mask_rows_v, other=0.0)
    for i_k in range(0, tl.cdiv(K, BK_STEP)):
        offs_kb = i_k * BK_STEP + tl.arange(0, BK_STEP)
        mask_kb = offs_kb < K
        mask_rows_kb = in_seq[:, None] & mask_kb[None, :]
        key_offsets = row_offsets * K + offs_kb[None, :]
        tile = state + offs_kb[:, None] * V + offs_v[None, :]
        tile_mask = mask_kb[:, None] & mask_v[None, :]
        s_keys = tl.load(chunk_states + tile, mask=tile_mask, other=0.0).to(tl.float32)
        ds_keys = tl.load(dstates + tile, mask=tile_mask, other=0.0).to(tl.float32)
        s_keys_t = tl.trans(s_keys.to(dot_dtype))
        d_qg = tl.dot(b_do, s_keys_t, input_precision=DOT_PRECISION)
        d_kd = tl.dot(v_new, tl.trans(ds_keys.to(dot_dtype)), input_precision=DOT_PRECISION)
        d_rw = -tl.dot(d_ru, s_keys_t, input_precision=DOT_PRECISION)  # Tᵀ dw

        if SCALAR_GATE:  # G one a row, the same for every column
            cum_end = tl.load(cum_chunk + last * HV + i_hv)
            cum_last = cum_end + tl.zeros([BK_STEP], tl.float32)
            b_cum = tl.load(cum_chunk + rows * HV + i_hv, mask=in_seq, other=0.0)
            b_cum = tl.where(in_seq, b_cum, cum_end)[:, None] + tl.zeros([1, BK_STEP], tl.float32)
        else:
            cum_last = tl.load(
                cum_chunk + (last * HV + i_hv) * K + offs_kb, mask=mask_kb, other=0.0
            )
            b_cum = load_cum_rows(
                cum_g=cum_chunk,
                tokens=rows,
                rows_in=in_seq,
                i_hv=i_hv,
                HV=HV,
                K=K,
                offs_k=offs_kb,
                cum_last=cum_last,
            )
        b_q, b_k = _normed_query_key_rows(
            q_chunk=q_chunk,
            k_chunk=k_chunk,
            q_factors=q_factors,
            k_factors=k_factors,
            rows=rows,
            in_seq=in_seq,
            i_h=i_h,
            H=H,
            K=K,
            offs_k=offs_kb,
        )
        gamma = tl.exp(b_cum)
        to_end = tl.exp(cum_last[None, :] - b_cum)
        d_beta += tl.sum(d_rw * b_k * gamma, axis=1)
        d_q = scale * gamma * d_qg
        d_k = b_beta[:, None] * gamma * d_rw + to_end * d_kd
        d_cum = b_q * d_q + b_beta[:, None] * b_k * gamma * d_rw - b_k * to_end * d_kd
        # G_C (the last row) also scales the carried state (Σ_v S ⊙ dS') and every kd row.
        d_decay = tl.sum(s_keys * ds_keys, axis=1)
        d_cum_last = tl.sum(b_k * to_end * d_kd, axis=0) + tl.exp(cum_last) * d_decay
        d_cum += tl.where(rows[:, None] == last, d_cum_last[None, :], 0.0)
        if SCALAR_GATE:  # onto the pair terms
            d_q += tl.load(dq_rows + key_base + key_offsets, mask=mask_rows_kb, other=0.0)
            d_k += tl.load(dk_rows + key_base + key_offsets, mask=mask_rows_kb, other=0.0)
            d_g += tl.sum(d_cum, axis=1)
        else:
            tl.store(d_cum_rows + key_base + key_offsets, d_cum, mask=mask_rows_kb)
        tl.store(dq_rows + key_base + key_offsets, d_q, mask=mask_rows_kb)
        tl.store(dk_rows + key_base + key_offsets, d_k, mask=mask_rows_kb)
    if SCALAR_GATE:
        tl.store(d_cum_rows + start * HV + rows * HV + i_hv, d_g, mask=in_seq)  # [B, T, HV]
    tl.store(dbeta + start * HV + rows * HV + i_hv, d_beta, mask=in_seq)


# The WY kernel's value and key steps (its loops over V and over K) and pipeline stages
# (bf16 / fp16 inputs): at 16 key columns a step the key loop spills less than at 32 but
# takes twice the trips (``launch_sweep.py --only wy`` sweeps the sizes).
WY_VALUE_STEP, WY_KEY_STEP, WY_STAGES = 32, 32, 2


class WyLaunch(NamedTuple):
    """How ``chunk_bwd_wy_kernel`` is launched: ``BV_STEP``, ``BK_STEP``, warps, stages, and
    the scalar gate's pair loop: its key columns a step (``PAIR_STEP``) and pipeline stages
    (``PAIR_STAGES``)."""

    value_step: int
    key_step: int
    warps: int
    stages: int
    pair_step: int = 64
    pair_stages: int = 1


def wy_launch(block_k: int, block_v: int, itemsize: int) -> WyLaunch:
    """The WY kernel's launch for ``block_k`` / ``block_v`` columns and inputs of
    ``itemsize`` bytes. Shared memory (227 KB a block on Hopper) holds the loops'
    pipelined tiles: fp32 tiles are twice as large, so fp32 inputs (the accuracy path) are
    not pipelined, and K > 128 halves the value step, which keeps every bf16 launch well
    inside it. Past 128 value columns pass 2's three ``[64, BV]`` operands stay in shared
    memory across its key loop, in fp32 192 KB: the key step there is 16, since at 32 the
    fp32 launch does not fit, and 8 warps hold them in registers where 4 spill.
    4 warps otherwise: a training step is faster than with 8, or with a key step of 16
    (``benchmarks/ab.py``)."""
    wide_v = block_v > 128
    value_step = WY_VALUE_STEP if block_k <= 128 else WY_VALUE_STEP // 2
    key_step = WY_KEY_STEP // 2 if wide_v and itemsize > 2 else WY_KEY_STEP
    return WyLaunch(
        value_step=min(block_v, value_step),
        key_step=min(block_k, key_step),
        warps=8 if wide_v else 4,
        stages=WY_STAGES if itemsize <= 2 else 1,
    )


def launch_wy(
    q,
    k,
    v,
    beta,
    cu_seqlens,
    cum_g,
    q_norm,
    k_norm,
    w,
    chunk_states,
    dstates,
    grad_o,
    dv_new,
    scale,
    length,
    layout: Layout,
    solve,
    d_aqk_tiles,
    d_a_tiles,
    d_aqk_low,
    d_a_low,
    v_new_rows,
    d_ru_rows,
    dq_hat,
    dk_hat,
    d_cum,
    dv,
    dbeta_rows,
    use_qk_l2norm: bool,
    use_beta_sigmoid: bool,
) -> None:
    """``chunk_bwd_wy_kernel`` over every chunk and value head (its outputs as there), as
    ``wy_launch`` configures it."""
    heads, head_k = q.shape[2], q.shape[3]
    value_heads, head_v = v.shape[2], v.shape[3]
    n_seqs, offsets, n_chunks = layout.n_seqs, layout.chunk_offsets, layout.n_chunks
    block_k, block_v, precision = layout.block_k, layout.block_v, layout.flags["DOT_PRECISION"]
    wy = wy_launch(block_k, block_v, q.element_size())
    chunk_bwd_wy_kernel[(n_chunks, value_heads)](
        q=q,
        k=k,
        v=v,
        beta=beta,
        cu_seqlens=cu_seqlens,
        chunk_offsets=offsets,
        cum_g=cum_g,
        q_norm=q_norm,
        k_norm=k_norm,
        w=w,
        chunk_states=chunk_states,
        dstates=dstates,
        grad_o=grad_o,
        dv_new=dv_new,
        scale=scale,
        length=length,
        n_seqs=n_seqs,
        solve=solve,
        d_aqk_tiles=d_aqk_tiles,
        d_a_tiles=d_a_tiles,
        d_aqk_low=d_aqk_low,
        d_a_low=d_a_low,
        v_new_rows=v_new_rows,
        d_ru_rows=d_ru_rows,
        dq_rows=dq_hat,
        dk_rows=dk_hat,
        d_cum_rows=d_cum,
        dv=dv,
        dbeta=dbeta_rows,
        H=heads,
        HV=value_heads,
        K=head_k,
        V=head_v,
        BK=block_k,
        BV=block_v,
        BV_STEP=wy.value_step,
        BK_STEP=wy.key_step,
        BN=next_power_of_2(n_seqs),
        CHUNK=CHUNK,
        USE_L2NORM=use_qk_l2norm,
        USE_BETA_SIGMOID=use_beta_sigmoid,
        IS_VARLEN=cu_seqlens is not None,
        DOT_PRECISION=precision,
        SCALAR_GATE=layout.flags["SCALAR_GATE"],
        PAIR_STEP=wy.pair_step,
        PAIR_STAGES=wy.pair_stages,
        num_warps=wy.warps,
        num_stages=wy.stages,
    )
