"""Depthwise causal conv1d.

Prefill: a token-parallel output kernel, in which a sequence's first ``W - 1`` tokens (the
only ones reading the initial state) are done apart by the program holding the sequence's
start. The program of a batch row's last token block also writes the row's final conv
state (its last ``W - 1`` inputs); for packed sequences, and for a pool rewritten in
place, a sequence-parallel kernel writes it after the output kernel instead. Decode (one
token per sequence): one kernel writes y and the new state in one pass over the state,
for W = 4 and D % 8 == 0 one that moves only 16-byte vectors
(:func:`conv_step_w4_kernel`), else a generic one.

Layouts: x ``[B, T, D]`` (or packed ``[1, T_total, D]`` with ``cu_seqlens``); weight
``[D, W]``; state ``[N, D, W - 1]``, entry ``j`` holding the input ``W - 1 - j`` tokens
before the sequence (or before the end, for the final state). With ``state_indices`` the
state is a pool and sequence n uses slot ``state_indices[n]`` (negative: padding, no
history and no write); the output kernel runs before the state kernel, so reading and
rewriting the same slot is safe.

Backward (functional op, fp32): ``conv_grad_z_kernel`` recomputes the pre-activation z
(a sequence's first W - 1 tokens apart, as in the forward) and writes dz = dy · act'(z)
with its programs' shares of dweight and dbias;
``conv_grad_x_kernel`` gathers dx from the W later dz of the same sequence and the final
state's gradient; ``conv_grad_state_kernel`` does the same for the initial state's
entries.
"""

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from kda_ops.kernels.fast_exp import fast_sigmoid
from kda_ops.kernels.sizes import cdiv, next_power_of_2, processors


@triton.jit
def _token_block(cu_seqlens, n_seqs, length, D: tl.constexpr, BT: tl.constexpr,
                 BD: tl.constexpr, BN: tl.constexpr, IS_VARLEN: tl.constexpr):  # fmt: skip
    """This program's tile, the program being (token block, channel block, batch): its
    channels and their mask ([BD]), and per row ([BT]) the token's global index (int64),
    sequence id, the sequence's first token (int64) and whether the row is a token."""
    i_t, i_d, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
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
def _tap_weight(weight, cols, mask_d, tap, W: tl.constexpr):
    """Tap ``tap`` of the channels ``cols`` ([BD] fp32)."""
    return tl.load(weight + cols * W + tap, mask=mask_d, other=0.0).to(tl.float32)


@triton.jit
def _pre_activation(x, state, weight, tokens, position, slots, valid, has_history, cols, mask_d,
                    D: tl.constexpr, W: tl.constexpr, HAS_STATE: tl.constexpr):  # fmt: skip
    """z = Σ_tap w_tap · input(position - (W - 1 - tap)) of the rows ([rows, BD] fp32),
    the inputs as ``_window_input`` gives them."""
    z = tl.zeros([position.shape[0], cols.shape[0]], dtype=tl.float32)
    for tap in tl.static_range(W):
        shift = W - 1 - tap
        b_x = _window_input(x, state, tokens - shift, position - shift, slots, valid,
                            has_history, cols, mask_d, D, W, HAS_STATE)  # fmt: skip
        z += b_x * _tap_weight(weight, cols, mask_d, tap, W)[None, :]
    return z


@triton.jit
def _add_bias(z, bias, cols, mask_d, HAS_BIAS: tl.constexpr):
    if HAS_BIAS:
        z += tl.load(bias + cols, mask=mask_d, other=0.0).to(tl.float32)[None, :]
    return z


@triton.jit
def _starting_sequences(seq, position, valid, n_seqs):
    """The first and last id of the sequences whose first token is a row of this tile
    (first > last if none)."""
    starts = valid & (position == 0)
    return tl.min(tl.where(starts, seq, n_seqs)), tl.max(tl.where(starts, seq, -1))


@triton.jit
def _state_slot(state_indices, i_n, USE_INDICES: tl.constexpr):
    """Sequence i_n's state slot (int64): ``state_indices[i_n]`` if given (negative:
    padding), else i_n."""
    slot = i_n.to(tl.int64)
    if USE_INDICES:
        slot = tl.load(state_indices + i_n).to(tl.int64)
    return slot


@triton.jit
def _head_rows(state_indices, cu_seqlens, length, i_n, W: tl.constexpr, BW: tl.constexpr,
               USE_INDICES: tl.constexpr, IS_VARLEN: tl.constexpr):  # fmt: skip
    """Sequence i_n's first W - 1 tokens, whose windows reach into the initial state, as
    the rows of a BW-row tile: their tokens, positions and state slots (int64 [BW]),
    whether each is a token, and whether it has a history (slot ``state_indices[i_n]``
    if given; negative: none)."""
    bos, span = _sequence_extent(cu_seqlens, i_n, length, IS_VARLEN)
    slot = _state_slot(state_indices, i_n, USE_INDICES)
    position = tl.arange(0, BW).to(tl.int64)
    slots = slot + position * 0
    valid = (position < W - 1) & (position < span)
    return bos + position, position, slots, valid, valid & (slots >= 0)


