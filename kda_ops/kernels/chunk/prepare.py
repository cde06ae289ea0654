"""The forward's token-parallel prepare kernel, ``chunk_prepare_kernel`` (grid: chunks ×
value heads), and the program body it shares with the backward's prepare kernel
(``prepare_chunks``).

Per chunk of C = 16 · ``BLOCKS`` tokens, in row blocks of 16 taken one after another: gate
activation and in-chunk cumulative log-decay G, l2norm of q and k, beta sigmoid, and the
UT/WY solve by block forward substitution, each block reading the solved blocks before it
back from the outputs it stored them to (``_prepare_chunk``). The forward's chunks are one
block (``FORWARD_CHUNK`` = 16 tokens: no coupling, a program of half the registers), the
backward's four (64 tokens, the chunks of its kernels). It stores what the recurrence
(``recurrence.py``) needs: ``w = T β (K ⊙ Γ)``, ``u = T β V``, ``qg = scale Q ⊙ Γ``,
``kd = K ⊙ Γ_C / Γ``, ``Aqk = tril((Q ⊙ Γ)(K / Γ)ᵀ)`` and the chunk's total log-decay
G_C (fp32), where Γ = exp(G) and ``T = (I + tril(β (K ⊙ Γ)(K / Γ)ᵀ, -1))⁻¹``.

Decay ratios exp(G_i - G_j) between blocks are split at block boundaries into factors of
at most 1 (row side decayed from its block's start, column side to its block's end, and
the gap between the two blocks). Inside a diagonal block, with the safe gate
(``-5 <= lower_bound < 0``) and bf16 / fp32 inputs, the column side is scaled up by at
most e^80 (inside fp32 and bf16 range) and the block is one dense dot. Any other gate
(and fp16) takes the same dense dots first, and the chunk's block decays, computed on the
way, say whether they were in range: every block decaying by at most e^80 (e^10 for
fp16) in every channel, as real gates mostly do. A chunk where one did not is redone
with its blocks' pairs split dyadically (four levels of two dots, every factor at most
1; ``diagonal_block``), overwriting every output of the dense pass. The kernel's
``CHUNKS`` picks what a launch does: ``"all"`` redoes such a chunk in the same program
(the safe gate's only path, and TensorRT's single-launch plugin); without the safe gate
``launch_chunk_kda`` (``launch.py``) launches twice, ``"bounded"`` (every chunk dense,
flagging those out of range in an int8 ``[chunks, HV]`` buffer) then ``"unbounded"``
(the flagged ones, dyadic), so that each launch compiles one path: a kernel holding both
paths spills heavily, while the bounded launch alone compiles to about the safe gate's
kernel.

A scalar gate (Gated DeltaNet, ``SCALAR_GATE``) has one decay a row: its activation,
cumulative sum and exponentials are ``[BLOCK]`` vectors, and a diagonal block is one
dense dot times exp(G_i - G_j) per pair (``scalar_diagonal_block``), exact for any decay:
one ``"all"`` launch that never redoes a chunk (``single_prepare_pass``)."""

import triton
import triton.language as tl

from kda_ops.kernels.chunk.device import (
    BLOCK,
    LOG2_BLOCK,
    activate_gate,
    activate_scalar_gate,
    beta_rows,
    block_cumsum,
    dyadic_level,
    inverse_norm,
    program_chunk,
    tile_row,
    unit_rows,
)
from kda_ops.kernels.fast_exp import fast_exp, fast_reciprocal
from kda_ops.kernels.gate import gate_parameters

# The backward's pairs kernel takes a diagonal block as a dense dot, factors up to
# e^{block's decay}, when it decays within e^75: the safe gate's bound (15 rows of at most
# 5), which other gates' blocks mostly meet too (``pair_limits`` of the backward's prepare
# flags the chunks where one does not).
PAIRS_DENSE_LIMIT = tl.constexpr(75.0)


