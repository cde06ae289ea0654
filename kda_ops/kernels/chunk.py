"""Chunkwise KDA / Gated DeltaNet forward in two kernels, as FlashKDA splits it.

1. ``chunk_prepare_kernel``, token-parallel (grid: chunks × value heads). Per chunk of
   C = 64 tokens, in four row blocks of 16: gate activation and in-chunk cumulative
   log-decay G, l2norm of q and k, beta sigmoid, and the UT/WY solve by block forward
   substitution, every solved block kept in registers. It stores what the recurrence
   needs: ``w = T β (K ⊙ Γ)``, ``u = T β V``, ``qg = scale Q ⊙ Γ``, ``kd = K ⊙ Γ_C / Γ``,
   ``Aqk = tril((Q ⊙ Γ)(K / Γ)ᵀ)`` and the chunk's total log-decay G_C (fp32), where
   Γ = exp(G) and ``T = (I + tril(β (K ⊙ Γ)(K / Γ)ᵀ, -1))⁻¹``.
2. ``chunk_recurrence_kernel``, head-parallel (grid: value blocks × sequences × heads).
   Walks the chunks with the fp32 state S in registers: ``v_new = u - w S``,
   ``o = qg S + Aqk v_new``, ``S = diag(Γ_C) S + kdᵀ v_new``. Chunk states are written
   to memory only when asked (``STORE_CHUNK_STATES``: the state at each chunk start, what
   a prefix cache stores, ``[n_chunks, HV, K, V]`` fp32 at the chunk's global number).

Decay ratios exp(G_i - G_j) between blocks are split at block boundaries into factors of
at most 1 (row side decayed from its block's start, column side to its block's end, and
the gap between the two blocks). Inside a diagonal block, with the safe gate
(``-5 <= lower_bound < 0``) and bf16 / fp32 inputs, the column side is scaled up by at
most e^80 (inside fp32 and bf16 range) and the block is one dense dot. Any other gate
(and fp16) takes the same dense dots first, and the chunk's block decays, computed on the
way, say whether they were in range: every block decaying by at most e^80 (e^10 for
fp16) in every channel, as real gates mostly do. A chunk where one did not is redone
with its blocks' pairs split dyadically (four levels of two dots, every factor at most
1; ``diagonal_block``), overwriting every output of the dense pass. The prepare kernel's
``CHUNKS`` picks what a launch does: ``"all"`` redoes such a chunk in the same program
(the safe gate's only path, and TensorRT's single-launch plugin); without the safe gate
``launch_chunk_kda`` launches twice, ``"bounded"`` (every chunk dense, flagging those
out of range in an int8 ``[chunks, HV]`` buffer) then ``"unbounded"`` (the flagged ones,
dyadic), so that each launch compiles one path: a kernel holding both paths spills
heavily, while the bounded launch alone compiles to about the safe gate's kernel.

Varlen needs no host sync: chunks are numbered per sequence on the device
(``chunk_offsets``) and the grid is the upper bound ``T // C + N``; programs past the
last chunk exit.

Both kernels order their parameters inputs → scalars → outputs and write every output
element the next kernel reads (``Aqk`` above the diagonal is masked on load, never
zero-filled), so they run as TensorRT AOT plugins (``lowering/tensorrt.py``)."""

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from kda_ops import reference
from kda_ops.kernels.fast_exp import fast_exp, fast_sigmoid
from kda_ops.kernels.gate import gate_activation, gate_parameters
from kda_ops.kernels.sizes import cdiv, next_power_of_2, processors, shared_memory
from kda_ops.reference import chunk_offsets as sequence_chunk_offsets
from kda_ops.reference import chunk_state_rows

CHUNK = reference.CHUNK_SIZE
BLOCK = tl.constexpr(16)  # rows of a block of the UT/WY solve; 4 blocks per chunk
LOG2_BLOCK = tl.constexpr(4)
L2NORM_EPS = tl.constexpr(reference.L2NORM_EPS)
# The backward's pairs kernel takes a diagonal block as a dense dot, factors up to
# e^{block's decay}, when it decays within e^75: the safe gate's bound (15 rows of at most
# 5), which other gates' blocks mostly meet too (``pair_limits`` of the backward's prepare
# flags the chunks where one does not).
PAIRS_DENSE_LIMIT = tl.constexpr(75.0)


@triton.jit
def locate_chunk(i_c, cu_seqlens, chunk_offsets, n_seqs, length,
                 BN: tl.constexpr, IS_VARLEN: tl.constexpr):  # fmt: skip
    """(first token of chunk i_c, tokens left in its sequence from there), both int64; none
    left for the programs of the varlen grid's upper bound that have no chunk."""
    # One return after a constexpr if/else: Triton 3.6 type-checks every return it
    # reaches, and code after an early `return` inside a constexpr branch is reached.
    if IS_VARLEN:
        seqs = tl.arange(0, BN)
        ends = tl.load(chunk_offsets + 1 + seqs, mask=seqs < n_seqs, other=2**31 - 1)
        seq = tl.sum((ends <= i_c).to(tl.int32))
        valid = seq < n_seqs
        first_chunk = tl.load(chunk_offsets + seq, mask=valid, other=0)
        bos = tl.load(cu_seqlens + seq, mask=valid, other=0).to(tl.int64)
        eos = tl.load(cu_seqlens + seq + 1, mask=valid, other=0).to(tl.int64)
        start = bos + (i_c - first_chunk).to(tl.int64) * 64
        remaining = tl.where(valid, eos - start, 0)
    else:
        n_chunks = tl.cdiv(length, 64)
        seq = i_c // n_chunks
        start = seq.to(tl.int64) * length + (i_c % n_chunks).to(tl.int64) * 64
        remaining = (seq + 1).to(tl.int64) * length - start
    return start, remaining


@triton.jit
def sequence_span(i_n, cu_seqlens, chunk_offsets, length, IS_VARLEN: tl.constexpr):
    """(first token, length, global number of the first chunk) of sequence i_n, for the
    head-parallel scans over its chunks; int64, int64, int32."""
    if IS_VARLEN:
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        seq_len = tl.load(cu_seqlens + i_n + 1).to(tl.int64) - bos
        first_chunk = tl.load(chunk_offsets + i_n).to(tl.int32)
    else:
        bos = i_n.to(tl.int64) * length
        seq_len = (i_n * 0 + length).to(tl.int64)
        first_chunk = i_n * tl.cdiv(length, 64)
    return bos, seq_len, first_chunk


@triton.jit
def inverse_unit_lower(a, DOT_PRECISION: tl.constexpr):
    """(I + a)⁻¹ for a strictly lower-triangular [BLOCK, BLOCK] fp32 a. With m = -a
    nilpotent (m^BLOCK = 0), the inverse is sum_k m^k = (I + m)(I + m²)(I + m⁴)(I + m⁸):
    six small dots instead of BLOCK dependent row updates. In ``DOT_PRECISION``: tf32 on
    tensor cores for bf16 / fp16 inputs (as the solve that uses the inverse), which moves
    their output well under its rounding; fp32 inputs keep FMA ("ieee")."""
    rows = tl.arange(0, BLOCK)
    power = -a
    inverse = (rows[:, None] == rows[None, :]).to(tl.float32) + power
    for _ in tl.static_range(LOG2_BLOCK - 1):
        power = tl.dot(power, power, input_precision=DOT_PRECISION)
        inverse += tl.dot(inverse, power, input_precision=DOT_PRECISION)
    return inverse


@triton.jit
def block_cumsum(b_g, ROWS: tl.constexpr, BK: tl.constexpr):
    """(cumulative sum over the rows of a [ROWS, BK] fp32 tile, its total [BK]), from
    one scan over the tile followed by ROWS zero rows, whose sums are all the total.
    The same as ``tl.cumsum`` and ``tl.sum`` over the rows, whose tile spreads them over
    the warps: joined with its zeros, each row's partner sits in the same thread. The
    prepare kernels, which are instruction-bound, and the backward's 64-row rebuild kernel
    compile to markedly fewer instructions this way than with those two
    (``benchmarks/ab.py`` times the forward and the training step)."""
    padded = tl.reshape(tl.permute(tl.join(b_g, tl.zeros_like(b_g)), (2, 0, 1)), [2 * ROWS, BK])
    sums = tl.permute(tl.reshape(tl.cumsum(padded, axis=0), [2, ROWS, BK]), (1, 2, 0))
    local, totals = tl.split(sums)
    # Every row of totals is the total, up to rounding: any one will do.
    return local, tl.max(totals, axis=0)