@triton.jit
def _write_output(y, z, bias, tokens, rows, cols, mask_d, D: tl.constexpr,
                  HAS_BIAS: tl.constexpr, SILU: tl.constexpr):  # fmt: skip
    """y = act(z + bias) of the rows where ``rows`` holds."""
    z = _add_bias(z, bias, cols, mask_d, HAS_BIAS)
    if SILU:
        z = z * fast_sigmoid(z)
    tl.store(y + tokens[:, None] * D + cols[None, :], z.to(y.dtype.element_ty),
             mask=rows[:, None] & mask_d[None, :])  # fmt: skip


@triton.jit
def causal_conv1d_kernel(
    x, weight, bias, state, state_indices, cu_seqlens, length, n_seqs, y, state_out,
    D: tl.constexpr, W: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr, BN: tl.constexpr,
    BW: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_STATE: tl.constexpr,
    USE_INDICES: tl.constexpr, IS_VARLEN: tl.constexpr, SILU: tl.constexpr,
    FINAL_STATE: tl.constexpr,
):  # fmt: skip
    """y of a [BT, BD] tile from x alone. With an initial state, a sequence's first W - 1
    tokens (the only ones reading it) are done apart (``_head_rows``) by the program
    holding the sequence's first token: the state's strided gather over every tile's rows
    made this kernel spill and load 2 bytes at a time. With ``FINAL_STATE`` (batch rows,
    not packed; ``state_out`` not ``state``) the program of a row's last token block also
    writes its final state, which otherwise ``conv_final_state_kernel`` does."""
    cols, mask_d, tokens, seq, bos, valid = _token_block(cu_seqlens, n_seqs, length, D, BT, BD,
                                                         BN, IS_VARLEN)  # fmt: skip
    position = tokens - bos
    z = _pre_activation(x, state, weight, tokens, position, seq, valid, valid, cols, mask_d, D,
                        W, False)  # fmt: skip
    rows = valid
    if HAS_STATE:
        rows = valid & (position >= W - 1)
    _write_output(y, z, bias, tokens, rows, cols, mask_d, D, HAS_BIAS, SILU)
    if HAS_STATE:
        i_n, last = _starting_sequences(seq, position, valid, n_seqs)
        while i_n <= last:
            h_tokens, h_position, slots, h_valid, has_history = _head_rows(
                state_indices, cu_seqlens, length, i_n, W, BW, USE_INDICES, IS_VARLEN
            )
            h_z = _pre_activation(x, state, weight, h_tokens, h_position, slots, h_valid,
                                  has_history, cols, mask_d, D, W, True)  # fmt: skip
            _write_output(y, h_z, bias, h_tokens, h_valid, cols, mask_d, D, HAS_BIAS, SILU)
            i_n += 1
    if FINAL_STATE:
        i_t, i_b = tl.program_id(0), tl.program_id(2)
        if i_t == tl.cdiv(length, BT) - 1:  # the batch row's last token block
            _write_final_state(x, state, state_indices, cu_seqlens, length, state_out, i_b,
                               cols, D, W, BW, HAS_STATE, USE_INDICES, False)  # fmt: skip


@triton.jit
def _sequence_span(seq, bos, valid, cu_seqlens, length, IS_VARLEN: tl.constexpr):
    """Length of each row's sequence (int64), from ``_token_block``'s sequence ids."""
    if IS_VARLEN:
        eos = tl.load(cu_seqlens + seq + 1, mask=valid, other=0).to(tl.int64)
        span = eos - bos
    else:
        span = tl.zeros_like(bos) + length
    return span


@triton.jit
def _grad_z_rows(x, state, weight, bias, grad_y, grad_z, tokens, position, slots, valid,
                 cols, mask_d, D: tl.constexpr, W: tl.constexpr, BW: tl.constexpr,
                 HAS_BIAS: tl.constexpr, HAS_STATE: tl.constexpr,
                 SILU: tl.constexpr):  # fmt: skip
    """dz = dy · act'(z) of the rows where ``valid`` holds, stored to grad_z; returns their
    Σ dz · input per tap ([BD, BW], taps first W) and Σ dz ([BD])."""
    z = _pre_activation(x, state, weight, tokens, position, slots, valid, valid, cols, mask_d,
                        D, W, HAS_STATE)  # fmt: skip
    z = _add_bias(z, bias, cols, mask_d, HAS_BIAS)
    mask = valid[:, None] & mask_d[None, :]
    offsets = tokens[:, None] * D + cols[None, :]
    b_dz = tl.load(grad_y + offsets, mask=mask, other=0.0).to(tl.float32)
    if SILU:  # silu'(z) = σ(z) (1 + z (1 - σ(z)))
        sig = fast_sigmoid(z)
        b_dz = b_dz * sig * (1.0 + z * (1.0 - sig))
    tl.store(grad_z + offsets, b_dz, mask=mask)
    taps = tl.arange(0, BW)
    shares = tl.zeros([cols.shape[0], BW], dtype=tl.float32)
    for tap in tl.static_range(W):
        shift = W - 1 - tap
        b_x = _window_input(x, state, tokens - shift, position - shift, slots, valid, valid,
                            cols, mask_d, D, W, HAS_STATE)  # fmt: skip
        shares += tl.where(taps[None, :] == tap, tl.sum(b_dz * b_x, axis=0)[:, None], 0.0)
    return shares, tl.sum(b_dz, axis=0)


