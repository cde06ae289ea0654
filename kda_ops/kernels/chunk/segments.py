"""The recurrence of a long sequence in segments: in-device context parallelism for
sequences too long and too few to fill the SMs with one serial scan each.

``recurrence_segments`` picks how many segments; ``segmented_recurrence`` runs them:
each segment's affine map from zero, the maps composed for each segment's exact incoming
state, then every segment again from that state."""

from typing import Optional

import torch
from torch import Tensor

from kda_ops.kernels.chunk.device import CHUNK
from kda_ops.kernels.chunk.planning import SCAN_COLUMN_SPLITS
from kda_ops.kernels.chunk.recurrence import launch_recurrence
from kda_ops.kernels.sizes import cdiv, processors
from kda_ops.reference import chunk_offsets as sequence_chunk_offsets

MIN_SEGMENT_TOKENS = 8192


def recurrence_segments(
    batch: int,
    length: int,
    value_heads: int,
    head_v: int,
    cu_seqlens: Optional[Tensor],
    device: torch.device,
) -> int:
    """Segments per sequence for the chunk recurrence (:func:`segment_count` on
    ``device``'s SMs): fixed length on CUDA only, else 1."""
    if cu_seqlens is not None or device.type != "cuda":
        return 1
    return segment_count(
        batch=batch, length=length, value_heads=value_heads, head_v=head_v, sms=processors(device)
    )


def segment_count(batch: int, length: int, value_heads: int, head_v: int, sms: int) -> int:
    """1 (one serial scan per sequence) unless the sequences are long and so few that,
    with their value columns split as narrowly as a scan splits them
    (``SCAN_COLUMN_SPLITS[0]``), they leave at least half the SMs idle; then the largest
    power of two ``S`` with ``batch * value_heads * S`` at most the SM count and segments
    of at least ``MIN_SEGMENT_TOKENS`` (a multiple of 64). Where split value columns
    nearly fill the SMs, segments only add the maps pass, and one pass was faster; with
    half the SMs idle segments were (``benchmarks/results/long_sequence_variants_*_h100.json``,
    docs/benchmarks.md)."""
    if 2 * batch * value_heads * cdiv(head_v, SCAN_COLUMN_SPLITS[0]) > sms:
        return 1
    segments = 1
    while (
        batch * value_heads * segments * 2 <= sms
        and length % (CHUNK * segments * 2) == 0
        and length // (segments * 2) >= MIN_SEGMENT_TOKENS
    ):
        segments *= 2
    return segments


def segmented_recurrence(
    intermediates, initial_state, batch, length, segments, o, final_state, chunk_states, precision
):
    """In-device context parallelism for the recurrence (the prepare kernel's outputs are
    per chunk, so segments share them). Each sequence is cut into ``segments`` runs of
    whole chunks, run as packed sequences:

    1. every segment from zero with ``K`` transition columns next to its values, giving its
       affine map ``S_end = M S_start + E`` (``[E | M]``, the state ``[K, V + K]``);
    2. the maps composed in order (``segments`` small ``[K, K] @ [K, V]`` steps per head)
       for each segment's exact incoming state;
    3. every segment again from that state, writing outputs, chunk states and final
       states.
    """
    u = intermediates[1]
    value_heads, head_v = u.shape[2], u.shape[3]
    head_k = intermediates[0].shape[3]
    device = u.device
    segment_length = length // segments
    cuts = torch.arange(0, batch * length + 1, segment_length, device=device, dtype=torch.int32)
    chunk_offsets = sequence_chunk_offsets(cuts, intermediates[4].shape[-1])  # aqk's chunk
    maps = torch.empty(
        batch * segments, value_heads, head_k, head_v + head_k, device=device, dtype=torch.float32
    )
    launch_recurrence(
        intermediates=intermediates,
        initial_state=None,
        cu_seqlens=cuts,
        chunk_offsets=chunk_offsets,
        length=segment_length,
        o=None,
        final_state=maps,
        chunk_states=None,
        precision=precision,
    )
    maps = maps.unflatten(0, (batch, segments))
    ends, transitions = maps[..., :head_v], maps[..., head_v:]
    state = torch.zeros_like(final_state) if initial_state is None else initial_state
    starts = []
    for segment in range(segments):
        starts.append(state)
        state = transitions[:, segment] @ state + ends[:, segment]
    starts = torch.stack(starts, 1).flatten(0, 1)
    segment_finals = torch.empty_like(starts)
    launch_recurrence(
        intermediates=intermediates,
        initial_state=starts,
        cu_seqlens=cuts,
        chunk_offsets=chunk_offsets,
        length=segment_length,
        o=o,
        final_state=segment_finals,
        chunk_states=chunk_states,
        precision=precision,
    )
    final_state.copy_(segment_finals.unflatten(0, (batch, segments))[:, -1])