@triton.jit
def inverse_unit_lower(a, DOT_PRECISION: tl.constexpr, BOUNDED: tl.constexpr):
    """(I + a)⁻¹ for a strictly lower-triangular [BLOCK, BLOCK] fp32 a. With m = -a
    nilpotent (m^BLOCK = 0), the inverse is sum_k m^k = (I + m)(I + m²)(I + m⁴)(I + m⁸):
    six small dots instead of BLOCK dependent row updates. In ``DOT_PRECISION``: tf32 on
    tensor cores for bf16 / fp16 inputs (as the solve that uses the inverse), which moves
    their output well under its rounding; fp32 inputs keep FMA ("ieee").

    ``BOUNDED``: every |a_ij| <= 1 (unit keys and β <= 1, as l2norm and the β sigmoid in
    the kernel make them), so every power's and partial product's entries stay under
    2^14 (those of the all-ones strictly lower matrix, binomial coefficients) and the dots
    take fp16 operands: tf32's 10-bit mantissa at half the bytes of the fp32 operands
    staged through shared memory, which bounds the prepare kernel."""
    rows = tl.arange(0, BLOCK)
    power = -a
    inverse = (rows[:, None] == rows[None, :]).to(tl.float32) + power
    for _ in tl.static_range(LOG2_BLOCK - 1):
        if BOUNDED and DOT_PRECISION == "tf32":
            half = power.to(tl.float16)
            power = tl.dot(half, half)
            inverse += tl.dot(inverse.to(tl.float16), power.to(tl.float16))
        else:
            power = tl.dot(power, power, input_precision=DOT_PRECISION)
            inverse += tl.dot(inverse, power, input_precision=DOT_PRECISION)
    return inverse


@triton.jit
def _load_block(
    q,
    k,
    v,
    g,
    beta,
    start,
    remaining,
    i_b,
    i_h,
    i_hv,
    offs_k,
    mask_k,
    offs_v,
    mask_v,
    H: tl.constexpr,
    HV: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    SCALAR_GATE: tl.constexpr,
):
    """Raw inputs of row block i_b, in their storage dtype, zero past the sequence's end:
    g ([BLOCK, BK], or [BLOCK] for a scalar gate), q, k ([BLOCK, BK]), v ([BLOCK, BV]),
    beta ([BLOCK])."""
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
    r_v = tl.load(
        v + value_rows * V + offs_v[None, :], mask=in_seq[:, None] & mask_v[None, :], other=0.0
    )
    r_beta = tl.load(beta + tokens * HV + i_hv, mask=in_seq, other=0.0)
    return raw_g, r_q, r_k, r_v, r_beta


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
def diagonal_block(
    r_q,
    r_k,
    q_in,
    k_in,
    to_start,
    decay,
    DOT_DTYPE: tl.constexpr,
    SAFE_GATE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    CUMULATIVE: tl.constexpr,
):
    """In-block products (q_i · k_j exp(G_i - G_j), k_i · k_j exp(G_i - G_j)) for j <= i,
    given the cumulative log-decay ``local`` from a reference row at or before the
    block's start: ``q_in``, ``k_in`` the rows decayed by it, ``to_start`` = exp(-local),
    and ``decay`` the per-token log-decay (or, with ``CUMULATIVE``, the cumulative one;
    ``dyadic_level``). Entries above the diagonal are left for the caller to mask (kk's
    diagonal too)."""
    if SAFE_GATE:  # local >= 16 * lower_bound >= -80: exp(-local) stays inside fp32 / bf16
        to_col = tl.trans((r_k * to_start).to(DOT_DTYPE))
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
def scalar_diagonal_block(
    r_q, r_k, local_rows, DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr
):
    """``diagonal_block`` for a scalar gate: (q_i · k_j, k_i · k_j) times exp(G_i - G_j)
    for j <= i from the rows' cumulative log-decay ``local_rows`` [BLOCK]; the exponent is
    at most 0 there, so one dense dot each is exact for any decay. Entries above the
    diagonal are 0."""
    sub = tl.arange(0, BLOCK)
    causal = sub[:, None] >= sub[None, :]
    pair_decay = fast_exp(tl.where(causal, local_rows[:, None] - local_rows[None, :], 0.0))
    pair_decay = tl.where(causal, pair_decay, 0.0)
    cols = tl.trans(r_k.to(DOT_DTYPE))
    kk = tl.dot(r_k.to(DOT_DTYPE), cols, input_precision=DOT_PRECISION) * pair_decay
    qk = tl.dot(r_q.to(DOT_DTYPE), cols, input_precision=DOT_PRECISION) * pair_decay
    return qk, kk


