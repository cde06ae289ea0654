"""Device functions the conv kernels share: a token-parallel program's tile
(``token_block``, sized by ``tile_sizes``), the inputs of its windows, from x or from a
sequence's initial state (``window_input``), the pre-activation z, a sequence's first
W - 1 tokens (the only ones reading the initial state, done apart by the program holding
the sequence's start: ``starting_sequences``, ``head_rows``) and a sequence's state slot
and extent. Shared so that the backward recomputes z exactly as the prefill computed it.
"""

import triton
import triton.language as tl

from kda_ops.kernels.sizes import cdiv, next_power_of_2


@triton.jit
def token_program(length, D: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr):
    """(token block, channel block, batch row) of a token-parallel program of the
    one-dimensional grid :func:`token_grid` plans: token blocks fastest, then channel
    blocks, then rows, a three-dimensional grid's order. One axis, because a grid's second
    and third extents stop at 65535 (a batch of 65536 rows would not launch)."""
    pid = tl.program_id(0)
    token_blocks = tl.cdiv(length, BT)
    channel_blocks: tl.constexpr = (D + BD - 1) // BD
    i_t = pid % token_blocks
    rest = pid // token_blocks
    return i_t, rest % channel_blocks, rest // channel_blocks


@triton.jit
def token_block(
    cu_seqlens,
    n_seqs,
    length,
    D: tl.constexpr,
    BT: tl.constexpr,
    BD: tl.constexpr,
    BN: tl.constexpr,
    IS_VARLEN: tl.constexpr,
):
    """This program's tile (:func:`token_program`): its channels and their mask ([BD]),
    and per row ([BT]) the token's global index (int64), sequence id, the sequence's first
    token (int64) and whether the row is a token."""
    i_t, i_d, i_b = token_program(length=length, D=D, BT=BT, BD=BD)
    rows = i_t * BT + tl.arange(0, BT)
    cols = i_d * BD + tl.arange(0, BD)
    if IS_VARLEN:
        seq_ids = tl.arange(0, BN)
        ends = tl.load(cu_seqlens + 1 + seq_ids, mask=seq_ids < n_seqs, other=2**31 - 1)
        seq = tl.sum((ends[None, :] <= rows[:, None]).to(tl.int32), axis=1)
        bos = tl.load(cu_seqlens + seq, mask=seq < n_seqs, other=0).to(tl.int64)
        valid = rows < tl.load(cu_seqlens + n_seqs)
        tokens = rows.to(tl.int64)
    else:
        seq = tl.zeros_like(rows) + i_b
        bos = seq.to(tl.int64) * length
        valid = rows < length
        tokens = rows.to(tl.int64) + i_b.to(tl.int64) * length
    return cols, cols < D, tokens, seq, bos, valid


@triton.jit
def tap_weight(weight, cols, mask_d, tap, W: tl.constexpr):
    """Tap ``tap`` of the channels ``cols`` ([BD] fp32)."""
    return tl.load(weight + cols * W + tap, mask=mask_d, other=0.0).to(tl.float32)


@triton.jit
def pre_activation(
    x,
    state,
    weight,
    tokens,
    position,
    slots,
    valid,
    has_history,
    cols,
    mask_d,
    D: tl.constexpr,
    W: tl.constexpr,
    HAS_STATE: tl.constexpr,
):
    """z = Σ_tap w_tap · input(position - (W - 1 - tap)) of the rows ([rows, BD] fp32),
    the inputs as ``window_input`` gives them."""
    z = tl.zeros([position.shape[0], cols.shape[0]], dtype=tl.float32)
    for tap in tl.static_range(W):
        shift = W - 1 - tap
        b_x = window_input(
            x=x,
            state=state,
            token=tokens - shift,
            source=position - shift,
            slot=slots,
            valid=valid,
            has_history=has_history,
            cols=cols,
            mask_d=mask_d,
            D=D,
            W=W,
            HAS_STATE=HAS_STATE,
        )
        z += b_x * tap_weight(weight=weight, cols=cols, mask_d=mask_d, tap=tap, W=W)[None, :]
    return z


