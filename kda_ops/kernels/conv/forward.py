"""The causal conv1d prefill and its launcher, ``launch_causal_conv1d``, which hands one
token per sequence to the decode step (``step.py``).

A token-parallel output kernel, in which a sequence's first ``W - 1`` tokens (the only
ones reading the initial state) are done apart by the program holding the sequence's
start. The program of a batch row's last token block also writes the row's final conv
state (its last ``W - 1`` inputs); for packed sequences, and for a pool rewritten in
place, a sequence-parallel kernel writes it after the output kernel instead. The output
kernel runs before the state kernel, so reading and rewriting the same slot is safe.
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
    state_slot,
    tile_sizes,
    token_block,
    token_grid,
    token_program,
)
from kda_ops.kernels.conv.step import step_launch
from kda_ops.kernels.fast_exp import fast_sigmoid
from kda_ops.kernels.launches import KernelLaunch, LaunchPlan
from kda_ops.kernels.sizes import cdiv, next_power_of_2


@triton.jit
def _write_output(
    y,
    z,
    bias,
    tokens,
    rows,
    cols,
    mask_d,
    D: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SILU: tl.constexpr,
):
    """y = act(z + bias) of the rows where ``rows`` holds."""
    z = add_bias(z=z, bias=bias, cols=cols, mask_d=mask_d, HAS_BIAS=HAS_BIAS)
    if SILU:
        z = z * fast_sigmoid(z)
    tl.store(
        y + tokens[:, None] * D + cols[None, :],
        z.to(y.dtype.element_ty),
        mask=rows[:, None] & mask_d[None, :],
    )


@triton.jit
def causal_conv1d_kernel(
    x,
    weight,
    bias,
    state,
    state_indices,
    cu_seqlens,
    length,
    n_seqs,
    y,
    state_out,
    D: tl.constexpr,
    W: tl.constexpr,
    BT: tl.constexpr,
    BD: tl.constexpr,
    BN: tl.constexpr,
    BW: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_STATE: tl.constexpr,
    USE_INDICES: tl.constexpr,
    IS_VARLEN: tl.constexpr,
    SILU: tl.constexpr,
    FINAL_STATE: tl.constexpr,
):
    """y of a [BT, BD] tile from x alone. With an initial state, a sequence's first W - 1
    tokens (the only ones reading it) are done apart (``head_rows``) by the program
    holding the sequence's first token: the state's strided gather over every tile's rows
    made this kernel spill and load 2 bytes at a time. With ``FINAL_STATE`` (batch rows,
    not packed; ``state_out`` not ``state``) the program of a row's last token block also
    writes its final state, which otherwise ``conv_final_state_kernel`` does."""
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
    z = pre_activation(
        x=x,
        state=state,
        weight=weight,
        tokens=tokens,
        position=position,
        slots=seq,
        valid=valid,
        has_history=valid,
        cols=cols,
        mask_d=mask_d,
        D=D,
        W=W,
        HAS_STATE=False,
    )
    rows = valid
    if HAS_STATE:
        rows = valid & (position >= W - 1)
    _write_output(
        y=y,
        z=z,
        bias=bias,
        tokens=tokens,
        rows=rows,
        cols=cols,
        mask_d=mask_d,
        D=D,
        HAS_BIAS=HAS_BIAS,
        SILU=SILU,
    )
    if HAS_STATE:
        i_n, last = starting_sequences(seq=seq, position=position, valid=valid, n_seqs=n_seqs)
        while i_n <= last:
            h_tokens, h_position, slots, h_valid, has_history = head_rows(
                state_indices=state_indices,
                cu_seqlens=cu_seqlens,
                length=length,
                i_n=i_n,
                W=W,
                BW=BW,
                USE_INDICES=USE_INDICES,
                IS_VARLEN=IS_VARLEN,
            )
            h_z = pre_activation(
                x=x,
                state=state,
                weight=weight,
                tokens=h_tokens,
                position=h_position,
                slots=slots,
                valid=h_valid,
                has_history=has_history,
                cols=cols,
                mask_d=mask_d,
                D=D,
                W=W,
                HAS_STATE=True,
            )
            _write_output(
                y=y,
                z=h_z,
                bias=bias,
                tokens=h_tokens,
                rows=h_valid,
                cols=cols,
                mask_d=mask_d,
                D=D,
                HAS_BIAS=HAS_BIAS,
                SILU=SILU,
            )
            i_n += 1
    if FINAL_STATE:
        i_t, _, i_b = token_program(length=length, D=D, BT=BT, BD=BD)
        if i_t == tl.cdiv(length, BT) - 1:  # the batch row's last token block
            _write_final_state(
                x=x,
                state_in=state,
                state_indices=state_indices,
                cu_seqlens=cu_seqlens,
                length=length,
                state_out=state_out,
                i_n=i_b,
                cols=cols,
                D=D,
                W=W,
                BW=BW,
                HAS_STATE=HAS_STATE,
                USE_INDICES=USE_INDICES,
                IS_VARLEN=False,
            )


@triton.jit
def _write_final_state(
    x,
    state_in,
    state_indices,
    cu_seqlens,
    length,
    state_out,
    i_n,
    cols,
    D: tl.constexpr,
    W: tl.constexpr,
    BW: tl.constexpr,
    HAS_STATE: tl.constexpr,
    USE_INDICES: tl.constexpr,
    IS_VARLEN: tl.constexpr,
):
    """Sequence i_n's final state for the channels ``cols``: its last W - 1 inputs, those
    before its start taken from its initial state (zeros without one)."""
    bos, span = sequence_extent(cu_seqlens=cu_seqlens, i_n=i_n, length=length, IS_VARLEN=IS_VARLEN)
    entries = tl.arange(0, BW)
    source = span - (W - 1) + entries  # position of the input each entry keeps
    mask = (cols < D)[:, None] & (entries < W - 1)[None, :]
    slot = state_slot(state_indices, i_n, USE_INDICES)
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
    tl.store(
        state_out + state_offsets + entries[None, :],
        b_state.to(state_out.dtype.element_ty),
        mask=mask,
    )


@triton.jit
def conv_final_state_kernel(
    x,
    state_in,
    state_indices,
    cu_seqlens,
    length,
    state_out,
    D: tl.constexpr,
    W: tl.constexpr,
    BD: tl.constexpr,
    BW: tl.constexpr,
    HAS_STATE: tl.constexpr,
    USE_INDICES: tl.constexpr,
    IS_VARLEN: tl.constexpr,
):
    i_n, i_d = tl.program_id(0), tl.program_id(1)
    _write_final_state(
        x=x,
        state_in=state_in,
        state_indices=state_indices,
        cu_seqlens=cu_seqlens,
        length=length,
        state_out=state_out,
        i_n=i_n,
        cols=i_d * BD + tl.arange(0, BD),
        D=D,
        W=W,
        BW=BW,
        HAS_STATE=HAS_STATE,
        USE_INDICES=USE_INDICES,
        IS_VARLEN=IS_VARLEN,
    )


# Token rows of a program's tile (4 warps, 128 channels): 32, where 64 rows take more
# registers and are slower (8 warps slower still; docs/design.md).
PREFILL_ROWS = 32


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
            y = launch_causal_conv1d(
                x=x,
                weight=weight,
                bias=bias,
                state_in=dense,
                state_out=dense,
                state_indices=state_indices,
                cu_seqlens=cu_seqlens,
                activation=activation,
            )
            state_out.copy_(dense)
            return y
    if x.shape[1] == 1 and cu_seqlens is None:
        step = step_launch(
            x=x,
            weight=weight,
            bias=bias,
            state_in=state_in,
            state_out=state_out,
            state_indices=state_indices,
            activation=activation,
        )
        step.run()
        return step.args["y"]
    return prefill_plan(
        x=x,
        weight=weight,
        bias=bias,
        state_in=state_in,
        state_out=state_out,
        state_indices=state_indices,
        cu_seqlens=cu_seqlens,
        activation=activation,
    ).run()["y"]


def prefill_plan(
    x: Tensor,
    weight: Tensor,
    bias: Optional[Tensor],
    state_in: Optional[Tensor],
    state_out: Tensor,
    state_indices: Optional[Tensor],
    cu_seqlens: Optional[Tensor],
    activation: str,
    *,
    fuse_final_state: bool = True,
) -> LaunchPlan:
    """The prefill kernels' launches (arguments as :func:`launch_causal_conv1d`'s, the
    states dense ``[N, D, W - 1]``), results ``"y"`` (new, x's shape) and ``"state_out"``.
    Any T, one token too; plans from a symbolic T (a traced graph) as for a long one.
    ``fuse_final_state=False``: the final state always by the second kernel (TensorRT's
    two single-kernel plugins), not by the first where it can."""
    x, weight = x.contiguous(), weight.contiguous()
    batch, length, channels = x.shape
    width = weight.shape[1]
    n_seqs = batch if cu_seqlens is None else cu_seqlens.shape[0] - 1
    y = torch.empty_like(x)
    planned_length = length if isinstance(length, int) else PREFILL_ROWS
    block_t, block_d = tile_sizes(PREFILL_ROWS, planned_length, channels)
    grid = token_grid(
        batch=batch, length=length, channels=channels, block_t=block_t, block_d=block_d
    )
    flags = dict(
        HAS_STATE=state_in is not None,
        USE_INDICES=state_indices is not None,
        IS_VARLEN=cu_seqlens is not None,
    )
    kept = next_power_of_2(width - 1)
    # Rows of a batch end in their last token block, whose program can write the final
    # state, unless the state is rewritten in place (other programs still read it) or
    # packed sequences may be empty (no program holds them): then a second kernel. A
    # symbolic T is at least 1 (export's and Dynamo's dims).
    fused = (
        fuse_final_state
        and cu_seqlens is None
        and state_out is not state_in
        and (not isinstance(length, int) or length > 0)
    )
    output = KernelLaunch(
        kernel=causal_conv1d_kernel,
        grid=grid,
        args=dict(
            x=x,
            weight=weight,
            bias=bias,
            state=state_in,
            state_indices=state_indices,
            cu_seqlens=cu_seqlens,
            length=length,
            n_seqs=n_seqs,
            y=y,
            state_out=state_out,
            D=channels,
            W=width,
            BT=block_t,
            BD=block_d,
            # Only packed sequences search their sequence among BN.
            BN=1 if cu_seqlens is None else next_power_of_2(n_seqs),
            BW=kept,
            HAS_BIAS=bias is not None,
            SILU=activation == "silu",
            FINAL_STATE=fused,
            **flags,
        ),
        writes=("y", "state_out") if fused else ("y",),
    )
    launches = [output]
    if not fused:
        grid = (n_seqs, cdiv(channels, block_d))
        launches.append(
            KernelLaunch(
                kernel=conv_final_state_kernel,
                grid=grid,
                args=dict(
                    x=x,
                    state_in=state_in,
                    state_indices=state_indices,
                    cu_seqlens=cu_seqlens,
                    length=length,
                    state_out=state_out,
                    D=channels,
                    W=width,
                    BD=block_d,
                    BW=kept,
                    **flags,
                ),
                writes=("state_out",),
            )
        )
    return LaunchPlan(tuple(launches), {"y": y, "state_out": state_out})