@triton.jit
def _open_block(
    raw_g,
    r_q,
    r_k,
    r_v,
    r_beta,
    gate_rate,
    gate_bias,
    scale,
    lower_bound,
    start,
    remaining,
    i_b,
    i_hv,
    decay_before,
    offs_k,
    mask_k,
    qg,
    aqk_rows,
    cum_g,
    q_norm,
    k_norm,
    HV: tl.constexpr,
    K: tl.constexpr,
    BK: tl.constexpr,
    SCALAR_GATE: tl.constexpr,
    USE_GATE: tl.constexpr,
    HAS_DT_BIAS: tl.constexpr,
    USE_LOWER_BOUND: tl.constexpr,
    SAFE_GATE: tl.constexpr,
    USE_L2NORM: tl.constexpr,
    USE_BETA_SIGMOID: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    C: tl.constexpr,
):
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
    rows = (tokens * HV + i_hv)[:, None] * K + offs_k[None, :]
    mask = in_seq[:, None] & mask_k[None, :]
    if SCALAR_GATE:
        g_rows = activate_scalar_gate(
            raw_g=raw_g,
            rate=gate_rate,
            bias=gate_bias,
            lower_bound=lower_bound,
            in_seq=in_seq,
            USE_GATE=USE_GATE,
            HAS_DT_BIAS=HAS_DT_BIAS,
            USE_LOWER_BOUND=USE_LOWER_BOUND,
        )
        local_rows = tl.cumsum(g_rows, axis=0)
        block_decay = tl.sum(g_rows, axis=0)
        if cum_g is not None:  # one a row: [B, T, HV]
            # decay_before holds the one value in every column (padding included).
            cum_rows = tl.max(decay_before, axis=0) + local_rows
            tl.store(cum_g + tokens * HV + i_hv, cum_rows, mask=in_seq)
    else:
        b_g = activate_gate(
            raw_g=raw_g,
            rate=gate_rate,
            bias=gate_bias,
            lower_bound=lower_bound,
            in_seq=in_seq,
            mask_k=mask_k,
            BK=BK,
            ROWS=BLOCK,
            SCALAR_GATE=SCALAR_GATE,
            USE_GATE=USE_GATE,
            HAS_DT_BIAS=HAS_DT_BIAS,
            USE_LOWER_BOUND=USE_LOWER_BOUND,
        )
        local, block_decay = block_cumsum(b_g, BLOCK, BK)  # padding rows add no decay
        if cum_g is not None:
            tl.store(cum_g + rows, decay_before[None, :] + local, mask=mask)
    if q_norm is not None and USE_L2NORM:
        tl.store(q_norm + tokens * HV + i_hv, inverse_norm(r_q.to(tl.float32)), mask=in_seq)
        tl.store(k_norm + tokens * HV + i_hv, inverse_norm(r_k.to(tl.float32)), mask=in_seq)
    r_q = unit_rows(r_q, USE_L2NORM)
    r_k = unit_rows(r_k, USE_L2NORM)
    r_beta = beta_rows(r_beta, in_seq, USE_BETA_SIGMOID)
    r_v = r_v.to(tl.float32)

    if SCALAR_GATE:
        # One decay a row: every factor a [BLOCK] vector, and the diagonal block's decay
        # exp(G_i - G_j) per pair, at most 1 for j <= i, exact for any gate.
        from_start = fast_exp(local_rows)
        k_in = r_k * from_start[:, None]
        q_in = r_q * from_start[:, None]
        qk, kk = scalar_diagonal_block(
            r_q=r_q,
            r_k=r_k,
            local_rows=local_rows,
            DOT_DTYPE=qg.dtype.element_ty,
            DOT_PRECISION=DOT_PRECISION,
        )
        k_out = r_k * fast_exp(block_decay - local_rows)[:, None]
    else:
        from_start = fast_exp(local)
        # exp(-local) as the reciprocal: the cumulative sum's tile leaves the scan in a
        # layout of its own, and one exponential of it changes layout instead of two
        # (``tools/sass_report.py``: fewer shared-memory bytes and barriers).
        to_start = fast_reciprocal(from_start)
        k_in = r_k * from_start
        q_in = r_q * from_start
        qk, kk = diagonal_block(
            r_q=r_q,
            r_k=r_k,
            q_in=q_in,
            k_in=k_in,
            to_start=to_start,
            decay=b_g,
            DOT_DTYPE=qg.dtype.element_ty,
            SAFE_GATE=SAFE_GATE,
            DOT_PRECISION=DOT_PRECISION,
            CUMULATIVE=False,
        )
        if SAFE_GATE:  # e^{-local} <= e^80 as in diagonal_block
            k_out = r_k * to_start * fast_exp(block_decay)[None, :]
        else:
            k_out = r_k * fast_exp(block_decay[None, :] - local)
    qk = tl.where(sub[:, None] >= sub[None, :], qk * scale, 0.0)
    tl.store(aqk_rows + i_b * BLOCK * (C + 1), qk.to(aqk_rows.dtype.element_ty))
    a_kk = tl.where(sub[:, None] > sub[None, :], r_beta[:, None] * kk, 0.0)
    to_chunk_start = fast_exp(decay_before)[None, :]
    rhs_w = r_beta[:, None] * k_in * to_chunk_start
    rhs_u = r_beta[:, None] * r_v
    tl.store(qg + rows, (scale * q_in * to_chunk_start).to(qg.dtype.element_ty), mask=mask)
    return k_in, q_in, k_out, r_beta, rhs_w, rhs_u, a_kk, decay_before + block_decay