@triton.jit
def conv_grad_z_kernel(
    x, weight, bias, state, cu_seqlens, grad_y, length, n_seqs, grad_z, dweight_parts,
    dbias_parts,
    D: tl.constexpr, W: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr, BN: tl.constexpr,
    BW: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_STATE: tl.constexpr,
    IS_VARLEN: tl.constexpr, SILU: tl.constexpr,
):  # fmt: skip
    """dz = dy · act'(z) (fp32, x's layout), z recomputed as ``causal_conv1d_kernel`` does
    (a sequence's first W - 1 tokens apart with a state); this program's shares of dweight
    (``[programs, D, BW]``, taps first W) and dbias (``[programs, D]``), the program
    numbered over (token block, batch)."""
    cols, mask_d, tokens, seq, bos, valid = _token_block(cu_seqlens, n_seqs, length, D, BT, BD,
                                                         BN, IS_VARLEN)  # fmt: skip
    position = tokens - bos
    rows = valid
    if HAS_STATE:
        rows = valid & (position >= W - 1)
    shares, dbias = _grad_z_rows(x, state, weight, bias, grad_y, grad_z, tokens, position, seq,
                                 rows, cols, mask_d, D, W, BW, HAS_BIAS, False, SILU)  # fmt: skip
    if HAS_STATE:
        i_n, last = _starting_sequences(seq, position, valid, n_seqs)
        while i_n <= last:
            h_tokens, h_position, slots, h_valid, _ = _head_rows(
                None, cu_seqlens, length, i_n, W, BW, False, IS_VARLEN
            )
            head_shares, head_dbias = _grad_z_rows(
                x, state, weight, bias, grad_y, grad_z, h_tokens, h_position, slots, h_valid,
                cols, mask_d, D, W, BW, HAS_BIAS, True, SILU,
            )  # fmt: skip
            shares += head_shares
            dbias += head_dbias
            i_n += 1
    part = tl.program_id(2) * tl.num_programs(0) + tl.program_id(0)
    taps = tl.arange(0, BW)
    tl.store(dweight_parts + (part * D + cols[:, None]) * BW + taps[None, :], shares,
             mask=mask_d[:, None])  # fmt: skip
    if HAS_BIAS:
        tl.store(dbias_parts + part * D + cols, dbias, mask=mask_d)


@triton.jit
def _window_input(x, state, token, source, slot, valid, has_history, cols, mask_d,
                  D: tl.constexpr, W: tl.constexpr, HAS_STATE: tl.constexpr):  # fmt: skip
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
def _gathered_grad(grad_z, weight, grad_final, position, span, first, seq, valid, cols,
                   mask_d, D: tl.constexpr, W: tl.constexpr):  # fmt: skip
    """Gradient of the inputs at sequence positions ``position`` ([BT] int64, may be
    negative: the state's entries), [BT, BD] fp32: Σ_tap w_tap dz at position +
    W - 1 - tap inside the sequence (token ``first + that``), plus the final state's
    gradient where the position is one it keeps."""
    acc = tl.zeros([position.shape[0], cols.shape[0]], dtype=tl.float32)
    for tap in tl.static_range(W):
        target = position + (W - 1 - tap)
        inside = (valid & (target >= 0) & (target < span))[:, None] & mask_d[None, :]
        b_dz = tl.load(grad_z + (first + target)[:, None] * D + cols[None, :], mask=inside,
                       other=0.0)  # fmt: skip
        acc += b_dz * _tap_weight(weight, cols, mask_d, tap, W)[None, :]
    entry = position - span + (W - 1)  # the final state's entry keeping this position
    kept = (valid & (entry >= 0) & (entry < W - 1))[:, None] & mask_d[None, :]
    acc += tl.load(grad_final + (seq.to(tl.int64)[:, None] * D + cols[None, :]) * (W - 1)
                   + entry[:, None], mask=kept, other=0.0)  # fmt: skip
    return acc


