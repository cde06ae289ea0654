"""The causal conv1d backward (functional op, fp32) and its launcher,
``launch_causal_conv1d_backward``: ``conv_grad_z_kernel`` recomputes the pre-activation z
(a sequence's first W - 1 tokens apart, as in the prefill) and writes dz = dy · act'(z)
with its programs' shares of dweight and dbias; ``conv_grad_x_kernel`` gathers dx from
the W later dz of the same sequence and the final state's gradient;
``conv_grad_state_kernel`` does the same for the initial state's entries.
"""

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from kda_ops.kernels.conv.device import (
    add_bias,
    head_rows,
    pre_activation,
    sequence_extent,
    starting_sequences,
    tap_weight,
    tile_sizes,
    token_block,
    token_grid,
    token_program,
    window_input,
)
from kda_ops.kernels.fast_exp import fast_sigmoid
from kda_ops.kernels.sizes import cdiv, next_power_of_2


@triton.jit
def _sequence_span(seq, bos, valid, cu_seqlens, length, IS_VARLEN: tl.constexpr):
    """Length of each row's sequence (int64), from ``token_block``'s sequence ids."""
    if IS_VARLEN:
        eos = tl.load(cu_seqlens + seq + 1, mask=valid, other=0).to(tl.int64)
        span = eos - bos
    else:
        span = tl.zeros_like(bos) + length
    return span


@triton.jit
def _grad_z_rows(
    x,
    state,
    weight,
    bias,
    grad_y,
    grad_z,
    tokens,
    position,
    slots,
    valid,
    cols,
    mask_d,
    D: tl.constexpr,
    W: tl.constexpr,
    BW: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_STATE: tl.constexpr,
    SILU: tl.constexpr,
):
    """dz = dy · act'(z) of the rows where ``valid`` holds, stored to grad_z; returns their
    Σ dz · input per tap ([BD, BW], taps first W) and Σ dz ([BD])."""
    z = pre_activation(
        x=x,
        state=state,
        weight=weight,
        tokens=tokens,
        position=position,
        slots=slots,
        valid=valid,
        has_history=valid,
        cols=cols,
        mask_d=mask_d,
        D=D,
        W=W,
        HAS_STATE=HAS_STATE,
    )
    z = add_bias(z=z, bias=bias, cols=cols, mask_d=mask_d, HAS_BIAS=HAS_BIAS)
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
        b_x = window_input(
            x=x,
            state=state,
            token=tokens - shift,
            source=position - shift,
            slot=slots,
            valid=valid,
            has_history=valid,
            cols=cols,
            mask_d=mask_d,
            D=D,
            W=W,
            HAS_STATE=HAS_STATE,
        )
        shares += tl.where(taps[None, :] == tap, tl.sum(b_dz * b_x, axis=0)[:, None], 0.0)
    return shares, tl.sum(b_dz, axis=0)