@triton.jit
def _eliminate(
    k_in,
    q_in,
    r_beta,
    decay_before,
    col_decay_after,
    col_k_out,
    col_w,
    col_u,
    rhs_w,
    rhs_u,
    aqk,
    solve,
    tile_offsets,
    scale,
    DOT_PRECISION: tl.constexpr,
):
    """Couples a row block to an earlier, solved column block: stores their Aqk tile (at
    ``aqk + tile_offsets``; A_ij's at ``solve + tile_offsets`` when given) and subtracts
    ``A_ij [w_j, u_j]`` from the row block's right-hand sides, which it returns. The gap
    between the column block's end and the row block's start decays the column side
    (factor <= 1; 1 for the block just before), which both products share."""
    dot_dtype = col_w.dtype
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
def _block_rows(start, remaining, i_b, i_hv, offs_k, mask_k, HV: tl.constexpr, K: tl.constexpr):
    """Offsets and mask of row block i_b's [BLOCK, BK] tile of a ``[B, T, HV, K]`` tensor."""
    sub = tl.arange(0, BLOCK)
    tokens = start + i_b * BLOCK + sub
    in_seq = i_b * BLOCK + sub < remaining
    offsets = (tokens * HV + i_hv)[:, None] * K + offs_k[None, :]
    return offsets, in_seq[:, None] & mask_k[None, :]


@triton.jit
def _solve_block(
    inverse,
    rhs_w,
    rhs_u,
    w,
    u,
    start,
    remaining,
    i_b,
    i_hv,
    offs_k,
    mask_k,
    offs_v,
    mask_v,
    HV: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    HALF_W: tl.constexpr,
):
    """Stores a block's w, u rows: its ``(I + a_kk)⁻¹`` (``inverse_unit_lower``) times the
    eliminated right-hand sides, in the storage dtype (what the later blocks read back).

    ``HALF_W``: w's product on fp16 operands, tf32's mantissa at half the bytes staged
    through shared memory. For the forward's one-block chunks with l2norm and the β
    sigmoid: no earlier block eliminated, the right-hand side β K Γ has entries of at
    most 1 and the inverse (``inverse_unit_lower``'s bound) at most 2^14. u's, β V, has no
    bound and keeps tf32 (in bf16, o's error against float64 grew from 3.79e-3 to 4.09e-3
    in a torch emulation of the forward's roundings)."""
    if HALF_W:
        b_w = tl.dot(inverse.to(tl.float16), rhs_w.to(tl.float16))
    else:
        b_w = tl.dot(inverse, rhs_w, input_precision=DOT_PRECISION)
    b_w = b_w.to(w.dtype.element_ty)
    b_u = tl.dot(inverse, rhs_u, input_precision=DOT_PRECISION).to(u.dtype.element_ty)
    key_rows, key_mask = _block_rows(
        start=start,
        remaining=remaining,
        i_b=i_b,
        i_hv=i_hv,
        offs_k=offs_k,
        mask_k=mask_k,
        HV=HV,
        K=K,
    )
    value_rows, value_mask = _block_rows(
        start=start,
        remaining=remaining,
        i_b=i_b,
        i_hv=i_hv,
        offs_k=offs_v,
        mask_k=mask_v,
        HV=HV,
        K=V,
    )
    tl.store(w + key_rows, b_w, mask=key_mask)
    tl.store(u + value_rows, b_u, mask=value_mask)


