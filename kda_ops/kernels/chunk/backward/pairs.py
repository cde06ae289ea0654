"""Kernel 4 of the backward, ``chunk_bwd_pairs_kernel`` (token-parallel, one program a
16-row block and split over the key columns; grid: chunks × column blocks of
``PAIRS_COLUMNS`` × 4 row blocks, value heads), and its launches: every pair term is a
per-column product. A program takes its block's pair terms of A and Aqk (q̂ / k̂ / G / β
gradients): its rows against the earlier blocks' columns, its columns against the later
blocks' rows (one other block at a time, in a loop), and its diagonal block, and adds them
to the WY kernel's row gradients (``wy.py``). What sums over the columns comes back as one
share per column block (dβ), which the gate kernel (``gate.py``) adds.

The WY kernel builds on 64 rows what this one reads by row blocks: dA goes over T's
buffer and scale·dAqk over Aqk's (neither is needed any more) unless they were kept by
the forward without the rows (the default training path: a graph may be backpropagated
again, so they get fresh buffers), the row-local gradients into fp32 dq / dk / dG / dbeta
buffers that this kernel reads back and completes. The two kernels are separate because
they only communicate through memory anyway, and apart each needs fewer registers. A
program over a whole chunk either re-loads (and re-normalises) every other row block for
each of its blocks or, its four row blocks unrolled, holds them all and spills; a program
of one row block holds one other block at a time: at 32 columns one warp holds it, eight
programs an SM.

Numerics: every pair factor exp(G_i - G_j) (i >= j) is split at a reference row p with
j <= p <= i so both halves are at most 1; p is the first row of the 16-row block of i.
Inside a diagonal block, the safe gate (``-5 <= lower_bound < 0``, not fp16) bounds the
growing half by e^75 and the block is a dense dot; every other gate splits the block's
pairs dyadically there, as the forward does (every factor at most 1; ``dyadic_level``).
The gate gradient is a difference: every pair term enters dG at its row and, negated, at
its column, so the diagonal blocks take fp32 products, split-bf16 on the tensor cores
(``DIAGONAL_PRECISION``; see ``_dense_diagonal_grads``). dβ_i = Σ_j dA_ij (k̂_i · k̂_j
e^{..}) is taken as k̂_i e^{G_i - ref} · (Σ_j dA_ij k̂_j e^{ref - G_j}), the sum A's row
term already forms, rather than by a K Kᵀ dot.
"""

import torch
import triton
import triton.language as tl

from kda_ops.kernels.chunk.backward.layout import Layout, key_columns
from kda_ops.kernels.chunk.backward.rows import load_beta_rows, load_cum_rows, load_normed_rows
from kda_ops.kernels.chunk.device import (
    BLOCK,
    CHUNK,
    LOG2_BLOCK,
    dyadic_level,
    locate_chunk,
    tile_row,
)
from kda_ops.kernels.sizes import cdiv, next_power_of_2