@triton.jit
def _load_block(q, k, v, g, beta, start, remaining, i_b, i_h, i_hv, offs_k, mask_k, offs_v,
                mask_v, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                SCALAR_GATE: tl.constexpr):  # fmt: skip
    """Raw inputs of row block i_b, in their storage dtype, zero past the sequence's end:
    g ([BLOCK, BK], or [BLOCK] for a scalar gate), q, k ([BLOCK, BK]), v ([BLOCK, BV]),
    beta ([BLOCK]). The kernel issues all four blocks' loads before any math, so their
    latencies overlap instead of stalling each block in turn."""
    sub = tl.arange(0, BLOCK)
    tokens = start + i_b * BLOCK + sub
    in_seq = i_b * BLOCK + sub < remaining
    mask = in_seq[:, None] & mask_k[None, :]
    value_rows = (tokens * HV + i_hv)[:, None]
    if SCALAR_GATE:
        raw_g = tl.load(g + tokens * HV + i_hv, mask=in_seq, other=0.0)
    else:
        raw_g = tl.load(g + value_rows * K + offs_k[None, :], mask=mask, other=0.0)
    key_rows = (tokens * H + i_h)[:, None] * K + offs_k[None, :]
    r_q = tl.load(q + key_rows, mask=mask, other=0.0)
    r_k = tl.load(k + key_rows, mask=mask, other=0.0)
    r_v = tl.load(v + value_rows * V + offs_v[None, :], mask=in_seq[:, None] & mask_v[None, :],
                  other=0.0)  # fmt: skip
    r_beta = tl.load(beta + tokens * HV + i_hv, mask=in_seq, other=0.0)
    return raw_g, r_q, r_k, r_v, r_beta


@triton.jit
def _reloaded(A_log, dt_bias, rate, bias, i_hv, offs_k, mask_k, K: tl.constexpr,
              SCALAR_GATE: tl.constexpr, USE_GATE: tl.constexpr, HAS_DT_BIAS: tl.constexpr,
              RELOAD: tl.constexpr):  # fmt: skip
    """``gate_parameters`` loaded again with ``RELOAD``, else ``rate`` and ``bias``."""
    if RELOAD:
        rate, bias = gate_parameters(A_log, dt_bias, i_hv, offs_k, mask_k, K, SCALAR_GATE,
                                     USE_GATE, HAS_DT_BIAS)  # fmt: skip
    return rate, bias


@triton.jit
def activate_gate(raw_g, rate, bias, lower_bound, in_seq, mask_k, BK: tl.constexpr,
                  ROWS: tl.constexpr, SCALAR_GATE: tl.constexpr, USE_GATE: tl.constexpr,
                  HAS_DT_BIAS: tl.constexpr, USE_LOWER_BOUND: tl.constexpr):  # fmt: skip
    """Activated log-decay of ROWS rows (``raw_g`` [ROWS, BK], or [ROWS] for a scalar
    gate) given ``gate_parameters``' ``rate`` and ``bias``, [ROWS, BK] fp32; 0 on padding
    rows."""
    b_g = raw_g.to(tl.float32)
    if SCALAR_GATE:
        b_g = b_g[:, None] + tl.zeros([ROWS, BK], dtype=tl.float32)
    if USE_GATE:
        if HAS_DT_BIAS:
            if SCALAR_GATE:
                b_g += bias
            else:
                b_g += bias[None, :]
        b_g = gate_activation(b_g, rate, lower_bound, USE_LOWER_BOUND)
    return tl.where(in_seq[:, None] & mask_k[None, :], b_g, 0.0)


@triton.jit
def inverse_norm(rows):
    """1 / sqrt(|row|² + eps) of each fp32 row (FLA's eps inside the square root)."""
    return tl.rsqrt(tl.sum(rows * rows, axis=1) + L2NORM_EPS)


@triton.jit
def unit_rows(rows, USE_L2NORM: tl.constexpr):
    """fp32 rows, l2-normalised when asked. One reciprocal square root per row and a
    multiply per element: a division per element is a reciprocal with Newton steps and
    range checks each."""
    rows = rows.to(tl.float32)
    if USE_L2NORM:
        rows = rows * inverse_norm(rows)[:, None]
    return rows


@triton.jit
def beta_rows(raw, rows_in, USE_BETA_SIGMOID: tl.constexpr):
    """β fp32 from its loaded values ``[R]``: through the sigmoid with ``USE_BETA_SIGMOID``
    (zero outside the sequence), as the forward and the backward must both see it."""
    beta = raw.to(tl.float32)
    if USE_BETA_SIGMOID:
        beta = tl.where(rows_in, fast_sigmoid(beta), 0.0)
    return beta


@triton.jit
def dyadic_level(level: tl.constexpr, decay, CUMULATIVE: tl.constexpr):
    """Level ``level`` (h = 2^level) of a diagonal block's dyadic split: the pairs j < i
    with i in the upper half of a 2h-row group and j in its lower half, and the factors
    that join them through the group's middle row m, exp(G_i - G_m) on upper rows and
    exp(G_m - G_j) on lower ones, both <= 1 whatever the decay. Every pair j < i of the
    block is at exactly one of the four levels, where exp(G_i - G_j) = factor_i factor_j.
    Returns (pairs [BLOCK, BLOCK] bool, factor [BLOCK, BK] fp32).

    ``decay`` is the per-token log-decay g, the exponents then sums of g over a span
    (a 0/1 span matrix's dot with g in split-tf32, "tf32x3", ~fp32 exact: plain tf32 would
    err by ~1e-3 of a decay that can reach hundreds); or with ``CUMULATIVE`` the
    cumulative log-decay G, the exponents then differences with the middle row (gathered
    by a one-hot "ieee" dot, exact)."""
    sub = tl.arange(0, BLOCK)
    half = 1 << level
    group = sub // (2 * half)
    upper = sub % (2 * half) >= half
    middle = group * 2 * half + half
    token = sub[None, :]
    if CUMULATIVE:
        at_middle = tl.dot((token == middle[:, None]).to(tl.float32), decay,
                           input_precision="ieee")  # fmt: skip
        exponent = tl.where(upper[:, None], decay - at_middle, at_middle - decay)
    else:
        span = tl.where(upper[:, None], (token > middle[:, None]) & (token <= sub[:, None]),
                        (token > sub[:, None]) & (token <= middle[:, None]))  # fmt: skip
        exponent = tl.dot(span.to(tl.float32), decay, input_precision="tf32x3")
    pairs = (group[:, None] == group[None, :]) & upper[:, None] & (token < middle[:, None])
    return pairs, tl.exp(exponent)


@triton.jit
def dense_decay_limit(DOT_DTYPE: tl.constexpr):
    """The largest in-block log-decay a dense diagonal dot may scale a row up by: e^80
    stays inside fp32 and bf16 (max ~e^88.7); fp16's max 65504 is ~e^11.1."""
    if DOT_DTYPE == tl.float16:  # noqa: SIM300 (a constexpr dtype)
        limit = 10.0
    else:
        limit = 80.0
    return limit


@triton.jit
def diagonal_block(r_q, r_k, q_in, k_in, local, decay, DOT_DTYPE: tl.constexpr,
                   SAFE_GATE: tl.constexpr, DOT_PRECISION: tl.constexpr,
                   CUMULATIVE: tl.constexpr):  # fmt: skip
    """In-block products (q_i · k_j exp(G_i - G_j), k_i · k_j exp(G_i - G_j)) for j <= i,
    ``local`` being the cumulative log-decay from a reference row at or before the
    block's start, ``q_in``, ``k_in`` the rows decayed by ``local`` and ``decay`` the
    per-token log-decay (or, with ``CUMULATIVE``, the cumulative one; ``dyadic_level``).
    Entries above the diagonal are left for the caller to mask (kk's diagonal too)."""
    if SAFE_GATE:  # local >= 16 * lower_bound >= -80: exp(-local) stays inside fp32 / bf16
        to_col = tl.trans((r_k * fast_exp(-local)).to(DOT_DTYPE))
        kk = tl.dot(k_in.to(DOT_DTYPE), to_col, input_precision=DOT_PRECISION)
        qk = tl.dot(q_in.to(DOT_DTYPE), to_col, input_precision=DOT_PRECISION)
    else:
        # Any decay, exactly: two dots a level of the dyadic split, whose factors scale
        # both the rows and the columns (only the level's pairs are kept).
        sub = tl.arange(0, BLOCK)
        qk = tl.where(sub[:, None] == sub[None, :], tl.sum(r_q * r_k, axis=1)[:, None], 0.0)
        kk = tl.zeros([BLOCK, BLOCK], dtype=tl.float32)
        for level in tl.static_range(LOG2_BLOCK):
            pairs, factor = dyadic_level(level, decay, CUMULATIVE)
            k_f = (r_k * factor).to(DOT_DTYPE)
            cols = tl.trans(k_f)
            kk += tl.where(pairs, tl.dot(k_f, cols, input_precision=DOT_PRECISION), 0.0)
            q_f = (r_q * factor).to(DOT_DTYPE)
            qk += tl.where(pairs, tl.dot(q_f, cols, input_precision=DOT_PRECISION), 0.0)
    return qk, kk


