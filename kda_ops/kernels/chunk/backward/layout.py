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
    q: Tensor,
    v: Tensor,
    g: Tensor,
    A_log: Optional[Tensor],
    dt_bias: Optional[Tensor],
    cu_seqlens: Optional[Tensor],
    lower_bound: Optional[float],
    use_qk_l2norm: bool,
    use_beta_sigmoid: bool,
) -> Layout:
    batch, length, _, head_k = q.shape
    if cu_seqlens is None:
        n_seqs, offsets = batch, None
    else:
        n_seqs, offsets = cu_seqlens.shape[0] - 1, sequence_chunk_offsets(cu_seqlens, CHUNK)
    block_k = dot_block(head_k)
    return Layout(
        n_seqs=n_seqs,
        chunk_offsets=offsets,
        n_chunks=chunk_state_rows(batch, length, None if cu_seqlens is None else n_seqs, CHUNK),
        block_k=block_k,
        block_v=dot_block(v.shape[3]),
        flags=prepare_flags(
            q, g, A_log, dt_bias, cu_seqlens, lower_bound, use_qk_l2norm, use_beta_sigmoid
        ),
        warps=prepare_warps(block_k),
    )


def key_columns(block_k: int, columns: int, device: torch.device) -> int:
    """Key columns a program of a kernel split over them (``PAIRS_COLUMNS``,
    ``GATE_COLUMNS``): ``columns`` on CUDA; off CUDA (the interpreter) 16, so that CI
    covers several column blocks."""
    return min(block_k, columns if device.type == "cuda" else 16)
