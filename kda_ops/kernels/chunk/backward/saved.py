"""What the training forward keeps for the backward: ``SavedForBackward``, the outputs of
the backward's prepare kernel (kernel 1) and the chunk states, and their allocation.
``ROWS`` names the fields the backward can rebuild (``recompute.py``), which the
training forward keeps only with ``keep_rows``.
"""

from typing import NamedTuple, Optional

import torch
from torch import Tensor

from kda_ops.kernels.chunk.device import CHUNK


class SavedForBackward(NamedTuple):
    """What the backward's prepare kernel (kernel 1) leaves for the rest of the backward;
    the training forward (``launch_chunk_kda_training``) keeps it, or all but its last
    ``len(ROWS)`` fields, so that the backward does not run kernel 1 again. With R chunk
    rows (``chunk_state_rows``): Aqk and T fp32 ``[R, HV, 64, 64]``; the chunks' total
    log-decay fp32 ``[R, HV, K]``; the inverse norms of the q and k rows fp32 ``[B, T,
    HV]``; without the safe gate the int8 ``[R, HV]`` flags of the chunks the pairs kernel
    takes dyadically (unused with it); the state entering every chunk ``[R, HV, K, V]`` in
    q's dtype (written by the forward's recurrence, or by the backward's own when kernel 1
    ran there); then the rows: G fp32 ``[B, T, HV, K]`` (``[B, T, HV]`` for the scalar
    gate; ``None``
    when kernel 1 did not store it), w, qg, kd ``[B, T, HV, K]`` in q's dtype and u ``[B,
    T, HV, V]`` in v's, which ``chunk_bwd_recompute_kernel`` rebuilds from the rest and the
    inputs (all but u, which the kept chunk states make unnecessary)."""

    aqk: Tensor
    solve: Tensor
    chunk_decay: Tensor
    q_norm: Tensor
    k_norm: Tensor
    unbounded: Tensor
    chunk_states: Tensor
    cum_g: Optional[Tensor]
    w: Tensor
    u: Tensor
    qg: Tensor
    kd: Tensor


ROWS = ("cum_g", "w", "u", "qg", "kd")  # SavedForBackward's last fields


def empty_saved(
    q: Tensor, v: Tensor, n_chunks: int, scalar_gate: bool, with_g: bool = True
) -> SavedForBackward:
    """Uninitialised ``SavedForBackward`` for q ``[B, T, H, K]``, v ``[B, T, HV, V]`` and
    ``n_chunks`` chunk rows (also the training op's fake outputs), G only ``with_g``, one
    a row for a ``scalar_gate``.
    Separate allocations: the training op returns them, and an op's outputs may not alias
    one another. The flags exist with the safe gate too (unused), so that the shapes do not
    depend on it."""
    batch, length, _, head_k = q.shape
    value_heads, head_v = v.shape[2], v.shape[3]
    tokens = (batch, length, value_heads)
    f32 = dict(dtype=torch.float32)
    return SavedForBackward(
        # Aqk in the dot dtype: the recurrences take it in that dtype (the same rounding,
        # once, as from fp32), and a stage of their pipelines holds a tile of it.
        aqk=q.new_empty(n_chunks, value_heads, CHUNK, CHUNK),
        solve=q.new_empty(n_chunks, value_heads, CHUNK, CHUNK, **f32),
        chunk_decay=q.new_empty(n_chunks, value_heads, head_k, **f32),
        q_norm=q.new_empty(*tokens, **f32),
        k_norm=q.new_empty(*tokens, **f32),
        unbounded=q.new_empty(n_chunks, value_heads, dtype=torch.int8),
        # In the dot dtype (fp32 inputs keep fp32): every backward product takes the
        # states and their gradients in it anyway (only Γ_C's term Σ S ⊙ dS' reads them
        # rounded); in fp32 the two are 2 × 0.54 GB at B = 1, T = 8192, HV = 64, K = V = 128.
        chunk_states=q.new_empty(n_chunks, value_heads, head_k, head_v),
        cum_g=q.new_empty(*tokens, *(() if scalar_gate else (head_k,)), **f32) if with_g else None,
        w=q.new_empty(*tokens, head_k),
        u=v.new_empty(*tokens, head_v),
        qg=q.new_empty(*tokens, head_k),
        kd=q.new_empty(*tokens, head_k),
    )