@triton.jit
def conv_grad_x_kernel(
    grad_z, weight, grad_final, cu_seqlens, length, n_seqs, dx,
    D: tl.constexpr, W: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr, BN: tl.constexpr,
    IS_VARLEN: tl.constexpr,
):  # fmt: skip
    """dx of x's tokens (x's dtype) from dz and the final state's gradient."""
    cols, mask_d, tokens, seq, bos, valid = _token_block(cu_seqlens, n_seqs, length, D, BT, BD,
                                                         BN, IS_VARLEN)  # fmt: skip
    span = _sequence_span(seq, bos, valid, cu_seqlens, length, IS_VARLEN)
    b_dx = _gathered_grad(grad_z, weight, grad_final, tokens - bos, span, bos, seq, valid,
                          cols, mask_d, D, W)  # fmt: skip
    tl.store(dx + tokens[:, None] * D + cols[None, :], b_dx.to(dx.dtype.element_ty),
             mask=valid[:, None] & mask_d[None, :])  # fmt: skip


@triton.jit
def _sequence_extent(cu_seqlens, i_n, length, IS_VARLEN: tl.constexpr):
    """Sequence i_n's first token and length (int64 scalars)."""
    if IS_VARLEN:
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        span = tl.load(cu_seqlens + i_n + 1).to(tl.int64) - bos
    else:
        bos = i_n.to(tl.int64) * length
        span = i_n.to(tl.int64) * 0 + length
    return bos, span


@triton.jit
def conv_grad_state_kernel(
    grad_z, weight, grad_final, cu_seqlens, length, d_state,
    D: tl.constexpr, W: tl.constexpr, BD: tl.constexpr, BW: tl.constexpr,
    IS_VARLEN: tl.constexpr,
):  # fmt: skip
    """The initial state's gradient (its dtype), entry e standing for position e - (W - 1)."""
    i_n, i_d = tl.program_id(0), tl.program_id(1)
    bos, span = _sequence_extent(cu_seqlens, i_n, length, IS_VARLEN)
    cols = i_d * BD + tl.arange(0, BD)
    mask_d = cols < D
    entries = tl.arange(0, BW)
    valid = entries < W - 1
    seq = entries * 0 + i_n
    b_ds = _gathered_grad(grad_z, weight, grad_final, (entries - (W - 1)).to(tl.int64),
                          span + entries * 0, bos, seq, valid, cols, mask_d, D, W)  # fmt: skip
    tl.store(d_state + (i_n.to(tl.int64) * D + cols[None, :]) * (W - 1) + entries[:, None],
             b_ds.to(d_state.dtype.element_ty), mask=valid[:, None] & mask_d[None, :])  # fmt: skip


@triton.jit
def _write_final_state(x, state_in, state_indices, cu_seqlens, length, state_out, i_n, cols,
                       D: tl.constexpr, W: tl.constexpr, BW: tl.constexpr,
                       HAS_STATE: tl.constexpr, USE_INDICES: tl.constexpr,
                       IS_VARLEN: tl.constexpr):  # fmt: skip
    """Sequence i_n's final state for the channels ``cols``: its last W - 1 inputs, those
    before its start taken from its initial state (zeros without one)."""
    bos, span = _sequence_extent(cu_seqlens, i_n, length, IS_VARLEN)
    entries = tl.arange(0, BW)
    source = span - (W - 1) + entries  # position of the input each entry keeps
    mask = (cols < D)[:, None] & (entries < W - 1)[None, :]
    slot = _state_slot(state_indices, i_n, USE_INDICES)
    if USE_INDICES:
        mask = mask & (cols * 0 + slot >= 0)[:, None]
    in_x = mask & (source >= 0)[None, :]
    b_state = tl.load(x + (bos + source)[None, :] * D + cols[:, None], mask=in_x, other=0.0)
    b_state = b_state.to(tl.float32)
    state_offsets = (slot * D + cols[:, None]) * (W - 1)
    if HAS_STATE:
        in_state = mask & (source < 0)[None, :]
        old = tl.load(
            state_in + state_offsets + (W - 1 + source)[None, :], mask=in_state, other=0.0
        )
        b_state += old.to(tl.float32)
    tl.store(state_out + state_offsets + entries[None, :],
             b_state.to(state_out.dtype.element_ty), mask=mask)  # fmt: skip


@triton.jit
def conv_final_state_kernel(
    x, state_in, state_indices, cu_seqlens, length, state_out,
    D: tl.constexpr, W: tl.constexpr, BD: tl.constexpr, BW: tl.constexpr,
    HAS_STATE: tl.constexpr, USE_INDICES: tl.constexpr, IS_VARLEN: tl.constexpr,
):  # fmt: skip
    i_n, i_d = tl.program_id(0), tl.program_id(1)
    _write_final_state(x, state_in, state_indices, cu_seqlens, length, state_out, i_n,
                       i_d * BD + tl.arange(0, BD), D, W, BW, HAS_STATE, USE_INDICES,
                       IS_VARLEN)  # fmt: skip