@triton.jit
def _open_block(raw_g, r_q, r_k, r_v, r_beta, gate_rate, gate_bias, scale, lower_bound, start,
                remaining, i_b, i_hv, decay_before, offs_k, mask_k, qg, aqk_rows, cum_g,
                q_norm, k_norm, HV: tl.constexpr, K: tl.constexpr, BK: tl.constexpr,
                SCALAR_GATE: tl.constexpr, USE_GATE: tl.constexpr, HAS_DT_BIAS: tl.constexpr,
                USE_LOWER_BOUND: tl.constexpr, SAFE_GATE: tl.constexpr,
                USE_L2NORM: tl.constexpr, USE_BETA_SIGMOID: tl.constexpr,
                DOT_PRECISION: tl.constexpr):  # fmt: skip
    """Row block i_b of the chunk from its raw inputs (``_load_block``), given the chunk's
    cumulative log-decay before it (``decay_before``, [BK]). Stores its qg rows and its
    diagonal Aqk tile (for the backward, given ``cum_g``, also its cumulative log-decay rows
    and, given ``q_norm`` / ``k_norm`` and with l2norm, the inverse norms of its q and k
    rows); returns

    - ``k_in``, ``q_in``: k and q decayed from the block start (factors <= 1),
    - ``k_out``: k decayed to the block end (factors <= 1), the column side of later blocks,
    - ``r_beta``, the right-hand sides ``β K Γ`` and ``β V`` of the UT/WY solve,
    - ``a_kk``: the block's own strictly lower ``β (K ⊙ Γ)(K / Γ)ᵀ`` tile,
    - ``decay_after``: the cumulative log-decay at the block's end.
    """
    sub = tl.arange(0, BLOCK)
    tokens = start + i_b * BLOCK + sub
    in_seq = i_b * BLOCK + sub < remaining
    b_g = activate_gate(raw_g, gate_rate, gate_bias, lower_bound, in_seq, mask_k, BK, BLOCK,
                        SCALAR_GATE, USE_GATE, HAS_DT_BIAS, USE_LOWER_BOUND)  # fmt: skip
    local, block_decay = block_cumsum(b_g, BLOCK, BK)  # padding rows add no decay
    rows = (tokens * HV + i_hv)[:, None] * K + offs_k[None, :]
    mask = in_seq[:, None] & mask_k[None, :]
    if cum_g is not None:
        tl.store(cum_g + rows, decay_before[None, :] + local, mask=mask)
    if q_norm is not None and USE_L2NORM:
        tl.store(q_norm + tokens * HV + i_hv, inverse_norm(r_q.to(tl.float32)), mask=in_seq)
        tl.store(k_norm + tokens * HV + i_hv, inverse_norm(r_k.to(tl.float32)), mask=in_seq)
    r_q = unit_rows(r_q, USE_L2NORM)
    r_k = unit_rows(r_k, USE_L2NORM)
    r_beta = beta_rows(r_beta, in_seq, USE_BETA_SIGMOID)
    r_v = r_v.to(tl.float32)

    from_start = fast_exp(local)
    k_in = r_k * from_start
    q_in = r_q * from_start
    qk, kk = diagonal_block(r_q, r_k, q_in, k_in, local, b_g, qg.dtype.element_ty, SAFE_GATE,
                            DOT_PRECISION, False)  # fmt: skip
    qk = tl.where(sub[:, None] >= sub[None, :], qk * scale, 0.0)
    tl.store(aqk_rows + i_b * BLOCK * (64 + 1), qk.to(aqk_rows.dtype.element_ty))
    a_kk = tl.where(sub[:, None] > sub[None, :], r_beta[:, None] * kk, 0.0)

    if SAFE_GATE:  # e^{-local} <= e^80 as in diagonal_block, whose exponentials these are
        k_out = r_k * fast_exp(-local) * fast_exp(block_decay)[None, :]
    else:
        k_out = r_k * fast_exp(block_decay[None, :] - local)
    to_chunk_start = fast_exp(decay_before)[None, :]
    rhs_w = r_beta[:, None] * k_in * to_chunk_start
    rhs_u = r_beta[:, None] * r_v
    tl.store(qg + rows, (scale * q_in * to_chunk_start).to(qg.dtype.element_ty), mask=mask)
    return k_in, q_in, k_out, r_beta, rhs_w, rhs_u, a_kk, decay_before + block_decay


@triton.jit
def _eliminate(k_in, q_in, r_beta, decay_before, col_decay_after, col_k_out, col_w, col_u,
               rhs_w, rhs_u, aqk, solve, tile_offsets, scale,
               DOT_PRECISION: tl.constexpr, ADJACENT: tl.constexpr):  # fmt: skip
    """Couples a row block to an earlier, solved column block: stores their Aqk tile (at
    ``aqk + tile_offsets``; A_ij's at ``solve + tile_offsets`` when given) and subtracts
    ``A_ij [w_j, u_j]`` from the row block's right-hand sides, which it returns. The gap
    between the column block's end and the row block's start decays the column side
    (factor <= 1), which both products share; ``ADJACENT``: the column block is the one
    just before, no gap."""
    dot_dtype = col_w.dtype
    if ADJACENT:
        col = tl.trans(col_k_out.to(dot_dtype))
    else:
        gap = fast_exp(decay_before - col_decay_after)[None, :]
        col = tl.trans((col_k_out * gap).to(dot_dtype))
    a_qk = tl.dot(q_in.to(dot_dtype), col, input_precision=DOT_PRECISION) * scale
    tl.store(aqk + tile_offsets, a_qk.to(aqk.dtype.element_ty))
    a_kk = r_beta[:, None] * tl.dot(k_in.to(dot_dtype), col, input_precision=DOT_PRECISION)
    if solve is not None:  # for T (_store_inverse), read back there
        tl.store(solve + tile_offsets, a_kk)
    minus_a = (-a_kk).to(dot_dtype)
    rhs_w = tl.dot(minus_a, col_w, acc=rhs_w, input_precision=DOT_PRECISION)
    rhs_u = tl.dot(minus_a, col_u, acc=rhs_u, input_precision=DOT_PRECISION)
    return rhs_w, rhs_u


@triton.jit
def _solve_block(inverse, rhs_w, rhs_u, w, u, start, remaining, i_b, i_hv, offs_k, mask_k,
                 offs_v, mask_v, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                 DOT_PRECISION: tl.constexpr):  # fmt: skip
    """w, u rows of a block, its ``(I + a_kk)⁻¹`` (``inverse_unit_lower``) times the
    eliminated right-hand sides; stored, and returned in the storage dtype for the later
    blocks."""
    sub = tl.arange(0, BLOCK)
    tokens = start + i_b * BLOCK + sub
    in_seq = i_b * BLOCK + sub < remaining
    b_w = tl.dot(inverse, rhs_w, input_precision=DOT_PRECISION).to(w.dtype.element_ty)
    b_u = tl.dot(inverse, rhs_u, input_precision=DOT_PRECISION).to(u.dtype.element_ty)
    rows = (tokens * HV + i_hv)[:, None]
    tl.store(w + rows * K + offs_k[None, :], b_w, mask=in_seq[:, None] & mask_k[None, :])
    tl.store(u + rows * V + offs_v[None, :], b_u, mask=in_seq[:, None] & mask_v[None, :])
    return b_w, b_u


