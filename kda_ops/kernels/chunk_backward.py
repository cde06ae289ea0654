"""Chunkwise KDA / Gated DeltaNet backward in six kernels, from the chunk-start states the
training forward's recurrence kernel keeps (or, when nothing was kept, that kernel run
here on kernel 1's intermediates).

Notation per chunk of C = 64 tokens and value head (as in ``kernels/chunk.py``): q̂, k̂ the
(l2-normalised) rows, β, in-chunk cumulative log-decay G (Γ = exp(G), Γ_C its last row),
``A = tril(β (K̂ ⊙ Γ)(K̂ / Γ)ᵀ, -1)``, ``T = (I + A)⁻¹``, ``w = T β (K̂ ⊙ Γ)``,
``u = T β V``, ``qg = scale Q̂ ⊙ Γ``, ``kd = K̂ ⊙ Γ_C / Γ``,
``Aqk = scale tril((Q̂ ⊙ Γ)(K̂ / Γ)ᵀ)``; with S the state entering the chunk,
``v_new = u - w S``, ``O = qg S + Aqk v_new``, ``S' = diag(Γ_C) S + kdᵀ v_new``.

1. ``chunk_bwd_prepare_kernel``, token-parallel (grid: chunks × value heads): the
   forward's prepare program (``prepare_chunks``, its four 16-row blocks in registers:
   w, qg, kd, u in the input dtype, Aqk, the chunks' total log-decay), which here also
   stores G (fp32), the 64×64 inverse T by blocks (fp32: the backward applies Tᵀ, so it
   needs T itself, not just T applied to the forward's right-hand sides) and, with the
   l2norm, the rows' inverse norms (fp32). The forward's ``chunk_recurrence_kernel``
   (``scan_chunks``) then writes the chunk-start states from w, u, kd.
   In training, the forward runs this kernel instead of the inference prepare
   (``launch_chunk_kda_training``) and keeps what the backward needs; by default all but
   G, w, u, qg, kd (kernel 1 then does not store G), of which ``chunk_bwd_recompute_kernel``
   rebuilds all but u (read only by the recurrence, whose states are kept) from the inputs
   and T: the gate's cumsum and a whole-chunk product instead of the block solve.
2. ``chunk_bwd_state_kernel``, head-parallel (grid: value blocks × sequences × heads).
   Walks the chunks backwards carrying dS (fp32, K × V in registers):
   ``dv_new = Aqkᵀ dO + kd dS'``, ``dS = diag(Γ_C) dS' + qgᵀ dO - wᵀ dv_new``. Stores
   dv_new (fp32), dS' of every chunk (q's dtype, at the chunk's global number) and dS of the
   first chunk (the initial state's gradient). It never needs S itself.
3. ``chunk_bwd_wy_kernel``, token-parallel, on all 64 rows, in two passes. By value
   blocks: recomputes ``u = T β V`` and ``v_new = u - w S``, computes ``dRu = Tᵀ dv_new``
   (so ``dv = β dRu``) and accumulates ``dAqk = dO v_newᵀ`` and dRu's terms of dA and
   dbeta. Then by key blocks, contracting over all of V at once: ``dqg = dO Sᵀ``,
   ``dkd = v_new dS'ᵀ``, ``dRw = Tᵀ dw = -dRu Sᵀ``, the decay term of Γ_C and dRw's
   terms of ``dA = -(dRu uᵀ + dRw wᵀ)`` and dbeta; writes dv and the row-local parts of
   dq, dk, dG, dbeta.
4. ``chunk_bwd_pairs_kernel``, token-parallel, one program a 16-row block and split over
   the key columns (grid: chunks × column blocks of 64 × 4 row blocks, value heads):
   every pair term is a per-column product. A program takes its block's pair terms of A
   and Aqk (q̂ / k̂ / G / β gradients): its rows against the earlier blocks' columns, its
   columns against the later blocks' rows (one other block at a time, in a loop), and
   its diagonal block, and adds them to kernel 3's row gradients. What sums over the
   columns comes back as one share per column block (dβ), which kernel 5 adds.
5. ``chunk_bwd_gate_kernel``, token-parallel and split over the key columns: the reverse
   in-chunk cumsum of dG, the gate-activation backward and per-chunk shares of dA_log and
   d dt_bias (the scalar gate's dg also as column-block shares); the first column block's
   programs also complete dβ (kernel 3's part plus kernel 4's shares, then the beta
   sigmoid's backward): the first kernel after all of them are written.
6. ``chunk_bwd_qk_kernel``, token-parallel: dq, dk from the per-value-head gradients of
   the l2-normalised rows, summing each head's value-head group, then the l2norm
   backward (a whole-row product, hence not in kernel 4).

Saved versus recomputed: the training forward's recurrence writes the chunk states S (q's
dtype; 0.27 GB in bf16 at T = 8192, 64 heads, K = V = 128) as it goes, and the forward
keeps them: writing them costs the forward a fraction of what running that
head-parallel scan again would cost the backward.
Kernel 1's outputs are made once, not per value block (kernel 2 reads them serially per
chunk, kernel 3 needs T, and recomputing them per value block would repeat the O(C² K)
work): by the training forward, which keeps Aqk and T (fp32; about 0.28 GB at that shape)
and, with ``disable_recompute``, G, w, u, qg, kd too (1.4 GB with the states); by the backward
itself when nothing was kept (``kda::chunk``'s own autograd, when that op is called
directly), which then also runs the recurrence for S.
Rebuilding G, w, qg and kd from the inputs and T costs a cumsum and a product a chunk,
and writes G (0.27 GB there) in the backward instead of holding it from the
forward; recomputing Aqk and T would cost the whole of kernel 1, a large share of the
step, so they are kept. u and v_new are recomputed in kernel 3 (one C × C and one C × K
product per value block) rather than stored. Kernel 3's first pass hands v_new and dRu
to its second through memory (input dtype, as the products that read them): one pass
over V with the three ``[C, K]`` row gradients accumulated in registers does not fit the
registers and spills; by key blocks each is one dot. Kernel 4 needs row blocks of what
kernel 3 builds on 64 rows: dA goes over T's buffer and scale·dAqk over Aqk's (neither
is needed any more) unless they were kept by the forward without the rows (the default
training path: a graph may be backpropagated again, so they get fresh buffers), the
row-local gradients into fp32 dq / dk / dG / dbeta buffers that kernel 4 reads back and
completes.
Kernels 3 and 4 are separate because they only communicate through memory anyway, and
apart each needs fewer registers. Kernel 4 takes one program a 16-row block and 64 key
columns: a program over a whole chunk either re-loads (and re-normalises) every other
row block for each of its blocks or, its four row blocks unrolled, holds them all and
spills; a program of one row block holds one other block at a time and fits its
registers, two programs an SM (the dense launch without spills). The gate's backward,
whose reverse cumsum runs across the blocks, is apart (kernel 5).

Numerics: every pair factor exp(G_i - G_j) (i >= j) is split at a reference row p with
j <= p <= i so both halves are at most 1; p is the first row of the 16-row block of i.
Inside a diagonal block, the safe gate (``-5 <= lower_bound < 0``, not fp16) bounds the
growing half by e^75 and the block is a dense dot; every other gate splits the block's
pairs dyadically there, as the forward does (every factor at most 1; ``dyadic_level``).
Accumulation is fp32; products with S / dS, dO and v_new use the input dtype (bf16 tensor
cores), products with T use fp32 operands (tf32). The gate gradient is a difference:
every pair term enters dG at its row and, negated, at its column, so the diagonal blocks
of kernel 4 take exact fp32 products (see ``_dense_diagonal_grads``). dβ_i = Σ_j dA_ij
(k̂_i · k̂_j e^{..}) is taken as k̂_i e^{G_i - ref} · (Σ_j dA_ij k̂_j e^{ref - G_j}), the
sum A's row term already forms, rather than by a K Kᵀ dot.
"""

from collections.abc import Sequence
from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from kda_ops.kernels.chunk import (
    BLOCK,
    CHUNK,
    LOG2_BLOCK,
    activate_gate,
    beta_rows,
    block_cumsum,
    dot_block,
    dyadic_level,
    inverse_norm,
    locate_chunk,
    prepare_chunks,
    prepare_flags,
    prepare_warps,
    scan_chunks,
    scan_launch,
    sequence_span,
    unit_rows,
)
from kda_ops.kernels.fast_exp import fast_exp
from kda_ops.kernels.gate import gate_activation, gate_parameters
from kda_ops.kernels.sizes import cdiv, next_power_of_2
from kda_ops.reference import chunk_offsets as sequence_chunk_offsets
from kda_ops.reference import chunk_state_rows


@triton.jit
def _load_unit_rows(x, tokens, rows_in, i_h, H: tl.constexpr, K: tl.constexpr, offs_k,
                    USE_L2NORM: tl.constexpr):  # fmt: skip
    """Rows of q or k ``[R, BK]`` fp32, l2-normalised with ``USE_L2NORM``; zero outside."""
    mask = rows_in[:, None] & (offs_k < K)[None, :]
    offsets = (tokens * H + i_h)[:, None] * K + offs_k[None, :]
    return unit_rows(tl.load(x + offsets, mask=mask, other=0.0), USE_L2NORM)


@triton.jit
def _stored_norms(norm, tokens, rows_in, i_hv, HV: tl.constexpr, USE_L2NORM: tl.constexpr):
    """``[R]`` fp32 factors that l2-normalise whole rows of q or k, as
    ``chunk_bwd_prepare_kernel`` stored them (``[B, T, HV]``; ones without ``USE_L2NORM``),
    for kernels that load rows a block of columns at a time."""
    factors = tl.full([tokens.shape[0]], 1.0, dtype=tl.float32)
    if USE_L2NORM:
        factors = tl.load(norm + tokens * HV + i_hv, mask=rows_in, other=0.0)
    return factors


