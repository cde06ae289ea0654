"""The causal conv1d decode step: one token per sequence, one kernel that writes y and the
new state in one pass over the state. For W = 4 and D % 8 == 0 one that moves only
16-byte vectors (:func:`conv_step_w4_kernel`), else a generic one that also takes states
of S > W - 1 kept inputs (as transformers and Mamba keep W). Each program owns its
channels of one slot, so the state may be rewritten in place.
"""

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from kda_ops.kernels.chunk.device import value_block_program
from kda_ops.kernels.conv.device import state_slot
from kda_ops.kernels.fast_exp import fast_sigmoid
from kda_ops.kernels.launches import KernelLaunch
from kda_ops.kernels.sizes import cdiv, next_power_of_2, processors


@triton.jit
def conv_step_kernel(
    x,
    weight,
    bias,
    state_in,
    state_indices,
    y,
    state_out,
    D: tl.constexpr,
    W: tl.constexpr,
    S: tl.constexpr,
    BD: tl.constexpr,
    BW: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_STATE: tl.constexpr,
    USE_INDICES: tl.constexpr,
    SILU: tl.constexpr,
):
    """One token per sequence, a state of S >= W - 1 kept inputs (W - 1 in kda's layout, W
    in transformers' and Mamba's): the row is the S kept inputs, then x, and the window
    its last W entries. Reads the state once, writes y and the row's last S entries as the
    new state. Each program owns its channels of one slot, so state_out may be state_in."""
    i_d, i_n = value_block_program(D, BD)  # one grid axis: batches past 65535 launch
    cols = i_d * BD + tl.arange(0, BD)
    taps = tl.arange(0, BW)
    mask_d = cols < D
    slot = state_slot(state_indices, i_n, USE_INDICES)
    mask_slot = mask_d & (cols * 0 + slot >= 0)  # a negative index: padding
    slot_base = slot * (D * S)  # the one 64-bit product; offsets in the slot are int32
    slot_offsets = cols[:, None] * S
    row = tl.zeros([BD, BW], dtype=tl.float32)
    if HAS_STATE:
        kept = mask_slot[:, None] & (taps < S)[None, :]
        row = tl.load(state_in + slot_base + slot_offsets + taps[None, :], mask=kept, other=0.0)
        row = row.to(tl.float32)
    b_x = tl.load(x + i_n.to(tl.int64) * D + cols, mask=mask_d, other=0.0).to(tl.float32)
    row = tl.where(taps[None, :] == S, b_x[:, None], row)
    first = S + 1 - W  # the row's entry under tap 0
    in_window = (taps >= first) & (taps <= S)
    b_w = tl.load(
        weight + cols[:, None] * W + (taps - first)[None, :],
        mask=mask_d[:, None] & in_window[None, :],
        other=0.0,
    ).to(tl.float32)
    acc = tl.sum(row * b_w, axis=1)
    if HAS_BIAS:
        acc += tl.load(bias + cols, mask=mask_d, other=0.0).to(tl.float32)
    if SILU:
        acc = acc * fast_sigmoid(acc)
    tl.store(y + i_n.to(tl.int64) * D + cols, acc.to(y.dtype.element_ty), mask=mask_d)
    shifted = mask_slot[:, None] & ((taps >= 1) & (taps <= S))[None, :]
    tl.store(
        state_out + slot_base + slot_offsets + (taps - 1)[None, :],
        row.to(state_out.dtype.element_ty),
        mask=shifted,
    )


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
    x,
    weight,
    bias,
    state_in,
    state_indices,
    y,
    state_out,
    batch,
    D: tl.constexpr,
    BG: tl.constexpr,
    NB: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_STATE: tl.constexpr,
    USE_INDICES: tl.constexpr,
    SILU: tl.constexpr,
):
    """:func:`conv_step_kernel` for W = 4 and D % 8 == 0, moving only 16-byte vectors.

    A thread owns groups of 8 channels: their 24 state values are 3 aligned 16-byte
    vectors, x and y one, the weight four. Values are regrouped per entry in registers
    (:func:`_entries_of`), where the generic kernel's state rows of 6 bytes cost a 2-byte
    access per value, and the new state (entries 1, 2 and x) is regrouped back the same
    way. Program (i, p): groups ``[i * BG, (i + 1) * BG)`` of sequences ``[p * NB, (p + 1)
    * NB)``, which share the weights it loads once; a slot's base is the only 64-bit
    product, offsets inside it are int32.
    """
    i_d, i_p = value_block_program(D // 8, BG)
    groups = i_d * BG + tl.arange(0, BG)
    lanes = tl.arange(0, 8)
    cols = groups[:, None] * 8 + lanes[None, :]  # [BG, 8] channels
    mask = (groups < D // 8)[:, None]
    # Four [BG, 8] loads, not one [BG, 32]: that one would spread a row over 4 threads.
    rows = weight + groups[:, None] * 32 + lanes[None, :]
    taps = _taps_of(
        w0=tl.load(rows, mask=mask, other=0.0).to(tl.float32),
        w1=tl.load(rows + 8, mask=mask, other=0.0).to(tl.float32),
        w2=tl.load(rows + 16, mask=mask, other=0.0).to(tl.float32),
        w3=tl.load(rows + 24, mask=mask, other=0.0).to(tl.float32),
    )
    b_bias = tl.zeros([BG, 8], dtype=tl.float32)
    if HAS_BIAS:
        b_bias = tl.load(bias + cols, mask=mask, other=0.0).to(tl.float32)
    for i_s in tl.static_range(NB):
        i_n = i_p * NB + i_s
        if i_n < batch:
            _step_w4(
                x=x,
                state_in=state_in,
                state_indices=state_indices,
                y=y,
                state_out=state_out,
                i_n=i_n,
                groups=groups,
                lanes=lanes,
                cols=cols,
                mask=mask,
                taps=taps,
                b_bias=b_bias,
                D=D,
                BG=BG,
                HAS_STATE=HAS_STATE,
                USE_INDICES=USE_INDICES,
                SILU=SILU,
            )


@triton.jit
def _step_w4(
    x,
    state_in,
    state_indices,
    y,
    state_out,
    i_n,
    groups,
    lanes,
    cols,
    mask,
    taps,
    b_bias,
    D: tl.constexpr,
    BG: tl.constexpr,
    HAS_STATE: tl.constexpr,
    USE_INDICES: tl.constexpr,
    SILU: tl.constexpr,
):
    """Sequence i_n's step in :func:`conv_step_w4_kernel`, the taps regrouped per entry
    (:func:`_taps_of`) and the bias given."""
    values = groups[:, None] * 24 + lanes[None, :]  # the first of the group's 3 vectors
    slot = state_slot(state_indices, i_n, USE_INDICES)
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


def step_sequences_per_program(programs: int, sms: int) -> int:
    """NB of :func:`conv_step_w4_kernel` given its program count at NB = 1: up to 8
    sequences share a program's weight load while at least two programs an SM remain:
    with many sequences the shared load shortens the step a little, with few the SMs would
    idle."""
    per_program = 8
    while per_program > 1 and programs < 2 * per_program * sms:
        per_program //= 2
    return per_program


def step_launch(
    x: Tensor,
    weight: Tensor,
    bias: Optional[Tensor],
    state_in: Optional[Tensor],
    state_out: Tensor,
    state_indices: Optional[Tensor],
    activation: str,
) -> KernelLaunch:
    """The launch of one token per sequence (x ``[N, 1, D]``, weight ``[D, W]``): one kernel
    that writes a new y (``args["y"]``, x's shape) and the new state into ``state_out``
    (``[slots, D, S]``, S >= W - 1, dense; may be ``state_in``). N may be symbolic."""
    x, weight = x.contiguous(), weight.contiguous()
    batch, _, channels = x.shape
    width, kept = weight.shape[1], state_out.shape[-1]
    args = dict(
        x=x,
        weight=weight,
        bias=bias,
        state_in=state_in,
        state_indices=state_indices,
        y=torch.empty_like(x),
        state_out=state_out,
        D=channels,
        HAS_BIAS=bias is not None,
        HAS_STATE=state_in is not None,
        USE_INDICES=state_indices is not None,
        SILU=activation == "silu",
    )
    writes = ("y", "state_out")
    if width == 4 and channels % 8 == 0 and kept == width - 1:
        # A thread per 8 channels, up to 128 threads (1024 channels) a program.
        groups = min(128, next_power_of_2(channels // 8))
        programs = cdiv(channels // 8, groups) * batch
        # A symbolic batch (a graph traced for any batch) keeps a sequence a program.
        per_program = (
            step_sequences_per_program(programs, processors(x.device))
            if isinstance(batch, int)
            else 1
        )
        grid = (cdiv(channels // 8, groups) * cdiv(batch, per_program),)
        args.update(batch=batch, BG=groups, NB=per_program, num_warps=max(1, min(4, groups // 32)))
        return KernelLaunch(kernel=conv_step_w4_kernel, grid=grid, args=args, writes=writes)
    block_d = min(512, next_power_of_2(channels))
    args.update(W=width, S=kept, BD=block_d, BW=next_power_of_2(kept + 1))
    return KernelLaunch(
        kernel=conv_step_kernel, grid=(cdiv(channels, block_d) * batch,), args=args, writes=writes
    )
