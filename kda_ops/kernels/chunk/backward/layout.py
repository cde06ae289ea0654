"""The sizes and flags every kernel launch of the backward shares (``Layout``), and the
key columns a program of a kernel split over them takes.
"""

from typing import NamedTuple, Optional

import torch
from torch import Tensor

from kda_ops.kernels.chunk.device import CHUNK
from kda_ops.kernels.chunk.planning import dot_block, prepare_flags, prepare_warps
from kda_ops.reference import chunk_offsets as sequence_chunk_offsets
from kda_ops.reference import chunk_state_rows
from kda_ops.signature import DeltaRuleInputs, DeltaRuleOptions


class Layout(NamedTuple):
    """Sizes and flags every kernel of the backward is launched with."""

    n_seqs: int
    chunk_offsets: Optional[Tensor]
    n_chunks: int
    block_k: int
    block_v: int
    flags: dict[str, object]
    warps: int


def plan_layout(
    inputs: DeltaRuleInputs, cu_seqlens: Optional[Tensor], options: DeltaRuleOptions
) -> Layout:
    q, v = inputs.q, inputs.v
    batch, length, _, head_k = q.shape
    if cu_seqlens is None:
        n_seqs, offsets = batch, None
    else:
        n_seqs, offsets = cu_seqlens.shape[0] - 1, sequence_chunk_offsets(cu_seqlens, CHUNK)
    block_k = dot_block(head_k)
    return Layout(
        n_seqs=n_seqs,
        chunk_offsets=offsets,
        n_chunks=chunk_state_rows(
            batch=batch,
            length=length,
            n_seqs=None if cu_seqlens is None else n_seqs,
            chunk_size=CHUNK,
        ),
        block_k=block_k,
        block_v=dot_block(v.shape[3]),
        flags=prepare_flags(inputs, cu_seqlens, options),
        warps=prepare_warps(block_k),
    )


def key_columns(block_k: int, columns: int, device: torch.device) -> int:
    """Key columns a program of a kernel split over them (``PAIRS_COLUMNS``,
    ``GATE_COLUMNS``): ``columns`` on CUDA; off CUDA (the interpreter) 16, so that CI
    covers several column blocks."""
    return min(block_k, columns if device.type == "cuda" else 16)