@triton.jit
def conv_grad_z_kernel(
    x,
    weight,
    bias,
    state,
    cu_seqlens,
    grad_y,
    length,
    n_seqs,
    grad_z,
    dweight_parts,
    dbias_parts,
    D: tl.constexpr,
    W: tl.constexpr,
    BT: tl.constexpr,
    BD: tl.constexpr,
    BN: tl.constexpr,
    BW: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_STATE: tl.constexpr,
    IS_VARLEN: tl.constexpr,
    SILU: tl.constexpr,
):
    """dz = dy · act'(z) (fp32, x's layout), z recomputed as ``causal_conv1d_kernel`` does
    (a sequence's first W - 1 tokens apart with a state); this program's shares of dweight
    (``[programs, D, BW]``, taps first W) and dbias (``[programs, D]``), the program
    numbered over (token block, batch)."""
    cols, mask_d, tokens, seq, bos, valid = token_block(
        cu_seqlens=cu_seqlens,
        n_seqs=n_seqs,
        length=length,
        D=D,
        BT=BT,
        BD=BD,
        BN=BN,
        IS_VARLEN=IS_VARLEN,
    )
    position = tokens - bos
    rows = valid
    if HAS_STATE:
        rows = valid & (position >= W - 1)
    shares, dbias = _grad_z_rows(
        x=x,
        state=state,
        weight=weight,
        bias=bias,
        grad_y=grad_y,
        grad_z=grad_z,
        tokens=tokens,
        position=position,
        slots=seq,
        valid=rows,
        cols=cols,
        mask_d=mask_d,
        D=D,
        W=W,
        BW=BW,
        HAS_BIAS=HAS_BIAS,
        HAS_STATE=False,
        SILU=SILU,
    )
    if HAS_STATE:
        i_n, last = starting_sequences(seq=seq, position=position, valid=valid, n_seqs=n_seqs)
        while i_n <= last:
            h_tokens, h_position, slots, h_valid, _ = head_rows(
                state_indices=None,
                cu_seqlens=cu_seqlens,
                length=length,
                i_n=i_n,
                W=W,
                BW=BW,
                USE_INDICES=False,
                IS_VARLEN=IS_VARLEN,
            )
            head_shares, head_dbias = _grad_z_rows(
                x=x,
                state=state,
                weight=weight,
                bias=bias,
                grad_y=grad_y,
                grad_z=grad_z,
                tokens=h_tokens,
                position=h_position,
                slots=slots,
                valid=h_valid,
                cols=cols,
                mask_d=mask_d,
                D=D,
                W=W,
                BW=BW,
                HAS_BIAS=HAS_BIAS,
                HAS_STATE=True,
                SILU=SILU,
            )
            shares += head_shares
            dbias += head_dbias
            i_n += 1
    i_t, _, i_b = token_program(length=length, D=D, BT=BT, BD=BD)
    part = i_b * tl.cdiv(length, BT) + i_t
    taps = tl.arange(0, BW)
    tl.store(
        dweight_parts + (part * D + cols[:, None]) * BW + taps[None, :],
        shares,
        mask=mask_d[:, None],
    )
    if HAS_BIAS:
        tl.store(dbias_parts + part * D + cols, dbias, mask=mask_d)


@triton.jit
def _gathered_grad(
    grad_z,
    weight,
    grad_final,
    position,
    span,
    first,
    seq,
    valid,
    cols,
    mask_d,
    D: tl.constexpr,
    W: tl.constexpr,
):
    """Gradient of the inputs at sequence positions ``position`` ([BT] int64, may be
    negative: the state's entries), [BT, BD] fp32: Σ_tap w_tap dz at position +
    W - 1 - tap inside the sequence (token ``first + that``), plus the final state's
    gradient where the position is one it keeps."""
    acc = tl.zeros([position.shape[0], cols.shape[0]], dtype=tl.float32)
    for tap in tl.static_range(W):
        target = position + (W - 1 - tap)
        inside = (valid & (target >= 0) & (target < span))[:, None] & mask_d[None, :]
        b_dz = tl.load(
            grad_z + (first + target)[:, None] * D + cols[None, :], mask=inside, other=0.0
        )
        acc += b_dz * tap_weight(weight=weight, cols=cols, mask_d=mask_d, tap=tap, W=W)[None, :]
    entry = position - span + (W - 1)  # the final state's entry keeping this position
    kept = (valid & (entry >= 0) & (entry < W - 1))[:, None] & mask_d[None, :]
    acc += tl.load(
        grad_final + (seq.to(tl.int64)[:, None] * D + cols[None, :]) * (W - 1) + entry[:, None],
        mask=kept,
        other=0.0,
    )
    return acc


@triton.jit
def conv_grad_x_kernel(
    grad_z,
    weight,
    grad_final,
    cu_seqlens,
    length,
    n_seqs,
    dx,
    D: tl.constexpr,
    W: tl.constexpr,
    BT: tl.constexpr,
    BD: tl.constexpr,
    BN: tl.constexpr,
    IS_VARLEN: tl.constexpr,
):
    """dx of x's tokens (x's dtype) from dz and the final state's gradient."""
    cols, mask_d, tokens, seq, bos, valid = token_block(
        cu_seqlens=cu_seqlens,
        n_seqs=n_seqs,
        length=length,
        D=D,
        BT=BT,
        BD=BD,
        BN=BN,
        IS_VARLEN=IS_VARLEN,
    )
    span = _sequence_span(
        seq=seq, bos=bos, valid=valid, cu_seqlens=cu_seqlens, length=length, IS_VARLEN=IS_VARLEN
    )
    b_dx = _gathered_grad(
        grad_z=grad_z,
        weight=weight,
        grad_final=grad_final,
        position=tokens - bos,
        span=span,
        first=bos,
        seq=seq,
        valid=valid,
        cols=cols,
        mask_d=mask_d,
        D=D,
        W=W,
    )
    tl.store(
        dx + tokens[:, None] * D + cols[None, :],
        b_dx.to(dx.dtype.element_ty),
        mask=valid[:, None] & mask_d[None, :],
    )