@triton.jit
def conv_step_kernel(
    x, weight, bias, state_in, state_indices, y, state_out,
    D: tl.constexpr, W: tl.constexpr, S: tl.constexpr, BD: tl.constexpr, BW: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_STATE: tl.constexpr, USE_INDICES: tl.constexpr,
    SILU: tl.constexpr,
):  # fmt: skip
    """One token per sequence, a state of S >= W - 1 kept inputs (W - 1 in kda's layout, W
    in transformers' and Mamba's): the row is the S kept inputs, then x, and the window
    its last W entries. Reads the state once, writes y and the row's last S entries as the
    new state. Each program owns its channels of one slot, so state_out may be state_in."""
    i_d, i_n = tl.program_id(0), tl.program_id(1)
    cols = i_d * BD + tl.arange(0, BD)
    taps = tl.arange(0, BW)
    mask_d = cols < D
    slot = _state_slot(state_indices, i_n, USE_INDICES)
    mask_slot = mask_d & (cols * 0 + slot >= 0)  # a negative index: padding
    slot_base = slot * (D * S)  # the one 64-bit product; offsets in the slot are int32
    slot_offsets = cols[:, None] * S
    row = tl.zeros([BD, BW], dtype=tl.float32)
    if HAS_STATE:
        kept = mask_slot[:, None] & (taps < S)[None, :]
        row = tl.load(state_in + slot_base + slot_offsets + taps[None, :], mask=kept,
                      other=0.0)  # fmt: skip
        row = row.to(tl.float32)
    b_x = tl.load(x + i_n.to(tl.int64) * D + cols, mask=mask_d, other=0.0).to(tl.float32)
    row = tl.where(taps[None, :] == S, b_x[:, None], row)
    first = S + 1 - W  # the row's entry under tap 0
    in_window = (taps >= first) & (taps <= S)
    b_w = tl.load(weight + cols[:, None] * W + (taps - first)[None, :],
                  mask=mask_d[:, None] & in_window[None, :], other=0.0).to(tl.float32)  # fmt: skip
    acc = tl.sum(row * b_w, axis=1)
    if HAS_BIAS:
        acc += tl.load(bias + cols, mask=mask_d, other=0.0).to(tl.float32)
    if SILU:
        acc = acc * fast_sigmoid(acc)
    tl.store(y + i_n.to(tl.int64) * D + cols, acc.to(y.dtype.element_ty), mask=mask_d)
    shifted = mask_slot[:, None] & ((taps >= 1) & (taps <= S))[None, :]
    tl.store(state_out + slot_base + slot_offsets + (taps - 1)[None, :],
             row.to(state_out.dtype.element_ty), mask=shifted)  # fmt: skip


@triton.jit
def _unpack8(v):
    """``[G, 8]`` -> its 8 columns, each ``[G]``. A thread holds whole rows (the loads are
    16-byte vectors along the 8), so the splits only rename registers."""
    even, odd = tl.split(tl.reshape(v, [v.shape[0], 2, 2, 2]))
    e0, e2 = tl.split(even)
    o1, o3 = tl.split(odd)
    v0, v4 = tl.split(e0)
    v2, v6 = tl.split(e2)
    v1, v5 = tl.split(o1)
    v3, v7 = tl.split(o3)
    return v0, v1, v2, v3, v4, v5, v6, v7


@triton.jit
def _pack8(v0, v1, v2, v3, v4, v5, v6, v7):
    """8 columns ``[G]`` -> ``[G, 8]``, the inverse of :func:`_unpack8`."""
    even = tl.join(tl.join(v0, v4), tl.join(v2, v6))
    odd = tl.join(tl.join(v1, v5), tl.join(v3, v7))
    return tl.reshape(tl.join(even, odd), [v0.shape[0], 8])


@triton.jit
def _entries_of(a, b, c):
    """The 24 contiguous state values of 8 channels, ``[G, 8]`` x 3 (value ``3m + j`` is
    entry j of channel m) -> entries 0, 1, 2, each ``[G, 8]`` over the channels."""
    a0, a1, a2, a3, a4, a5, a6, a7 = _unpack8(a)
    b0, b1, b2, b3, b4, b5, b6, b7 = _unpack8(b)
    c0, c1, c2, c3, c4, c5, c6, c7 = _unpack8(c)
    return (
        _pack8(a0, a3, a6, b1, b4, b7, c2, c5),
        _pack8(a1, a4, a7, b2, b5, c0, c3, c6),
        _pack8(a2, a5, b0, b3, b6, c1, c4, c7),
    )


