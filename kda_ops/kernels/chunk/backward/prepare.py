"""Kernel 1 of the backward, ``chunk_bwd_prepare_kernel`` (token-parallel, grid: chunks ×
value heads): the forward's prepare program (``prepare_chunks``, its four 16-row blocks one
after another: w, qg, kd, u in the input dtype, Aqk, the chunks' total log-decay), which here
also stores G (fp32), the 64×64 inverse T by blocks (fp32: the backward applies Tᵀ, so it
needs T itself, not just T applied to the forward's right-hand sides) and, with the
l2norm, the rows' inverse norms (fp32). The forward's ``chunk_recurrence_kernel``
(``scan_saved``) then writes the chunk-start states from w, u, kd.

In training, the forward runs this kernel instead of the inference prepare
(``launch_chunk_kda_training``) and keeps what the backward needs (``saved.py``).
"""

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from kda_ops.kernels.chunk.backward.layout import Layout
from kda_ops.kernels.chunk.backward.saved import SavedForBackward, empty_saved
from kda_ops.kernels.chunk.device import CHUNK_BLOCKS
from kda_ops.kernels.chunk.launch import scan_chunks
from kda_ops.kernels.chunk.planning import single_prepare_pass
from kda_ops.kernels.chunk.prepare import prepare_chunks
from kda_ops.kernels.sizes import next_power_of_2
from kda_ops.signature import DeltaRuleInputs, DeltaRuleOptions


@triton.jit
def chunk_bwd_prepare_kernel(
    q,
    k,
    v,
    g,
    beta,
    A_log,
    dt_bias,
    cu_seqlens,
    chunk_offsets,
    scale,
    lower_bound,
    length,
    n_seqs,
    cum_g,
    w,
    u,
    qg,
    kd,
    aqk,
    solve,
    chunk_decay,
    q_norm,
    k_norm,
    unbounded,
    redo,
    H: tl.constexpr,
    HV: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    BN: tl.constexpr,
    SCALAR_GATE: tl.constexpr,
    USE_GATE: tl.constexpr,
    HAS_DT_BIAS: tl.constexpr,
    USE_LOWER_BOUND: tl.constexpr,
    SAFE_GATE: tl.constexpr,
    USE_L2NORM: tl.constexpr,
    USE_BETA_SIGMOID: tl.constexpr,
    IS_VARLEN: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    CHUNKS: tl.constexpr,
):
    """The forward's prepare (``prepare_chunks``: w, qg, kd in q's dtype, u in v's, the
    chunk's total log-decay) with what the backward also reads, for the tokens of chunk
    i_c and value head i_hv: cum_g (fp32 ``[B, T, HV, K]``, ``[B, T, HV]`` for the scalar
    gate), at ``[i_c, i_hv]`` of
    ``[n_chunks, HV, C, C]`` Aqk in q's dtype (causal part only; blocks above the
    diagonal are left unwritten) and fp32 T (likewise); with ``USE_L2NORM`` the inverse
    norms of the q and k rows (fp32 ``[B, T, HV]``) for the WY and pairs kernels, which
    read a row a block of key columns at a time; without the safe gate, at
    ``unbounded[i_c, i_hv]`` (int8) whether a row block of the chunk decays past the pairs
    kernel's dense limit in some channel. ``redo`` and ``CHUNKS``: the forward's two
    launches without the safe gate (``chunk/prepare.py``)."""
    prepare_chunks(
        q=q,
        k=k,
        v=v,
        g=g,
        beta=beta,
        A_log=A_log,
        dt_bias=dt_bias,
        cu_seqlens=cu_seqlens,
        chunk_offsets=chunk_offsets,
        scale=scale,
        lower_bound=lower_bound,
        length=length,
        n_seqs=n_seqs,
        window_first=0,
        chunk_decay=chunk_decay,
        w=w,
        u=u,
        qg=qg,
        kd=kd,
        aqk=aqk,
        unbounded=redo,
        cum_g=cum_g,
        solve=solve,
        q_norm=q_norm,
        k_norm=k_norm,
        pair_limits=unbounded,
        H=H,
        HV=HV,
        K=K,
        V=V,
        BK=BK,
        BV=BV,
        BN=BN,
        SCALAR_GATE=SCALAR_GATE,
        USE_GATE=USE_GATE,
        HAS_DT_BIAS=HAS_DT_BIAS,
        USE_LOWER_BOUND=USE_LOWER_BOUND,
        SAFE_GATE=SAFE_GATE,
        USE_L2NORM=USE_L2NORM,
        USE_BETA_SIGMOID=USE_BETA_SIGMOID,
        IS_VARLEN=IS_VARLEN,
        DOT_PRECISION=DOT_PRECISION,
        CHUNKS=CHUNKS,
        BLOCKS=CHUNK_BLOCKS,
    )


