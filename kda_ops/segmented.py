"""In-device context parallelism: one long sequence split into segments run in parallel.

The chunkwise recurrence is serial over the T / 64 chunks of a sequence and parallel over
(batch, value head) only, so a ``B = 1`` sequence with few heads leaves most SMs idle.
:func:`chunk_kda_segmented` cuts each sequence into ``S`` equal segments, runs them as a
batch of ``B·S`` independent sequences that yields each segment's affine map
(:mod:`kda_ops.affine`: one chunk run with ``V + K`` value columns), composes the maps in
order to get every segment's exact incoming state (``S`` small ``[K, K] @ [K, V]`` steps
per head), and adds the incoming state's contribution to the outputs. No rerun.
Differentiable (the op's autograd plus plain PyTorch).

:func:`plan_segments` picks ``S`` from the shapes: on CUDA, enough segments to give every
SM a (segment, head) recurrence, segments of at least :data:`MIN_SEGMENT_LENGTH` tokens;
elsewhere 1 (the CPU reference gains nothing). The thresholds follow the kernel's
parallelism, not a measurement: ``benchmarks/cp.py`` measures them on a GPU.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
from torch import Tensor

from kda_ops import arguments
from kda_ops.affine import apply_map, prefix_states, segment_maps
from kda_ops.delta_rule_ops import chunk_op
from kda_ops.kernels.sizes import processors
from kda_ops.signature import DeltaRuleInputs, DeltaRuleOptions
from kda_ops.validation import ArgumentChecker

MIN_SEGMENT_LENGTH = 4096
MAX_SEGMENTS = 64


def plan_segments(batch: int, length: int, value_heads: int, device: torch.device) -> int:
    """The number of segments per sequence for :func:`chunk_kda_segmented` (1 = don't
    split): on CUDA, the largest power of two ``S`` with ``batch·value_heads·S`` at most the
    SM count, ``length % S == 0`` and ``length / S >= MIN_SEGMENT_LENGTH``."""
    if device.type != "cuda":
        return 1
    sms = processors(device)
    segments = 1
    while (
        segments * 2 <= MAX_SEGMENTS
        and batch * value_heads * segments * 2 <= sms
        and length % (segments * 2) == 0
        and length // (segments * 2) >= MIN_SEGMENT_LENGTH
    ):
        segments *= 2
    return segments


def _split(x: Tensor, segments: int) -> Tensor:
    """``[B, T, ...]`` -> ``[B·S, T / S, ...]`` (segments of a row stay consecutive)."""
    return x.reshape(x.shape[0] * segments, x.shape[1] // segments, *x.shape[2:])


def _merge(x: Tensor, segments: int) -> Tensor:
    """Inverse of :func:`_split`."""
    return x.reshape(x.shape[0] // segments, x.shape[1] * segments, *x.shape[2:])


def segmented_delta_rule(
    inputs: DeltaRuleInputs,
    options: DeltaRuleOptions,
    initial_state: Optional[Tensor],
    segments: int,
) -> tuple[Tensor, Tensor]:
    """Segmented chunk KDA on checked inputs (``T % segments == 0``); returns o
    ``[B, T, HV, V]`` and the final state ``[B, HV, K, V]``."""
    batch, head_v = inputs.v.shape[0], inputs.v.shape[-1]
    maps = segment_maps(inputs.map_tokens(functools.partial(_split, segments=segments)), options)
    # [S, B, HV, K, V + K]: segment-major, so the prefix scan runs over the first dim.
    packed = maps.packed.unflatten(0, (batch, segments)).transpose(0, 1)
    if initial_state is not None:  # a state entering segment 0 is one more map in front
        identity = torch.zeros_like(packed[0, ..., head_v:])
        start = torch.cat([initial_state.to(packed.dtype), identity], -1)
        packed = torch.cat([start.unsqueeze(0), packed])
    incoming = prefix_states(packed, head_v)
    if initial_state is not None:
        incoming = incoming[1:]
    final_state = apply_map(packed[-1], incoming[-1])  # [B, HV, K, V]
    per_segment = incoming.transpose(0, 1).flatten(0, 1)  # [B·S, HV, K, V]
    return _merge(maps.output(per_segment), segments), final_state


def chunk_kda_segmented(
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
    num_segments: Optional[int] = None,
) -> tuple[Tensor, Optional[Tensor]]:
    """:func:`kda_ops.chunk_kda` (fixed-length batches) with in-device context parallelism.

    Same arguments and results as ``chunk_kda`` (no ``cu_seqlens``), plus
    ``num_segments``: segments per sequence, a divisor of T; ``None`` asks
    :func:`plan_segments`. With 1 segment this is exactly ``chunk_kda``'s op.
    """
    function = "chunk_kda_segmented"
    inputs, options = arguments.delta_rule_arguments(
        function, q, k, v, g, beta, scale=scale, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        use_gate_in_kernel=use_gate_in_kernel,
        use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, A_log=A_log, dt_bias=dt_bias,
        lower_bound=lower_bound, initial_state=initial_state,
    )  # fmt: skip
    batch, length, value_heads = v.shape[:3]
    if num_segments is None:
        num_segments = plan_segments(batch, length, value_heads, q.device)
    if not isinstance(num_segments, int) or num_segments < 1 or length % num_segments:
        ArgumentChecker(function).fail(
            ValueError, f"`num_segments` must be a positive divisor of T = {length}, got "
            f"{num_segments!r}",
        )  # fmt: skip
    if num_segments == 1:
        o, final_state = chunk_op(*inputs, initial_state, None, *options)
    else:
        o, final_state = segmented_delta_rule(inputs, options, initial_state, num_segments)
    return o, final_state if output_final_state else None