@triton.jit
def _dyadic_diagonal_grads(d_a, r_beta, m_q, r_q, r_k, r_cum, PRECISION: tl.constexpr):
    """Gradients of one diagonal block of the pair matrices ``P_ij = Σ_c x_ic k_jc
    e^{G_ic - G_jc}`` (x = k for A, x = q for Aqk) given the cotangents dA (strictly
    lower, scaled by β_i in A) and m_q (Aqk's, lower), exact for any gate. Returns
    (dk from A's rows, dq from Aqk's rows, dk from both columns, dβ = Σ_j dA_ij (K K)_ij).

    The pairs j < i go through the levels of the dyadic split (``dyadic_level``), whose
    factors (<= 1) scale the rows and the columns of four dots a level; Aqk's r == c terms
    need no decay and are added directly. Products are fp32 and the dots near-exact, as in
    ``_dense_diagonal_grads`` and for the same reason: a pair term's two ends in dG, at its
    row and at its column, must be rounded alike. ``PRECISION``: as there."""
    sub = tl.arange(0, BLOCK)
    m_q_diag = tl.sum(tl.where(sub[:, None] == sub[None, :], m_q, 0.0), axis=1)[:, None]
    row_k = tl.zeros_like(r_k)
    row_q = m_q_diag * r_k
    col = m_q_diag * r_q
    d_beta = tl.zeros([BLOCK], dtype=tl.float32)
    for level in tl.static_range(LOG2_BLOCK):
        pairs, factor = dyadic_level(level, r_cum, True)
        k_f = r_k * factor
        pair_a = tl.where(pairs, d_a, 0.0)
        pair_q = tl.where(pairs, m_q, 0.0)
        # Σ_j dA_ij k_j f_j gives both A's row term (times β_i f_i) and dβ (dotted with
        # k_i f_i): no separate K Kᵀ dot.
        a_rows = tl.dot(pair_a, k_f, input_precision=PRECISION)
        row_k += r_beta[:, None] * factor * a_rows
        d_beta += tl.sum(k_f * a_rows, axis=1)
        row_q += factor * tl.dot(pair_q, k_f, input_precision=PRECISION)
        col_f = tl.dot(tl.trans(pair_a), r_beta[:, None] * k_f, input_precision=PRECISION)
        col_f += tl.dot(tl.trans(pair_q), r_q * factor, input_precision=PRECISION)
        col += factor * col_f
    return row_k, row_q, col, d_beta


@triton.jit
def _dense_diagonal_grads(d_a, r_beta, m_q, r_q, r_k, r_cum, ref, up, PRECISION: tl.constexpr):
    """``_dyadic_diagonal_grads``'s gradients by dense dots with the pair factors split at
    the block's first row ``ref`` (for blocks decaying within ``PAIRS_DENSE_LIMIT``
    (``chunk/prepare.py``), so that the growing half e^{ref - G} stays below e^75);
    ``up = e^{G - ref}`` ``[BLOCK, BK]``.

    Operands stay fp32 and the dots near-exact whatever the inputs' dtype (``PRECISION``:
    "ieee" FMA, or "bf16x3", three bf16 products of the operands' high and low halves, about
    16 significant bits against bf16's 8): each pair term enters dG twice, at its row
    (through k e^{ref - G}) and negated at its column (through q or k e^{G - ref}), and only
    cancels in dg, the reverse cumsum, when both ends are rounded alike. The diagonal block
    holds the largest terms (Aqk's r == c term, which cancels exactly, and the least decayed
    pairs): with bf16 operands dg is off by percents, and dA_log / d dt_bias, sums over
    tokens, by far more."""
    down = tl.exp(ref[None, :] - r_cum)
    k_up = r_k * up
    k_down = r_k * down
    # Σ_j dA_ij k_j e^{ref - G_j} gives A's row term (times β_i e^{G_i - ref}) and dβ
    # (dotted with k_i e^{G_i - ref}): no K Kᵀ dot.
    a_rows = tl.dot(d_a, k_down, input_precision=PRECISION)
    row_q = tl.dot(m_q, k_down, input_precision=PRECISION) * up
    col = tl.dot(tl.trans(r_beta[:, None] * d_a), k_up, input_precision=PRECISION)
    col = (col + tl.dot(tl.trans(m_q), r_q * up, input_precision=PRECISION)) * down
    return r_beta[:, None] * up * a_rows, row_q, col, tl.sum(k_up * a_rows, axis=1)


@triton.jit
def _load_pair_block(
    q,
    k,
    beta,
    cum_g,
    q_norm,
    k_norm,
    start,
    remaining,
    i_b,
    i_h,
    i_hv,
    offs_k,
    cum_last,
    H: tl.constexpr,
    HV: tl.constexpr,
    K: tl.constexpr,
    USE_L2NORM: tl.constexpr,
    USE_BETA_SIGMOID: tl.constexpr,
):
    """Row block i_b of the chunk on the key columns ``offs_k``: q̂, k̂, G ``[BLOCK, BK]``
    fp32 and β ``[BLOCK]``. The rows are normalised by their full-row norms, which
    ``chunk_bwd_prepare_kernel`` stored (``[B, T, HV]`` fp32): a program sees only its
    columns."""
    sub = tl.arange(0, BLOCK)
    tokens = start + i_b * BLOCK + sub
    rows_in = i_b * BLOCK + sub < remaining
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
    r_beta = load_beta_rows(
        beta=beta,
        tokens=tokens,
        rows_in=rows_in,
        i_hv=i_hv,
        HV=HV,
        USE_BETA_SIGMOID=USE_BETA_SIGMOID,
    )
    r_cum = load_cum_rows(
        cum_g=cum_g,
        tokens=tokens,
        rows_in=rows_in,
        i_hv=i_hv,
        HV=HV,
        K=K,
        offs_k=offs_k,
        cum_last=cum_last,
    )
    return r_q, r_k, r_beta, r_cum