@triton.jit
def chunk_prepare_kernel(
    q,
    k,
    v,
    g,
    beta,
    A_log,
    dt_bias,
    cu_seqlens,
    chunk_offsets,
    scale,
    lower_bound,
    length,
    n_seqs,
    window_first,
    chunk_decay,
    w,
    u,
    qg,
    kd,
    aqk,
    unbounded,
    H: tl.constexpr,
    HV: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    BN: tl.constexpr,
    SCALAR_GATE: tl.constexpr,
    USE_GATE: tl.constexpr,
    HAS_DT_BIAS: tl.constexpr,
    USE_LOWER_BOUND: tl.constexpr,
    SAFE_GATE: tl.constexpr,
    USE_L2NORM: tl.constexpr,
    USE_BETA_SIGMOID: tl.constexpr,
    IS_VARLEN: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    CHUNKS: tl.constexpr,
    BLOCKS: tl.constexpr,
    WINDOW: tl.constexpr,
):
    """A program a chunk and value head (grid: chunks × HV), or with ``WINDOW`` chunks
    ``[window_first, window_first + WINDOW)`` of every sequence (grid: sequences ·
    ``WINDOW`` × HV; ``program_chunk``)."""
    prepare_chunks(
        q=q,
        k=k,
        v=v,
        g=g,
        beta=beta,
        A_log=A_log,
        dt_bias=dt_bias,
        cu_seqlens=cu_seqlens,
        chunk_offsets=chunk_offsets,
        scale=scale,
        lower_bound=lower_bound,
        length=length,
        n_seqs=n_seqs,
        window_first=window_first,
        chunk_decay=chunk_decay,
        w=w,
        u=u,
        qg=qg,
        kd=kd,
        aqk=aqk,
        unbounded=unbounded,
        cum_g=None,
        solve=None,
        q_norm=None,
        k_norm=None,
        pair_limits=None,
        H=H,
        HV=HV,
        K=K,
        V=V,
        BK=BK,
        BV=BV,
        BN=BN,
        SCALAR_GATE=SCALAR_GATE,
        USE_GATE=USE_GATE,
        HAS_DT_BIAS=HAS_DT_BIAS,
        USE_LOWER_BOUND=USE_LOWER_BOUND,
        SAFE_GATE=SAFE_GATE,
        USE_L2NORM=USE_L2NORM,
        USE_BETA_SIGMOID=USE_BETA_SIGMOID,
        IS_VARLEN=IS_VARLEN,
        DOT_PRECISION=DOT_PRECISION,
        CHUNKS=CHUNKS,
        BLOCKS=BLOCKS,
        WINDOW=WINDOW,
    )