def prepare_backward(
    inputs: DeltaRuleInputs,
    cu_seqlens: Optional[Tensor],
    options: DeltaRuleOptions,
    layout: Layout,
    with_g: bool = True,
) -> SavedForBackward:
    """Kernel 1 on contiguous inputs (arguments as ``launch_chunk_kda``'s), storing G only
    ``with_g``."""
    q, k, v, g, beta, A_log, dt_bias = inputs
    scale, lower_bound = options.scale, options.lower_bound
    _, length, heads, head_k = q.shape
    value_heads = v.shape[2]
    saved = empty_saved(
        q=q, v=v, n_chunks=layout.n_chunks, scalar_gate=layout.flags["SCALAR_GATE"], with_g=with_g
    )
    # Without the safe gate the prepare kernel flags (``unbounded``) the chunks that decay
    # past the pairs kernel's dense limit; the pairs kernel then runs twice, dense and
    # dyadic chunks. As in the forward, without the safe gate a first launch takes every
    # chunk's diagonal blocks as dense dots and flags (``redo``) the chunks a second one
    # redoes dyadically.
    passes, flagged, redo = ("all",), None, None
    if not layout.flags["SAFE_GATE"]:
        flagged = saved.unbounded
    if not single_prepare_pass(layout.flags):
        passes, redo = ("bounded", "unbounded"), torch.empty_like(flagged)
    for chunks in passes:
        chunk_bwd_prepare_kernel[(layout.n_chunks, value_heads)](
            q=q,
            k=k,
            v=v,
            g=g,
            beta=beta,
            A_log=A_log,
            dt_bias=dt_bias,
            cu_seqlens=cu_seqlens,
            chunk_offsets=layout.chunk_offsets,
            scale=scale,
            lower_bound=0.0 if lower_bound is None else lower_bound,
            length=length,
            n_seqs=layout.n_seqs,
            cum_g=saved.cum_g,
            w=saved.w,
            u=saved.u,
            qg=saved.qg,
            kd=saved.kd,
            aqk=saved.aqk,
            solve=saved.solve,
            chunk_decay=saved.chunk_decay,
            q_norm=saved.q_norm,
            k_norm=saved.k_norm,
            unbounded=flagged,
            redo=redo,
            H=heads,
            HV=value_heads,
            K=head_k,
            V=v.shape[3],
            BK=layout.block_k,
            BV=layout.block_v,
            BN=next_power_of_2(layout.n_seqs),
            **layout.flags,
            CHUNKS=chunks,
            num_warps=layout.warps,
        )
    return saved


def scan_saved(
    saved: SavedForBackward,
    initial_state: Optional[Tensor],
    cu_seqlens: Optional[Tensor],
    layout: Layout,
    o: Optional[Tensor],
    final_state: Tensor,
) -> None:
    """The forward's recurrence over kernel 1's outputs: fills ``saved.chunk_states`` and
    ``final_state``, and ``o`` when given."""
    scan_chunks(
        intermediates=(saved.w, saved.u, saved.qg, saved.kd, saved.aqk, saved.chunk_decay),
        initial_state=initial_state,
        cu_seqlens=cu_seqlens,
        chunk_offsets=layout.chunk_offsets,
        o=o,
        final_state=final_state,
        chunk_states=saved.chunk_states,
        precision=layout.flags["DOT_PRECISION"],
    )