@triton.jit
def _load_normed_rows(x, norm, tokens, rows_in, i_h, i_hv, H: tl.constexpr, HV: tl.constexpr,
                      K: tl.constexpr, offs_k, USE_L2NORM: tl.constexpr):  # fmt: skip
    """Rows of q or k ``[R, BK]`` fp32 on the columns ``offs_k``, l2-normalised by their
    whole rows' factors as kernel 1 stored them (``_stored_norms``); zero outside."""
    raw = _load_unit_rows(x, tokens, rows_in, i_h, H, K, offs_k, False)
    return raw * _stored_norms(norm, tokens, rows_in, i_hv, HV, USE_L2NORM)[:, None]


@triton.jit
def _load_cum_rows(cum_g, tokens, rows_in, i_hv, HV: tl.constexpr, K: tl.constexpr, offs_k,
                   cum_last):  # fmt: skip
    """Cumulative log-decay rows ``[R, BK]``; rows past the sequence hold the chunk's last
    value (padding decays nothing, so every pair factor stays <= 1)."""
    mask = rows_in[:, None] & (offs_k < K)[None, :]
    rows = tl.load(cum_g + (tokens * HV + i_hv)[:, None] * K + offs_k[None, :], mask=mask,
                   other=0.0)  # fmt: skip
    return tl.where(rows_in[:, None], rows, cum_last[None, :])


@triton.jit
def _load_beta_rows(beta, tokens, rows_in, i_hv, HV: tl.constexpr,
                    USE_BETA_SIGMOID: tl.constexpr):  # fmt: skip
    """β ``[R]`` fp32 (after the sigmoid with ``USE_BETA_SIGMOID``, the forward's
    ``beta_rows``), zero outside."""
    raw = tl.load(beta + tokens * HV + i_hv, mask=rows_in, other=0.0)
    return beta_rows(raw, rows_in, USE_BETA_SIGMOID)


@triton.jit
def _l2norm_backward(x, tokens, rows_in, i_h, H: tl.constexpr, K: tl.constexpr, offs_k,
                     d_unit):  # fmt: skip
    """The gradient of raw rows of q or k ``[R, BK]`` from that of their l2-normalised
    rows: ``(d - x̂ (x̂ · d)) / sqrt(|x|² + eps)``."""
    raw = _load_unit_rows(x, tokens, rows_in, i_h, H, K, offs_k, False)
    inv_norm = inverse_norm(raw)
    unit = raw * inv_norm[:, None]
    return (d_unit - unit * tl.sum(unit * d_unit, axis=1)[:, None]) * inv_norm[:, None]


@triton.jit
def _gate_input(g, dt_bias, tokens, rows_in, i_hv, HV: tl.constexpr, K: tl.constexpr,
                offs_k, BK: tl.constexpr, SCALAR_GATE: tl.constexpr,
                HAS_DT_BIAS: tl.constexpr):  # fmt: skip
    """``g (+ dt_bias)`` rows ``[R, BK]`` fp32; a scalar (GDN) gate is broadcast over the
    K channels."""
    mask_k = offs_k < K
    if SCALAR_GATE:
        x = tl.load(g + tokens * HV + i_hv, mask=rows_in, other=0.0).to(tl.float32)
        if HAS_DT_BIAS:
            x += tl.load(dt_bias + i_hv).to(tl.float32)
        x = x[:, None] + tl.zeros([1, BK], dtype=tl.float32)
    else:
        x = tl.load(g + (tokens * HV + i_hv)[:, None] * K + offs_k[None, :],
                    mask=rows_in[:, None] & mask_k[None, :], other=0.0).to(tl.float32)  # fmt: skip
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
def _row(x, sub, j):
    """Row j of a 2-D block, as a vector over its columns."""
    return tl.sum(tl.where(sub[:, None] == j, x, 0.0), axis=0)


@triton.jit
def _column(x, sub, j):
    """Column j of a 2-D block, as a vector over its rows."""
    return tl.sum(tl.where(sub[None, :] == j, x, 0.0), axis=1)


@triton.jit
def _dyadic_diagonal_grads(d_a, r_beta, m_q, r_q, r_k, r_cum):
    """Gradients of one diagonal block of the pair matrices ``P_ij = Σ_c x_ic k_jc
    e^{G_ic - G_jc}`` (x = k for A, x = q for Aqk) given the cotangents dA (strictly
    lower, scaled by β_i in A) and m_q (Aqk's, lower), exact for any gate. Returns
    (dk from A's rows, dq from Aqk's rows, dk from both columns, dβ = Σ_j dA_ij (K K)_ij).

    The pairs j < i go through the levels of the dyadic split (``dyadic_level``), whose
    factors (<= 1) scale the rows and the columns of four dots a level; Aqk's r == c terms
    need no decay and are added directly. Products are fp32 and the dots exact, as in
    ``_dense_diagonal_grads`` and for the same reason: a pair term's two ends in dG, at its
    row and at its column, must be rounded alike."""
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
        a_rows = tl.dot(pair_a, k_f, input_precision="ieee")
        row_k += r_beta[:, None] * factor * a_rows
        d_beta += tl.sum(k_f * a_rows, axis=1)
        row_q += factor * tl.dot(pair_q, k_f, input_precision="ieee")
        col_f = tl.dot(tl.trans(pair_a), r_beta[:, None] * k_f, input_precision="ieee")
        col_f += tl.dot(tl.trans(pair_q), r_q * factor, input_precision="ieee")
        col += factor * col_f
    return row_k, row_q, col, d_beta


@triton.jit
def _dense_diagonal_grads(d_a, r_beta, m_q, r_q, r_k, r_cum, ref, up):
    """``_dyadic_diagonal_grads``'s gradients by dense dots with the pair factors split at
    the block's first row ``ref`` (for blocks decaying within ``PAIRS_DENSE_LIMIT`` (chunk.py), so
    that the growing half e^{ref - G} stays below e^75); ``up = e^{G - ref}``
    ``[BLOCK, BK]``.

    Operands stay fp32 and the dots exact whatever the inputs' dtype: each pair term
    enters dG twice, at its row (through k e^{ref - G}) and negated at its column (through
    q or k e^{G - ref}), and only cancels in dg, the reverse cumsum, when both ends are
    rounded alike. The diagonal block holds the largest terms (Aqk's r == c term, which
    cancels exactly, and the least decayed pairs): with bf16 operands dg is off by
    percents, and dA_log / d dt_bias, sums over tokens, by far more."""
    down = tl.exp(ref[None, :] - r_cum)
    k_up = r_k * up
    k_down = r_k * down
    # Σ_j dA_ij k_j e^{ref - G_j} gives A's row term (times β_i e^{G_i - ref}) and dβ
    # (dotted with k_i e^{G_i - ref}): no K Kᵀ dot.
    a_rows = tl.dot(d_a, k_down, input_precision="ieee")
    row_q = tl.dot(m_q, k_down, input_precision="ieee") * up
    col = tl.dot(tl.trans(r_beta[:, None] * d_a), k_up, input_precision="ieee")
    col = (col + tl.dot(tl.trans(m_q), r_q * up, input_precision="ieee")) * down
    return r_beta[:, None] * up * a_rows, row_q, col, tl.sum(k_up * a_rows, axis=1)


@triton.jit
def _load_pair_block(q, k, beta, cum_g, q_norm, k_norm, start, remaining, i_b, i_h, i_hv,
                     offs_k, cum_last, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr,
                     USE_L2NORM: tl.constexpr, USE_BETA_SIGMOID: tl.constexpr):  # fmt: skip
    """Row block i_b of the chunk on the key columns ``offs_k``: q̂, k̂, G ``[BLOCK, BK]``
    fp32 and β ``[BLOCK]``. The rows are normalised by their full-row norms, which
    ``chunk_bwd_prepare_kernel`` stored (``[B, T, HV]`` fp32): a program sees only its
    columns."""
    sub = tl.arange(0, BLOCK)
    tokens = start + i_b * BLOCK + sub
    rows_in = i_b * BLOCK + sub < remaining
    r_q = _load_normed_rows(q, q_norm, tokens, rows_in, i_h, i_hv, H, HV, K, offs_k, USE_L2NORM)
    r_k = _load_normed_rows(k, k_norm, tokens, rows_in, i_h, i_hv, H, HV, K, offs_k, USE_L2NORM)
    r_beta = _load_beta_rows(beta, tokens, rows_in, i_hv, HV, USE_BETA_SIGMOID)
    r_cum = _load_cum_rows(cum_g, tokens, rows_in, i_hv, HV, K, offs_k, cum_last)
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
def chunk_bwd_prepare_kernel(
    q, k, v, g, beta, A_log, dt_bias, cu_seqlens, chunk_offsets,
    scale, lower_bound, length, n_seqs,
    cum_g, w, u, qg, kd, aqk, solve, chunk_decay, q_norm, k_norm, unbounded, redo,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr,
    BV: tl.constexpr, BN: tl.constexpr,
    SCALAR_GATE: tl.constexpr, USE_GATE: tl.constexpr, HAS_DT_BIAS: tl.constexpr,
    USE_LOWER_BOUND: tl.constexpr, SAFE_GATE: tl.constexpr, USE_L2NORM: tl.constexpr,
    USE_BETA_SIGMOID: tl.constexpr, IS_VARLEN: tl.constexpr, DOT_PRECISION: tl.constexpr,
    CHUNKS: tl.constexpr,
):  # fmt: skip
    """The forward's prepare (``prepare_chunks``: w, qg, kd in q's dtype, u in v's, the
    chunk's total log-decay) with what the backward also reads, for the tokens of chunk
    i_c and value head i_hv: cum_g (fp32 ``[B, T, HV, K]``), at ``[i_c, i_hv]`` of
    ``[n_chunks, HV, C, C]`` Aqk in q's dtype (causal part only; blocks above the
    diagonal are left unwritten) and fp32 T (likewise); with ``USE_L2NORM`` the inverse
    norms of the q and k rows (fp32 ``[B, T, HV]``) for the WY and pairs kernels, which
    read a row a block of key columns at a time; without the safe gate, at
    ``unbounded[i_c, i_hv]`` (int8) whether a row block of the chunk decays past the pairs
    kernel's dense limit in some channel. ``redo`` and ``CHUNKS``: the forward's two
    launches without the safe gate (``chunk.py``)."""
    prepare_chunks(q, k, v, g, beta, A_log, dt_bias, cu_seqlens, chunk_offsets, scale,
                   lower_bound, length, n_seqs, chunk_decay, w, u, qg, kd, aqk, redo, cum_g,
                   solve, q_norm, k_norm, unbounded, H, HV, K, V, BK, BV, BN, SCALAR_GATE,
                   USE_GATE, HAS_DT_BIAS, USE_LOWER_BOUND, SAFE_GATE, USE_L2NORM,
                   USE_BETA_SIGMOID, IS_VARLEN, DOT_PRECISION, CHUNKS)  # fmt: skip


