"""Depthwise causal conv1d: a token-parallel output kernel and a sequence-parallel kernel
that writes the final conv state (the last ``W - 1`` inputs); for one token per sequence
(decode) a single kernel does both in one pass over the state.

Layouts: x ``[B, T, D]`` (or packed ``[1, T_total, D]`` with ``cu_seqlens``); weight
``[D, W]``; state ``[N, D, W - 1]``, entry ``j`` holding the input ``W - 1 - j`` tokens
before the sequence (or before the end, for the final state). With ``state_indices`` the
state is a pool and sequence n uses slot ``state_indices[n]`` (negative: padding, no
history and no write); the output kernel runs before the state kernel, so reading and
rewriting the same slot is safe.
"""

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _sequence_bounds(rows, cu_seqlens, n_seqs, i_b, length, BN: tl.constexpr,
                     IS_VARLEN: tl.constexpr):  # fmt: skip
    """For token rows of one program: (sequence id, first token, valid) per row."""
    if IS_VARLEN:
        seq_ids = tl.arange(0, BN)
        ends = tl.load(cu_seqlens + 1 + seq_ids, mask=seq_ids < n_seqs, other=2**31 - 1)
        seq = tl.sum((ends[None, :] <= rows[:, None]).to(tl.int32), axis=1)
        bos = tl.load(cu_seqlens + seq, mask=seq < n_seqs, other=0).to(tl.int64)
        valid = rows < tl.load(cu_seqlens + n_seqs)
        return seq, bos, valid
    seq = tl.zeros_like(rows) + i_b
    return seq, seq.to(tl.int64) * length, rows < length


@triton.jit
def causal_conv1d_kernel(
    x, weight, bias, state, state_indices, cu_seqlens, length, n_seqs, y,
    D: tl.constexpr, W: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr, BN: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_STATE: tl.constexpr, USE_INDICES: tl.constexpr,
    IS_VARLEN: tl.constexpr, SILU: tl.constexpr,
):  # fmt: skip
    i_t, i_d, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows = i_t * BT + tl.arange(0, BT)
    cols = i_d * BD + tl.arange(0, BD)
    mask_d = cols < D
    seq, bos, valid = _sequence_bounds(rows, cu_seqlens, n_seqs, i_b, length, BN, IS_VARLEN)
    tokens = rows.to(tl.int64) + (0 if IS_VARLEN else i_b.to(tl.int64) * length)
    position = tokens - bos
    slot = seq.to(tl.int64)
    has_history = valid
    if USE_INDICES:
        slot = tl.load(state_indices + seq, mask=valid, other=-1).to(tl.int64)
        has_history = valid & (slot >= 0)

    # Only blocks holding one of a sequence's first W - 1 tokens read the state: its
    # strided gather costs an instruction per element even where fully masked off.
    reads_state = tl.min(tl.where(has_history, position, W)) < W - 1
    acc = tl.zeros([BT, BD], dtype=tl.float32)
    for tap in tl.static_range(W):
        source = position - (W - 1 - tap)
        in_x = (valid & (source >= 0))[:, None] & mask_d[None, :]
        b_x = tl.load(x + (tokens - (W - 1 - tap))[:, None] * D + cols[None, :], mask=in_x,
                      other=0.0).to(tl.float32)  # fmt: skip
        if HAS_STATE:  # noqa: SIM102 (a compile-time branch around a run-time one)
            if reads_state:
                in_state = (has_history & (source < 0))[:, None] & mask_d[None, :]
                state_offsets = (slot[:, None] * D + cols[None, :]) * (W - 1) + (W - 1 + source)[
                    :, None
                ]
                b_x += tl.load(state + state_offsets, mask=in_state, other=0.0).to(tl.float32)
        b_w = tl.load(weight + cols * W + tap, mask=mask_d, other=0.0).to(tl.float32)
        acc += b_x * b_w[None, :]
    if HAS_BIAS:
        acc += tl.load(bias + cols, mask=mask_d, other=0.0).to(tl.float32)[None, :]
    if SILU:
        acc = acc * tl.sigmoid(acc)
    mask = valid[:, None] & mask_d[None, :]
    tl.store(y + tokens[:, None] * D + cols[None, :], acc.to(y.dtype.element_ty), mask=mask)