@triton.jit
def _store_kd(kd, k_out, decay_after, chunk_decay, start, remaining, i_b, i_hv, offs_k,
              mask_k, HV: tl.constexpr, K: tl.constexpr):  # fmt: skip
    """kd rows of a block: k decayed to the chunk's end."""
    sub = tl.arange(0, BLOCK)
    tokens = start + i_b * BLOCK + sub
    in_seq = i_b * BLOCK + sub < remaining
    b_kd = k_out * fast_exp(chunk_decay - decay_after)[None, :]
    tl.store(kd + (tokens * HV + i_hv)[:, None] * K + offs_k[None, :],
             b_kd.to(kd.dtype.element_ty), mask=in_seq[:, None] & mask_k[None, :])  # fmt: skip


@triton.jit
def chunk_prepare_kernel(
    q, k, v, g, beta, A_log, dt_bias, cu_seqlens, chunk_offsets,
    scale, lower_bound, length, n_seqs,
    chunk_decay, w, u, qg, kd, aqk, unbounded,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, BN: tl.constexpr,
    SCALAR_GATE: tl.constexpr, USE_GATE: tl.constexpr, HAS_DT_BIAS: tl.constexpr,
    USE_LOWER_BOUND: tl.constexpr, SAFE_GATE: tl.constexpr, USE_L2NORM: tl.constexpr,
    USE_BETA_SIGMOID: tl.constexpr, IS_VARLEN: tl.constexpr, DOT_PRECISION: tl.constexpr,
    CHUNKS: tl.constexpr,
):  # fmt: skip
    prepare_chunks(q, k, v, g, beta, A_log, dt_bias, cu_seqlens, chunk_offsets, scale,
                   lower_bound, length, n_seqs, chunk_decay, w, u, qg, kd, aqk, unbounded,
                   None, None, None, None, None, H, HV, K, V, BK, BV, BN, SCALAR_GATE,
                   USE_GATE, HAS_DT_BIAS, USE_LOWER_BOUND, SAFE_GATE, USE_L2NORM,
                   USE_BETA_SIGMOID, IS_VARLEN, DOT_PRECISION, CHUNKS)  # fmt: skip


@triton.jit
def prepare_chunks(q, k, v, g, beta, A_log, dt_bias, cu_seqlens, chunk_offsets, scale,
                   lower_bound, length, n_seqs, chunk_decay, w, u, qg, kd, aqk, unbounded,
                   cum_g, solve, q_norm, k_norm, pair_limits,
                   H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                   BK: tl.constexpr, BV: tl.constexpr, BN: tl.constexpr,
                   SCALAR_GATE: tl.constexpr, USE_GATE: tl.constexpr,
                   HAS_DT_BIAS: tl.constexpr, USE_LOWER_BOUND: tl.constexpr,
                   SAFE_GATE: tl.constexpr, USE_L2NORM: tl.constexpr,
                   USE_BETA_SIGMOID: tl.constexpr, IS_VARLEN: tl.constexpr,
                   DOT_PRECISION: tl.constexpr, CHUNKS: tl.constexpr):  # fmt: skip
    """The body of a prepare program (chunk, value head), for ``chunk_prepare_kernel`` and,
    with the backward's extra outputs (``cum_g`` ... ``pair_limits``, or all ``None``;
    ``cum_g`` alone may be ``None``, when the backward rebuilds G), for the backward's
    prepare kernel: which chunks a launch prepares is ``CHUNKS`` (module
    docstring), ``unbounded`` holding the flags between a "bounded" and an "unbounded"
    launch."""
    i_c, i_hv = tl.program_id(0), tl.program_id(1)
    i_h = i_hv // (HV // H)
    start, remaining = locate_chunk(i_c, cu_seqlens, chunk_offsets, n_seqs, length,
                                     BN, IS_VARLEN)  # fmt: skip
    if remaining > 0:
        # fmt: off
        if CHUNKS == "unbounded":
            if tl.load(unbounded + i_c * HV + i_hv) != 0:
                _prepare_chunk(q, k, v, g, beta, A_log, dt_bias, scale, lower_bound, start,
                               remaining, i_c, i_h, i_hv, chunk_decay, w, u, qg, kd, aqk, cum_g,
                               solve, q_norm, k_norm, pair_limits, H, HV, K, V, BK, BV,
                               SCALAR_GATE, USE_GATE, HAS_DT_BIAS, USE_LOWER_BOUND, False,
                               USE_L2NORM, USE_BETA_SIGMOID, DOT_PRECISION)
        else:
            fits = _prepare_chunk(q, k, v, g, beta, A_log, dt_bias, scale, lower_bound, start,
                                  remaining, i_c, i_h, i_hv, chunk_decay, w, u, qg, kd, aqk,
                                  cum_g, solve, q_norm, k_norm, pair_limits, H, HV, K, V, BK,
                                  BV, SCALAR_GATE, USE_GATE, HAS_DT_BIAS, USE_LOWER_BOUND, True,
                                  USE_L2NORM, USE_BETA_SIGMOID, DOT_PRECISION)
            if not SAFE_GATE:
                if CHUNKS == "bounded":
                    tl.store(unbounded + i_c * HV + i_hv, (fits == 0).to(tl.int8))
                elif fits == 0:  # "all": redo this chunk here, overwriting every output
                    tl.debug_barrier()  # the dense pass's stores land first
                    _prepare_chunk(q, k, v, g, beta, A_log, dt_bias, scale, lower_bound, start,
                                   remaining, i_c, i_h, i_hv, chunk_decay, w, u, qg, kd, aqk,
                                   cum_g, solve, q_norm, k_norm, pair_limits, H, HV, K, V, BK,
                                   BV, SCALAR_GATE, USE_GATE, HAS_DT_BIAS, USE_LOWER_BOUND,
                                   False, USE_L2NORM, USE_BETA_SIGMOID, DOT_PRECISION)
        # fmt: on


@triton.jit
def _store_inverse(t_rows, t00, t11, t22, t33):
    """T = (I + A)⁻¹ of a chunk by 16-row blocks, T_IJ = -T_II Σ_{J <= L < I} A_IL T_LJ,
    over the A tiles below the diagonal that ``t_rows`` holds (tile (I, J) at
    ``t_rows + (I * 64 + J) * BLOCK``), given the diagonal inverses; overwrites them with
    T's, and T's diagonal tiles. Read back from memory, the A tiles reach these small dots
    without the compiler recomputing the dots that made them in the dots' layout."""
    tl.debug_barrier()  # every A tile stored
    tile = BLOCK * 64
    a10 = tl.load(t_rows + tile)
    a20 = tl.load(t_rows + 2 * tile)
    a21 = tl.load(t_rows + 2 * tile + BLOCK)
    a30 = tl.load(t_rows + 3 * tile)
    a31 = tl.load(t_rows + 3 * tile + BLOCK)
    a32 = tl.load(t_rows + 3 * tile + 2 * BLOCK)
    t10 = _inverse_tile(t11, _dot(a10, t00))
    t20 = _inverse_tile(t22, _dot(a20, t00) + _dot(a21, t10))
    t21 = _inverse_tile(t22, _dot(a21, t11))
    t30 = _inverse_tile(t33, _dot(a30, t00) + _dot(a31, t10) + _dot(a32, t20))
    t31 = _inverse_tile(t33, _dot(a31, t11) + _dot(a32, t21))
    t32 = _inverse_tile(t33, _dot(a32, t22))
    tl.debug_barrier()  # every A tile read
    tl.store(t_rows, t00)
    tl.store(t_rows + tile, t10)
    tl.store(t_rows + tile + BLOCK, t11)
    tl.store(t_rows + 2 * tile, t20)
    tl.store(t_rows + 2 * tile + BLOCK, t21)
    tl.store(t_rows + 2 * tile + 2 * BLOCK, t22)
    tl.store(t_rows + 3 * tile, t30)
    tl.store(t_rows + 3 * tile + BLOCK, t31)
    tl.store(t_rows + 3 * tile + 2 * BLOCK, t32)
    tl.store(t_rows + 3 * tile + 3 * BLOCK, t33)


@triton.jit
def _dot(a, b):
    """A [16, 16] fp32 product, exact (FMA)."""
    return tl.dot(a, b, input_precision="ieee")


@triton.jit
def _inverse_tile(t_diag, acc):
    """Block (I, J) of T below the diagonal, -T_II Σ_{J <= L < I} A_IL T_LJ, given T_II
    and the sum."""
    return -_dot(t_diag, acc)


