"""Segments of a KDA / Gated DeltaNet sequence as affine maps of their incoming state.

A segment maps its incoming state ``S_in`` (``[K, V]`` per value head) to its end state
``S_out = M S_in + E``, with ``M`` (``[K, K]``) the ordered product of the per-token
transitions ``(I - β k kᵀ) diag(α)`` and ``E`` the end state reached from a zero state.
Its outputs are affine in ``S_in`` too: ``o_t = o_t⁰ + P_t S_in`` with ``P_t`` (``[K]``)
the read-out of the incoming state. Maps compose as
``(M_b, E_b) ∘ (M_a, E_a) = (M_b M_a, M_b E_a + E_b)``, which is what context
parallelism (across devices: :mod:`kda_ops.distributed`; inside one:
:mod:`kda_ops.segmented`) is built on. Adding zero-state end states is *not* enough: every
token keeps transforming the state it receives.

All of it comes from one run of the ``kda::chunk`` op (so every in-kernel option — l2norm,
gate, beta sigmoid — acts exactly as in the op), because the recurrence is linear in the
state and the values jointly, and each value column of the state evolves on its own: the
values are extended with ``K`` zero columns and the initial state with the identity,
``v' = [v | 0]``, ``S₀' = [S_start | I]``. Then the end state is ``[E | M]`` and the output
``[o⁰ | P]``. Cost: one chunk run with ``V + K`` value columns instead of ``V``, plus a
``[T, HV, K] × [HV, K, V]`` product to apply an incoming state. ``P`` comes back in v's
dtype (the op's output dtype); ``M`` and ``E`` in the state dtype (float32 / float64).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from kda_ops import arguments
from kda_ops.delta_rule_ops import chunk_op
from kda_ops.signature import DeltaRuleInputs, DeltaRuleOptions
from kda_ops.validation import MAX_HEAD_DIM


@dataclass
class AffineSegments:
    """Segments as affine maps of their incoming states (N segments, value head dims).

    base_output: ``[B, T, HV, V]`` (v's dtype), the output when nothing comes in.
    readout: ``[B, T, HV, K]`` (v's dtype), ``P``: ``o_t = base_output_t + P_t S_in``.
    packed: ``[N, HV, K, V + K]`` (state dtype), ``[E | M]``: the end state from no
        incoming state, then the transition. This is what context parallelism exchanges.
    """

    base_output: Tensor
    readout: Tensor
    packed: Tensor

    @property
    def head_v(self) -> int:
        return self.base_output.shape[-1]

    def end_state(self, incoming: Tensor) -> Tensor:
        """``M S_in + E`` for incoming states ``[N, HV, K, V]``."""
        return apply_map(self.packed, incoming)

    def output(self, incoming: Tensor) -> Tensor:
        """The output ``[B, T, HV, V]`` (v's dtype) for incoming states ``[B, HV, K, V]``
        (one per batch row), summed in the state dtype."""
        correction = torch.einsum("bthk,bhkv->bthv", self.readout.to(incoming.dtype), incoming)
        out = self.base_output.to(incoming.dtype) + correction
        return out.to(self.base_output.dtype)

    def first_output(self, incoming: Tensor, length: int) -> Tensor:
        """The output ``[1, T, HV, V]`` of a varlen batch whose first sequence (its first
        ``length`` tokens) receives ``incoming`` ``[1, HV, K, V]`` and the others nothing."""
        head = AffineSegments(self.base_output[:, :length], self.readout[:, :length], self.packed)
        return torch.cat([head.output(incoming), self.base_output[:, length:]], dim=1)


def segment_maps(
    inputs: DeltaRuleInputs,
    options: DeltaRuleOptions,
    start: Optional[Tensor] = None,
    cu_seqlens: Optional[Tensor] = None,
    max_columns: int = MAX_HEAD_DIM,
) -> AffineSegments:
    """Each sequence of the batch as an affine map of its incoming state (one chunk run).

    ``inputs`` and ``options`` as ``kda::chunk`` takes them (q, k ``[B, T, H, K]``; v
    ``[B, T, HV, V]``). ``start`` ``[N, HV, K, V]`` (state dtype) is a state every segment
    starts from *before* the incoming one is added (the sequence's own initial state);
    ``E`` and ``base_output`` include it. The ``V + K`` value columns run in blocks of at
    most ``max_columns`` (one run when ``V + K <= 256``). Differentiable through the op's
    autograd.
    """
    q, v = inputs.q, inputs.v
    batch, length, value_heads, head_v = v.shape
    head_k = q.shape[-1]
    n_seqs = batch if cu_seqlens is None else cu_seqlens.shape[0] - 1
    eye = torch.eye(head_k, dtype=arguments.state_dtype(q), device=q.device)
    identity = eye.expand(n_seqs, value_heads, head_k, head_k)
    if start is None:
        start = identity.new_zeros(n_seqs, value_heads, head_k, head_v)
    values = torch.cat([v, v.new_zeros(batch, length, value_heads, head_k)], dim=-1)
    initial = torch.cat([start, identity], -1)
    # Value columns evolve independently: run them in blocks the kernels accept.
    blocks = _column_blocks(head_v + head_k, max_columns)
    runs = [
        chunk_op(*inputs._replace(v=values[..., b].contiguous()), initial[..., b].contiguous(),
                 cu_seqlens, *options)
        for b in blocks
    ]  # fmt: skip
    o = torch.cat([run[0] for run in runs], dim=-1)
    final = torch.cat([run[1] for run in runs], dim=-1)
    return AffineSegments(base_output=o[..., :head_v], readout=o[..., head_v:], packed=final)


def _column_blocks(columns: int, width: int) -> list[slice]:
    return [slice(start, min(start + width, columns)) for start in range(0, columns, width)]


def apply_map(packed: Tensor, incoming: Tensor) -> Tensor:
    """``M S + E`` for packed maps ``[..., K, V + K]`` and states ``[..., K, V]``."""
    head_v = incoming.shape[-1]
    return packed[..., head_v:] @ incoming + packed[..., :head_v]


def prefix_states(packed: Tensor, head_v: int) -> Tensor:
    """Incoming state of every segment of a chain, each starting where the last ended.

    packed: ``[S, ..., K, V + K]``, the maps of S consecutive segments (the first one
    receives nothing). Returns ``[S, ..., K, V]``: ``S_0 = 0``,
    ``S_{i+1} = M_i S_i + E_i``. Sequential over S (S is small: devices or segments);
    differentiable.
    """
    state = packed.new_zeros(*packed.shape[1:-1], head_v)
    states = [state]
    for i in range(packed.shape[0] - 1):
        state = apply_map(packed[i], state)
        states.append(state)
    return torch.stack(states)


def prefix_adjoints(packed: Tensor, states: Tensor, grads: Tensor) -> Tensor:
    """Reverse pass of :func:`prefix_states`: the gradients of the packed maps.

    packed ``[S, ..., K, V + K]``; states ``[S, ..., K, V]`` (from :func:`prefix_states`);
    grads ``[S, ..., K, V]``, each segment's local gradient of the loss w.r.t. its incoming
    state. With total adjoints ``Λ_{S-1} = G_{S-1}``, ``Λ_i = G_i + M_iᵀ Λ_{i+1}``, segment
    i's map gets ``dE_i = Λ_{i+1}`` and ``dM_i = Λ_{i+1} S_iᵀ`` (zero for the last one).
    Returns ``[S, ..., K, V + K]`` packed like the maps.
    """
    head_v = states.shape[-1]
    adjoint = torch.zeros_like(grads[0])
    out = [torch.zeros_like(packed[-1])]
    for i in range(packed.shape[0] - 1, 0, -1):
        adjoint = grads[i] + packed[i][..., head_v:].mT @ adjoint
        # segment i - 1 feeds segment i
        out.append(torch.cat([adjoint, adjoint @ states[i - 1].mT], dim=-1))
    return torch.stack(out[::-1])
