"""Device functions that more than one kernel of the chunked forward and backward calls:
where a program's chunk or sequence lies in the token rows, the in-chunk cumulative sum
of the log-decay, the gate activation of a row block, the l2norm and beta sigmoid of its
rows, and the dyadic split of a diagonal block's decay factors. Kept in one place so that
the forward's prepare kernel and the backward's kernels compute these rows alike.

Chunks are C = ``CHUNK`` = 64 tokens (the forward's prepare takes C = 16, one block), in
row blocks of ``BLOCK`` = 16 (the blocks of the prepare kernel's UT/WY solve). With packed
sequences chunks are numbered per sequence on the device (``chunk_offsets``), so that a
launch needs no host sync: the grid is an upper bound and ``locate_chunk`` gives the
programs past the last chunk nothing to do."""

import triton
import triton.language as tl

from kda_ops import reference
from kda_ops.kernels.fast_exp import fast_sigmoid
from kda_ops.kernels.gate import gate_activation

CHUNK = reference.CHUNK_SIZE
BLOCK = tl.constexpr(16)  # rows of a block of the UT/WY solve
CHUNK_BLOCKS = tl.constexpr(CHUNK // BLOCK.value)  # row blocks of a 64-token chunk
LOG2_BLOCK = tl.constexpr(4)
L2NORM_EPS = tl.constexpr(reference.L2NORM_EPS)


@triton.jit
def locate_chunk(
    i_c,
    cu_seqlens,
    chunk_offsets,
    n_seqs,
    length,
    BN: tl.constexpr,
    IS_VARLEN: tl.constexpr,
    C: tl.constexpr = 64,
):
    """(first token of chunk i_c, tokens left in its sequence from there), both int64, for
    chunks of C tokens (``chunk_offsets`` numbering them); none left for the programs of
    the varlen grid's upper bound that have no chunk."""
    start, remaining, _ = _locate(
        i_c=i_c,
        cu_seqlens=cu_seqlens,
        chunk_offsets=chunk_offsets,
        n_seqs=n_seqs,
        length=length,
        BN=BN,
        IS_VARLEN=IS_VARLEN,
        C=C,
    )
    return start, remaining


@triton.jit
def _locate(
    i_c,
    cu_seqlens,
    chunk_offsets,
    n_seqs,
    length,
    BN: tl.constexpr,
    IS_VARLEN: tl.constexpr,
    C: tl.constexpr,
):
    """``locate_chunk``'s (first token, tokens left) and the chunk's number in its
    sequence."""
    # One return after a constexpr if/else: Triton 3.6 type-checks every return it
    # reaches, and code after an early `return` inside a constexpr branch is reached.
    if IS_VARLEN:
        # Every bound loaded at once and the chunk's picked from them, so that a program
        # waits for one round trip to memory before its own loads, not for two (the
        # sequence's index, then its bounds at that index).
        seqs = tl.arange(0, BN)
        in_batch = seqs < n_seqs
        ends = tl.load(chunk_offsets + 1 + seqs, mask=in_batch, other=2**31 - 1)
        starts = tl.load(cu_seqlens + seqs, mask=in_batch, other=0)
        stops = tl.load(cu_seqlens + 1 + seqs, mask=in_batch, other=0)
        before = ends <= i_c  # the sequences whose chunks all come before chunk i_c
        seq = tl.sum(before.to(tl.int32))
        first_chunk = tl.max(tl.where(before, ends, 0))
        bos = tl.sum(tl.where(seqs == seq, starts, 0)).to(tl.int64)
        eos = tl.sum(tl.where(seqs == seq, stops, 0)).to(tl.int64)
        local = i_c - first_chunk
        start = bos + local.to(tl.int64) * C
        remaining = tl.where(seq < n_seqs, eos - start, 0)
    else:
        n_chunks = tl.cdiv(length, C)
        seq = i_c // n_chunks
        local = i_c % n_chunks
        start = seq.to(tl.int64) * length + local.to(tl.int64) * C
        remaining = (seq + 1).to(tl.int64) * length - start
    return start, remaining, local


@triton.jit
def program_chunk(
    pid,
    window_first,
    cu_seqlens,
    chunk_offsets,
    n_seqs,
    length,
    BN: tl.constexpr,
    IS_VARLEN: tl.constexpr,
    C: tl.constexpr,
    WINDOW: tl.constexpr,
):
    """(global number, first token, tokens left in its sequence from there) of the chunk of
    C tokens of a token-parallel program numbered ``pid`` along the chunks. ``WINDOW`` =
    0: the chunk numbered as the program (``locate_chunk``). Else only chunks
    ``[window_first, window_first + WINDOW)`` of each sequence (the pipelined forward's
    time windows, ``launch.py``): at fixed length ``WINDOW`` programs a sequence; packed,
    the programs of the grid over every chunk whose chunk lies outside get none (sequences
    times ``WINDOW`` programs could be many more than chunks)."""
    if WINDOW == 0:
        i_c = pid
        start, remaining = locate_chunk(
            i_c=i_c,
            cu_seqlens=cu_seqlens,
            chunk_offsets=chunk_offsets,
            n_seqs=n_seqs,
            length=length,
            BN=BN,
            IS_VARLEN=IS_VARLEN,
            C=C,
        )
    elif IS_VARLEN:
        i_c = pid
        start, remaining, local = _locate(
            i_c=i_c,
            cu_seqlens=cu_seqlens,
            chunk_offsets=chunk_offsets,
            n_seqs=n_seqs,
            length=length,
            BN=BN,
            IS_VARLEN=IS_VARLEN,
            C=C,
        )
        inside = (local >= window_first) & (local < window_first + WINDOW)
        remaining = tl.where(inside, remaining, 0)
    else:
        i_n = pid // WINDOW
        c = window_first + pid % WINDOW
        n_chunks = tl.cdiv(length, C)
        i_c = i_n * n_chunks + c
        start = i_n.to(tl.int64) * length + c.to(tl.int64) * C
        remaining = tl.where(c < n_chunks, (i_n + 1).to(tl.int64) * length - start, 0)
    return i_c, start, remaining


@triton.jit
def sequence_span(
    i_n, cu_seqlens, chunk_offsets, length, IS_VARLEN: tl.constexpr, C: tl.constexpr = 64
):
    """(first token, length, global number of the first chunk) of sequence i_n, for the
    head-parallel scans over its chunks of C tokens; int64, int64, int32."""
    if IS_VARLEN:
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        seq_len = tl.load(cu_seqlens + i_n + 1).to(tl.int64) - bos
        first_chunk = tl.load(chunk_offsets + i_n).to(tl.int32)
    else:
        bos = i_n.to(tl.int64) * length
        seq_len = (i_n * 0 + length).to(tl.int64)
        first_chunk = i_n * tl.cdiv(length, C)
    return bos, seq_len, first_chunk


@triton.jit
def value_block_program(V: tl.constexpr, BV: tl.constexpr):
    """(block, row) of a program of a one-dimensional grid that walks the BV-wide blocks of
    V columns of each row in turn: the value blocks of a sequence-head in the scans, the
    channel blocks of a sequence in the conv decode step. One axis, because a grid's second
    and third extents stop at 65535: a batch of 2048 sequences at 32 value heads would not
    launch."""
    blocks: tl.constexpr = (V + BV - 1) // BV
    pid = tl.program_id(0)
    return pid % blocks, pid // blocks


@triton.jit
def scan_program(i_rank, sequence_order, HV: tl.constexpr, IS_VARLEN: tl.constexpr):
    """(sequence, value head, sequence-head index) of the head-parallel scan program that
    takes sequence-head ``i_rank`` in launch order: packed sequences in the order of
    ``sequence_order`` (``reference.longest_first``), fixed-length ones in their own."""
    i_hv = i_rank % HV
    if IS_VARLEN:
        i_n = tl.load(sequence_order + i_rank // HV)
    else:
        i_n = i_rank // HV
    return i_n, i_hv, i_n * HV + i_hv


@triton.jit
def tile_row(tile, i):
    """Row ``i`` (a tensor index) of a 2-D tile, as a vector over its columns."""
    return tl.sum(tl.where(tl.arange(0, tile.shape[0])[:, None] == i, tile, 0.0), axis=0)


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
def activate_gate(
    raw_g,
    rate,
    bias,
    lower_bound,
    in_seq,
    mask_k,
    BK: tl.constexpr,
    ROWS: tl.constexpr,
    SCALAR_GATE: tl.constexpr,
    USE_GATE: tl.constexpr,
    HAS_DT_BIAS: tl.constexpr,
    USE_LOWER_BOUND: tl.constexpr,
):
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
        b_g = gate_activation(
            x=b_g, rate=rate, lower_bound=lower_bound, USE_LOWER_BOUND=USE_LOWER_BOUND
        )
    return tl.where(in_seq[:, None] & mask_k[None, :], b_g, 0.0)


@triton.jit
def activate_scalar_gate(
    raw_g,
    rate,
    bias,
    lower_bound,
    in_seq,
    USE_GATE: tl.constexpr,
    HAS_DT_BIAS: tl.constexpr,
    USE_LOWER_BOUND: tl.constexpr,
):
    """Activated log-decay of a scalar gate's rows (``raw_g`` [ROWS]), [ROWS] fp32; 0 on
    padding rows: one activation a row, where ``activate_gate`` broadcasts it over K."""
    b_g = raw_g.to(tl.float32)
    if USE_GATE:
        if HAS_DT_BIAS:
            b_g += bias
        b_g = gate_activation(
            x=b_g, rate=rate, lower_bound=lower_bound, USE_LOWER_BOUND=USE_LOWER_BOUND
        )
    return tl.where(in_seq, b_g, 0.0)


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
        at_middle = tl.dot((token == middle[:, None]).to(tl.float32), decay, input_precision="ieee")
        exponent = tl.where(upper[:, None], decay - at_middle, at_middle - decay)
    else:
        span = tl.where(
            upper[:, None],
            (token > middle[:, None]) & (token <= sub[:, None]),
            (token > sub[:, None]) & (token <= middle[:, None]),
        )
        exponent = tl.dot(span.to(tl.float32), decay, input_precision="tf32x3")
    pairs = (group[:, None] == group[None, :]) & upper[:, None] & (token < middle[:, None])
    return pairs, tl.exp(exponent)