@triton.jit
def conv_grad_state_kernel(
    grad_z,
    weight,
    grad_final,
    cu_seqlens,
    length,
    d_state,
    D: tl.constexpr,
    W: tl.constexpr,
    BD: tl.constexpr,
    BW: tl.constexpr,
    IS_VARLEN: tl.constexpr,
):
    """The initial state's gradient (its dtype), entry e standing for position e - (W - 1)."""
    i_n, i_d = tl.program_id(0), tl.program_id(1)
    bos, span = sequence_extent(cu_seqlens=cu_seqlens, i_n=i_n, length=length, IS_VARLEN=IS_VARLEN)
    cols = i_d * BD + tl.arange(0, BD)
    mask_d = cols < D
    entries = tl.arange(0, BW)
    valid = entries < W - 1
    seq = entries * 0 + i_n
    b_ds = _gathered_grad(
        grad_z=grad_z,
        weight=weight,
        grad_final=grad_final,
        position=(entries - (W - 1)).to(tl.int64),
        span=span + entries * 0,
        first=bos,
        seq=seq,
        valid=valid,
        cols=cols,
        mask_d=mask_d,
        D=D,
        W=W,
    )
    tl.store(
        d_state + (i_n.to(tl.int64) * D + cols[None, :]) * (W - 1) + entries[:, None],
        b_ds.to(d_state.dtype.element_ty),
        mask=valid[:, None] & mask_d[None, :],
    )


# Token rows of a program's tile (4 warps, 128 channels): 64, at which the dz / dx kernels
# run faster than at 32 (docs/design.md).
BACKWARD_ROWS = 64


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
    block_t, block_d = tile_sizes(BACKWARD_ROWS, length, channels)
    block_w = next_power_of_2(width)
    grid = token_grid(
        batch=batch, length=length, channels=channels, block_t=block_t, block_d=block_d
    )
    programs = cdiv(length, block_t) * batch  # the programs of a channel block
    grad_z = torch.empty(x.shape, device=x.device, dtype=torch.float32)
    dweight_parts = torch.empty(programs, channels, block_w, device=x.device, dtype=torch.float32)
    dbias_parts = torch.empty(programs, channels, device=x.device, dtype=torch.float32)
    shape = dict(D=channels, W=width, BD=block_d, IS_VARLEN=cu_seqlens is not None)
    seqs = dict(BT=block_t, BN=next_power_of_2(n_seqs))
    conv_grad_z_kernel[grid](
        x=x,
        weight=weight,
        bias=bias,
        state=initial_state,
        cu_seqlens=cu_seqlens,
        grad_y=grad_y,
        length=length,
        n_seqs=n_seqs,
        grad_z=grad_z,
        dweight_parts=dweight_parts,
        dbias_parts=dbias_parts,
        **shape,
        **seqs,
        BW=block_w,
        HAS_BIAS=bias is not None,
        HAS_STATE=initial_state is not None,
        SILU=activation == "silu",
    )
    dx = torch.empty_like(x)
    conv_grad_x_kernel[grid](
        grad_z=grad_z,
        weight=weight,
        grad_final=grad_final_state,
        cu_seqlens=cu_seqlens,
        length=length,
        n_seqs=n_seqs,
        dx=dx,
        **shape,
        **seqs,
    )
    d_state = x.new_empty(0)
    if initial_state is not None:
        d_state = torch.empty_like(initial_state)
        conv_grad_state_kernel[(n_seqs, cdiv(channels, block_d))](
            grad_z=grad_z,
            weight=weight,
            grad_final=grad_final_state,
            cu_seqlens=cu_seqlens,
            length=length,
            d_state=d_state,
            **shape,
            BW=next_power_of_2(width - 1),
        )
    dweight = dweight_parts[..., :width].sum(0).to(weight.dtype)
    dbias = x.new_empty(0) if bias is None else dbias_parts.sum(0).to(bias.dtype)
    return dx, dweight, dbias, d_state