@triton.jit
def _prepare_chunk(q, k, v, g, beta, A_log, dt_bias, scale, lower_bound, start, remaining,
                   i_c, i_h, i_hv, chunk_decay, w, u, qg, kd, aqk, cum_g, solve, q_norm, k_norm,
                   pair_limits, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr,
                   V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                   SCALAR_GATE: tl.constexpr, USE_GATE: tl.constexpr, HAS_DT_BIAS: tl.constexpr,
                   USE_LOWER_BOUND: tl.constexpr, SAFE_GATE: tl.constexpr,
                   USE_L2NORM: tl.constexpr, USE_BETA_SIGMOID: tl.constexpr,
                   DOT_PRECISION: tl.constexpr):  # fmt: skip
    """The prepare kernel's work on one chunk and value head (see the module docstring);
    ``SAFE_GATE``: every diagonal block's decay is known to fit a dense dot. Given ``solve``
    (the backward), also T = (I + A)⁻¹ (fp32 ``[C, C]`` tiles on and below the diagonal at
    the chunk's place, as ``aqk``), the cumulative log-decay and l2norm factors
    (``_open_block``) and whether a row block decays past ``PAIRS_DENSE_LIMIT``
    (``pair_limits``, int8, without the safe gate). Returns whether every row block
    decays within ``dense_decay_limit``."""
    offs_k = tl.arange(0, BK)
    mask_k = offs_k < K
    offs_v = tl.arange(0, BV)
    mask_v = offs_v < V
    sub = tl.arange(0, BLOCK)
    # Aqk tile (i, j) of this chunk starts at aqk_rows + (i * 64 + j) * BLOCK; T's likewise.
    square = ((i_c * HV + i_hv).to(tl.int64) * 64 + sub)[:, None] * 64 + sub[None, :]
    aqk_rows = aqk + square
    tile = BLOCK * 64  # one row block down

    # The four row blocks, unrolled so every solved block stays in registers.
    # fmt: off
    g0, q0, k0, v0, beta0 = _load_block(q, k, v, g, beta, start, remaining, 0, i_h, i_hv, offs_k,
                                        mask_k, offs_v, mask_v, H, HV, K, V, SCALAR_GATE)
    g1, q1, k1, v1, beta1 = _load_block(q, k, v, g, beta, start, remaining, 1, i_h, i_hv, offs_k,
                                        mask_k, offs_v, mask_v, H, HV, K, V, SCALAR_GATE)
    g2, q2, k2, v2, beta2 = _load_block(q, k, v, g, beta, start, remaining, 2, i_h, i_hv, offs_k,
                                        mask_k, offs_v, mask_v, H, HV, K, V, SCALAR_GATE)
    g3, q3, k3, v3, beta3 = _load_block(q, k, v, g, beta, start, remaining, 3, i_h, i_hv, offs_k,
                                        mask_k, offs_v, mask_v, H, HV, K, V, SCALAR_GATE)
    gate_rate, gate_bias = gate_parameters(A_log, dt_bias, i_hv, offs_k, mask_k, K, SCALAR_GATE,
                                           USE_GATE, HAS_DT_BIAS)
    # The launch that also keeps T (the backward's kernel 1) reloads them for each row block:
    # held across the blocks they spill there.
    reload = solve is not None

    decay0 = tl.zeros([BK], dtype=tl.float32)
    _, _, k_out0, _, rhs_w0, rhs_u0, a0, decay1 = _open_block(
        g0, q0, k0, v0, beta0, gate_rate, gate_bias, scale, lower_bound, start, remaining, 0,
        i_hv, decay0, offs_k, mask_k, qg, aqk_rows, cum_g, q_norm, k_norm, HV, K, BK, SCALAR_GATE,
        USE_GATE, HAS_DT_BIAS, USE_LOWER_BOUND, SAFE_GATE, USE_L2NORM, USE_BETA_SIGMOID,
        DOT_PRECISION)
    t00 = inverse_unit_lower(a0, DOT_PRECISION)  # off the elimination chain
    w0, u0 = _solve_block(t00, rhs_w0, rhs_u0, w, u, start, remaining, 0, i_hv, offs_k, mask_k,
                          offs_v, mask_v, HV, K, V, DOT_PRECISION)

    gate_rate, gate_bias = _reloaded(A_log, dt_bias, gate_rate, gate_bias, i_hv, offs_k, mask_k,
                                     K, SCALAR_GATE, USE_GATE, HAS_DT_BIAS, reload)
    k_in1, q_in1, k_out1, beta1, rhs_w1, rhs_u1, a1, decay2 = _open_block(
        g1, q1, k1, v1, beta1, gate_rate, gate_bias, scale, lower_bound, start, remaining, 1,
        i_hv, decay1, offs_k, mask_k, qg, aqk_rows, cum_g, q_norm, k_norm, HV, K, BK, SCALAR_GATE,
        USE_GATE, HAS_DT_BIAS, USE_LOWER_BOUND, SAFE_GATE, USE_L2NORM, USE_BETA_SIGMOID,
        DOT_PRECISION)
    t11 = inverse_unit_lower(a1, DOT_PRECISION)
    rhs_w1, rhs_u1 = _eliminate(k_in1, q_in1, beta1, decay1, decay1, k_out0, w0, u0,
                                rhs_w1, rhs_u1, aqk, solve, square + tile, scale,
                                DOT_PRECISION, True)
    w1, u1 = _solve_block(t11, rhs_w1, rhs_u1, w, u, start, remaining, 1, i_hv, offs_k, mask_k,
                          offs_v, mask_v, HV, K, V, DOT_PRECISION)

    gate_rate, gate_bias = _reloaded(A_log, dt_bias, gate_rate, gate_bias, i_hv, offs_k, mask_k,
                                     K, SCALAR_GATE, USE_GATE, HAS_DT_BIAS, reload)
    k_in2, q_in2, k_out2, beta2, rhs_w2, rhs_u2, a2, decay3 = _open_block(
        g2, q2, k2, v2, beta2, gate_rate, gate_bias, scale, lower_bound, start, remaining, 2,
        i_hv, decay2, offs_k, mask_k, qg, aqk_rows, cum_g, q_norm, k_norm, HV, K, BK, SCALAR_GATE,
        USE_GATE, HAS_DT_BIAS, USE_LOWER_BOUND, SAFE_GATE, USE_L2NORM, USE_BETA_SIGMOID,
        DOT_PRECISION)
    t22 = inverse_unit_lower(a2, DOT_PRECISION)
    rhs_w2, rhs_u2 = _eliminate(k_in2, q_in2, beta2, decay2, decay1, k_out0, w0, u0,
                                rhs_w2, rhs_u2, aqk, solve, square + 2 * tile, scale,
                                DOT_PRECISION, False)
    rhs_w2, rhs_u2 = _eliminate(k_in2, q_in2, beta2, decay2, decay2, k_out1, w1, u1,
                                rhs_w2, rhs_u2, aqk, solve, square + 2 * tile + BLOCK, scale,
                                DOT_PRECISION, True)
    w2, u2 = _solve_block(t22, rhs_w2, rhs_u2, w, u, start, remaining, 2, i_hv, offs_k, mask_k,
                          offs_v, mask_v, HV, K, V, DOT_PRECISION)

    gate_rate, gate_bias = _reloaded(A_log, dt_bias, gate_rate, gate_bias, i_hv, offs_k, mask_k,
                                     K, SCALAR_GATE, USE_GATE, HAS_DT_BIAS, reload)
    k_in3, q_in3, k_out3, beta3, rhs_w3, rhs_u3, a3, decay4 = _open_block(
        g3, q3, k3, v3, beta3, gate_rate, gate_bias, scale, lower_bound, start, remaining, 3,
        i_hv, decay3, offs_k, mask_k, qg, aqk_rows, cum_g, q_norm, k_norm, HV, K, BK, SCALAR_GATE,
        USE_GATE, HAS_DT_BIAS, USE_LOWER_BOUND, SAFE_GATE, USE_L2NORM, USE_BETA_SIGMOID,
        DOT_PRECISION)
    t33 = inverse_unit_lower(a3, DOT_PRECISION)
    rhs_w3, rhs_u3 = _eliminate(k_in3, q_in3, beta3, decay3, decay1, k_out0, w0, u0,
                                rhs_w3, rhs_u3, aqk, solve, square + 3 * tile, scale,
                                DOT_PRECISION, False)
    rhs_w3, rhs_u3 = _eliminate(k_in3, q_in3, beta3, decay3, decay2, k_out1, w1, u1,
                                rhs_w3, rhs_u3, aqk, solve, square + 3 * tile + BLOCK, scale,
                                DOT_PRECISION, False)
    rhs_w3, rhs_u3 = _eliminate(k_in3, q_in3, beta3, decay3, decay3, k_out2, w2, u2,
                                rhs_w3, rhs_u3, aqk, solve, square + 3 * tile + 2 * BLOCK, scale,
                                DOT_PRECISION, True)
    _solve_block(t33, rhs_w3, rhs_u3, w, u, start, remaining, 3, i_hv, offs_k, mask_k, offs_v,
                 mask_v, HV, K, V, DOT_PRECISION)

    # kd needs the decay at the chunk's end, known only now.
    tl.store(chunk_decay + (i_c * HV + i_hv).to(tl.int64) * K + offs_k, decay4, mask=mask_k)
    _store_kd(kd, k_out0, decay1, decay4, start, remaining, 0, i_hv, offs_k, mask_k, HV, K)
    _store_kd(kd, k_out1, decay2, decay4, start, remaining, 1, i_hv, offs_k, mask_k, HV, K)
    _store_kd(kd, k_out2, decay3, decay4, start, remaining, 2, i_hv, offs_k, mask_k, HV, K)
    _store_kd(kd, k_out3, decay4, decay4, start, remaining, 3, i_hv, offs_k, mask_k, HV, K)

    if solve is not None:
        _store_inverse(solve + square, t00, t11, t22, t33)
    # fmt: on
    # Whether the dense diagonal dots were in range: every block's decay within the limit.
    blocks = tl.minimum(
        tl.minimum(decay1, decay2 - decay1), tl.minimum(decay3 - decay2, decay4 - decay3)
    )
    least = tl.min(blocks, axis=0)
    if pair_limits is not None:
        tl.store(pair_limits + i_c * HV + i_hv, (least < -PAIRS_DENSE_LIMIT).to(tl.int8))
    return least >= -dense_decay_limit(qg.dtype.element_ty)