@triton.jit
def chunk_bwd_state_kernel(
    w, qg, kd, aqk, cum_g, grad_o, grad_final_state, cu_seqlens, chunk_offsets, length,
    dv_new, dstates, grad_initial_state,
    HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    CHUNK: tl.constexpr, HAS_INITIAL_STATE: tl.constexpr, IS_VARLEN: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """Reverse scan over the chunks of sequence i_n, value head i_hv, value columns of
    block i_v. Writes dv_new (fp32 ``[B, T, HV, V]``), dstates (``[n_chunks, HV, K, V]``
    in its buffer's dtype: the gradient of the state leaving each chunk) and, with
    ``HAS_INITIAL_STATE``, the initial state's gradient (fp32 ``[N, HV, K, V]``)."""
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_hv = i_nh // HV, i_nh % HV
    bos, seq_len, first_chunk = sequence_span(i_n, cu_seqlens, chunk_offsets, length, IS_VARLEN)
    offs_k = tl.arange(0, BK)
    offs_v = i_v * BV + tl.arange(0, BV)
    mask_k = offs_k < K
    mask_v = offs_v < V
    dot_dtype = qg.dtype.element_ty

    tile_offsets = offs_k[:, None] * V + offs_v[None, :]  # within one [K, V] state
    state_mask = mask_k[:, None] & mask_v[None, :]
    d_state = tl.load(grad_final_state + i_nh.to(tl.int64) * K * V + tile_offsets,
                      mask=state_mask, other=0.0)  # fmt: skip

    rows = tl.arange(0, CHUNK)
    causal_t = rows[:, None] <= rows[None, :]  # Aqkᵀ's causal part
    n_chunks = tl.cdiv(seq_len, CHUNK)
    for step in range(0, n_chunks):
        c = n_chunks - 1 - step
        tokens = bos + c * CHUNK + rows
        in_seq = c * CHUNK + rows < seq_len
        token_offsets = (tokens * HV + i_hv)[:, None]
        mask_rows_k = in_seq[:, None] & mask_k[None, :]
        mask_rows_v = in_seq[:, None] & mask_v[None, :]
        chunk_id = (first_chunk + c).to(tl.int64) * HV + i_hv
        tl.store(dstates + chunk_id * K * V + tile_offsets,
                 d_state.to(dstates.dtype.element_ty), mask=state_mask)  # fmt: skip
        b_w = tl.load(w + token_offsets * K + offs_k[None, :], mask=mask_rows_k, other=0.0)
        b_qg = tl.load(qg + token_offsets * K + offs_k[None, :], mask=mask_rows_k, other=0.0)
        b_kd = tl.load(kd + token_offsets * K + offs_k[None, :], mask=mask_rows_k, other=0.0)
        b_do = tl.load(grad_o + token_offsets * V + offs_v[None, :], mask=mask_rows_v,
                       other=0.0).to(dot_dtype)  # fmt: skip
        # Aqkᵀ loaded as such (tile element (j, i) from Aqk's row i), not transposed after
        # the load: with a bf16 Aqk, ``tl.trans`` of the loaded tile read shared memory out
        # of range (compute-sanitizer, Triton 3.6).
        b_aqk_t = tl.load(aqk + (chunk_id * CHUNK + rows)[None, :] * CHUNK + rows[:, None],
                          mask=causal_t, other=0.0)  # fmt: skip
        last = tl.minimum(seq_len - c * CHUNK, CHUNK) - 1
        decay_last = tl.exp(tl.load(cum_g + ((bos + c * CHUNK + last) * HV + i_hv) * K + offs_k,
                                    mask=mask_k, other=0.0))  # fmt: skip

        b_dv = tl.dot(b_aqk_t.to(dot_dtype), b_do, input_precision=DOT_PRECISION)
        b_dv += tl.dot(b_kd.to(dot_dtype), d_state.to(dot_dtype), input_precision=DOT_PRECISION)
        tl.store(dv_new + token_offsets * V + offs_v[None, :], b_dv, mask=mask_rows_v)
        d_state = d_state * decay_last[:, None]
        d_state += tl.dot(tl.trans(b_qg.to(dot_dtype)), b_do, input_precision=DOT_PRECISION)
        d_state -= tl.dot(tl.trans(b_w.to(dot_dtype)), b_dv.to(dot_dtype),
                          input_precision=DOT_PRECISION)  # fmt: skip
    if HAS_INITIAL_STATE:
        tl.store(grad_initial_state + i_nh.to(tl.int64) * K * V + tile_offsets, d_state,
                 mask=state_mask)  # fmt: skip


@triton.jit
def chunk_bwd_wy_kernel(
    q, k, v, beta, cu_seqlens, chunk_offsets, cum_g, q_norm, k_norm, w, chunk_states, dstates,
    grad_o, dv_new, scale, length, n_seqs,
    solve, d_aqk_tiles, d_a_tiles, d_aqk_low, d_a_low, v_new_rows, d_ru_rows, dq_rows,
    dk_rows, d_cum_rows, dv, dbeta,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, BV_STEP: tl.constexpr, BK_STEP: tl.constexpr,
    BN: tl.constexpr, CHUNK: tl.constexpr,
    USE_L2NORM: tl.constexpr, USE_BETA_SIGMOID: tl.constexpr, IS_VARLEN: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """For chunk i_c and value head i_hv, on all 64 rows: everything that goes through S,
    dS' and T, in two passes so that no ``[C, K]`` accumulator lives across a loop:

    1. by value blocks of BV_STEP: u = T β V, v_new = u - w S, dRu = Tᵀ dv_new (both
       stored for pass 2 in ``v_new_rows`` / ``d_ru_rows``, q's dtype ``[B, T, HV, V]``),
       dv = β dRu, dAqk = dO v_newᵀ, and dRu's terms of dA and dbeta;
    2. by key blocks of BK_STEP, contracting over all of V (BV, padded) at once:
       dqg = dO Sᵀ, dkd = v_new dS'ᵀ, dRw = -dRu Sᵀ, the decay term of Γ_C, dRw's terms of
       dA and dbeta, and the row gradients of these key columns.

    Writes dv (v's dtype, final), the row-local parts of dq, dk (of the l2-normalised
    rows, per value head), dG (all three fp32 ``[B, T, HV, K]``) and dbeta (fp32
    ``[B, T, HV]``), dA into ``d_a_tiles`` and scale·dAqk into ``d_aqk_tiles`` (both
    ``[C, C]`` fp32 a chunk, zero above the diagonal, strictly lower for dA; they may be
    the buffers of T (``solve``, read once, first) and of Aqk, which it does not read) and,
    when given, both again in the dot dtype into ``d_a_low`` / ``d_aqk_low`` (the pairs
    kernel's off-diagonal tiles; dA's fp32 buffer then gets only its diagonal 16 × 16
    tiles. Masking scale·dAqk's store as well, before pass 2, would add spills)."""
    i_c, i_hv = tl.program_id(0), tl.program_id(1)
    i_h = i_hv // (HV // H)
    start, remaining = locate_chunk(i_c, cu_seqlens, chunk_offsets, n_seqs, length, BN,
                                    IS_VARLEN)  # fmt: skip
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
    b_beta = _load_beta_rows(beta + start * HV, rows, in_seq, i_hv, HV, USE_BETA_SIGMOID)
    b_t = tl.load(solve + square + in_square, mask=rows[:, None] >= rows[None, :], other=0.0)
    b_w = tl.load(w + key_base + row_offsets * K + offs_k[None, :],
                  mask=in_seq[:, None] & mask_k[None, :], other=0.0).to(dot_dtype)  # fmt: skip
    d_aqk = tl.zeros([CHUNK, CHUNK], dtype=tl.float32)
    d_a = tl.zeros([CHUNK, CHUNK], dtype=tl.float32)
    d_beta = tl.zeros([CHUNK], dtype=tl.float32)
    for i_v in range(0, tl.cdiv(V, BV_STEP)):
        offs_v = i_v * BV_STEP + tl.arange(0, BV_STEP)
        mask_v = offs_v < V
        mask_rows_v = in_seq[:, None] & mask_v[None, :]
        value_offsets = row_offsets * V + offs_v[None, :]
        b_s = tl.load(chunk_states + state + offs_k[:, None] * V + offs_v[None, :],
                      mask=mask_k[:, None] & mask_v[None, :], other=0.0)  # fmt: skip
        b_v = tl.load(v + value_base + value_offsets, mask=mask_rows_v, other=0.0).to(tl.float32)
        b_do = tl.load(grad_o + value_base + value_offsets, mask=mask_rows_v,
                       other=0.0).to(dot_dtype)  # fmt: skip
        b_dvn = tl.load(dv_new + value_base + value_offsets, mask=mask_rows_v, other=0.0)
        b_u = tl.dot(b_t, b_beta[:, None] * b_v, input_precision=DOT_PRECISION)
        v_new = b_u - tl.dot(b_w, b_s.to(dot_dtype), input_precision=DOT_PRECISION)
        v_new = v_new.to(dot_dtype)
        d_aqk += tl.dot(b_do, tl.trans(v_new), input_precision=DOT_PRECISION)
        d_ru = tl.dot(tl.trans(b_t), b_dvn, input_precision=DOT_PRECISION)
        tl.store(dv + value_base + value_offsets,
                 (b_beta[:, None] * d_ru).to(dv.dtype.element_ty), mask=mask_rows_v)  # fmt: skip
        tl.store(v_new_rows + value_base + value_offsets, v_new, mask=mask_rows_v)
        tl.store(d_ru_rows + value_base + value_offsets, d_ru.to(dot_dtype), mask=mask_rows_v)
        d_beta += tl.sum(d_ru * b_v, axis=1)
        d_a -= tl.dot(d_ru, tl.trans(b_u), input_precision=DOT_PRECISION)
    tl.debug_barrier()  # pass 2 reads what other threads stored; T is not read again
    d_aqk = tl.where(rows[:, None] >= rows[None, :], scale * d_aqk, 0.0)
    tl.store(d_aqk_tiles + square + in_square, d_aqk)
    if d_aqk_low is not None:
        tl.store(d_aqk_low + square + in_square, d_aqk.to(dot_dtype))

    offs_v = tl.arange(0, BV)
    mask_v = offs_v < V
    mask_rows_v = in_seq[:, None] & mask_v[None, :]
    value_offsets = row_offsets * V + offs_v[None, :]
    b_do = tl.load(grad_o + value_base + value_offsets, mask=mask_rows_v,
                   other=0.0).to(dot_dtype)  # fmt: skip
    v_new = tl.load(v_new_rows + value_base + value_offsets, mask=mask_rows_v, other=0.0)
    d_ru = tl.load(d_ru_rows + value_base + value_offsets, mask=mask_rows_v, other=0.0)
    q_chunk = q + start * H * K
    k_chunk = k + start * H * K
    cum_chunk = cum_g + start * HV * K
    q_factors = _stored_norms(q_norm + start * HV, rows, in_seq, i_hv, HV, USE_L2NORM)
    k_factors = _stored_norms(k_norm + start * HV, rows, in_seq, i_hv, HV, USE_L2NORM)
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
        w_keys = tl.load(w + key_base + key_offsets, mask=mask_rows_kb,
                         other=0.0).to(tl.float32)  # fmt: skip
        d_a -= tl.dot(d_rw, tl.trans(w_keys), input_precision=DOT_PRECISION)

        cum_last = tl.load(cum_chunk + (last * HV + i_hv) * K + offs_kb, mask=mask_kb,
                           other=0.0)  # fmt: skip
        b_q = _load_unit_rows(q_chunk, rows, in_seq, i_h, H, K, offs_kb, False)
        b_k = _load_unit_rows(k_chunk, rows, in_seq, i_h, H, K, offs_kb, False)
        b_q *= q_factors[:, None]
        b_k *= k_factors[:, None]
        b_cum = _load_cum_rows(cum_chunk, rows, in_seq, i_hv, HV, K, offs_kb, cum_last)
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
        tl.store(dq_rows + key_base + key_offsets, d_q, mask=mask_rows_kb)
        tl.store(dk_rows + key_base + key_offsets, d_k, mask=mask_rows_kb)
        tl.store(d_cum_rows + key_base + key_offsets, d_cum, mask=mask_rows_kb)
    tl.store(dbeta + start * HV + rows * HV + i_hv, d_beta, mask=in_seq)
    d_a = tl.where(rows[:, None] > rows[None, :], d_a, 0.0)
    if d_a_low is None:
        tl.store(d_a_tiles + square + in_square, d_a)
    else:  # fp32 only where the pairs kernel reads it: the diagonal tiles
        diagonal = rows[:, None] // BLOCK == rows[None, :] // BLOCK
        tl.store(d_a_tiles + square + in_square, d_a, mask=diagonal)
        tl.store(d_a_low + square + in_square, d_a.to(dot_dtype))


@triton.jit
def _open_rows(r_q, r_k, r_cum, dot_dtype: tl.constexpr):
    """A row block's reference (G of its first row, ``[BK]``), ``up = e^{G - ref}`` (<= 1,
    ``[BLOCK, BK]`` fp32) and its k̂, q̂ times ``up`` in the dot dtype, the row side of its
    pairs with earlier blocks."""
    ref = _row(r_cum, tl.arange(0, BLOCK), 0)
    up = tl.exp(r_cum - ref[None, :])
    return ref, up, (r_k * up).to(dot_dtype), (r_q * up).to(dot_dtype)


@triton.jit
def _load_row_grads(dq_rows, dk_rows, d_cum_rows, offsets, mask):
    """A row block's dq̂, dk̂, dG so far (fp32 tiles at ``offsets``)."""
    return (tl.load(dq_rows + offsets, mask=mask, other=0.0),
            tl.load(dk_rows + offsets, mask=mask, other=0.0),
            tl.load(d_cum_rows + offsets, mask=mask, other=0.0))  # fmt: skip


@triton.jit
def _finish_rows(d_aqk_tiles, d_a_tiles, d_cum_rows, dq_rows, dk_rows, dbeta_part, start,
                 remaining, chunk_id, i_b, i_hv, i_k, offs_k, r_q, r_k, r_beta, r_cum, ref, up,
                 rows_a, rows_q, col, HV: tl.constexpr, K: tl.constexpr, N_K: tl.constexpr,
                 DENSE: tl.constexpr):  # fmt: skip
    """Completes row block i_b once its pairs with every other block are in: ``rows_a``,
    ``rows_q`` its rows against earlier columns (``_earlier_columns``), ``col`` its columns
    against later rows (``_later_rows``). Adds the diagonal block (``DENSE``: fp32 dots at
    ``ref``, for blocks decaying within ``PAIRS_DENSE_LIMIT`` (chunk.py); else dyadic),
    adds everything to the row-local gradients of ``chunk_bwd_wy_kernel`` in place (dq̂,
    dk̂, dG fp32) and stores this column block's share of dβ (``[B, T, HV, N_K]`` fp32)."""
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
    old_q, old_k, old_cum = _load_row_grads(dq_rows, dk_rows, d_cum_rows, offsets, mask)
    d_a, m_q = _pair_tiles(d_aqk_tiles, d_a_tiles, chunk_id, i_b, i_b)
    if DENSE:
        diag_k, diag_q, diag_col, d_beta = _dense_diagonal_grads(d_a, r_beta, m_q, r_q, r_k,
                                                                 r_cum, ref, up)  # fmt: skip
    else:
        diag_k, diag_q, diag_col, d_beta = _dyadic_diagonal_grads(d_a, r_beta, m_q, r_q, r_k,
                                                                  r_cum)  # fmt: skip
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
    q, k, beta, cu_seqlens, chunk_offsets, cum_g, q_norm, k_norm, d_aqk_tiles,
    d_a_tiles, d_aqk_low, d_a_low, unbounded, length, n_seqs,
    dq_rows, dk_rows, d_cum_rows, dbeta_part,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, BN: tl.constexpr,
    CHUNK: tl.constexpr, BLOCK: tl.constexpr, SAFE_GATE: tl.constexpr,
    USE_L2NORM: tl.constexpr, USE_BETA_SIGMOID: tl.constexpr, IS_VARLEN: tl.constexpr,
    DOT_PRECISION: tl.constexpr, CHUNKS: tl.constexpr,
):  # fmt: skip
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
    start, remaining = locate_chunk(i_c, cu_seqlens, chunk_offsets, n_seqs, length, BN,
                                    IS_VARLEN)  # fmt: skip
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
    cum_last = tl.load(cum_g + ((start + last) * HV + i_hv) * K + offs_k, mask=offs_k < K,
                       other=0.0)  # fmt: skip
    n_blocks = tl.minimum(tl.cdiv(remaining, BLOCK), CHUNK // BLOCK)

    r_q, r_k, r_beta, r_cum = _load_pair_block(q, k, beta, cum_g, q_norm, k_norm, start,
                                               remaining, i_b, i_h, i_hv, offs_k, cum_last, H,
                                               HV, K, USE_L2NORM, USE_BETA_SIGMOID)  # fmt: skip
    # Triton carries a name assigned before a loop and again inside it: no shared `_`.
    ref, up, _row_k_in, _row_q_in = _open_rows(r_q, r_k, r_cum, dot_dtype)
    rows_a = tl.zeros([BLOCK, BK], dtype=tl.float32)
    rows_q = tl.zeros([BLOCK, BK], dtype=tl.float32)
    for j_b in range(0, i_b):
        c_q, c_k, c_beta, c_cum = _load_pair_block(q, k, beta, cum_g, q_norm, k_norm, start,
                                                   remaining, j_b, i_h, i_hv, offs_k, cum_last,
                                                   H, HV, K, USE_L2NORM,
                                                   USE_BETA_SIGMOID)  # fmt: skip
        d_a, m_q = _pair_tiles(d_aqk_low, d_a_low, chunk_id, i_b, j_b)
        rows_a, rows_q = _earlier_columns(d_a, m_q, ref, c_k, c_cum, rows_a, rows_q,
                                          DOT_PRECISION)  # fmt: skip
    col = tl.zeros([BLOCK, BK], dtype=tl.float32)
    for j_b in range(i_b + 1, n_blocks):
        c_q, c_k, c_beta, c_cum = _load_pair_block(q, k, beta, cum_g, q_norm, k_norm, start,
                                                   remaining, j_b, i_h, i_hv, offs_k, cum_last,
                                                   H, HV, K, USE_L2NORM,
                                                   USE_BETA_SIGMOID)  # fmt: skip
        c_ref, _c_up, c_k_in, c_q_in = _open_rows(c_q, c_k, c_cum, dot_dtype)
        d_a, m_q = _pair_tiles(d_aqk_low, d_a_low, chunk_id, j_b, i_b)
        col = _later_rows(d_a, m_q, c_beta, c_ref, c_k_in, c_q_in, r_cum, col, DOT_PRECISION)
    _finish_rows(d_aqk_tiles, d_a_tiles, d_cum_rows, dq_rows, dk_rows, dbeta_part, start,
                 remaining, chunk_id, i_b, i_hv, i_k, offs_k, r_q, r_k, r_beta, r_cum, ref, up,
                 rows_a, rows_q, col, HV, K, N_K,
                 SAFE_GATE or CHUNKS == "bounded")  # fmt: skip


@triton.jit
def _finish_dbeta(beta, dbeta_rows, dbeta_part, dbeta, tokens, rows_in, i_hv, HV: tl.constexpr,
                  N_SHARES: tl.constexpr, USE_BETA_SIGMOID: tl.constexpr):  # fmt: skip
    """dβ of rows ``tokens`` (beta's dtype): kernel 3's part (``dbeta_rows``, fp32 ``[B, T,
    HV]``) plus the pairs kernel's shares (``dbeta_part``, fp32 ``[B, T, HV, N_SHARES]``),
    through the sigmoid's backward with ``USE_BETA_SIGMOID``."""
    row = tokens * HV + i_hv
    d = tl.load(dbeta_rows + row, mask=rows_in, other=0.0)
    for share in tl.static_range(N_SHARES):
        d += tl.load(dbeta_part + row * N_SHARES + share, mask=rows_in, other=0.0)
    if USE_BETA_SIGMOID:
        b = _load_beta_rows(beta, tokens, rows_in, i_hv, HV, USE_BETA_SIGMOID)
        d = d * b * (1.0 - b)
    tl.store(dbeta + row, d.to(dbeta.dtype.element_ty), mask=rows_in)


@triton.jit
def chunk_bwd_gate_kernel(
    g, A_log, dt_bias, beta, cu_seqlens, chunk_offsets, d_cum_rows, dbeta_rows, dbeta_part,
    lower_bound, length, n_seqs,
    dg, dA_log_part, ddt_part, dbeta,
    HV: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, BN: tl.constexpr,
    CHUNK: tl.constexpr, N_SHARES: tl.constexpr, SCALAR_GATE: tl.constexpr,
    USE_GATE: tl.constexpr, HAS_DT_BIAS: tl.constexpr, USE_LOWER_BOUND: tl.constexpr,
    USE_BETA_SIGMOID: tl.constexpr, IS_VARLEN: tl.constexpr,
):  # fmt: skip
    """For chunk i_c, value head i_hv and the BK key columns of block i_k: from the
    complete dG (``d_cum_rows``, fp32 ``[B, T, HV, K]``) the gate's backward: dg, the
    reverse cumsum of dG inside the chunk (G_i = Σ_{s <= i} g_s) through the gate
    activation (g's dtype and shape; for the scalar gate this block's share, fp32 ``[B, T,
    HV, N_K]``), and at row ``i_c * HV + i_hv`` the shares of dA_log (``[.., N_K]``) and d
    dt_bias (``[.., K]``, or ``[.., N_K]`` for the scalar gate). Block 0 also completes the
    chunk's dβ (``_finish_dbeta``)."""
    N_K = (K + BK - 1) // BK
    i_c, i_k, i_hv = tl.program_id(0) // N_K, tl.program_id(0) % N_K, tl.program_id(1)
    start, remaining = locate_chunk(i_c, cu_seqlens, chunk_offsets, n_seqs, length, BN,
                                    IS_VARLEN)  # fmt: skip
    if remaining <= 0:
        return
    rows = tl.arange(0, CHUNK)
    tokens = start + rows
    rows_in = rows < remaining
    offs_k = i_k * BK + tl.arange(0, BK)
    mask_k = offs_k < K
    offsets = (tokens * HV + i_hv)[:, None] * K + offs_k[None, :]
    d_cum = tl.load(d_cum_rows + offsets, mask=rows_in[:, None] & mask_k[None, :], other=0.0)
    if USE_GATE:
        x = _gate_input(g, dt_bias, tokens, rows_in, i_hv, HV, K, offs_k, BK, SCALAR_GATE,
                        HAS_DT_BIAS)  # fmt: skip
        rate = tl.exp(tl.load(A_log + i_hv).to(tl.float32))
    # After the loads above: a load placed after a store (dβ's) would wait for it.
    if i_k == 0:
        _finish_dbeta(beta, dbeta_rows, dbeta_part, dbeta, tokens, rows_in, i_hv, HV, N_SHARES,
                      USE_BETA_SIGMOID)  # fmt: skip
    d_raw = tl.cumsum(d_cum, axis=0, reverse=True)
    if SCALAR_GATE:  # one gate shared by the K channels: this program's share of them
        d_raw = tl.sum(tl.where(mask_k[None, :], d_raw, 0.0), axis=1)[:, None] + tl.zeros(
            [1, BK], dtype=tl.float32
        )
        channel = tl.arange(0, BK) == 0  # the column that stands for the raw gate
    else:
        channel = mask_k
    if USE_GATE:
        d_raw, d_rate = _gate_activation_backward(d_raw, x, rate, lower_bound, USE_LOWER_BOUND)
        used = rows_in[:, None] & channel[None, :]
        chunk_id = (i_c * HV + i_hv).to(tl.int64)
        tl.store(dA_log_part + chunk_id * N_K + i_k, tl.sum(tl.where(used, d_rate, 0.0)))
        d_dt = tl.sum(tl.where(used, d_raw, 0.0), axis=0)
        if SCALAR_GATE:
            tl.store(ddt_part + chunk_id * N_K + i_k, tl.sum(d_dt, axis=0))
        else:
            tl.store(ddt_part + chunk_id * K + offs_k, d_dt, mask=mask_k)
    if SCALAR_GATE:
        tl.store(dg + (tokens * HV + i_hv) * N_K + i_k, _column(d_raw, tl.arange(0, BK), 0),
                 mask=rows_in)  # fmt: skip
    else:
        tl.store(dg + offsets, d_raw.to(dg.dtype.element_ty),
                 mask=rows_in[:, None] & mask_k[None, :])  # fmt: skip


@triton.jit
def chunk_bwd_qk_kernel(
    x, d_unit, n_tokens,
    dx,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, BT: tl.constexpr,
    USE_L2NORM: tl.constexpr,
):  # fmt: skip
    """The gradient of q or k (``[B, T, H, K]``, its dtype) for BT tokens of head i_h from
    the per-value-head gradients of its l2-normalised rows (``[B, T, HV, K]`` fp32): the
    sum over the head's value-head group, then the l2norm backward. Apart from the pairs
    kernel because that one sees only some key columns, and the l2norm backward needs a
    whole row."""
    i_t, i_h = tl.program_id(0), tl.program_id(1)
    tokens = i_t.to(tl.int64) * BT + tl.arange(0, BT)
    rows_in = tokens < n_tokens
    offs_k = tl.arange(0, BK)
    mask = rows_in[:, None] & (offs_k < K)[None, :]
    d = tl.zeros([BT, BK], dtype=tl.float32)
    for i_g in range(0, HV // H):
        d += tl.load(d_unit + (tokens * HV + i_h * (HV // H) + i_g)[:, None] * K
                     + offs_k[None, :], mask=mask, other=0.0)  # fmt: skip
    if USE_L2NORM:
        d = _l2norm_backward(x, tokens, rows_in, i_h, H, K, offs_k, d)
    tl.store(dx + (tokens * H + i_h)[:, None] * K + offs_k[None, :], d.to(dx.dtype.element_ty),
             mask=mask)  # fmt: skip


@triton.jit
def chunk_bwd_recompute_kernel(
    q, k, g, beta, A_log, dt_bias, cu_seqlens, chunk_offsets, solve, q_norm, k_norm,
    scale, lower_bound, length, n_seqs,
    cum_g, w, qg, kd,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BK: tl.constexpr,
    BN: tl.constexpr, SCALAR_GATE: tl.constexpr, USE_GATE: tl.constexpr,
    HAS_DT_BIAS: tl.constexpr, USE_LOWER_BOUND: tl.constexpr, USE_L2NORM: tl.constexpr,
    USE_BETA_SIGMOID: tl.constexpr, IS_VARLEN: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """G (fp32) and w, qg, kd (input dtype) of chunk i_c and value head i_hv (module
    docstring; ``[B, T, HV, K]``) from the raw inputs and kernel 1's T, without the solve,
    for key columns block i_s (BK wide, the last possibly past K, masked): G as the
    forward's gate activation and a 64-row cumsum (the forward sums by 16-row blocks: the
    same to fp32 rounding), ``w = T β (K̂ ⊙ Γ)`` as a 64-row product, ``qg = scale Q̂ ⊙
    Γ``, ``kd = K̂ ⊙ Γ_C / Γ`` (every factor <= 1). The l2norm factors are kernel 1's
    (``q_norm``, ``k_norm``), so that a program needs only its columns; the beta sigmoid is
    the forward's (``beta_rows``). Each output is stored as soon as it is made, so that few
    tiles are live at once. Not u: only the recurrence reads it, and the training forward
    keeps that recurrence's chunk states."""
    i_c, i_hv, i_s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_h = i_hv // (HV // H)
    start, remaining = locate_chunk(i_c, cu_seqlens, chunk_offsets, n_seqs, length, BN,
                                    IS_VARLEN)  # fmt: skip
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
    gate_rate, gate_bias = gate_parameters(A_log, dt_bias, i_hv, offs_k, offs_k < K, K,
                                           SCALAR_GATE, USE_GATE, HAS_DT_BIAS)  # fmt: skip
    # Padding rows add no decay, so the total is Γ_C: G at the last row, from the same
    # scan (its own order of additions, so equal to that row up to fp32 rounding).
    decay, decay_last = block_cumsum(
        activate_gate(raw_g, gate_rate, gate_bias, lower_bound, rows_in, offs_k < K, BK, 64,
                      SCALAR_GATE, USE_GATE, HAS_DT_BIAS, USE_LOWER_BOUND),
        64, BK,
    )  # fmt: skip
    tl.store(cum_g + key_offsets, decay, mask=mask_k)
    from_start = fast_exp(decay)
    r_q = _load_normed_rows(q, q_norm, tokens, rows_in, i_h, i_hv, H, HV, K, offs_k,
                            USE_L2NORM)  # fmt: skip
    tl.store(qg + key_offsets, (scale * r_q * from_start).to(qg.dtype.element_ty),
             mask=mask_k)  # fmt: skip
    r_k = _load_normed_rows(k, k_norm, tokens, rows_in, i_h, i_hv, H, HV, K, offs_k,
                            USE_L2NORM)  # fmt: skip
    # Γ_C from this scan, not kernel 1's chunk decays: at |G| ~ 100 (the safe gate's range)
    # an ulp of G is ~1e-5, and G's rounding cancels only within one summation.
    b_kd = r_k * fast_exp(decay_last[None, :] - decay)
    tl.store(kd + key_offsets, b_kd.to(kd.dtype.element_ty), mask=mask_k)
    # T's tiles above the diagonal are never written; inside the diagonal ones the
    # upper triangle is zero.
    t = tl.load(solve + (chunk_id * 64 + rows)[:, None] * 64 + rows[None, :])
    t = tl.where(rows[:, None] >= rows[None, :], t, 0.0)
    r_beta = _load_beta_rows(beta, tokens, rows_in, i_hv, HV, USE_BETA_SIGMOID)
    b_w = tl.dot(t, r_beta[:, None] * r_k * from_start, input_precision=DOT_PRECISION)
    tl.store(w + key_offsets, b_w.to(w.dtype.element_ty), mask=mask_k)


class SavedForBackward(NamedTuple):
    """What the backward's prepare kernel (kernel 1) leaves for the rest of the backward;
    the training forward (``launch_chunk_kda_training``) keeps it, or all but its last
    ``len(ROWS)`` fields, so that the backward does not run kernel 1 again. With R chunk
    rows (``chunk_state_rows``): Aqk and T fp32 ``[R, HV, 64, 64]``; the chunks' total
    log-decay fp32 ``[R, HV, K]``; the inverse norms of the q and k rows fp32 ``[B, T,
    HV]``; without the safe gate the int8 ``[R, HV]`` flags of the chunks the pairs kernel
    takes dyadically (unused with it); the state entering every chunk ``[R, HV, K, V]`` in
    q's dtype (written by the forward's recurrence, or by the backward's own when kernel 1
    ran there); then the rows: G fp32 ``[B, T, HV, K]`` (``None``
    when kernel 1 did not store it), w, qg, kd ``[B, T, HV, K]`` in q's dtype and u ``[B,
    T, HV, V]`` in v's, which ``chunk_bwd_recompute_kernel`` rebuilds from the rest and the
    inputs (all but u, which the kept chunk states make unnecessary)."""

    aqk: Tensor
    solve: Tensor
    chunk_decay: Tensor
    q_norm: Tensor
    k_norm: Tensor
    unbounded: Tensor
    chunk_states: Tensor
    cum_g: Optional[Tensor]
    w: Tensor
    u: Tensor
    qg: Tensor
    kd: Tensor


ROWS = ("cum_g", "w", "u", "qg", "kd")  # SavedForBackward's last fields
# The prepare flags chunk_bwd_recompute_kernel, the pairs and the gate kernels take.
RECOMPUTE_FLAGS = ("SCALAR_GATE", "USE_GATE", "HAS_DT_BIAS", "USE_LOWER_BOUND", "USE_L2NORM",
                   "USE_BETA_SIGMOID", "IS_VARLEN", "DOT_PRECISION")  # fmt: skip
PAIRS_FLAGS = ("SAFE_GATE", "USE_L2NORM", "USE_BETA_SIGMOID", "IS_VARLEN", "DOT_PRECISION")
GATE_FLAGS = ("SCALAR_GATE", "USE_GATE", "HAS_DT_BIAS", "USE_LOWER_BOUND", "USE_BETA_SIGMOID",
              "IS_VARLEN")  # fmt: skip
# chunk_bwd_recompute_kernel's key columns a program and warps: 64 at 2 warps, faster than
# more warps or 32 or 128 columns although 2 warps take every register and a little stack
# (``benchmarks/launch_sweep.py --only rebuild``).
REBUILD_COLUMNS, REBUILD_WARPS = 64, 2


# Key columns a program of the pairs kernel on CUDA: 64, two programs an SM without
# spills; 32 columns fit three, but each program reloads the pair tiles and the row norms
# for half the work, and the step is slower (``launch_sweep.py --only pairs``). The gate
# kernel: 32 columns at 1 warp, the fastest of 16 to 128 columns at 1 to 4 warps
# (``launch_sweep.py --only gate``).
PAIRS_COLUMNS, PAIRS_STAGES = 64, 1
GATE_COLUMNS, GATE_WARPS = 32, 1
# The WY kernel's value and key steps (its loops over V and over K) and pipeline stages
# (bf16 / fp16 inputs): at 16 key columns a step the key loop spills less than at 32 but
# takes twice the trips (``launch_sweep.py --only wy`` sweeps the sizes).
WY_VALUE_STEP, WY_KEY_STEP, WY_STAGES = 32, 32, 2
# Warps of the dS scan: 8, which at K = 128 do not spill at 32 value columns and spill
# less than 4 warps at 64 and 128.
STATE_WARPS = 8


class WyLaunch(NamedTuple):
    """How ``chunk_bwd_wy_kernel`` is launched: ``BV_STEP``, ``BK_STEP``, warps, stages."""

    value_step: int
    key_step: int
    warps: int
    stages: int


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
    return WyLaunch(value_step=min(block_v, value_step), key_step=min(block_k, key_step),
                    warps=8 if wide_v else 4, stages=WY_STAGES if itemsize <= 2 else 1)  # fmt: skip


def rebuild_blocks(head_k: int) -> tuple[int, int]:
    """(programs a chunk, key columns a program) of ``chunk_bwd_recompute_kernel``: the
    key columns split into ``REBUILD_COLUMNS``-wide blocks."""
    splits = cdiv(head_k, REBUILD_COLUMNS)
    return splits, dot_block(cdiv(head_k, splits))


class _Layout(NamedTuple):
    """Sizes and flags every kernel of the backward is launched with."""

    n_seqs: int
    chunk_offsets: Optional[Tensor]
    n_chunks: int
    block_k: int
    block_v: int
    flags: dict[str, object]
    warps: int


def _layout(
    q: Tensor,
    v: Tensor,
    g: Tensor,
    A_log: Optional[Tensor],
    dt_bias: Optional[Tensor],
    cu_seqlens: Optional[Tensor],
    lower_bound: Optional[float],
    use_qk_l2norm: bool,
    use_beta_sigmoid: bool,
) -> _Layout:
    batch, length, _, head_k = q.shape
    if cu_seqlens is None:
        n_seqs, offsets = batch, None
    else:
        n_seqs, offsets = cu_seqlens.shape[0] - 1, sequence_chunk_offsets(cu_seqlens, CHUNK)
    block_k = dot_block(head_k)
    return _Layout(
        n_seqs=n_seqs,
        chunk_offsets=offsets,
        n_chunks=chunk_state_rows(batch, length, None if cu_seqlens is None else n_seqs, CHUNK),
        block_k=block_k,
        block_v=dot_block(v.shape[3]),
        flags=prepare_flags(
            q, g, A_log, dt_bias, cu_seqlens, lower_bound, use_qk_l2norm, use_beta_sigmoid
        ),
        warps=prepare_warps(block_k),
    )


def empty_saved(q: Tensor, v: Tensor, n_chunks: int, with_g: bool = True) -> SavedForBackward:
    """Uninitialised ``SavedForBackward`` for q ``[B, T, H, K]``, v ``[B, T, HV, V]`` and
    ``n_chunks`` chunk rows (also the training op's fake outputs), G only ``with_g``.
    Separate allocations: the training op returns them, and an op's outputs may not alias
    one another. The flags exist with the safe gate too (unused), so that the shapes do not
    depend on it."""
    batch, length, _, head_k = q.shape
    value_heads, head_v = v.shape[2], v.shape[3]
    tokens = (batch, length, value_heads)
    f32 = dict(dtype=torch.float32)
    return SavedForBackward(
        # Aqk in the dot dtype: the recurrences take it in that dtype (the same rounding,
        # once, as from fp32), and a stage of their pipelines holds a tile of it.
        aqk=q.new_empty(n_chunks, value_heads, CHUNK, CHUNK),
        solve=q.new_empty(n_chunks, value_heads, CHUNK, CHUNK, **f32),
        chunk_decay=q.new_empty(n_chunks, value_heads, head_k, **f32),
        q_norm=q.new_empty(*tokens, **f32),
        k_norm=q.new_empty(*tokens, **f32),
        unbounded=q.new_empty(n_chunks, value_heads, dtype=torch.int8),
        # In the dot dtype (fp32 inputs keep fp32): every backward product takes the
        # states and their gradients in it anyway (only Γ_C's term Σ S ⊙ dS' reads them
        # rounded); in fp32 the two are 2 × 0.54 GB at B = 1, T = 8192, HV = 64, K = V = 128.
        chunk_states=q.new_empty(n_chunks, value_heads, head_k, head_v),
        cum_g=q.new_empty(*tokens, head_k, **f32) if with_g else None,
        w=q.new_empty(*tokens, head_k),
        u=v.new_empty(*tokens, head_v),
        qg=q.new_empty(*tokens, head_k),
        kd=q.new_empty(*tokens, head_k),
    )


def _prepare_backward(q, k, v, g, beta, A_log, dt_bias, cu_seqlens, scale, lower_bound,
                      layout: _Layout, with_g: bool = True) -> SavedForBackward:  # fmt: skip
    """Kernel 1 on contiguous inputs (arguments as ``launch_chunk_kda``'s), storing G only
    ``with_g``."""
    _, length, heads, head_k = q.shape
    value_heads = v.shape[2]
    saved = empty_saved(q, v, layout.n_chunks, with_g)
    # Without the safe gate the prepare kernel flags (``unbounded``) the chunks that decay
    # past the pairs kernel's dense limit; the pairs kernel then runs twice, dense and
    # dyadic chunks. As in the forward, without the safe gate a first launch takes every
    # chunk's diagonal blocks as dense dots and flags (``redo``) the chunks a second one
    # redoes dyadically.
    passes, flagged, redo = ("all",), None, None
    if not layout.flags["SAFE_GATE"]:
        passes, flagged = ("bounded", "unbounded"), saved.unbounded
        redo = torch.empty_like(flagged)
    for chunks in passes:
        chunk_bwd_prepare_kernel[(layout.n_chunks, value_heads)](
            q, k, v, g, beta, A_log, dt_bias, cu_seqlens, layout.chunk_offsets, scale,
            0.0 if lower_bound is None else lower_bound, length, layout.n_seqs,
            saved.cum_g, saved.w, saved.u, saved.qg, saved.kd, saved.aqk, saved.solve,
            saved.chunk_decay, saved.q_norm, saved.k_norm, flagged, redo,
            H=heads, HV=value_heads, K=head_k, V=v.shape[3], BK=layout.block_k,
            BV=layout.block_v, BN=next_power_of_2(layout.n_seqs), **layout.flags,
            CHUNKS=chunks, num_warps=layout.warps,
        )  # fmt: skip
    return saved


def _rebuild_rows(q, k, v, g, beta, A_log, dt_bias, cu_seqlens, scale, lower_bound,
                  kept: Sequence[Tensor], layout: _Layout) -> SavedForBackward:  # fmt: skip
    """``SavedForBackward`` from its fields but the rows (``kept``), the rows written by
    ``chunk_bwd_recompute_kernel`` into fresh tensors (contiguous inputs). Not u (``None``):
    only the recurrence reads it, and the kept chunk states are that recurrence's output."""
    batch, length, heads, head_k = q.shape
    value_heads = v.shape[2]
    tokens_shape = (batch, length, value_heads)
    cum_g = q.new_empty(*tokens_shape, head_k, dtype=torch.float32)
    w, qg, kd = (q.new_empty(*tokens_shape, head_k) for _ in range(3))
    kept = SavedForBackward(*kept, *(None,) * len(ROWS))
    flags = layout.flags
    splits, block_k = rebuild_blocks(head_k)
    chunk_bwd_recompute_kernel[(layout.n_chunks, value_heads, splits)](
        q, k, g, beta, A_log, dt_bias, cu_seqlens, layout.chunk_offsets, kept.solve,
        kept.q_norm, kept.k_norm, scale, 0.0 if lower_bound is None else lower_bound, length,
        layout.n_seqs,
        cum_g, w, qg, kd,
        H=heads, HV=value_heads, K=head_k, BK=block_k,
        BN=next_power_of_2(layout.n_seqs),
        **{name: flags[name] for name in RECOMPUTE_FLAGS}, num_warps=REBUILD_WARPS,
    )  # fmt: skip
    return kept._replace(cum_g=cum_g, w=w, qg=qg, kd=kd)


def _scan_saved(saved: SavedForBackward, initial_state: Optional[Tensor],
                cu_seqlens: Optional[Tensor], layout: _Layout, o: Optional[Tensor],
                final_state: Tensor) -> None:  # fmt: skip
    """The forward's recurrence over kernel 1's outputs: fills ``saved.chunk_states`` and
    ``final_state``, and ``o`` when given."""
    scan_chunks((saved.w, saved.u, saved.qg, saved.kd, saved.aqk, saved.chunk_decay),
                initial_state, cu_seqlens, layout.chunk_offsets, o, final_state,
                saved.chunk_states, layout.flags["DOT_PRECISION"])  # fmt: skip


def launch_chunk_kda_training(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    A_log: Optional[Tensor],
    dt_bias: Optional[Tensor],
    initial_state: Optional[Tensor],
    cu_seqlens: Optional[Tensor],
    scale: float,
    lower_bound: Optional[float],
    use_qk_l2norm: bool,
    use_beta_sigmoid: bool,
    keep_rows: bool = True,
) -> tuple[Tensor, Tensor, tuple[Tensor, ...]]:
    """``launch_chunk_kda`` (same arguments, o and final state) for training: the
    prepare step is the backward's kernel 1, whose outputs are returned for
    ``launch_chunk_kda_backward(..., saved=)`` (``SavedForBackward``; without the rows
    unless ``keep_rows``): about 0.55 GB without the rows, 1.4 GB with them, at B = 1,
    T = 8192, H = 64, bf16 (step times against FLA's in ``benchmarks/README.md``)."""
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    layout = _layout(q, v, g, A_log, dt_bias, cu_seqlens, lower_bound, use_qk_l2norm,
                     use_beta_sigmoid)  # fmt: skip
    saved = _prepare_backward(q, k, v, g, beta, A_log, dt_bias, cu_seqlens, scale, lower_bound,
                              layout, with_g=keep_rows)  # fmt: skip
    if initial_state is not None:
        initial_state = initial_state.contiguous()
    o = torch.empty_like(v)
    final_state = q.new_empty(layout.n_seqs, v.shape[2], q.shape[3], v.shape[3],
                              dtype=torch.float32)  # fmt: skip
    _scan_saved(saved, initial_state, cu_seqlens, layout, o, final_state)
    return o, final_state, saved if keep_rows else saved[: -len(ROWS)]


def launch_chunk_kda_backward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    A_log: Optional[Tensor],
    dt_bias: Optional[Tensor],
    initial_state: Optional[Tensor],
    cu_seqlens: Optional[Tensor],
    grad_o: Tensor,
    grad_final_state: Tensor,
    scale: float,
    lower_bound: Optional[float],
    use_qk_l2norm: bool,
    use_beta_sigmoid: bool,
    saved: Optional[Sequence[Tensor]] = None,
) -> tuple[Tensor, ...]:
    """Gradients of ``launch_chunk_kda`` (same arguments, shapes and dtypes) given
    ``grad_o`` ``[B, T, HV, V]`` (v's dtype) and ``grad_final_state`` ``[N, HV, K, V]``
    fp32. Returns the gradients of (q, k, v, g, beta, A_log, dt_bias, initial_state), each
    in its input's dtype and shape; an absent optional input gets an empty tensor
    (``kda::delta_rule_backward``'s convention). No host sync, varlen included.
    ``saved``: kernel 1's outputs from ``launch_chunk_kda_training`` (then kernel 1 does
    not run). Without the rows, ``chunk_bwd_recompute_kernel`` rebuilds them and ``saved``
    is only read; with them, the backward overwrites its Aqk, T and, when K == V, qg and
    kd (they serve one backward).

    Scratch, with R chunk rows (``chunk_state_rows``): the chunk states and their
    gradients (``[R, HV, K, V]`` each, q's dtype), dv_new, three row-gradient buffers (fp32
    ``[B, T, HV, K or V]``), v_new and dRu (input dtype), dβ's shares over the key-column
    blocks, and unless given, ``SavedForBackward``; at B = 1, T = 8192, HV = 64, K = V =
    128, bf16, about 2.5 GB besides the outputs."""
    q, k, v, g, beta, grad_o = (x.contiguous() for x in (q, k, v, g, beta, grad_o))
    grad_final_state = grad_final_state.to(torch.float32).contiguous()
    if initial_state is not None:
        initial_state = initial_state.contiguous()
    batch, length, heads, head_k = q.shape
    value_heads, head_v = v.shape[2], v.shape[3]
    layout = _layout(q, v, g, A_log, dt_bias, cu_seqlens, lower_bound, use_qk_l2norm,
                     use_beta_sigmoid)  # fmt: skip
    # Kept tensors are scratch only when kept with their rows (disable_recompute).
    owns_saved = saved is None or len(saved) == len(SavedForBackward._fields)
    if saved is None:  # nothing kept: kernel 1 and the recurrence for the chunk states here
        saved = _prepare_backward(q, k, v, g, beta, A_log, dt_bias, cu_seqlens, scale,
                                  lower_bound, layout)  # fmt: skip
        final_state = q.new_empty(layout.n_seqs, value_heads, head_k, head_v,
                                  dtype=torch.float32)  # fmt: skip
        _scan_saved(saved, initial_state, cu_seqlens, layout, None, final_state)
    elif not owns_saved:
        saved = _rebuild_rows(q, k, v, g, beta, A_log, dt_bias, cu_seqlens, scale, lower_bound,
                              saved, layout)  # fmt: skip
    aqk, solve, chunk_decay, q_norm, k_norm, unbounded, chunk_states, cum_g, w, u, qg, kd = saved
    del saved  # so that, when kernel 1 ran here, u is freed once dead
    n_seqs, offsets, n_chunks = layout.n_seqs, layout.chunk_offsets, layout.n_chunks
    block_k, block_v, flags = layout.block_k, layout.block_v, layout.flags
    f32 = dict(device=q.device, dtype=torch.float32)
    precision = flags["DOT_PRECISION"]
    shape = dict(H=heads, HV=value_heads, K=head_k, BK=block_k,
                 BN=next_power_of_2(n_seqs), CHUNK=CHUNK, BLOCK=BLOCK.value)  # fmt: skip
    lower = 0.0 if lower_bound is None else lower_bound
    # fp32 inputs (the accuracy path) are not pipelined: their tiles are twice as large.
    pipelined = q.dtype != torch.float32
    wy = wy_launch(block_k, block_v, q.element_size())
    tokens_shape = (batch, length, value_heads)

    del u, chunk_decay

    dv_new = torch.empty(*tokens_shape, head_v, **f32)
    dstates = torch.empty_like(chunk_states)
    d_initial = None if initial_state is None else torch.empty_like(grad_final_state)
    # Its loop loads the forward recurrence's five tiles a chunk (dO for u); fp32 inputs
    # are not pipelined (above).
    split_v, stages = scan_launch(block_k, block_v, n_seqs * value_heads, q.device,
                                  q.element_size(), aqk.element_size(), True,
                                  pipelined)  # fmt: skip
    chunk_bwd_state_kernel[(cdiv(head_v, split_v), n_seqs * value_heads)](
        w, qg, kd, aqk, cum_g, grad_o, grad_final_state, cu_seqlens, offsets, length,
        dv_new, dstates, d_initial,
        HV=value_heads, K=head_k, V=head_v, BK=block_k, BV=split_v, CHUNK=CHUNK,
        HAS_INITIAL_STATE=initial_state is not None, IS_VARLEN=cu_seqlens is not None,
        DOT_PRECISION=precision, num_warps=STATE_WARPS, num_stages=stages,
    )  # fmt: skip

    # The WY kernel's pass 1 to pass 2, v_new and dRu, over qg and kd (dead: only the scan
    # reads them) when K == V.
    if head_k == head_v:
        v_new_rows, d_ru_rows = qg, kd
    else:
        v_new_rows, d_ru_rows = (q.new_empty(*tokens_shape, head_v) for _ in range(2))
    del qg, kd
    # dA and scale·dAqk (fp32) over T and Aqk (read no more) unless another backward may
    # need them; over Aqk only where it is fp32 (it is kept in the dot dtype).
    d_a_tiles = solve if owns_saved else torch.empty_like(solve)
    d_aqk_tiles = aqk if owns_saved and aqk.dtype == torch.float32 else torch.empty_like(solve)
    # The pairs kernel's off-diagonal tiles in the dot dtype: half the bytes (bf16 / fp16),
    # loaded up front (they enter its dots in that dtype anyway). fp32 inputs: none, the
    # pairs kernel reads every tile from the fp32 buffers.
    if q.dtype == torch.float32:
        d_a_low = d_aqk_low = None
        pair_low_tiles = (d_aqk_tiles, d_a_tiles)
    else:
        d_a_low, d_aqk_low = (torch.empty_like(solve, dtype=q.dtype) for _ in range(2))
        pair_low_tiles = (d_aqk_low, d_a_low)
    dq_hat, dk_hat, d_cum = (torch.empty(*tokens_shape, head_k, **f32) for _ in range(3))
    dv = torch.empty_like(v)
    dbeta_rows = torch.empty(*tokens_shape, **f32)
    chunk_bwd_wy_kernel[(n_chunks, value_heads)](
        q, k, v, beta, cu_seqlens, offsets, cum_g, q_norm, k_norm, w, chunk_states, dstates,
        grad_o, dv_new, scale, length, n_seqs, solve, d_aqk_tiles, d_a_tiles, d_aqk_low, d_a_low,
        v_new_rows, d_ru_rows, dq_hat, dk_hat, d_cum, dv, dbeta_rows,
        H=heads, HV=value_heads, K=head_k, V=head_v, BK=block_k, BV=block_v,
        BV_STEP=wy.value_step, BK_STEP=wy.key_step, BN=shape["BN"], CHUNK=CHUNK,
        USE_L2NORM=use_qk_l2norm, USE_BETA_SIGMOID=use_beta_sigmoid,
        IS_VARLEN=cu_seqlens is not None, DOT_PRECISION=precision,
        num_warps=wy.warps, num_stages=wy.stages,
    )  # fmt: skip
    # Freed before the pairs and l2norm kernels allocate theirs: the peak stays at this one.
    del w, chunk_states, dstates, dv_new, v_new_rows, d_ru_rows

    # The pairs and the gate kernels split the key columns (each its N_K blocks): the sums
    # over them come back as shares (the pairs kernel's dβ; the gate kernel's dA_log and,
    # for the scalar gate, its dg and d dt_bias).
    pair_k, gate_k = (key_columns(block_k, columns, q.device)
                      for columns in (PAIRS_COLUMNS, GATE_COLUMNS))  # fmt: skip
    n_pair_k, n_gate_k = cdiv(head_k, pair_k), cdiv(head_k, gate_k)
    scalar_gate = g.dim() == 3
    dg = torch.empty(*tokens_shape, n_gate_k, **f32) if scalar_gate else torch.empty_like(g)
    dbeta_part = torch.empty(*tokens_shape, n_pair_k, **f32)
    # Chunks' shares of the gate-parameter gradients; rows of absent varlen chunks stay 0.
    dA_log_part = torch.zeros(n_chunks, value_heads, n_gate_k, **f32)
    ddt_part = torch.zeros(n_chunks, value_heads, n_gate_k if scalar_gate else head_k, **f32)
    if flags["SAFE_GATE"]:
        pair_passes, unbounded = ("all",), None
    else:
        pair_passes = ("bounded", "unbounded")
    pair_flags = {name: flags[name] for name in PAIRS_FLAGS}
    for chunks in pair_passes:
        chunk_bwd_pairs_kernel[(n_chunks * 4 * n_pair_k, value_heads)](
            q, k, beta, cu_seqlens, offsets, cum_g, q_norm, k_norm, d_aqk_tiles, d_a_tiles,
            *pair_low_tiles, unbounded, length, n_seqs,
            dq_hat, dk_hat, d_cum, dbeta_part,
            **dict(shape, BK=pair_k), **pair_flags, CHUNKS=chunks, num_warps=4,
            num_stages=PAIRS_STAGES,
        )  # fmt: skip
    dbeta = torch.empty_like(beta)
    chunk_bwd_gate_kernel[(n_chunks * n_gate_k, value_heads)](
        g, A_log, dt_bias, beta, cu_seqlens, offsets, d_cum, dbeta_rows, dbeta_part, lower,
        length, n_seqs, dg, dA_log_part, ddt_part, dbeta,
        HV=value_heads, K=head_k, BK=gate_k, BN=shape["BN"], CHUNK=CHUNK, N_SHARES=n_pair_k,
        **{name: flags[name] for name in GATE_FLAGS}, num_warps=GATE_WARPS,
    )  # fmt: skip
    # Grouped value heads share q and k: each head sums its group before the l2norm backward.
    dq, dk = torch.empty_like(q), torch.empty_like(k)
    for x, d_unit, dx in ((q, dq_hat, dq), (k, dk_hat, dk)):
        chunk_bwd_qk_kernel[(cdiv(batch * length, 32), heads)](
            x, d_unit, batch * length, dx, H=heads, HV=value_heads, K=head_k, BK=block_k,
            BT=32, USE_L2NORM=use_qk_l2norm, num_warps=4,
        )  # fmt: skip

    if scalar_gate:
        dg = dg.sum(-1).to(g.dtype)
    # A fresh empty tensor for each absent input: an op's outputs may not alias.
    d_A_log = q.new_empty(0) if A_log is None else dA_log_part.sum((0, 2)).to(A_log.dtype)
    d_dt = ddt_part.sum(0)
    if scalar_gate:
        d_dt = d_dt.sum(-1)
    d_dt_bias = q.new_empty(0) if dt_bias is None else d_dt.flatten().to(dt_bias.dtype)
    d_initial = q.new_empty(0) if d_initial is None else d_initial.to(initial_state.dtype)
    return dq, dk, dv, dg, dbeta, d_A_log, d_dt_bias, d_initial


def key_columns(block_k: int, columns: int, device: torch.device) -> int:
    """Key columns a program of a kernel split over them (``PAIRS_COLUMNS``,
    ``GATE_COLUMNS``): ``columns`` on CUDA; off CUDA (the interpreter) 16, so that CI
    covers several column blocks."""
    return min(block_k, columns if device.type == "cuda" else 16)