@triton.jit
def add_bias(z, bias, cols, mask_d, HAS_BIAS: tl.constexpr):
    if HAS_BIAS:
        z += tl.load(bias + cols, mask=mask_d, other=0.0).to(tl.float32)[None, :]
    return z


@triton.jit
def starting_sequences(seq, position, valid, n_seqs):
    """The first and last id of the sequences whose first token is a row of this tile
    (first > last if none)."""
    starts = valid & (position == 0)
    return tl.min(tl.where(starts, seq, n_seqs)), tl.max(tl.where(starts, seq, -1))


@triton.jit
def state_slot(state_indices, i_n, USE_INDICES: tl.constexpr):
    """Sequence i_n's state slot (int64): ``state_indices[i_n]`` if given (negative:
    padding), else i_n."""
    slot = i_n.to(tl.int64)
    if USE_INDICES:
        slot = tl.load(state_indices + i_n).to(tl.int64)
    return slot


@triton.jit
def head_rows(
    state_indices,
    cu_seqlens,
    length,
    i_n,
    W: tl.constexpr,
    BW: tl.constexpr,
    USE_INDICES: tl.constexpr,
    IS_VARLEN: tl.constexpr,
):
    """Sequence i_n's first W - 1 tokens, whose windows reach into the initial state, as
    the rows of a BW-row tile: their tokens, positions and state slots (int64 [BW]),
    whether each is a token, and whether it has a history (slot ``state_indices[i_n]``
    if given; negative: none)."""
    bos, span = sequence_extent(cu_seqlens=cu_seqlens, i_n=i_n, length=length, IS_VARLEN=IS_VARLEN)
    slot = state_slot(state_indices, i_n, USE_INDICES)
    position = tl.arange(0, BW).to(tl.int64)
    slots = slot + position * 0
    valid = (position < W - 1) & (position < span)
    return bos + position, position, slots, valid, valid & (slots >= 0)


@triton.jit
def window_input(
    x,
    state,
    token,
    source,
    slot,
    valid,
    has_history,
    cols,
    mask_d,
    D: tl.constexpr,
    W: tl.constexpr,
    HAS_STATE: tl.constexpr,
):
    """The input at sequence position ``source`` of each row ([rows, BD] fp32): x's token
    for source >= 0, the state's entry ``W - 1 + source`` before the start where the row
    has a history, else 0."""
    in_x = (valid & (source >= 0))[:, None] & mask_d[None, :]
    b_x = tl.load(x + token[:, None] * D + cols[None, :], mask=in_x, other=0.0).to(tl.float32)
    if HAS_STATE:
        in_state = (has_history & (source < 0) & (source >= -(W - 1)))[:, None] & mask_d[None, :]
        offsets = (slot[:, None] * D + cols[None, :]) * (W - 1) + (W - 1 + source)[:, None]
        b_x += tl.load(state + offsets, mask=in_state, other=0.0).to(tl.float32)
    return b_x


@triton.jit
def sequence_extent(cu_seqlens, i_n, length, IS_VARLEN: tl.constexpr):
    """Sequence i_n's first token and length (int64 scalars)."""
    if IS_VARLEN:
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        span = tl.load(cu_seqlens + i_n + 1).to(tl.int64) - bos
    else:
        bos = i_n.to(tl.int64) * length
        span = i_n.to(tl.int64) * 0 + length
    return bos, span


def token_grid(batch: int, length: int, channels: int, block_t: int, block_d: int) -> tuple[int]:
    """The grid of a token-parallel conv kernel (:func:`token_program`): every (token block,
    channel block, batch row) on one axis. Sizes may be symbolic: a traced graph's, or
    TensorRT's shape expressions (``lowering/tensorrt.py``), hence only ``+ * //`` with the
    symbolic operand first."""
    token_blocks = (length + (block_t - 1)) // block_t
    return (token_blocks * batch * cdiv(channels, block_d),)


def tile_sizes(rows: int, length: int, channels: int) -> tuple[int, int]:
    """(BT, BD): tokens (at most ``rows``) and channels of a program's tile
    (``token_block``) in the prefill and backward kernels."""
    block_t = min(rows, next_power_of_2(max(length, 1)))
    return block_t, min(128, next_power_of_2(channels))