@triton.jit
def prepare_chunks(
    q,
    k,
    v,
    g,
    beta,
    A_log,
    dt_bias,
    cu_seqlens,
    chunk_offsets,
    scale,
    lower_bound,
    length,
    n_seqs,
    window_first,
    chunk_decay,
    w,
    u,
    qg,
    kd,
    aqk,
    unbounded,
    cum_g,
    solve,
    q_norm,
    k_norm,
    pair_limits,
    H: tl.constexpr,
    HV: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    BN: tl.constexpr,
    SCALAR_GATE: tl.constexpr,
    USE_GATE: tl.constexpr,
    HAS_DT_BIAS: tl.constexpr,
    USE_LOWER_BOUND: tl.constexpr,
    SAFE_GATE: tl.constexpr,
    USE_L2NORM: tl.constexpr,
    USE_BETA_SIGMOID: tl.constexpr,
    IS_VARLEN: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    CHUNKS: tl.constexpr,
    BLOCKS: tl.constexpr,
    WINDOW: tl.constexpr = 0,
):
    """The body of a prepare program (a chunk of ``BLOCKS`` row blocks, a value head), for
    ``chunk_prepare_kernel`` and, with the backward's extra outputs (``cum_g`` ...
    ``pair_limits``, or all ``None``; ``cum_g`` alone may be ``None``, when the backward
    rebuilds G), for the backward's prepare kernel: which chunks a launch prepares is
    ``CHUNKS`` (module docstring), ``unbounded`` holding the flags between a "bounded"
    and an "unbounded" launch."""
    # The (chunk, value head) grid read as one index, value heads fastest: the value heads
    # that share a q / k head (grouped value heads) run side by side and read their q and
    # k rows once from memory, the second time from L2.
    flat = tl.program_id(0) + tl.program_id(1) * tl.num_programs(0)
    i_hv = flat % HV
    i_h = i_hv // (HV // H)
    i_c, start, remaining = program_chunk(
        pid=flat // HV,
        window_first=window_first,
        cu_seqlens=cu_seqlens,
        chunk_offsets=chunk_offsets,
        n_seqs=n_seqs,
        length=length,
        BN=BN,
        IS_VARLEN=IS_VARLEN,
        C=BLOCKS * BLOCK,
        WINDOW=WINDOW,
    )
    if remaining > 0:
        if CHUNKS == "unbounded":
            if tl.load(unbounded + i_c * HV + i_hv) != 0:
                _prepare_chunk(
                    q=q,
                    k=k,
                    v=v,
                    g=g,
                    beta=beta,
                    A_log=A_log,
                    dt_bias=dt_bias,
                    scale=scale,
                    lower_bound=lower_bound,
                    start=start,
                    remaining=remaining,
                    i_c=i_c,
                    i_h=i_h,
                    i_hv=i_hv,
                    chunk_decay=chunk_decay,
                    w=w,
                    u=u,
                    qg=qg,
                    kd=kd,
                    aqk=aqk,
                    cum_g=cum_g,
                    solve=solve,
                    q_norm=q_norm,
                    k_norm=k_norm,
                    pair_limits=pair_limits,
                    H=H,
                    HV=HV,
                    K=K,
                    V=V,
                    BK=BK,
                    BV=BV,
                    SCALAR_GATE=SCALAR_GATE,
                    USE_GATE=USE_GATE,
                    HAS_DT_BIAS=HAS_DT_BIAS,
                    USE_LOWER_BOUND=USE_LOWER_BOUND,
                    SAFE_GATE=False,
                    USE_L2NORM=USE_L2NORM,
                    USE_BETA_SIGMOID=USE_BETA_SIGMOID,
                    DOT_PRECISION=DOT_PRECISION,
                    BLOCKS=BLOCKS,
                )
        else:
            fits = _prepare_chunk(
                q=q,
                k=k,
                v=v,
                g=g,
                beta=beta,
                A_log=A_log,
                dt_bias=dt_bias,
                scale=scale,
                lower_bound=lower_bound,
                start=start,
                remaining=remaining,
                i_c=i_c,
                i_h=i_h,
                i_hv=i_hv,
                chunk_decay=chunk_decay,
                w=w,
                u=u,
                qg=qg,
                kd=kd,
                aqk=aqk,
                cum_g=cum_g,
                solve=solve,
                q_norm=q_norm,
                k_norm=k_norm,
                pair_limits=pair_limits,
                H=H,
                HV=HV,
                K=K,
                V=V,
                BK=BK,
                BV=BV,
                SCALAR_GATE=SCALAR_GATE,
                USE_GATE=USE_GATE,
                HAS_DT_BIAS=HAS_DT_BIAS,
                USE_LOWER_BOUND=USE_LOWER_BOUND,
                SAFE_GATE=True,
                USE_L2NORM=USE_L2NORM,
                USE_BETA_SIGMOID=USE_BETA_SIGMOID,
                DOT_PRECISION=DOT_PRECISION,
                BLOCKS=BLOCKS,
            )
            if not SAFE_GATE:
                if CHUNKS == "bounded":
                    tl.store(unbounded + i_c * HV + i_hv, (fits == 0).to(tl.int8))
                # "all": redo it, overwriting all; a scalar gate's diagonal blocks are exact
                # for any decay (``scalar_diagonal_block``), never redone
                elif not SCALAR_GATE and fits == 0:
                    tl.debug_barrier()  # the dense pass's stores land first
                    _prepare_chunk(
                        q=q,
                        k=k,
                        v=v,
                        g=g,
                        beta=beta,
                        A_log=A_log,
                        dt_bias=dt_bias,
                        scale=scale,
                        lower_bound=lower_bound,
                        start=start,
                        remaining=remaining,
                        i_c=i_c,
                        i_h=i_h,
                        i_hv=i_hv,
                        chunk_decay=chunk_decay,
                        w=w,
                        u=u,
                        qg=qg,
                        kd=kd,
                        aqk=aqk,
                        cum_g=cum_g,
                        solve=solve,
                        q_norm=q_norm,
                        k_norm=k_norm,
                        pair_limits=pair_limits,
                        H=H,
                        HV=HV,
                        K=K,
                        V=V,
                        BK=BK,
                        BV=BV,
                        SCALAR_GATE=SCALAR_GATE,
                        USE_GATE=USE_GATE,
                        HAS_DT_BIAS=HAS_DT_BIAS,
                        USE_LOWER_BOUND=USE_LOWER_BOUND,
                        SAFE_GATE=False,
                        USE_L2NORM=USE_L2NORM,
                        USE_BETA_SIGMOID=USE_BETA_SIGMOID,
                        DOT_PRECISION=DOT_PRECISION,
                        BLOCKS=BLOCKS,
                    )