@triton.jit
def _pair_tiles(d_aqk_tiles, d_a_tiles, chunk_id, i_b, j_b):
    """Tile (i_b, j_b) of this chunk's dA and scale·dAqk, ``[BLOCK, BLOCK]`` in the
    buffers' dtype."""
    sub = tl.arange(0, BLOCK)
    tile = chunk_id * 64 * 64 + (sub + i_b * BLOCK)[:, None] * 64 + (sub + j_b * BLOCK)[None, :]
    return tl.load(d_a_tiles + tile), tl.load(d_aqk_tiles + tile)


@triton.jit
def _earlier_columns(d_a, m_q, ref, c_k, c_cum, rows_a, rows_q, DOT_PRECISION: tl.constexpr):
    """Adds row block I's pairs with an earlier column block J to its row sums, their
    factors split at I's first row ``ref``: e^{G_i - G_j} = e^{G_i - ref} e^{ref - G_j},
    both <= 1. ``d_a``, ``m_q``: tile (I, J) of dA and scale·dAqk (dot dtype); ``c_k``,
    ``c_cum``: J's k̂ and G (fp32). Returns ``rows_a += dA k̂_j e^{ref - G_j}`` (to be
    scaled by β_i e^{G_i - ref}) and ``rows_q += scale·dAqk k̂_j e^{ref - G_j}`` (by
    e^{G_i - ref}), ``[BLOCK, BK]`` fp32."""
    k_ref = (c_k * tl.exp(ref[None, :] - c_cum)).to(d_a.dtype)
    rows_a += tl.dot(d_a, k_ref, input_precision=DOT_PRECISION)
    rows_q += tl.dot(m_q, k_ref, input_precision=DOT_PRECISION)
    return rows_a, rows_q


@triton.jit
def _later_rows(d_a, m_q, r_beta, ref, k_in, q_in, c_cum, col, DOT_PRECISION: tl.constexpr):
    """Adds column block J's pairs with a later row block I to J's column sums: ``col +=
    e^{ref - G_j} ⊙ ((β dA)ᵀ k_in + dAqkᵀ q_in)`` (``[BLOCK, BK]`` fp32), with ``d_a``,
    ``m_q`` tile (I, J) (dot dtype), ``r_beta``, ``ref`` I's β and reference, ``k_in``,
    ``q_in`` I's k̂, q̂ times e^{G - ref} (dot dtype) and ``c_cum`` J's G."""
    m_a = (r_beta[:, None] * d_a).to(d_a.dtype)
    col_ref = tl.dot(tl.trans(m_a), k_in, input_precision=DOT_PRECISION)
    col_ref += tl.dot(tl.trans(m_q), q_in, input_precision=DOT_PRECISION)
    return col + tl.exp(ref[None, :] - c_cum) * col_ref


@triton.jit
def _open_rows(r_q, r_k, r_cum, dot_dtype: tl.constexpr):
    """A row block's reference (G of its first row, ``[BK]``), ``up = e^{G - ref}`` (<= 1,
    ``[BLOCK, BK]`` fp32) and its k̂, q̂ times ``up`` in the dot dtype, the row side of its
    pairs with earlier blocks."""
    ref = tile_row(r_cum, 0)
    up = tl.exp(r_cum - ref[None, :])
    return ref, up, (r_k * up).to(dot_dtype), (r_q * up).to(dot_dtype)