@triton.jit
def chunk_recurrence_kernel(
    w, u, qg, kd, aqk, chunk_decay, initial_state, cu_seqlens, chunk_offsets, length,
    first_head, o, final_state, chunk_states,
    HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, WIDTH: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr,
    HAS_INITIAL_STATE: tl.constexpr, IS_VARLEN: tl.constexpr, DOT_PRECISION: tl.constexpr,
    STORE_CHUNK_STATES: tl.constexpr, STORE_OUTPUT: tl.constexpr, STAGES: tl.constexpr,
):  # fmt: skip
    i_v, i_nh = tl.program_id(0), first_head + tl.program_id(1)
    i_n, i_hv = i_nh // HV, i_nh % HV
    bos, seq_len, first_chunk = sequence_span(i_n, cu_seqlens, chunk_offsets, length, IS_VARLEN)
    offs_k = tl.arange(0, BK)
    offs_v = i_v * BV + tl.arange(0, BV)
    mask_k = offs_k < K
    mask_v = offs_v < V  # value columns (u, o)
    mask_s = offs_v < WIDTH  # state columns
    dot_dtype = qg.dtype.element_ty

    tile_offsets = offs_k[:, None] * WIDTH + offs_v[None, :]  # within one [K, WIDTH] state
    state_offsets = i_nh.to(tl.int64) * K * WIDTH + tile_offsets
    state_mask = mask_k[:, None] & mask_s[None, :]
    state = tl.zeros([BK, BV], dtype=tl.float32)
    if HAS_INITIAL_STATE:
        state = tl.load(initial_state + state_offsets, mask=state_mask, other=0.0)
    if WIDTH > V:  # transition columns: u = 0 and the identity as the state coming in
        state += tl.where(offs_k[:, None] == offs_v[None, :] - V, 1.0, 0.0)

    rows = tl.arange(0, 64)
    for c in tl.range(0, tl.cdiv(seq_len, 64), num_stages=STAGES):
        tokens = bos + c * 64 + rows
        in_seq = c * 64 + rows < seq_len
        token_offsets = (tokens * HV + i_hv)[:, None]
        mask_rows_k = in_seq[:, None] & mask_k[None, :]
        mask_rows_v = in_seq[:, None] & mask_v[None, :]
        mask_rows_s = in_seq[:, None] & mask_s[None, :]
        b_w = tl.load(w + token_offsets * K + offs_k[None, :], mask=mask_rows_k, other=0.0)
        b_qg = tl.load(qg + token_offsets * K + offs_k[None, :], mask=mask_rows_k, other=0.0)
        b_kd = tl.load(kd + token_offsets * K + offs_k[None, :], mask=mask_rows_k, other=0.0)
        b_u = tl.load(u + token_offsets * V + offs_v[None, :], mask=mask_rows_v, other=0.0)
        chunk_id = (first_chunk + c).to(tl.int64) * HV + i_hv
        if STORE_CHUNK_STATES:  # the state entering this chunk
            tl.store(chunk_states + chunk_id * K * WIDTH + tile_offsets,
                     state.to(chunk_states.dtype.element_ty), mask=state_mask)  # fmt: skip
        b_aqk = tl.load(aqk + (chunk_id * 64 + rows)[:, None] * 64 + rows[None, :])
        # Blocks above the diagonal are never written (no zero-filled buffer needed).
        b_aqk = tl.where(rows[:, None] >= rows[None, :], b_aqk, 0.0)
        decay_last = fast_exp(tl.load(chunk_decay + chunk_id * K + offs_k, mask=mask_k, other=0.0))

        b_state = state.to(dot_dtype)
        v_new = b_u.to(tl.float32) - tl.dot(b_w.to(dot_dtype), b_state,
                                            input_precision=DOT_PRECISION)  # fmt: skip
        v_new = tl.where(mask_rows_s, v_new, 0.0).to(dot_dtype)
        if STORE_OUTPUT:
            b_o = tl.dot(b_qg.to(dot_dtype), b_state, input_precision=DOT_PRECISION)
            b_o += tl.dot(b_aqk.to(dot_dtype), v_new, input_precision=DOT_PRECISION)
            tl.store(o + token_offsets * V + offs_v[None, :], b_o.to(o.dtype.element_ty),
                     mask=mask_rows_v)  # fmt: skip
        state = state * decay_last[:, None] + tl.dot(
            tl.trans(b_kd.to(dot_dtype)), v_new, input_precision=DOT_PRECISION
        )
    tl.store(final_state + state_offsets, state, mask=state_mask)


def uses_safe_gate(lower_bound: Optional[float], has_gate: bool, dtype: torch.dtype) -> bool:
    """Whether diagonal blocks may be dense dots: the in-kernel safe gate bounds a block's
    decay by e^80, inside fp32 / bf16 range; fp16's (e^11) is too small."""
    return (
        has_gate
        and lower_bound is not None
        and lower_bound >= reference.SAFE_GATE_LOWER_BOUND
        and dtype != torch.float16
    )


def prepare_flags(
    q: Tensor,
    g: Tensor,
    A_log: Optional[Tensor],
    dt_bias: Optional[Tensor],
    cu_seqlens: Optional[Tensor],
    lower_bound: Optional[float],
    use_qk_l2norm: bool,
    use_beta_sigmoid: bool,
) -> dict[str, object]:
    """The constexpr flags the forward's and the backward's token-parallel kernels share.
    fp32 inputs get exact fp32 products; fp16 / bf16 use the tensor cores."""
    return dict(
        SCALAR_GATE=g.dim() == 3, USE_GATE=A_log is not None, HAS_DT_BIAS=dt_bias is not None,
        USE_LOWER_BOUND=lower_bound is not None and A_log is not None,
        SAFE_GATE=uses_safe_gate(lower_bound, A_log is not None, q.dtype),
        USE_L2NORM=use_qk_l2norm, USE_BETA_SIGMOID=use_beta_sigmoid,
        IS_VARLEN=cu_seqlens is not None,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
    )  # fmt: skip


def dot_block(n: int) -> int:
    """The tile width of a head dim: its next power of two, at least 16 (``tl.dot`` needs
    every dim >= 16; masks cover the padding)."""
    return max(16, next_power_of_2(n))


