"""Kernel 2 of the backward, ``chunk_bwd_state_kernel`` (head-parallel, a program a value
block of a sequence-head, ``value_block_program``), and its launch. Walks the chunks
backwards carrying dS (fp32, K × V in registers): ``dv_new = Aqkᵀ dO + kd dS'``,
``dS = diag(Γ_C) dS' + qgᵀ dO - wᵀ dv_new``. Stores dv_new (fp32), dS' of every chunk
(q's dtype, at the chunk's global number) and dS of the first chunk (the initial state's
gradient). It never needs S itself. A head-parallel scan as the forward's recurrence, it
takes its value columns, pipeline stages and launches from the same planning
(``scan_plan``), except that where 64-column programs would not
each have an SM it takes 128 columns (``run_ahead=False``).
"""

import torch
import triton
import triton.language as tl

from kda_ops.kernels.chunk.backward.layout import Layout
from kda_ops.kernels.chunk.device import CHUNK, scan_program, sequence_span, value_block_program
from kda_ops.kernels.chunk.planning import scan_plan
from kda_ops.kernels.sizes import cdiv
from kda_ops.reference import longest_first


# A length of 1, specialized, takes more shared memory (fp32, K = 256: 253952 bytes
# against 221184) than Hopper has; the launch planning assumes an unspecialized length.
@triton.jit(do_not_specialize=["length"])
def chunk_bwd_state_kernel(
    w,
    qg,
    kd,
    aqk,
    cum_g,
    grad_o,
    grad_final_state,
    cu_seqlens,
    chunk_offsets,
    sequence_order,
    length,
    first_head,
    dv_new,
    dstates,
    grad_initial_state,
    HV: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    CHUNK: tl.constexpr,
    HAS_INITIAL_STATE: tl.constexpr,
    IS_VARLEN: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    SCALAR_GATE: tl.constexpr,
):
    """Reverse scan over the chunks of sequence i_n, value head i_hv, value columns of
    block i_v. Writes dv_new (fp32 ``[B, T, HV, V]``), dstates (``[n_chunks, HV, K, V]``
    in its buffer's dtype: the gradient of the state leaving each chunk) and, with
    ``HAS_INITIAL_STATE``, the initial state's gradient (fp32 ``[N, HV, K, V]``)."""
    i_v, i_rank = value_block_program(V, BV)
    i_n, i_hv, i_nh = scan_program(first_head + i_rank, sequence_order, HV, IS_VARLEN)
    bos, seq_len, first_chunk = sequence_span(
        i_n=i_n,
        cu_seqlens=cu_seqlens,
        chunk_offsets=chunk_offsets,
        length=length,
        IS_VARLEN=IS_VARLEN,
    )
    offs_k = tl.arange(0, BK)
    offs_v = i_v * BV + tl.arange(0, BV)
    mask_k = offs_k < K
    mask_v = offs_v < V
    dot_dtype = qg.dtype.element_ty

    tile_offsets = offs_k[:, None] * V + offs_v[None, :]  # within one [K, V] state
    state_mask = mask_k[:, None] & mask_v[None, :]
    d_state = tl.load(
        grad_final_state + i_nh.to(tl.int64) * K * V + tile_offsets, mask=state_mask, other=0.0
    )

    rows = tl.arange(0, CHUNK)
    causal_t = rows[:, None] <= rows[None, :]  # Aqkᵀ's causal part
    n_chunks = tl.cdiv(seq_len, CHUNK)
    for step in range(0, n_chunks):
        c = n_chunks - 1 - step
        tokens = bos + c * CHUNK + rows
        in_seq = c * CHUNK + rows < seq_len
        token_offsets = (tokens * HV + i_hv)[:, None]
        mask_rows_k = in_seq[:, None] & mask_k[None, :]
        mask_rows_v = in_seq[:, None] & mask_v[None, :]
        chunk_id = (first_chunk + c).to(tl.int64) * HV + i_hv
        tl.store(
            dstates + chunk_id * K * V + tile_offsets,
            d_state.to(dstates.dtype.element_ty),
            mask=state_mask,
        )
        b_w = tl.load(w + token_offsets * K + offs_k[None, :], mask=mask_rows_k, other=0.0)
        b_qg = tl.load(qg + token_offsets * K + offs_k[None, :], mask=mask_rows_k, other=0.0)
        b_kd = tl.load(kd + token_offsets * K + offs_k[None, :], mask=mask_rows_k, other=0.0)
        b_do = tl.load(
            grad_o + token_offsets * V + offs_v[None, :], mask=mask_rows_v, other=0.0
        ).to(dot_dtype)
        # Aqkᵀ loaded as such (tile element (j, i) from Aqk's row i), not transposed after
        # the load: with a bf16 Aqk, ``tl.trans`` of the loaded tile read shared memory out
        # of range (compute-sanitizer, Triton 3.6).
        b_aqk_t = tl.load(
            aqk + (chunk_id * CHUNK + rows)[None, :] * CHUNK + rows[:, None],
            mask=causal_t,
            other=0.0,
        )
        last = tl.minimum(seq_len - c * CHUNK, CHUNK) - 1
        last_row = (bos + c * CHUNK + last) * HV + i_hv
        if SCALAR_GATE:  # G one a row
            decay_last = tl.exp(tl.load(cum_g + last_row) + tl.zeros([BK], dtype=tl.float32))
        else:
            decay_last = tl.exp(tl.load(cum_g + last_row * K + offs_k, mask=mask_k, other=0.0))

        b_dv = tl.dot(b_aqk_t.to(dot_dtype), b_do, input_precision=DOT_PRECISION)
        b_dv += tl.dot(b_kd.to(dot_dtype), d_state.to(dot_dtype), input_precision=DOT_PRECISION)
        tl.store(dv_new + token_offsets * V + offs_v[None, :], b_dv, mask=mask_rows_v)
        d_state = d_state * decay_last[:, None]
        d_state += tl.dot(tl.trans(b_qg.to(dot_dtype)), b_do, input_precision=DOT_PRECISION)
        d_state -= tl.dot(
            tl.trans(b_w.to(dot_dtype)), b_dv.to(dot_dtype), input_precision=DOT_PRECISION
        )
    if HAS_INITIAL_STATE:
        tl.store(
            grad_initial_state + i_nh.to(tl.int64) * K * V + tile_offsets, d_state, mask=state_mask
        )