@triton.jit
def _load_row_grads(dq_rows, dk_rows, d_cum_rows, offsets, mask):
    """A row block's dq̂, dk̂, dG so far (fp32 tiles at ``offsets``)."""
    return (
        tl.load(dq_rows + offsets, mask=mask, other=0.0),
        tl.load(dk_rows + offsets, mask=mask, other=0.0),
        tl.load(d_cum_rows + offsets, mask=mask, other=0.0),
    )


@triton.jit
def _finish_rows(
    d_aqk_tiles,
    d_a_tiles,
    d_cum_rows,
    dq_rows,
    dk_rows,
    dbeta_part,
    start,
    remaining,
    chunk_id,
    i_b,
    i_hv,
    i_k,
    offs_k,
    r_q,
    r_k,
    r_beta,
    r_cum,
    ref,
    up,
    rows_a,
    rows_q,
    col,
    HV: tl.constexpr,
    K: tl.constexpr,
    N_K: tl.constexpr,
    DENSE: tl.constexpr,
    DIAGONAL_PRECISION: tl.constexpr,
):
    """Completes row block i_b once its pairs with every other block are in: ``rows_a``,
    ``rows_q`` its rows against earlier columns (``_earlier_columns``), ``col`` its columns
    against later rows (``_later_rows``). Adds the diagonal block (``DENSE``: fp32 dots at
    ``ref``, for blocks decaying within ``PAIRS_DENSE_LIMIT`` (``chunk/prepare.py``); else
    dyadic), adds everything to the row-local gradients of ``chunk_bwd_wy_kernel`` in place
    (dq̂, dk̂, dG fp32) and stores this column block's share of dβ (``[B, T, HV, N_K]``
    fp32)."""
    sub = tl.arange(0, BLOCK)
    tokens = start + i_b * BLOCK + sub
    rows_in = i_b * BLOCK + sub < remaining
    mask = rows_in[:, None] & (offs_k < K)[None, :]
    offsets = (tokens * HV + i_hv)[:, None] * K + offs_k[None, :]
    # The three row gradients are loaded together, before any store (the compiler keeps a
    # load after a store it cannot prove apart, so one after another each waited its own
    # round trip at the program's end), and before the diagonal block, so that the loads
    # overlap its dots; the dense launches still fit their registers, the dyadic one
    # spills a little more for it.
    old_q, old_k, old_cum = _load_row_grads(
        dq_rows=dq_rows, dk_rows=dk_rows, d_cum_rows=d_cum_rows, offsets=offsets, mask=mask
    )
    d_a, m_q = _pair_tiles(
        d_aqk_tiles=d_aqk_tiles, d_a_tiles=d_a_tiles, chunk_id=chunk_id, i_b=i_b, j_b=i_b
    )
    if DENSE:
        diag_k, diag_q, diag_col, d_beta = _dense_diagonal_grads(
            d_a=d_a,
            r_beta=r_beta,
            m_q=m_q,
            r_q=r_q,
            r_k=r_k,
            r_cum=r_cum,
            ref=ref,
            up=up,
            PRECISION=DIAGONAL_PRECISION,
        )
    else:
        diag_k, diag_q, diag_col, d_beta = _dyadic_diagonal_grads(
            d_a=d_a,
            r_beta=r_beta,
            m_q=m_q,
            r_q=r_q,
            r_k=r_k,
            r_cum=r_cum,
            PRECISION=DIAGONAL_PRECISION,
        )
    row_k = r_beta[:, None] * up * rows_a + diag_k
    row_q = up * rows_q + diag_q
    col += diag_col
    tl.store(dq_rows + offsets, old_q + row_q, mask=mask)
    tl.store(dk_rows + offsets, old_k + row_k + col, mask=mask)
    tl.store(d_cum_rows + offsets, old_cum + r_q * row_q + r_k * (row_k - col), mask=mask)
    # Σ_j dA_ij kk_ij over the earlier columns is k̂_i e^{G_i - ref} · rows_a.
    d_beta += tl.sum(r_k * up * rows_a, axis=1)
    tl.store(dbeta_part + (tokens * HV + i_hv) * N_K + i_k, d_beta, mask=rows_in)


