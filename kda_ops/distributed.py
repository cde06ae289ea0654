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
backend that has ``all_gather`` (NCCL, gloo).

Varlen (``cu_seqlens``): the global packed batch (``B = 1``, ``T = Σ T_r`` tokens) is split
into contiguous shards, rank r holding tokens ``[Σ_{j<r} T_j, Σ_{j≤r} T_j)``; every rank
passes the *global* ``cu_seqlens`` ``[N + 1]`` (strictly increasing: no empty sequences)
and the global initial states ``[N, ...]``, exactly what one process would give
``chunk_kda`` / ``causal_conv1d``. The shard offsets come from one all-gather of the local
lengths. A rank's shard is cut into local pieces (:func:`shard_sequences`); sequences
wholly inside it run as usual, and only the sequence that crosses a rank boundary is
composed: each rank's LAST piece's map is exchanged, masked to zero where it does not feed
the next rank (the next rank starts a new sequence; ``M`` also where the rank holds more
than one piece, since then its last piece starts from the sequence's own initial state),
so the same prefix scan over the ranks chains only through ranks whose whole shard is one
piece of the crossing sequence, and gives each rank the exact state entering its FIRST
piece (zero where a sequence starts exactly at the shard start). Each rank returns the
final states of the sequences that end on it. The conv halo applies only where the
first token continues a sequence, and carries that sequence's initial conv state when it
began fewer than ``W - 1`` tokens before the boundary.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from itertools import pairwise
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from kda_ops import arguments
from kda_ops.affine import AffineSegments, apply_map, prefix_adjoints, prefix_states, segment_maps
from kda_ops.conv import causal_conv1d
from kda_ops.signature import DeltaRuleInputs, DeltaRuleOptions
from kda_ops.validation import ArgumentChecker

Group = Optional[dist.ProcessGroup]


def all_gather_stacked(x: Tensor, group: Group) -> Tensor:
    """``[CP, *x.shape]``: every rank's ``x`` (not differentiable)."""
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.stack(parts)


@dataclass(frozen=True)
class ShardSequences:
    """The local pieces of the global packed sequences on one rank's shard.

    cu_seqlens: local offsets ``[0, ..., T_r]`` of the ``n`` pieces.
    first: global index of the sequence the first piece belongs to (piece ``i`` belongs to
        sequence ``first + i``).
    continues_in: the first piece continues a sequence begun on an earlier rank.
    continues_out: the last piece continues on the next rank.
    """

    cu_seqlens: tuple[int, ...]
    first: int
    continues_in: bool
    continues_out: bool

    @property
    def num_pieces(self) -> int:
        return len(self.cu_seqlens) - 1

    @property
    def ending(self) -> range:
        """Global indices of the sequences that end on this rank (their final states)."""
        return range(self.first, self.first + self.num_pieces - self.continues_out)


def shard_sequences(cu_seqlens: list[int], start: int, stop: int) -> ShardSequences:
    """The pieces of tokens ``[start, stop)`` of a packed batch with global offsets
    ``cu_seqlens`` (strictly increasing, ``cu_seqlens[0] <= start < stop <= cu_seqlens[-1]``)."""
    first = bisect.bisect_right(cu_seqlens, start) - 1
    last = bisect.bisect_left(cu_seqlens, stop) - 1  # the sequence holding token stop - 1
    inner = (offset - start for offset in cu_seqlens[first + 1 : last + 1])
    return ShardSequences(
        cu_seqlens=(0, *inner, stop - start),
        first=first,
        continues_in=cu_seqlens[first] < start,
        continues_out=cu_seqlens[last + 1] > stop,
    )


def _shard(check: ArgumentChecker, cu_seqlens: object, x: Tensor, group: Group) -> ShardSequences:
    """Checks the global ``cu_seqlens`` against x ``[1, T_r, ...]`` on every rank (one
    all-gather of the local lengths) and returns this rank's pieces."""
    seqlens = check.cu_seqlens(cu_seqlens, x.shape[0])
    lengths = all_gather_stacked(torch.tensor([x.shape[1]], device=x.device), group)
    lengths = lengths.flatten().tolist()
    if min(lengths) < 1:
        check.fail(ValueError, f"every rank needs at least one token, got lengths {lengths}")
    bounds = seqlens.tolist()
    if bounds[0] != 0 or bounds[-1] != sum(lengths) or any(b <= a for a, b in pairwise(bounds)):
        check.fail(
            ValueError,
            f"`cu_seqlens` must be the global offsets: strictly increasing from 0 to the "
            f"total length {sum(lengths)} of the ranks' shards {lengths}, got {bounds}",
        )
    start = sum(lengths[: dist.get_rank(group)])
    return shard_sequences(bounds, start, start + x.shape[1])


def _piece_starts(initial_state: Tensor, shard: ShardSequences) -> Tensor:
    """The rows ``[n, ...]`` of the global ``initial_state`` ``[N, ...]`` for this rank's
    pieces; zero for a first piece that continues a sequence (its start lies elsewhere)."""
    rows = initial_state[shard.first : shard.first + shard.num_pieces]
    if shard.continues_in:
        rows = torch.cat([torch.zeros_like(rows[:1]), rows[1:]])
    return rows


def _local_offsets(shard: ShardSequences, cu_seqlens: Tensor) -> Tensor:
    """The pieces' offsets as a tensor like the global ``cu_seqlens``."""
    return torch.tensor(shard.cu_seqlens, dtype=cu_seqlens.dtype, device=cu_seqlens.device)


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
    """tail ``[B, D, W - 1]`` of this rank -> the tail of the rank before if ``receive``
    (its first token continues the sequence there), else ``start``. ``send``: the next
    rank receives this rank's tail (so it sends back the tail's gradient)."""

    @staticmethod
    def forward(
        ctx: Any, tail: Tensor, start: Tensor, receive: bool, send: bool, group: Group
    ) -> Tensor:
        rank = dist.get_rank(group)
        tails = all_gather_stacked(tail.detach(), group)
        ctx.rank, ctx.receive, ctx.send, ctx.group = rank, receive, send, group
        return tails[rank - 1].to(start.dtype) if receive else start.clone()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Optional[Tensor], None, None, None]:
        grads = all_gather_stacked(grad, ctx.group)
        grad_tail = grads[ctx.rank + 1] if ctx.send else torch.zeros_like(grad)
        return grad_tail, None if ctx.receive else grad, None, None, None


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
    ``[B, T_r, ...]``. Fixed length: ``initial_state`` ``[B, HV, K, V]`` is the state before
    the whole sequence; only rank 0 reads it. Returns this rank's outputs ``[B, T_r, HV, V]``
    and, with ``output_final_state``, the exact state after this rank's last token (the
    sequence's final state on the last rank).

    Varlen: ``B = 1`` and ``cu_seqlens`` int ``[N + 1]`` the *global* offsets of the packed
    batch split over the ranks in rank order; ``initial_state`` ``[N, HV, K, V]`` global
    too (each rank reads the rows of the sequences starting on it). The final state is
    ``[n_r, HV, K, V]``: the final states of the sequences ending on this rank, global
    indices ``shard_sequences(...).ending``.
    """
    function = "chunk_kda_cp"
    # Fixed length: only rank 0 starts from initial_state. Varlen: every rank checks the
    # global layout, cu_seqlens [N + 1] and initial_state [N, HV, K, V].
    start = initial_state if cu_seqlens is not None or dist.get_rank(group) == 0 else None
    inputs, options = arguments.delta_rule_arguments(
        function, q, k, v, g, beta, scale=scale, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        use_gate_in_kernel=use_gate_in_kernel,
        use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, A_log=A_log, dt_bias=dt_bias,
        lower_bound=lower_bound, initial_state=start, cu_seqlens=cu_seqlens, global_offsets=True,
    )  # fmt: skip
    if cu_seqlens is None:
        maps = segment_maps(inputs, options, start=start)
        incoming = _IncomingState.apply(maps.packed, maps.head_v, group)
        o, final_state = maps.output(incoming), maps.end_state(incoming)
    else:
        o, final_state = _chunk_kda_cp_varlen(
            function, inputs, options, initial_state, cu_seqlens, group
        )
    return o, final_state if output_final_state else None


def _chunk_kda_cp_varlen(
    function: str,
    inputs: DeltaRuleInputs,
    options: DeltaRuleOptions,
    initial_state: Optional[Tensor],
    cu_seqlens: Tensor,
    group: Group,
) -> tuple[Tensor, Tensor]:
    """Varlen :func:`chunk_kda_cp`: ``(o [1, T_r, HV, V], final states [n_r, HV, K, V])``."""
    shard = _shard(ArgumentChecker(function), cu_seqlens, inputs.q, group)
    start = None if initial_state is None else _piece_starts(initial_state, shard)
    local_cu = _local_offsets(shard, cu_seqlens)
    maps = segment_maps(inputs, options, start=start, cu_seqlens=local_cu)
    incoming = _IncomingState.apply(_outgoing_map(maps, shard), maps.head_v, group)
    o = maps.first_output(incoming, shard.cu_seqlens[1])
    first_end = apply_map(maps.packed[:1], incoming)
    ends = torch.cat([first_end, maps.packed[1:, ..., : maps.head_v]])
    return o, ends[: len(shard.ending)]


def _outgoing_map(maps: AffineSegments, shard: ShardSequences) -> Tensor:
    """The map ``[1, HV, K, V + K]`` of the last piece as the next rank's composition sees
    it: zero unless the piece continues there, and ``M`` zero unless the piece is the whole
    shard (else it starts from its sequence's own initial state, already in ``E``)."""
    end, transition = maps.packed[-1:].split([maps.head_v, maps.packed.shape[-1] - maps.head_v], -1)
    keep_transition = shard.continues_out and shard.num_pieces == 1
    return torch.cat([end * shard.continues_out, transition * keep_transition], dim=-1)


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

    x ``[B, T_r, D]`` with ``T_r >= W - 1`` on every rank; weight ``[D, W]``; bias ``[D]``.
    Fixed length: ``initial_state`` ``[B, D, W - 1]``, the inputs before the sequence, read
    on rank 0 only; returns this rank's ``y`` ``[B, T_r, D]`` and the conv state after its
    last token. Varlen (``B = 1``, global ``cu_seqlens`` ``[N + 1]`` as for
    :func:`chunk_kda_cp`): ``initial_state`` ``[N, D, W - 1]`` global; returns ``y`` and the
    final conv states ``[n_r, D, W - 1]`` of the sequences ending on this rank.
    """
    check = ArgumentChecker("causal_conv1d_cp")
    x = check.tensor("x", x, dims=3)
    weight = check.tensor("weight", weight, dims=2)
    history = weight.shape[1] - 1
    if x.shape[1] < history:
        check.fail(
            ValueError,
            f"every rank needs at least W - 1 = {history} tokens of `x`, got T = {x.shape[1]}",
        )
    if cu_seqlens is not None:
        return _causal_conv1d_cp_varlen(
            check, x, weight, bias, initial_state, activation, cu_seqlens, group
        )
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    start = initial_state if rank == 0 else None
    if start is None:
        start = x.new_zeros(x.shape[0], x.shape[2], history)
    tail = x[:, x.shape[1] - history :].transpose(1, 2)
    halo = _Halo.apply(tail, start, rank > 0, rank < world - 1, group)
    return causal_conv1d(x, weight, bias, halo, activation)


def _causal_conv1d_cp_varlen(
    check: ArgumentChecker,
    x: Tensor,
    weight: Tensor,
    bias: Optional[Tensor],
    initial_state: Optional[Tensor],
    activation: Optional[str],
    cu_seqlens: Tensor,
    group: Group,
) -> tuple[Tensor, Tensor]:
    """Varlen :func:`causal_conv1d_cp`: ``(y [1, T_r, D], final states [n_r, D, W - 1])``."""
    shard = _shard(check, cu_seqlens, x, group)
    history = weight.shape[1] - 1
    if initial_state is None:
        initial_state = x.new_zeros(cu_seqlens.shape[0] - 1, x.shape[2], history)
    expected = (cu_seqlens.shape[0] - 1, x.shape[2], history)
    check.shape("initial_state", check.tensor("initial_state", initial_state, dims=3), expected,
                "(N, D, W - 1)")  # fmt: skip
    starts = _piece_starts(initial_state, shard)  # [n, D, W - 1]
    # The inputs before the last piece's end: its own start state, then its tokens (a piece
    # that is the whole shard has >= W - 1 tokens, so its zero start never shows).
    last_piece = x[0, shard.cu_seqlens[-2] :].T.to(starts.dtype)
    tail = torch.cat([starts[-1], last_piece], dim=-1)
    tail = tail[:, tail.shape[-1] - history :].unsqueeze(0)
    halo = _Halo.apply(tail, starts[:1], shard.continues_in, shard.continues_out, group)
    local_cu = _local_offsets(shard, cu_seqlens)
    y, final = causal_conv1d(x, weight, bias, torch.cat([halo, starts[1:]]), activation, local_cu)
    return y, final[: len(shard.ending)]