def prepare_warps(block_k: int) -> int:
    """Warps of a prepare program (the forward's and the backward's kernel 1): 4 up to 64
    key columns, 8 past them (``benchmarks/launch_sweep.py --only prepare``). No register
    cap: at 8 warps a cap that fits two programs per SM makes the program spill, which
    costs more than the second program gains. Past 128 columns the same launch still
    fits: it takes every register and a little stack, and little shared memory."""
    return 4 if block_k <= 64 else 8


def scan_shared(stages: int, block_k: int, block_v: int, itemsize: int, aqk_itemsize: int,
                store_output: bool) -> int:  # fmt: skip
    """Bytes of shared memory a head-parallel scan's loop takes at ``stages`` stages, an
    upper bound (:func:`scan_stages`)."""
    tiles = itemsize * (2 * block_k + block_v)
    if store_output:
        tiles += itemsize * block_k + aqk_itemsize * 64
    return stages * (64 * tiles + 4 * block_k) + itemsize * block_k * block_v


def scan_stages(block_k: int, block_v: int, itemsize: int, aqk_itemsize: int,
                store_output: bool, shared_memory: int) -> int:  # fmt: skip
    """Pipeline stages of a head-parallel scan's loop over the chunks (this forward's
    ``chunk_recurrence_kernel``, the backward's dS scan): 3 at up to 64 value columns
    where their buffers fit ``shared_memory`` bytes, else 2. With 2 the next chunk's tiles
    are loaded at the end of a step, after its stores, and waited for at the start of the
    next; with 3 the loads run a whole step ahead. A stage holds w, kd ``[64, BK]`` and u
    (dO) ``[64, BV]`` in the input dtype (``itemsize`` bytes), with the outputs also qg
    ``[64, BK]`` and Aqk ``[64, 64]`` in its own dtype, and G_C; the state operand takes
    up to ``[BK, BV]`` more (:func:`scan_shared`). At K = 128 in bf16 the recurrence's
    3 stages fit Hopper's shared memory up to 64 value columns, not at 128. The segmented
    path's maps pass (no outputs) would fit 3 stages at 128 columns too, but runs slower
    with them than with 2, while at 64 columns the third stage pays there as well
    (``benchmarks/cp.py``); hence the 64-column limit for every scan.

    Up to 128 key columns 2 stages are taken unchecked: they fit every launch there, fp32
    inputs included, whose tiles take less than the bound. Past 128 a stage of the
    recurrence's tiles is about half of shared memory: 2 stages where they fit (narrow
    value blocks), else 1, whose loads wait at the start of each step.
    ``tests/kda_ops/kernels/test_sm90_compile.py`` checks the launches against the limit."""
    tiles = (block_k, block_v, itemsize, aqk_itemsize, store_output)
    if block_v <= 64 and scan_shared(3, *tiles) <= shared_memory:
        return 3
    if block_k <= 128 or scan_shared(2, *tiles) <= shared_memory:
        return 2
    return 1


def scan_widest(block_k: int, itemsize: int) -> int:
    """The most value columns a scan program takes: its fp32 state ``[BK, columns]``
    lives in registers. 128 up to 128 key columns; past them 64 (at 256 key columns the
    state alone is 64 registers a thread at 8 warps, ``scan_warps``), and 32 with fp32
    inputs, whose products hold their operands in shared memory, which the dS scan at 64
    columns all but fills."""
    if block_k <= 128:
        return 128
    return 64 if itemsize <= 2 else 32


def scan_warps(block_k: int) -> int:
    """Warps of a forward recurrence program: 4, and 8 past 128 key columns, where a
    ``[256, 64]`` fp32 state alone takes 128 registers a thread at 4 warps and the program
    spills; 8 warps halve that."""
    return 4 if block_k <= 128 else 8


