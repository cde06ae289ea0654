"""Context parallelism over ``torch.distributed``: one long sequence split across ranks.

Rank r of a process group holds tokens ``[r·T/CP, (r+1)·T/CP)`` of every sequence of the
batch (the same B on every rank; the local lengths may differ).

:func:`chunk_kda_cp` (KDA / Gated DeltaNet): each rank turns its segment into an affine
map ``(M_r, E_r)`` of its incoming state (:mod:`kda_ops.affine`, one chunk run with
``V + K`` value columns), one all-gather exchanges the maps (``CP × B × HV × K × (K + V)``
numbers, independent of the segment length), each rank composes the maps of the ranks
before it into its exact incoming state ``S_r`` and finishes its outputs
``o = o⁰ + P S_r`` and end state ``M_r S_r + E_r``. Backward is exact: each rank's
gradient w.r.t. its incoming state is all-gathered (the same volume as the maps) and every
rank runs the reverse scan ``Λ_i = G_i + M_iᵀ Λ_{i+1}`` to get the gradient of its own map
(:func:`kda_ops.affine.prefix_adjoints`).

:func:`causal_conv1d_cp` (the short conv): each rank's first outputs need the last
``W - 1`` inputs of the rank before (the halo), exchanged by an all-gather of the
``B × D × (W - 1)`` tails; their gradients travel back the same way.

Every rank must call these functions in the same order, and, when training, run backward
through all of their outputs (the backward passes are collectives too). Works with any
backend that has ``all_gather`` (NCCL, gloo). Varlen (``cu_seqlens``) is not supported
yet: split packed sequences so each rank holds whole sequences, or use fixed lengths.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from kda_ops.affine import prefix_adjoints, prefix_states, resolve_config, segment_maps
from kda_ops.conv import causal_conv1d
from kda_ops.validation import ArgumentChecker

Group = Optional[dist.ProcessGroup]


def all_gather_stacked(x: Tensor, group: Group) -> Tensor:
    """``[CP, *x.shape]``: every rank's ``x`` (not differentiable)."""
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.stack(parts)


class _IncomingState(torch.autograd.Function):
    """packed map ``[B, HV, K, V + K]`` of this rank -> its incoming state ``[B, HV, K, V]``."""

    @staticmethod
    def forward(ctx: Any, packed: Tensor, head_v: int, group: Group) -> Tensor:
        maps = all_gather_stacked(packed.detach(), group)
        states = prefix_states(maps, head_v)
        ctx.save_for_backward(maps, states)
        ctx.group = group
        return states[dist.get_rank(group)].clone()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        maps, states = ctx.saved_tensors
        grads = all_gather_stacked(grad, ctx.group)
        return prefix_adjoints(maps, states, grads)[dist.get_rank(ctx.group)], None, None


class _Halo(torch.autograd.Function):
    """tail ``[B, D, W - 1]`` of this rank -> the tail of the rank before (rank 0: ``start``)."""

    @staticmethod
    def forward(ctx: Any, tail: Tensor, start: Tensor, group: Group) -> Tensor:
        rank = dist.get_rank(group)
        tails = all_gather_stacked(tail.detach(), group)
        ctx.rank, ctx.world, ctx.group = rank, tails.shape[0], group
        return start.clone() if rank == 0 else tails[rank - 1].to(start.dtype)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Optional[Tensor], None]:
        grads = all_gather_stacked(grad, ctx.group)
        next_rank = ctx.rank + 1
        grad_tail = grads[next_rank] if next_rank < ctx.world else torch.zeros_like(grad)
        return grad_tail, grad if ctx.rank == 0 else None, None


def _check_fixed_length(function: str, cu_seqlens: object) -> None:
    if cu_seqlens is not None:
        ArgumentChecker(function).fail(
            ValueError,
            "`cu_seqlens` (varlen) is not supported across ranks; give each rank whole "
            "packed sequences and call chunk_kda, or use fixed-length batches",
        )


def chunk_kda_cp(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    scale: Optional[float] = None,
    initial_state: Optional[Tensor] = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    A_log: Optional[Tensor] = None,
    dt_bias: Optional[Tensor] = None,
    lower_bound: Optional[float] = None,
    cu_seqlens: Optional[Tensor] = None,
    group: Group = None,
) -> tuple[Tensor, Optional[Tensor]]:
    """:func:`kda_ops.chunk_kda` on this rank's segment of sequences split across ``group``.

    Arguments as for ``chunk_kda``, with q, k, v, g, beta this rank's tokens
    ``[B, T_r, ...]``. ``initial_state`` ``[B, HV, K, V]`` is the state before the whole
    sequence; only rank 0 reads it. Returns this rank's outputs ``[B, T_r, HV, V]`` and, with
    ``output_final_state``, the exact state after this rank's last token (the sequence's
    final state on the last rank). ``cu_seqlens`` raises ``ValueError`` (not supported).
    """
    function = "chunk_kda_cp"
    _check_fixed_length(function, cu_seqlens)
    rank = dist.get_rank(group)
    start = initial_state if rank == 0 else None
    config = resolve_config(
        function, q, k, v, g, beta, scale=scale, initial_state=start,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_gate_in_kernel=use_gate_in_kernel,
        use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, A_log=A_log, dt_bias=dt_bias,
        lower_bound=lower_bound,
    )  # fmt: skip
    maps = segment_maps(q, k, v, g, beta, config, start=start)
    incoming = _IncomingState.apply(maps.packed, maps.head_v, group)
    o = maps.output(incoming)
    return o, maps.end_state(incoming) if output_final_state else None


def causal_conv1d_cp(
    x: Tensor,
    weight: Tensor,
    bias: Optional[Tensor] = None,
    initial_state: Optional[Tensor] = None,
    activation: Optional[str] = "silu",
    cu_seqlens: Optional[Tensor] = None,
    group: Group = None,
) -> tuple[Tensor, Tensor]:
    """:func:`kda_ops.causal_conv1d` on this rank's segment, with the previous rank's last
    ``W - 1`` inputs as the halo.

    x ``[B, T_r, D]`` with ``T_r >= W - 1`` on every rank; weight ``[D, W]``; bias ``[D]``;
    ``initial_state`` ``[B, D, W - 1]``: the inputs before the sequence, read on rank 0 only.
    Returns this rank's ``y`` ``[B, T_r, D]`` and the conv state after its last token.
    """
    function = "causal_conv1d_cp"
    _check_fixed_length(function, cu_seqlens)
    check = ArgumentChecker(function)
    x = check.tensor("x", x, dims=3)
    weight = check.tensor("weight", weight, dims=2)
    history = weight.shape[1] - 1
    if x.shape[1] < history:
        check.fail(
            ValueError,
            f"every rank needs at least W - 1 = {history} tokens of `x`, got T = {x.shape[1]}",
        )
    start = initial_state if dist.get_rank(group) == 0 else None
    if start is None:
        start = x.new_zeros(x.shape[0], x.shape[2], history)
    tail = x[:, x.shape[1] - history :].transpose(1, 2)
    halo = _Halo.apply(tail, start, group)
    return causal_conv1d(x, weight, bias, halo, activation)