# Warps of the dS scan: 8, which at K = 128 do not spill at 32 value columns and spill
# less than 4 warps at 64 and 128.
STATE_WARPS = 8


def launch_state_scan(
    q,
    w,
    qg,
    kd,
    aqk,
    cum_g,
    grad_o,
    grad_final_state,
    cu_seqlens,
    length,
    layout: Layout,
    dv_new,
    dstates,
    d_initial,
) -> None:
    """``chunk_bwd_state_kernel`` over every sequence and value head: writes ``dv_new``,
    ``dstates`` and, given ``d_initial``, the initial state's gradient; packed sequences
    longest first (``longest_first``)."""
    head_k = q.shape[3]
    value_heads, head_v = dv_new.shape[2], dv_new.shape[3]
    n_seqs, offsets = layout.n_seqs, layout.chunk_offsets
    block_k, block_v, precision = layout.block_k, layout.block_v, layout.flags["DOT_PRECISION"]
    # Its loop loads the forward recurrence's five tiles a chunk (dO for u); fp32 inputs
    # (the accuracy path) are not pipelined: their tiles are twice as large.
    pipelined = q.dtype != torch.float32
    launches = scan_plan(
        block_k=block_k,
        block_v=block_v,
        sequence_heads=n_seqs * value_heads,
        device=q.device,
        itemsize=q.element_size(),
        aqk_itemsize=aqk.element_size(),
        store_output=True,
        warps=STATE_WARPS,
        pipelined=pipelined,
        run_ahead=False,
    )
    order = None if cu_seqlens is None else longest_first(cu_seqlens)
    for first_head, heads, columns, stages in launches:
        chunk_bwd_state_kernel[(cdiv(head_v, columns) * heads,)](
            w=w,
            qg=qg,
            kd=kd,
            aqk=aqk,
            cum_g=cum_g,
            grad_o=grad_o,
            grad_final_state=grad_final_state,
            cu_seqlens=cu_seqlens,
            chunk_offsets=offsets,
            sequence_order=order,
            length=length,
            first_head=first_head,
            dv_new=dv_new,
            dstates=dstates,
            grad_initial_state=d_initial,
            HV=value_heads,
            K=head_k,
            V=head_v,
            BK=block_k,
            BV=columns,
            CHUNK=CHUNK,
            HAS_INITIAL_STATE=d_initial is not None,
            IS_VARLEN=cu_seqlens is not None,
            DOT_PRECISION=precision,
            SCALAR_GATE=layout.flags["SCALAR_GATE"],
            num_warps=STATE_WARPS,
            num_stages=stages,
        )