@triton.jit
def chunk_bwd_pairs_kernel(
    q,
    k,
    beta,
    cu_seqlens,
    chunk_offsets,
    cum_g,
    q_norm,
    k_norm,
    d_aqk_tiles,
    d_a_tiles,
    d_aqk_low,
    d_a_low,
    unbounded,
    length,
    n_seqs,
    dq_rows,
    dk_rows,
    d_cum_rows,
    dbeta_part,
    H: tl.constexpr,
    HV: tl.constexpr,
    K: tl.constexpr,
    BK: tl.constexpr,
    BN: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK: tl.constexpr,
    SAFE_GATE: tl.constexpr,
    USE_L2NORM: tl.constexpr,
    USE_BETA_SIGMOID: tl.constexpr,
    IS_VARLEN: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DIAGONAL_PRECISION: tl.constexpr,
    CHUNKS: tl.constexpr,
):
    """For 16-row block i_b of chunk i_c, value head i_hv and the BK key columns of block
    i_k (every pair term is a per-column product but for dβ's sum over columns, whose
    shares the launcher adds): the pair terms of A (cotangent dA) and Aqk (scale·dAqk) of
    its rows, against the earlier blocks' columns, and of its columns, against the later
    blocks' rows; fp32 ``d_a_tiles`` / ``d_aqk_tiles`` for the diagonal tile, the same in
    the dot dtype (``d_a_low`` / ``d_aqk_low``) for the others. Added in place to dq̂ / dk̂
    / dG (``dq_rows`` / ``dk_rows`` / ``d_cum_rows``, fp32 ``[B, T, HV, K]``, of the
    l2-normalised rows); dβ's share stored (fp32 ``[B, T, HV, N_K]``, before the sigmoid
    backward). The gate's backward (``chunk_bwd_gate_kernel``) follows.

    One program a row block: each off-diagonal pair's four products are split between
    the row block's program (two) and the column block's (two), and a program holds one
    other block at a time.

    ``CHUNKS``: ``"all"`` with the safe gate (dense diagonal blocks); otherwise the
    launcher runs ``"bounded"`` (the chunks ``unbounded`` does not flag, dense) and
    ``"unbounded"`` (the flagged ones, dyadic), so that each launch compiles one path."""
    N_K = (K + BK - 1) // BK
    pid = tl.program_id(0)
    i_b, i_k, i_c = pid % 4, (pid // 4) % N_K, pid // (4 * N_K)
    i_hv = tl.program_id(1)
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
    if remaining <= i_b * BLOCK:  # no rows of this block in the sequence
        return
    chunk_id = (i_c * HV + i_hv).to(tl.int64)
    if CHUNKS != "all":  # this launch takes the flagged chunks or the others
        flagged = tl.load(unbounded + chunk_id) != 0
        if flagged != (CHUNKS == "unbounded"):
            return
    offs_k = i_k * BK + tl.arange(0, BK)
    dot_dtype = q.dtype.element_ty
    last = tl.minimum(remaining, CHUNK) - 1
    cum_last = tl.load(
        cum_g + ((start + last) * HV + i_hv) * K + offs_k, mask=offs_k < K, other=0.0
    )
    n_blocks = tl.minimum(tl.cdiv(remaining, BLOCK), CHUNK // BLOCK)

    r_q, r_k, r_beta, r_cum = _load_pair_block(
        q=q,
        k=k,
        beta=beta,
        cum_g=cum_g,
        q_norm=q_norm,
        k_norm=k_norm,
        start=start,
        remaining=remaining,
        i_b=i_b,
        i_h=i_h,
        i_hv=i_hv,
        offs_k=offs_k,
        cum_last=cum_last,
        H=H,
        HV=HV,
        K=K,
        USE_L2NORM=USE_L2NORM,
        USE_BETA_SIGMOID=USE_BETA_SIGMOID,
    )
    # Triton carries a name assigned before a loop and again inside it: no shared `_`.
    ref, up, _row_k_in, _row_q_in = _open_rows(r_q=r_q, r_k=r_k, r_cum=r_cum, dot_dtype=dot_dtype)
    rows_a = tl.zeros([BLOCK, BK], dtype=tl.float32)
    rows_q = tl.zeros([BLOCK, BK], dtype=tl.float32)
    for j_b in range(0, i_b):
        c_q, c_k, c_beta, c_cum = _load_pair_block(
            q=q,
            k=k,
            beta=beta,
            cum_g=cum_g,
            q_norm=q_norm,
            k_norm=k_norm,
            start=start,
            remaining=remaining,
            i_b=j_b,
            i_h=i_h,
            i_hv=i_hv,
            offs_k=offs_k,
            cum_last=cum_last,
            H=H,
            HV=HV,
            K=K,
            USE_L2NORM=USE_L2NORM,
            USE_BETA_SIGMOID=USE_BETA_SIGMOID,
        )
        d_a, m_q = _pair_tiles(
            d_aqk_tiles=d_aqk_low, d_a_tiles=d_a_low, chunk_id=chunk_id, i_b=i_b, j_b=j_b
        )
        rows_a, rows_q = _earlier_columns(
            d_a=d_a,
            m_q=m_q,
            ref=ref,
            c_k=c_k,
            c_cum=c_cum,
            rows_a=rows_a,
            rows_q=rows_q,
            DOT_PRECISION=DOT_PRECISION,
        )
    col = tl.zeros([BLOCK, BK], dtype=tl.float32)
    for j_b in range(i_b + 1, n_blocks):
        c_q, c_k, c_beta, c_cum = _load_pair_block(
            q=q,
            k=k,
            beta=beta,
            cum_g=cum_g,
            q_norm=q_norm,
            k_norm=k_norm,
            start=start,
            remaining=remaining,
            i_b=j_b,
            i_h=i_h,
            i_hv=i_hv,
            offs_k=offs_k,
            cum_last=cum_last,
            H=H,
            HV=HV,
            K=K,
            USE_L2NORM=USE_L2NORM,
            USE_BETA_SIGMOID=USE_BETA_SIGMOID,
        )
        c_ref, _c_up, c_k_in, c_q_in = _open_rows(
            r_q=c_q, r_k=c_k, r_cum=c_cum, dot_dtype=dot_dtype
        )
        d_a, m_q = _pair_tiles(
            d_aqk_tiles=d_aqk_low, d_a_tiles=d_a_low, chunk_id=chunk_id, i_b=j_b, j_b=i_b
        )
        col = _later_rows(
            d_a=d_a,
            m_q=m_q,
            r_beta=c_beta,
            ref=c_ref,
            k_in=c_k_in,
            q_in=c_q_in,
            c_cum=r_cum,
            col=col,
            DOT_PRECISION=DOT_PRECISION,
        )
    _finish_rows(
        d_aqk_tiles=d_aqk_tiles,
        d_a_tiles=d_a_tiles,
        d_cum_rows=d_cum_rows,
        dq_rows=dq_rows,
        dk_rows=dk_rows,
        dbeta_part=dbeta_part,
        start=start,
        remaining=remaining,
        chunk_id=chunk_id,
        i_b=i_b,
        i_hv=i_hv,
        i_k=i_k,
        offs_k=offs_k,
        r_q=r_q,
        r_k=r_k,
        r_beta=r_beta,
        r_cum=r_cum,
        ref=ref,
        up=up,
        rows_a=rows_a,
        rows_q=rows_q,
        col=col,
        HV=HV,
        K=K,
        N_K=N_K,
        DENSE=SAFE_GATE or CHUNKS == "bounded",
        DIAGONAL_PRECISION=DIAGONAL_PRECISION,
    )


# The prepare flags chunk_bwd_pairs_kernel takes.
PAIRS_FLAGS = ("SAFE_GATE", "USE_L2NORM", "USE_BETA_SIGMOID", "IS_VARLEN", "DOT_PRECISION")
# Key columns and pipeline stages of a pairs program on CUDA, its warps by the diagonal
# blocks' path, and the diagonal blocks' fp32 products with bf16 / fp16 inputs: three
# bf16 tensor-core products of the operands' high and low halves ("bf16x3", ~16
# significant bits) in place of FMA ("ieee"). Chosen by ``launch_sweep.py --only pairs``
# and ``ab.py``: with the FMA products a program took 4 warps and 64 columns, its tiles
# in the FMA layouts at 255 registers; with the tensor-core products a warp holds a
# 32-column program, eight an SM (the dyadic path's four dots a level want two warps).
PAIRS_COLUMNS, PAIRS_STAGES = 32, 1
PAIRS_WARPS = {"dense": 1, "dyadic": 2}
DIAGONAL_PRECISION = "bf16x3"


def pair_columns(block_k: int, device: torch.device) -> int:
    """Key columns a program of ``chunk_bwd_pairs_kernel`` takes (``key_columns``)."""
    return key_columns(block_k, PAIRS_COLUMNS, device)


def pair_warps(chunks: str) -> int:
    """Warps of a pairs launch over ``chunks`` (the kernel's ``CHUNKS``): the dyadic path's
    for the unbounded chunks, else the dense one's (``PAIRS_WARPS``)."""
    return PAIRS_WARPS["dyadic" if chunks == "unbounded" else "dense"]


def diagonal_precision(dot_precision: str, device: torch.device) -> str:
    """The ``input_precision`` of the diagonal blocks' fp32 dots: ``DIAGONAL_PRECISION``
    on CUDA for inputs whose dots are tf32 (bf16 / fp16), else exact (fp32 inputs, and the
    interpreter, which has no split-bf16 products)."""
    return DIAGONAL_PRECISION if device.type == "cuda" and dot_precision != "ieee" else "ieee"


def launch_pairs(
    q,
    k,
    beta,
    cu_seqlens,
    cum_g,
    q_norm,
    k_norm,
    d_aqk_tiles,
    d_a_tiles,
    pair_low_tiles,
    unbounded,
    length,
    layout: Layout,
    dq_hat,
    dk_hat,
    d_cum,
    dbeta_part,
) -> None:
    """``chunk_bwd_pairs_kernel`` over every row block, key-column block, chunk and value
    head: one dense launch with the safe gate, else the launch over the chunks
    ``unbounded`` does not flag and the one over those it does."""
    heads, head_k = q.shape[2], q.shape[3]
    value_heads = beta.shape[2]
    n_seqs, offsets, n_chunks, flags = (
        layout.n_seqs,
        layout.chunk_offsets,
        layout.n_chunks,
        layout.flags,
    )
    pair_k = pair_columns(layout.block_k, q.device)
    n_pair_k = cdiv(head_k, pair_k)
    shape = dict(
        H=heads,
        HV=value_heads,
        K=head_k,
        BK=layout.block_k,
        BN=next_power_of_2(n_seqs),
        CHUNK=CHUNK,
        BLOCK=BLOCK.value,
    )
    if flags["SAFE_GATE"]:
        pair_passes, unbounded = ("all",), None
    else:
        pair_passes = ("bounded", "unbounded")
    pair_flags = {name: flags[name] for name in PAIRS_FLAGS}
    diagonal = diagonal_precision(flags["DOT_PRECISION"], q.device)
    d_aqk_low, d_a_low = pair_low_tiles
    for chunks in pair_passes:
        chunk_bwd_pairs_kernel[(n_chunks * 4 * n_pair_k, value_heads)](
            q=q,
            k=k,
            beta=beta,
            cu_seqlens=cu_seqlens,
            chunk_offsets=offsets,
            cum_g=cum_g,
            q_norm=q_norm,
            k_norm=k_norm,
            d_aqk_tiles=d_aqk_tiles,
            d_a_tiles=d_a_tiles,
            d_aqk_low=d_aqk_low,
            d_a_low=d_a_low,
            unbounded=unbounded,
            length=length,
            n_seqs=n_seqs,
            dq_rows=dq_hat,
            dk_rows=dk_hat,
            d_cum_rows=d_cum,
            dbeta_part=dbeta_part,
            **dict(shape, BK=pair_k),
            **pair_flags,
            DIAGONAL_PRECISION=diagonal,
            CHUNKS=chunks,
            num_warps=pair_warps(chunks),
            num_stages=PAIRS_STAGES,
        )