@triton.jit
def conv_final_state_kernel(
    x, state_in, state_indices, cu_seqlens, length, state_out,
    D: tl.constexpr, W: tl.constexpr, BD: tl.constexpr, BW: tl.constexpr,
    HAS_STATE: tl.constexpr, USE_INDICES: tl.constexpr, IS_VARLEN: tl.constexpr,
):  # fmt: skip
    i_n, i_d = tl.program_id(0), tl.program_id(1)
    if IS_VARLEN:
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        length = tl.load(cu_seqlens + i_n + 1).to(tl.int64) - bos
    else:
        bos = i_n.to(tl.int64) * length
    cols = i_d * BD + tl.arange(0, BD)
    entries = tl.arange(0, BW)
    source = length - (W - 1) + entries  # position of the input each entry keeps
    mask = (cols < D)[:, None] & (entries < W - 1)[None, :]
    slot = i_n.to(tl.int64)
    if USE_INDICES:
        slot = tl.load(state_indices + i_n).to(tl.int64)
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
def conv_step_kernel(
    x, weight, bias, state_in, state_indices, y, state_out,
    D: tl.constexpr, W: tl.constexpr, BD: tl.constexpr, BW: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_STATE: tl.constexpr, USE_INDICES: tl.constexpr,
    SILU: tl.constexpr,
):  # fmt: skip
    """One token per sequence: the window is the W - 1 kept inputs, then x. Reads the
    state once, writes y and the window's last W - 1 entries as the new state. Each
    program owns its channels of one slot, so state_out may be state_in."""
    i_d, i_n = tl.program_id(0), tl.program_id(1)
    cols = i_d * BD + tl.arange(0, BD)
    taps = tl.arange(0, BW)
    mask_d = cols < D
    slot = i_n.to(tl.int64)
    if USE_INDICES:
        slot = tl.load(state_indices + i_n).to(tl.int64)
    mask_slot = mask_d & (cols * 0 + slot >= 0)  # a negative index: padding
    slot_offsets = (slot * D + cols[:, None]) * (W - 1)
    window = tl.zeros([BD, BW], dtype=tl.float32)
    if HAS_STATE:
        kept = mask_slot[:, None] & (taps < W - 1)[None, :]
        window = tl.load(state_in + slot_offsets + taps[None, :], mask=kept, other=0.0)
        window = window.to(tl.float32)
    b_x = tl.load(x + i_n.to(tl.int64) * D + cols, mask=mask_d, other=0.0).to(tl.float32)
    window = tl.where(taps[None, :] == W - 1, b_x[:, None], window)
    b_w = tl.load(weight + cols[:, None] * W + taps[None, :],
                  mask=mask_d[:, None] & (taps < W)[None, :], other=0.0).to(tl.float32)  # fmt: skip
    acc = tl.sum(window * b_w, axis=1)
    if HAS_BIAS:
        acc += tl.load(bias + cols, mask=mask_d, other=0.0).to(tl.float32)
    if SILU:
        acc = acc * tl.sigmoid(acc)
    tl.store(y + i_n.to(tl.int64) * D + cols, acc.to(y.dtype.element_ty), mask=mask_d)
    shifted = mask_slot[:, None] & ((taps >= 1) & (taps < W))[None, :]
    tl.store(state_out + slot_offsets + (taps - 1)[None, :],
             window.to(state_out.dtype.element_ty), mask=shifted)  # fmt: skip


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
    pool) and returns y ``[B, T, D]`` in x's dtype."""
    x, weight = x.contiguous(), weight.contiguous()
    batch, length, channels = x.shape
    width = weight.shape[1]
    n_seqs = batch if cu_seqlens is None else cu_seqlens.shape[0] - 1
    y = torch.empty_like(x)
    flags = dict(HAS_STATE=state_in is not None, USE_INDICES=state_indices is not None)
    if length == 1 and cu_seqlens is None:
        block_d = min(512, triton.next_power_of_2(channels))
        conv_step_kernel[(triton.cdiv(channels, block_d), batch)](
            x, weight, bias, state_in, state_indices, y, state_out,
            D=channels, W=width, BD=block_d, BW=triton.next_power_of_2(width),
            HAS_BIAS=bias is not None, SILU=activation == "silu", **flags,
        )  # fmt: skip
        return y
    block_t = min(64, triton.next_power_of_2(max(length, 1)))
    block_d = min(128, triton.next_power_of_2(channels))
    flags["IS_VARLEN"] = cu_seqlens is not None
    grid = (triton.cdiv(length, block_t), triton.cdiv(channels, block_d), batch)
    causal_conv1d_kernel[grid](
        x, weight, bias, state_in, state_indices, cu_seqlens, length, n_seqs, y,
        D=channels, W=width, BT=block_t, BD=block_d, BN=triton.next_power_of_2(n_seqs),
        HAS_BIAS=bias is not None, SILU=activation == "silu", **flags,
    )  # fmt: skip
    conv_final_state_kernel[(n_seqs, triton.cdiv(channels, block_d))](
        x, state_in, state_indices, cu_seqlens, length, state_out,
        D=channels, W=width, BD=block_d, BW=triton.next_power_of_2(width - 1), **flags,
    )  # fmt: skip
    return y