def scan_value_columns(block_v: int, sequence_heads: int, sm_count: Optional[int],
                       three_stages_at_64: bool, widest: int = 128) -> int:  # fmt: skip
    """Value columns per program of a head-parallel scan over the chunks (this forward's
    recurrence, the backward's reverse scan) on ``sm_count`` SMs (``None`` off CUDA): the
    fewest that still leave every program an SM of its own; where none does, 64 if a scan
    at 64 columns runs 3 stages (``three_stages_at_64``, from :func:`scan_stages`), else
    128, at most ``widest`` (:func:`scan_widest`). Each program walks all chunks serially,
    so splitting V pays while SMs are idle; and a step at 64 columns with its loads a
    chunk ahead (3 stages) beats one at 128 waiting for its loads, even when the
    64-column programs take two waves. Without the third stage 64 columns lose to 128,
    hence 128 then (``benchmarks/launch_sweep.py --only recurrence``). Off CUDA (the
    interpreter) 32, so that CI covers several value blocks."""
    if sm_count is None:
        return min(block_v, 32)
    for columns in (32, 64):
        if columns < block_v and sequence_heads * (block_v // columns) <= sm_count:
            return columns
    return min(block_v, 64 if three_stages_at_64 else 128, widest)


def scan_config(block_k: int, block_v: int, sequence_heads: int, sm_count: Optional[int],
                itemsize: int, aqk_itemsize: int, store_output: bool, shared_memory: int,
                pipelined: bool = True) -> tuple[int, int]:  # fmt: skip
    """(value columns a program, pipeline stages) of a head-parallel scan over the chunks:
    :func:`scan_value_columns` and :func:`scan_stages` for its tiles (arguments as
    there), or 1 stage where the launcher does not pipeline the loop."""
    widest = scan_widest(block_k, itemsize)
    if not pipelined:
        return scan_value_columns(block_v, sequence_heads, sm_count, False, widest), 1
    tiles = (itemsize, aqk_itemsize, store_output, shared_memory)
    three_stages_at_64 = scan_stages(block_k, 64, *tiles) == 3
    columns = scan_value_columns(block_v, sequence_heads, sm_count, three_stages_at_64, widest)
    return columns, scan_stages(block_k, columns, *tiles)


def scan_launch(block_k: int, block_v: int, sequence_heads: int, device: torch.device,
                itemsize: int, aqk_itemsize: int, store_output: bool,
                pipelined: bool = True) -> tuple[int, int]:  # fmt: skip
    """:func:`scan_config` on ``device``."""
    sm_count = processors(device) if device.type == "cuda" else None
    return scan_config(block_k, block_v, sequence_heads, sm_count, itemsize, aqk_itemsize,
                       store_output, shared_memory(device), pipelined)  # fmt: skip


def scan_launches(block_v: int, sequence_heads: int, columns: int,
                  sm_count: int) -> list[tuple[int, int, int]]:  # fmt: skip
    """(first sequence-head, sequence-heads, value columns) of each launch of a scan that
    takes ``columns`` (``scan_value_columns``) on ``sm_count`` SMs: one launch, unless its
    programs need more than one wave and the heads past the first wave fit one wave at
    half the columns; then those run in a second launch at half the columns, shorter
    steps in place of a second wave of full ones: the remaining heads' programs at half
    the columns finish sooner than a second wave at full width would."""
    per_head = cdiv(block_v, columns)
    first_wave = sm_count // per_head
    rest = sequence_heads - first_wave
    half = columns // 2
    if first_wave > 0 and rest > 0 and half >= 16 and rest * cdiv(block_v, half) <= sm_count:
        return [(0, first_wave, columns), (first_wave, rest, half)]
    return [(0, sequence_heads, columns)]


def launch_chunk_kda(
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
    chunk_states: Optional[Tensor] = None,
    output: bool = True,
    segments: Optional[int] = None,
) -> tuple[Optional[Tensor], Tensor]:
    """Chunked forward; returns o ``[B, T, HV, V]`` (v's dtype; ``None`` with
    ``output=False``, which skips the output products) and the fp32 final state.
    Shapes as in ``kda_ops.delta_rule``; inputs in one dtype of fp16 / bf16 / fp32.

    ``chunk_states``: optional contiguous output ``[R, HV, K, V]`` (fp32, or the dot dtype
    where the backward reads them) with
    ``R = chunk_state_rows(B, T, N or None)``, filled with the state at the start of every
    chunk (chunk c of sequence n at row ``n * ceil(T / 64) + c``, or
    ``chunk_offsets(cu_seqlens)[n] + c`` with packed sequences, whose rows past the last
    chunk are left untouched).

    ``segments``: how many segments the recurrence of each sequence runs in
    (``_segmented_recurrence``; fixed length with ``T % (64 * segments) == 0``); ``None``
    lets :func:`recurrence_segments` choose from the shapes."""
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    batch, length, heads, head_k = q.shape
    value_heads, head_v = v.shape[2], v.shape[3]
    if cu_seqlens is None:
        n_seqs = batch
        chunk_offsets = None
    else:
        n_seqs = cu_seqlens.shape[0] - 1
        chunk_offsets = sequence_chunk_offsets(cu_seqlens, CHUNK)
    # An upper bound with packed sequences (no host sync); programs past the end exit.
    n_chunks = chunk_state_rows(batch, length, None if cu_seqlens is None else n_seqs, CHUNK)
    block_k, block_v = dot_block(head_k), dot_block(head_v)
    flags = prepare_flags(q, g, A_log, dt_bias, cu_seqlens, lower_bound, use_qk_l2norm,
                          use_beta_sigmoid)  # fmt: skip
    precision = flags["DOT_PRECISION"]
    tokens_shape = (batch, length, value_heads)
    chunk_decay = torch.empty(n_chunks, value_heads, head_k, device=q.device, dtype=torch.float32)
    w, qg, kd = (q.new_empty(*tokens_shape, head_k) for _ in range(3))
    u = q.new_empty(*tokens_shape, head_v)
    aqk = q.new_empty(n_chunks, value_heads, CHUNK, CHUNK)
    if flags["SAFE_GATE"]:
        passes, unbounded = ("all",), None
    else:
        passes = ("bounded", "unbounded")
        unbounded = torch.empty(n_chunks, value_heads, device=q.device, dtype=torch.int8)
    for chunks in passes:
        chunk_prepare_kernel[(n_chunks, value_heads)](
            q, k, v, g, beta, A_log, dt_bias, cu_seqlens, chunk_offsets,
            scale, 0.0 if lower_bound is None else lower_bound, length, n_seqs,
            chunk_decay, w, u, qg, kd, aqk, unbounded,
            H=heads, HV=value_heads, K=head_k, V=head_v, BK=block_k, BV=block_v,
            BN=next_power_of_2(n_seqs), **flags, CHUNKS=chunks,
            num_warps=prepare_warps(block_k),
        )  # fmt: skip
    o = torch.empty_like(v) if output else None
    if initial_state is not None:
        initial_state = initial_state.contiguous()
    final_state = q.new_empty(n_seqs, value_heads, head_k, head_v, dtype=torch.float32)
    scan_chunks((w, u, qg, kd, aqk, chunk_decay), initial_state, cu_seqlens, chunk_offsets, o,
                final_state, chunk_states, precision, segments)  # fmt: skip
    return o, final_state


def scan_chunks(
    intermediates: tuple[Tensor, ...],
    initial_state: Optional[Tensor],
    cu_seqlens: Optional[Tensor],
    chunk_offsets: Optional[Tensor],
    o: Optional[Tensor],
    final_state: Tensor,
    chunk_states: Optional[Tensor],
    precision: str,
    segments: Optional[int] = None,
) -> None:
    """The head-parallel recurrence over the prepare kernel's ``(w, u, qg, kd, aqk,
    chunk_decay)`` (shapes as ``launch_chunk_kda`` allocates them): writes ``final_state``
    and, when given, the outputs ``o`` and the chunk-start states; ``chunk_offsets`` of
    ``cu_seqlens`` (``sequence_chunk_offsets``). ``segments`` as in ``launch_chunk_kda``."""
    batch, length, value_heads = intermediates[1].shape[:3]
    if segments is None:
        segments = recurrence_segments(batch, length, value_heads, cu_seqlens, final_state.device)
    if segments == 1:
        _recurrence(intermediates, initial_state, cu_seqlens, chunk_offsets, length, o,
                    final_state, chunk_states, precision)  # fmt: skip
    else:
        _segmented_recurrence(intermediates, initial_state, batch, length, segments, o,
                              final_state, chunk_states, precision)  # fmt: skip


MIN_SEGMENT_TOKENS = 8192


def recurrence_segments(
    batch: int, length: int, value_heads: int, cu_seqlens: Optional[Tensor], device: torch.device
) -> int:
    """Segments per sequence for the chunk recurrence: 1 (one serial scan per sequence)
    unless the sequences are long and too few to fill the SMs, then the largest power of two
    ``S`` with ``batch * value_heads * S`` at most the SM count and segments of at least
    ``MIN_SEGMENT_TOKENS`` (a multiple of 64). Fixed length on CUDA only."""
    if cu_seqlens is not None or device.type != "cuda":
        return 1
    sms = processors(device)
    segments = 1
    while (
        batch * value_heads * segments * 2 <= sms
        and length % (CHUNK * segments * 2) == 0
        and length // (segments * 2) >= MIN_SEGMENT_TOKENS
    ):
        segments *= 2
    return segments


def _recurrence(intermediates, initial_state, cu_seqlens, chunk_offsets, length, o, final_state,
                chunk_states, precision, width=None):  # fmt: skip
    """One launch of ``chunk_recurrence_kernel`` over the sequences of ``final_state``
    (``[N, HV, K, width]``; ``width`` > V adds transition columns, see the kernel)."""
    w, u, qg, kd, aqk, chunk_decay = intermediates
    n_seqs, value_heads, head_k, state_width = final_state.shape
    head_v = u.shape[-1]
    block_k, block_v = dot_block(head_k), dot_block(state_width)
    sequence_heads = n_seqs * value_heads
    tiles = (w.element_size(), aqk.element_size(), o is not None)
    columns, _ = scan_launch(block_k, block_v, sequence_heads, u.device, *tiles)
    launches = scan_launches(block_v, sequence_heads, columns, processors(u.device))
    for first_head, heads, split_v in launches:
        chunk_recurrence_kernel[(cdiv(state_width, split_v), heads)](
            w, u, qg, kd, aqk, chunk_decay, initial_state, cu_seqlens, chunk_offsets, length,
            first_head, o, final_state, chunk_states,
            HV=value_heads, K=head_k, V=head_v, WIDTH=state_width, BK=block_k, BV=split_v,
            HAS_INITIAL_STATE=initial_state is not None, IS_VARLEN=cu_seqlens is not None,
            DOT_PRECISION=precision, STORE_CHUNK_STATES=chunk_states is not None,
            STORE_OUTPUT=o is not None,
            STAGES=scan_stages(block_k, split_v, *tiles, shared_memory(u.device)),
            num_warps=scan_warps(block_k),
        )  # fmt: skip


def _segmented_recurrence(intermediates, initial_state, batch, length, segments, o,
                          final_state, chunk_states, precision):  # fmt: skip
    """In-device context parallelism for the recurrence (the prepare kernel's outputs are
    per chunk, so segments share them). Each sequence is cut into ``segments`` runs of
    whole chunks, run as packed sequences:

    1. every segment from zero with ``K`` transition columns next to its values, giving its
       affine map ``S_end = M S_start + E`` (``[E | M]``, the state ``[K, V + K]``);
    2. the maps composed in order (``segments`` small ``[K, K] @ [K, V]`` steps per head)
       for each segment's exact incoming state;
    3. every segment again from that state, writing outputs, chunk states and final
       states.
    """
    u = intermediates[1]
    value_heads, head_v = u.shape[2], u.shape[3]
    head_k = intermediates[0].shape[3]
    device = u.device
    segment_length = length // segments
    cuts = torch.arange(0, batch * length + 1, segment_length, device=device, dtype=torch.int32)
    chunk_offsets = sequence_chunk_offsets(cuts, CHUNK)
    maps = torch.empty(batch * segments, value_heads, head_k, head_v + head_k, device=device,
                       dtype=torch.float32)  # fmt: skip
    _recurrence(intermediates, None, cuts, chunk_offsets, segment_length, None, maps, None,
                precision)  # fmt: skip
    maps = maps.unflatten(0, (batch, segments))
    ends, transitions = maps[..., :head_v], maps[..., head_v:]
    state = torch.zeros_like(final_state) if initial_state is None else initial_state
    starts = []
    for segment in range(segments):
        starts.append(state)
        state = transitions[:, segment] @ state + ends[:, segment]
    starts = torch.stack(starts, 1).flatten(0, 1)
    segment_finals = torch.empty_like(starts)
    _recurrence(intermediates, starts, cuts, chunk_offsets, segment_length, o, segment_finals,
                chunk_states, precision)  # fmt: skip
    final_state.copy_(segment_finals.unflatten(0, (batch, segments))[:, -1])