@triton.jit
def _interleave(p, q, r):
    """Inverse of :func:`_entries_of`: entries 0, 1, 2 ``[G, 8]`` -> the 24 values."""
    p0, p1, p2, p3, p4, p5, p6, p7 = _unpack8(p)
    q0, q1, q2, q3, q4, q5, q6, q7 = _unpack8(q)
    r0, r1, r2, r3, r4, r5, r6, r7 = _unpack8(r)
    return (
        _pack8(p0, q0, r0, p1, q1, r1, p2, q2),
        _pack8(r2, p3, q3, r3, p4, q4, r4, p5),
        _pack8(q5, r5, p6, q6, r6, p7, q7, r7),
    )


@triton.jit
def _taps_of(w0, w1, w2, w3):
    """The 32 contiguous weights of 8 channels, ``[G, 8]`` x 4 (value ``4m + j`` is tap j of
    channel m) -> taps 0..3, each ``[G, 8]`` over the channels."""
    a0, a1, a2, a3, a4, a5, a6, a7 = _unpack8(w0)
    b0, b1, b2, b3, b4, b5, b6, b7 = _unpack8(w1)
    c0, c1, c2, c3, c4, c5, c6, c7 = _unpack8(w2)
    d0, d1, d2, d3, d4, d5, d6, d7 = _unpack8(w3)
    return (
        _pack8(a0, a4, b0, b4, c0, c4, d0, d4),
        _pack8(a1, a5, b1, b5, c1, c5, d1, d5),
        _pack8(a2, a6, b2, b6, c2, c6, d2, d6),
        _pack8(a3, a7, b3, b7, c3, c7, d3, d7),
    )