@triton.jit
def _store_inverse(t_rows):
    """T = (I + A)⁻¹ of a chunk by 16-row blocks, T_IJ = -T_II Σ_{J <= L < I} A_IL T_LJ,
    over the tiles ``t_rows`` holds (tile (I, J) at ``t_rows + (I * 64 + J) * BLOCK``):
    the A tiles below the diagonal and the diagonal inverses T_II; overwrites the A tiles
    with T's."""
    tl.debug_barrier()  # every tile stored
    tile = BLOCK * 64
    t00 = tl.load(t_rows)
    t11 = tl.load(t_rows + tile + BLOCK)
    t22 = tl.load(t_rows + 2 * tile + 2 * BLOCK)
    t33 = tl.load(t_rows + 3 * tile + 3 * BLOCK)
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
    tl.store(t_rows + tile, t10)
    tl.store(t_rows + 2 * tile, t20)
    tl.store(t_rows + 2 * tile + BLOCK, t21)
    tl.store(t_rows + 3 * tile, t30)
    tl.store(t_rows + 3 * tile + BLOCK, t31)
    tl.store(t_rows + 3 * tile + 2 * BLOCK, t32)


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
def _prepare_chunk(
    q,
    k,
    v,
    g,
    beta,
    A_log,
    dt_bias,
    scale,
    lower_bound,
    start,
    remaining,
    i_c,
    i_h,
    i_hv,
    chunk_decay,
    w,
    u,
    qg,
    kd,
    aqk,
    cum_g,
    solve,
    q_norm,
    k_norm,
    pair_limits,
    H: tl.constexpr,
    HV: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    SCALAR_GATE: tl.constexpr,
    USE_GATE: tl.constexpr,
    HAS_DT_BIAS: tl.constexpr,
    USE_LOWER_BOUND: tl.constexpr,
    SAFE_GATE: tl.constexpr,
    USE_L2NORM: tl.constexpr,
    USE_BETA_SIGMOID: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCKS: tl.constexpr,
):
    """The prepare kernel's work on one chunk and value head (see the module docstring);
    ``SAFE_GATE``: every diagonal block's decay is known to fit a dense dot. Given ``solve``
    (the backward), also T = (I + A)⁻¹ (fp32 ``[C, C]`` tiles on and below the diagonal at
    the chunk's place, as ``aqk``), the cumulative log-decay and l2norm factors
    (``_open_block``) and whether a row block decays past ``PAIRS_DENSE_LIMIT``
    (``pair_limits``, int8, without the safe gate). Returns whether every row block
    decays within ``dense_decay_limit``.

    One row block at a time, in a loop: a block reads the earlier blocks it is coupled to
    (their w and u rows, and their k decayed to the block's end, which ``kd`` holds until
    the chunk's decay is known) back from memory, where this program stored them. Only
    one block is live in registers: a program takes 4 warps and under 256 registers, two
    programs an SM, where the one-pass kernel that held all four blocks took every register
    of 8 warps, one program an SM."""
    offs_k = tl.arange(0, BK)
    mask_k = offs_k < K
    offs_v = tl.arange(0, BV)
    mask_v = offs_v < V
    sub = tl.arange(0, BLOCK)
    C: tl.constexpr = BLOCKS * BLOCK
    # Aqk tile (i, j) of this chunk starts at aqk_rows + (i * C + j) * BLOCK; T's likewise.
    square = ((i_c * HV + i_hv).to(tl.int64) * C + sub)[:, None] * C + sub[None, :]
    aqk_rows = aqk + square
    tile = BLOCK * C  # one row block down
    blocks = tl.arange(0, BLOCKS)
    block_ends = tl.zeros([BLOCKS, BK], dtype=tl.float32)  # cumulative log-decay at block ends
    least = tl.zeros([BK], dtype=tl.float32)  # the least block decay, per channel
    decay_before = tl.zeros([BK], dtype=tl.float32)
    # Not pipelined: Triton does not pipeline a loop that holds another loop, and loading
    # the next block ahead by hand takes every register and spills.
    for i_b in tl.range(0, BLOCKS, num_stages=1):
        raw_g, r_q, r_k, r_v, r_beta = _load_block(
            q=q,
            k=k,
            v=v,
            g=g,
            beta=beta,
            start=start,
            remaining=remaining,
            i_b=i_b,
            i_h=i_h,
            i_hv=i_hv,
            offs_k=offs_k,
            mask_k=mask_k,
            offs_v=offs_v,
            mask_v=mask_v,
            H=H,
            HV=HV,
            K=K,
            V=V,
            SCALAR_GATE=SCALAR_GATE,
        )
        gate_rate, gate_bias = gate_parameters(
            A_log=A_log,
            dt_bias=dt_bias,
            i_hv=i_hv,
            offs_k=offs_k,
            mask_k=mask_k,
            K=K,
            SCALAR_GATE=SCALAR_GATE,
            USE_GATE=USE_GATE,
            HAS_DT_BIAS=HAS_DT_BIAS,
        )
        k_in, q_in, k_out, r_beta, rhs_w, rhs_u, a_kk, decay_after = _open_block(
            raw_g=raw_g,
            r_q=r_q,
            r_k=r_k,
            r_v=r_v,
            r_beta=r_beta,
            gate_rate=gate_rate,
            gate_bias=gate_bias,
            scale=scale,
            lower_bound=lower_bound,
            start=start,
            remaining=remaining,
            i_b=i_b,
            i_hv=i_hv,
            decay_before=decay_before,
            offs_k=offs_k,
            mask_k=mask_k,
            qg=qg,
            aqk_rows=aqk_rows,
            cum_g=cum_g,
            q_norm=q_norm,
            k_norm=k_norm,
            HV=HV,
            K=K,
            BK=BK,
            SCALAR_GATE=SCALAR_GATE,
            USE_GATE=USE_GATE,
            HAS_DT_BIAS=HAS_DT_BIAS,
            USE_LOWER_BOUND=USE_LOWER_BOUND,
            SAFE_GATE=SAFE_GATE,
            USE_L2NORM=USE_L2NORM,
            USE_BETA_SIGMOID=USE_BETA_SIGMOID,
            DOT_PRECISION=DOT_PRECISION,
            C=C,
        )
        bounded: tl.constexpr = USE_L2NORM and USE_BETA_SIGMOID
        inverse = inverse_unit_lower(a_kk, DOT_PRECISION, bounded)
        key_rows, key_mask = _block_rows(
            start=start,
            remaining=remaining,
            i_b=i_b,
            i_hv=i_hv,
            offs_k=offs_k,
            mask_k=mask_k,
            HV=HV,
            K=K,
        )
        tl.store(kd + key_rows, k_out.to(kd.dtype.element_ty), mask=key_mask)
        for j_b in tl.range(0, i_b, num_stages=1):
            key_rows, key_mask = _block_rows(
                start=start,
                remaining=remaining,
                i_b=j_b,
                i_hv=i_hv,
                offs_k=offs_k,
                mask_k=mask_k,
                HV=HV,
                K=K,
            )
            value_rows, value_mask = _block_rows(
                start=start,
                remaining=remaining,
                i_b=j_b,
                i_hv=i_hv,
                offs_k=offs_v,
                mask_k=mask_v,
                HV=HV,
                K=V,
            )
            col_k_out = tl.load(kd + key_rows, mask=key_mask, other=0.0).to(tl.float32)
            col_w = tl.load(w + key_rows, mask=key_mask, other=0.0)
            col_u = tl.load(u + value_rows, mask=value_mask, other=0.0)
            col_decay_after = tile_row(block_ends, j_b)
            rhs_w, rhs_u = _eliminate(
                k_in=k_in,
                q_in=q_in,
                r_beta=r_beta,
                decay_before=decay_before,
                col_decay_after=col_decay_after,
                col_k_out=col_k_out,
                col_w=col_w,
                col_u=col_u,
                rhs_w=rhs_w,
                rhs_u=rhs_u,
                aqk=aqk,
                solve=solve,
                tile_offsets=square + i_b * tile + j_b * BLOCK,
                scale=scale,
                DOT_PRECISION=DOT_PRECISION,
            )
        _solve_block(
            inverse=inverse,
            rhs_w=rhs_w,
            rhs_u=rhs_u,
            w=w,
            u=u,
            start=start,
            remaining=remaining,
            i_b=i_b,
            i_hv=i_hv,
            offs_k=offs_k,
            mask_k=mask_k,
            offs_v=offs_v,
            mask_v=mask_v,
            HV=HV,
            K=K,
            V=V,
            DOT_PRECISION=DOT_PRECISION,
            HALF_W=bounded and BLOCKS == 1 and DOT_PRECISION == "tf32",
        )
        if solve is not None:
            tl.store(solve + square + i_b * (tile + BLOCK), inverse)
        block_ends = tl.where(blocks[:, None] == i_b, decay_after[None, :], block_ends)
        least = tl.minimum(least, decay_after - decay_before)
        decay_before = decay_after
        tl.debug_barrier()  # this block's stores land before the next block reads them

    # kd: k decayed to the chunk's end, known only now.
    tl.store(chunk_decay + (i_c * HV + i_hv).to(tl.int64) * K + offs_k, decay_before, mask=mask_k)
    for j_b in tl.range(0, BLOCKS - 1):  # the last block ends at the chunk's end: already kd
        key_rows, key_mask = _block_rows(
            start=start,
            remaining=remaining,
            i_b=j_b,
            i_hv=i_hv,
            offs_k=offs_k,
            mask_k=mask_k,
            HV=HV,
            K=K,
        )
        to_chunk_end = fast_exp(decay_before - tile_row(block_ends, j_b))[None, :]
        b_kd = tl.load(kd + key_rows, mask=key_mask, other=0.0).to(tl.float32) * to_chunk_end
        tl.store(kd + key_rows, b_kd.to(kd.dtype.element_ty), mask=key_mask)

    if solve is not None:
        _store_inverse(solve + square)
    # Whether the dense diagonal dots were in range: every block's decay within the limit.
    smallest = tl.min(least, axis=0)
    if pair_limits is not None:
        tl.store(pair_limits + i_c * HV + i_hv, (smallest < -PAIRS_DENSE_LIMIT).to(tl.int8))
    return smallest >= -dense_decay_limit(qg.dtype.element_ty)