@triton.jit
def conv_step_w4_kernel(
    x, weight, bias, state_in, state_indices, y, state_out, batch,
    D: tl.constexpr, BG: tl.constexpr, NB: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_STATE: tl.constexpr, USE_INDICES: tl.constexpr,
    SILU: tl.constexpr,
):  # fmt: skip
    """:func:`conv_step_kernel` for W = 4 and D % 8 == 0, moving only 16-byte vectors.

    A thread owns groups of 8 channels: their 24 state values are 3 aligned 16-byte
    vectors, x and y one, the weight four. Values are regrouped per entry in registers
    (:func:`_entries_of`), where the generic kernel's state rows of 6 bytes cost a 2-byte
    access per value, and the new state (entries 1, 2 and x) is regrouped back the same
    way. Program (i, p): groups ``[i * BG, (i + 1) * BG)`` of sequences ``[p * NB, (p + 1)
    * NB)``, which share the weights it loads once; a slot's base is the only 64-bit
    product, offsets inside it are int32.
    """
    i_d, i_p = tl.program_id(0), tl.program_id(1)
    groups = i_d * BG + tl.arange(0, BG)
    lanes = tl.arange(0, 8)
    cols = groups[:, None] * 8 + lanes[None, :]  # [BG, 8] channels
    mask = (groups < D // 8)[:, None]
    # Four [BG, 8] loads, not one [BG, 32]: that one would spread a row over 4 threads.
    rows = weight + groups[:, None] * 32 + lanes[None, :]
    taps = _taps_of(
        tl.load(rows, mask=mask, other=0.0).to(tl.float32),
        tl.load(rows + 8, mask=mask, other=0.0).to(tl.float32),
        tl.load(rows + 16, mask=mask, other=0.0).to(tl.float32),
        tl.load(rows + 24, mask=mask, other=0.0).to(tl.float32),
    )
    b_bias = tl.zeros([BG, 8], dtype=tl.float32)
    if HAS_BIAS:
        b_bias = tl.load(bias + cols, mask=mask, other=0.0).to(tl.float32)
    for i_s in tl.static_range(NB):
        i_n = i_p * NB + i_s
        if i_n < batch:
            _step_w4(x, state_in, state_indices, y, state_out, i_n, groups, lanes, cols, mask,
                     taps, b_bias, D, BG, HAS_STATE, USE_INDICES, SILU)  # fmt: skip


@triton.jit
def _step_w4(x, state_in, state_indices, y, state_out, i_n, groups, lanes, cols, mask, taps,
             b_bias, D: tl.constexpr, BG: tl.constexpr, HAS_STATE: tl.constexpr,
             USE_INDICES: tl.constexpr, SILU: tl.constexpr):  # fmt: skip
    """Sequence i_n's step in :func:`conv_step_w4_kernel`, the taps regrouped per entry
    (:func:`_taps_of`) and the bias given."""
    values = groups[:, None] * 24 + lanes[None, :]  # the first of the group's 3 vectors
    slot = _state_slot(state_indices, i_n, USE_INDICES)
    kept = mask & (groups * 0 + slot >= 0)[:, None]  # negative: padding, no history or write
    b_x = tl.load(x + i_n.to(tl.int64) * D + cols, mask=mask, other=0.0)
    e0 = tl.zeros([BG, 8], dtype=state_out.dtype.element_ty)
    e1, e2 = e0, e0
    if HAS_STATE:
        slot_in = state_in + slot * (3 * D)
        e0, e1, e2 = _entries_of(
            tl.load(slot_in + values, mask=kept, other=0.0),
            tl.load(slot_in + values + 8, mask=kept, other=0.0),
            tl.load(slot_in + values + 16, mask=kept, other=0.0),
        )
    w0, w1, w2, w3 = taps
    acc = e0.to(tl.float32) * w0 + e1.to(tl.float32) * w1 + e2.to(tl.float32) * w2
    acc += b_x.to(tl.float32) * w3 + b_bias
    if SILU:
        acc = acc * fast_sigmoid(acc)
    tl.store(y + i_n.to(tl.int64) * D + cols, acc.to(y.dtype.element_ty), mask=mask)
    dtype = state_out.dtype.element_ty
    a, b, c = _interleave(e1.to(dtype), e2.to(dtype), b_x.to(dtype))  # the window shifted
    slot_out = state_out + slot * (3 * D)
    tl.store(slot_out + values, a, mask=kept)
    tl.store(slot_out + values + 8, b, mask=kept)
    tl.store(slot_out + values + 16, c, mask=kept)


# Token rows of a program's tile (4 warps, 128 channels): 32 in the prefill, where 64 rows
# take more registers and are slower (8 warps slower still); 64 in the backward, whose
# dz / dx kernels run faster at 64 than at 32 (timings in benchmarks/README.md).
PREFILL_ROWS, BACKWARD_ROWS = 32, 64


def _tile_sizes(rows: int, length: int, channels: int) -> tuple[int, int]:
    """(BT, BD): tokens (at most ``rows``) and channels of a program's tile
    (``_token_block``) in the prefill and backward kernels."""
    block_t = min(rows, next_power_of_2(max(length, 1)))
    return block_t, min(128, next_power_of_2(channels))


def _step_sequences_per_program(programs: int, sms: int) -> int:
    """NB of :func:`conv_step_w4_kernel` given its program count at NB = 1: up to 8
    sequences share a program's weight load while at least two programs an SM remain:
    with many sequences the shared load shortens the step a little, with few the SMs would
    idle."""
    per_program = 8
    while per_program > 1 and programs < 2 * per_program * sms:
        per_program //= 2
    return per_program


def _launch_step(
    x: Tensor,
    weight: Tensor,
    bias: Optional[Tensor],
    state_in: Optional[Tensor],
    state_out: Tensor,
    state_indices: Optional[Tensor],
    y: Tensor,
    flags: dict,
) -> None:
    """One token per sequence (x ``[N, 1, D]``): one kernel, y and the new state (of
    ``state_out.shape[-1] >= W - 1`` entries)."""
    batch, _, channels = x.shape
    width, kept = weight.shape[1], state_out.shape[-1]
    if width == 4 and channels % 8 == 0 and kept == width - 1:
        # A thread per 8 channels, up to 128 threads (1024 channels) a program.
        groups = min(128, next_power_of_2(channels // 8))
        programs = cdiv(channels // 8, groups) * batch
        per_program = _step_sequences_per_program(programs, processors(x.device))
        grid = (cdiv(channels // 8, groups), cdiv(batch, per_program))
        conv_step_w4_kernel[grid](
            x, weight, bias, state_in, state_indices, y, state_out, batch,
            D=channels, BG=groups, NB=per_program, num_warps=max(1, min(4, groups // 32)),
            **flags,
        )  # fmt: skip
        return
    block_d = min(512, next_power_of_2(channels))
    conv_step_kernel[(cdiv(channels, block_d), batch)](
        x, weight, bias, state_in, state_indices, y, state_out,
        D=channels, W=width, S=kept, BD=block_d, BW=next_power_of_2(kept + 1), **flags,
    )  # fmt: skip


def launch_causal_conv1d(
    x: Tensor,
    weight: Tensor,
    bias: Optional[Tensor],
    state_in: Optional[Tensor],
    state_out: Tensor,
    state_indices: Optional[Tensor],
    cu_seqlens: Optional[Tensor],
    activation: str,
) -> Tensor:
    """Writes the final conv states into ``state_out`` (may be ``state_in``, the in-place
    pool) and returns y ``[B, T, D]`` in x's dtype. The decode step (T = 1, no
    ``cu_seqlens``) also takes states of S > W - 1 entries (the last S inputs, as
    transformers and Mamba keep W); the prefill kernels take W - 1."""
    x, weight = x.contiguous(), weight.contiguous()
    if state_in is not None and not state_in.is_contiguous():
        # The kernels index a dense [N, D, W - 1]; views such as FLA's cache[..., 1:] are not.
        if state_in is not state_out:
            state_in = state_in.contiguous()
        else:
            dense = state_in.contiguous()
            y = launch_causal_conv1d(x, weight, bias, dense, dense, state_indices, cu_seqlens,
                                     activation)  # fmt: skip
            state_out.copy_(dense)
            return y
    batch, length, channels = x.shape
    width = weight.shape[1]
    n_seqs = batch if cu_seqlens is None else cu_seqlens.shape[0] - 1
    y = torch.empty_like(x)
    flags = dict(HAS_STATE=state_in is not None, USE_INDICES=state_indices is not None)
    if length == 1 and cu_seqlens is None:
        flags.update(HAS_BIAS=bias is not None, SILU=activation == "silu")
        _launch_step(x, weight, bias, state_in, state_out, state_indices, y, flags)
        return y
    block_t, block_d = _tile_sizes(PREFILL_ROWS, length, channels)
    flags["IS_VARLEN"] = cu_seqlens is not None
    grid = (cdiv(length, block_t), cdiv(channels, block_d), batch)
    kept = next_power_of_2(width - 1)
    # Rows of a batch end in their last token block, whose program can write the final
    # state, unless the state is rewritten in place (other programs still read it) or
    # packed sequences may be empty (no program holds them): then a second kernel.
    fused = cu_seqlens is None and length > 0 and state_out is not state_in
    causal_conv1d_kernel[grid](
        x, weight, bias, state_in, state_indices, cu_seqlens, length, n_seqs, y, state_out,
        D=channels, W=width, BT=block_t, BD=block_d, BN=next_power_of_2(n_seqs), BW=kept,
        HAS_BIAS=bias is not None, SILU=activation == "silu", FINAL_STATE=fused, **flags,
    )  # fmt: skip
    if not fused:
        conv_final_state_kernel[(n_seqs, cdiv(channels, block_d))](
            x, state_in, state_indices, cu_seqlens, length, state_out,
            D=channels, W=width, BD=block_d, BW=kept, **flags,
        )  # fmt: skip
    return y


def launch_causal_conv1d_backward(
    x: Tensor,
    weight: Tensor,
    bias: Optional[Tensor],
    initial_state: Optional[Tensor],
    cu_seqlens: Optional[Tensor],
    grad_y: Tensor,
    grad_final_state: Tensor,
    activation: Optional[str],
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Gradients of the functional ``launch_causal_conv1d`` for (x, weight, bias,
    initial_state), each in its input's dtype and shape (an absent optional: an empty
    tensor), given grad_y (x's shape) and the final state's gradient ``[N, D, W - 1]``.
    Scratch: dz (fp32, x's shape) and per-program fp32 shares of dweight and dbias."""
    x, weight = x.contiguous(), weight.contiguous()
    grad_y = grad_y.contiguous()
    grad_final_state = grad_final_state.to(torch.float32).contiguous()
    if initial_state is not None:
        initial_state = initial_state.contiguous()
    batch, length, channels = x.shape
    width = weight.shape[1]
    n_seqs = batch if cu_seqlens is None else cu_seqlens.shape[0] - 1
    block_t, block_d = _tile_sizes(BACKWARD_ROWS, length, channels)
    block_w = next_power_of_2(width)
    grid = (cdiv(length, block_t), cdiv(channels, block_d), batch)
    programs = grid[0] * grid[2]
    grad_z = torch.empty(x.shape, device=x.device, dtype=torch.float32)
    dweight_parts = torch.empty(programs, channels, block_w, device=x.device,
                                dtype=torch.float32)  # fmt: skip
    dbias_parts = torch.empty(programs, channels, device=x.device, dtype=torch.float32)
    shape = dict(D=channels, W=width, BD=block_d, IS_VARLEN=cu_seqlens is not None)
    seqs = dict(BT=block_t, BN=next_power_of_2(n_seqs))
    conv_grad_z_kernel[grid](
        x, weight, bias, initial_state, cu_seqlens, grad_y, length, n_seqs, grad_z,
        dweight_parts, dbias_parts, **shape, **seqs, BW=block_w, HAS_BIAS=bias is not None,
        HAS_STATE=initial_state is not None, SILU=activation == "silu",
    )  # fmt: skip
    dx = torch.empty_like(x)
    conv_grad_x_kernel[grid](
        grad_z, weight, grad_final_state, cu_seqlens, length, n_seqs, dx, **shape, **seqs
    )
    d_state = x.new_empty(0)
    if initial_state is not None:
        d_state = torch.empty_like(initial_state)
        conv_grad_state_kernel[(n_seqs, cdiv(channels, block_d))](
            grad_z, weight, grad_final_state, cu_seqlens, length, d_state, **shape,
            BW=next_power_of_2(width - 1),
        )  # fmt: skip
    dweight = dweight_parts[..., :width].sum(0).to(weight.dtype)
    dbias = x.new_empty(0) if bias is None else dbias_parts.sum(0).to(bias.dtype)
    return dx, dweight, dbias, d_state
