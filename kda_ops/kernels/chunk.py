"""Chunkwise KDA / Gated DeltaNet forward in two kernels, as FlashKDA splits it.

1. ``chunk_prepare_kernel``, token-parallel (grid: chunks × value heads). Per chunk of
   C = 64 tokens: gate activation and in-chunk cumulative log-decay G (stored, fp32),
   l2norm of q and k, beta sigmoid, the UT/WY solve by 16-row blocks, and what the
   recurrence needs: ``w = T β (K ⊙ Γ)``, ``u = T β V``, ``qg = scale Q ⊙ Γ``,
   ``kd = K ⊙ Γ_C / Γ`` and ``Aqk = tril((Q ⊙ Γ)(K / Γ)ᵀ)``, where Γ = exp(G) and
   ``T = (I + tril(β (K ⊙ Γ)(K / Γ)ᵀ, -1))⁻¹``.
2. ``chunk_recurrence_kernel``, head-parallel (grid: value blocks × sequences × heads).
   Walks the chunks with the fp32 state S in registers: ``v_new = u - w S``,
   ``o = qg S + Aqk v_new``, ``S = diag(Γ_C) S + kdᵀ v_new``. Chunk states are written
   to memory only when asked (``STORE_CHUNK_STATES``: the state at each chunk start, what
   a prefix cache stores, ``[n_chunks, HV, K, V]`` fp32 at the chunk's global number).

Decay ratios exp(G_i - G_j) are formed against a reference row p with j <= p <= i, so
each factor is at most 1, except inside a 16-row diagonal block. There, with the safe
gate (``-5 <= lower_bound < 0``) and bf16 / fp32 inputs, one reference at the block start
keeps every factor below e^80 (inside fp32 and bf16 range) and the block is a dense dot;
any other gate, and fp16, takes the exact token-by-token path for diagonal blocks.

Varlen needs no host sync: chunks are numbered per sequence on the device
(``chunk_offsets``) and the grid is the upper bound ``T // C + N``; programs past the
last chunk exit.

Both kernels order their parameters inputs → scalars → outputs and write every output
element the next kernel reads (``Aqk`` above the diagonal is masked on load, never
zero-filled), so they run as TensorRT AOT plugins (``lowering/tensorrt.py``).
"""

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from kda_ops.reference import chunk_offsets as sequence_chunk_offsets
from kda_ops.reference import chunk_state_rows

CHUNK = 64
BLOCK = 16  # rows of a diagonal block of the UT/WY solve
L2NORM_EPS = tl.constexpr(1e-6)
SAFE_GATE_LOWER_BOUND = -5.0


@triton.jit
def _locate_chunk(i_c, cu_seqlens, chunk_offsets, n_seqs, length,
                  BN: tl.constexpr, IS_VARLEN: tl.constexpr):  # fmt: skip
    """(first token of chunk i_c, tokens left in its sequence from there); none left for
    the programs of the varlen grid's upper bound that have no chunk."""
    if IS_VARLEN:
        seqs = tl.arange(0, BN)
        ends = tl.load(chunk_offsets + 1 + seqs, mask=seqs < n_seqs, other=2**31 - 1)
        seq = tl.sum((ends <= i_c).to(tl.int32))
        valid = seq < n_seqs
        first_chunk = tl.load(chunk_offsets + seq, mask=valid, other=0)
        bos = tl.load(cu_seqlens + seq, mask=valid, other=0).to(tl.int64)
        eos = tl.load(cu_seqlens + seq + 1, mask=valid, other=0).to(tl.int64)
        start = bos + (i_c - first_chunk).to(tl.int64) * 64
        return start, tl.where(valid, eos - start, 0)
    n_chunks = tl.cdiv(length, 64)
    seq = i_c // n_chunks
    start = seq.to(tl.int64) * length + (i_c % n_chunks).to(tl.int64) * 64
    return start, (seq + 1).to(tl.int64) * length - start


@triton.jit
def _inverse_unit_lower(a, BLOCK: tl.constexpr):
    """(I + a)⁻¹ for a strictly lower-triangular [BLOCK, BLOCK] a, by forward
    substitution: row i of the inverse is e_i - a[i, :] @ inverse."""
    rows = tl.arange(0, BLOCK)
    inverse = (rows[:, None] == rows[None, :]).to(tl.float32)
    for i in range(1, BLOCK):
        a_row = tl.sum(tl.where(rows[:, None] == i, a, 0.0), axis=0)
        update = tl.sum(a_row[:, None] * inverse, axis=0)
        inverse = tl.where(rows[:, None] == i, inverse - update[None, :], inverse)
    return inverse


@triton.jit
def chunk_prepare_kernel(
    q, k, v, g, beta, A_log, dt_bias, cu_seqlens, chunk_offsets,
    scale, lower_bound, length, n_seqs,
    cum_g, w, u, qg, kd, aqk,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, BN: tl.constexpr, BLOCK: tl.constexpr,
    SCALAR_GATE: tl.constexpr, USE_GATE: tl.constexpr, HAS_DT_BIAS: tl.constexpr,
    USE_LOWER_BOUND: tl.constexpr, SAFE_GATE: tl.constexpr, USE_L2NORM: tl.constexpr,
    USE_BETA_SIGMOID: tl.constexpr, IS_VARLEN: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    i_c, i_hv = tl.program_id(0), tl.program_id(1)
    i_h = i_hv // (HV // H)
    start, remaining = _locate_chunk(i_c, cu_seqlens, chunk_offsets, n_seqs, length,
                                     BN, IS_VARLEN)  # fmt: skip
    if remaining <= 0:
        return
    offs_k = tl.arange(0, BK)
    offs_v = tl.arange(0, BV)
    mask_k = offs_k < K
    mask_v = offs_v < V
    dot_dtype = q.dtype.element_ty

    # --- Gate activation and in-chunk cumulative log-decay of all 64 rows -> cum_g.
    rows = tl.arange(0, 64)
    in_seq = rows < remaining
    tokens = start + rows
    mask_rows_k = in_seq[:, None] & mask_k[None, :]
    if SCALAR_GATE:
        b_g = tl.load(g + tokens * HV + i_hv, mask=in_seq, other=0.0).to(tl.float32)[:, None]
        b_g = b_g + tl.zeros([64, BK], dtype=tl.float32)
    else:
        b_g = tl.load(g + (tokens * HV + i_hv)[:, None] * K + offs_k[None, :], mask=mask_rows_k,
                      other=0.0).to(tl.float32)  # fmt: skip
    if USE_GATE:
        rate = tl.exp(tl.load(A_log + i_hv).to(tl.float32))
        if HAS_DT_BIAS:
            if SCALAR_GATE:
                b_g += tl.load(dt_bias + i_hv).to(tl.float32)
            else:
                b_g += tl.load(dt_bias + i_hv * K + offs_k, mask=mask_k, other=0.0)[None, :]
        if USE_LOWER_BOUND:
            b_g = lower_bound * tl.sigmoid(rate * b_g)
        else:
            b_g = -rate * (tl.maximum(b_g, 0.0) + tl.log(1.0 + tl.exp(-tl.abs(b_g))))
    b_g = tl.where(mask_rows_k, b_g, 0.0)  # padding rows decay nothing
    b_cum = tl.cumsum(b_g, axis=0)
    g_offsets = (tokens * HV + i_hv)[:, None] * K + offs_k[None, :]
    tl.store(cum_g + g_offsets, b_cum, mask=mask_rows_k)
    last = tl.minimum(remaining, 64) - 1
    cum_last = tl.sum(tl.where(rows[:, None] == last, b_cum, 0.0), axis=0)
    tl.debug_barrier()  # cum_g rows are re-read below by other threads of this program

    # --- Row blocks of 16: A and Aqk rows, then the block forward substitution.
    sub = tl.arange(0, BLOCK)
    for i_b in range(0, 64 // BLOCK):
        r_tok = start + i_b * BLOCK + sub
        r_in = i_b * BLOCK + sub < remaining
        r_mask_k = r_in[:, None] & mask_k[None, :]
        qk_offsets = (r_tok * H + i_h)[:, None] * K + offs_k[None, :]
        r_q = tl.load(q + qk_offsets, mask=r_mask_k, other=0.0).to(tl.float32)
        r_k = tl.load(k + qk_offsets, mask=r_mask_k, other=0.0).to(tl.float32)
        if USE_L2NORM:
            r_q = r_q / tl.sqrt(tl.sum(r_q * r_q, axis=1) + L2NORM_EPS)[:, None]
            r_k = r_k / tl.sqrt(tl.sum(r_k * r_k, axis=1) + L2NORM_EPS)[:, None]
        r_beta = tl.load(beta + r_tok * HV + i_hv, mask=r_in, other=0.0).to(tl.float32)
        if USE_BETA_SIGMOID:
            r_beta = tl.where(r_in, tl.sigmoid(r_beta), 0.0)
        r_v = tl.load(v + (r_tok * HV + i_hv)[:, None] * V + offs_v[None, :],
                      mask=r_in[:, None] & mask_v[None, :], other=0.0).to(tl.float32)  # fmt: skip
        r_cum = tl.load(cum_g + (r_tok * HV + i_hv)[:, None] * K + offs_k[None, :],
                        mask=r_mask_k, other=0.0)  # fmt: skip
        r_cum = tl.where(r_in[:, None], r_cum, cum_last[None, :])  # padding decays nothing
        # Reference: the first row of this block. Factors for earlier columns are <= 1.
        ref = tl.sum(tl.where(sub[:, None] == 0, r_cum, 0.0), axis=0)
        r_k_ref = (r_k * tl.exp(r_cum - ref[None, :])).to(dot_dtype)
        r_q_ref = (r_q * tl.exp(r_cum - ref[None, :])).to(dot_dtype)
        rhs_w = r_beta[:, None] * r_k * tl.exp(r_cum)
        rhs_u = r_beta[:, None] * r_v

        for j_b in range(0, i_b):
            c_tok = start + j_b * BLOCK + sub
            c_in = j_b * BLOCK + sub < remaining
            c_mask_k = c_in[:, None] & mask_k[None, :]
            c_offsets = (c_tok * H + i_h)[:, None] * K + offs_k[None, :]
            c_k = tl.load(k + c_offsets, mask=c_mask_k, other=0.0).to(tl.float32)
            if USE_L2NORM:
                c_k = c_k / tl.sqrt(tl.sum(c_k * c_k, axis=1) + L2NORM_EPS)[:, None]
            c_cum = tl.load(cum_g + (c_tok * HV + i_hv)[:, None] * K + offs_k[None, :],
                            mask=c_mask_k, other=0.0)  # fmt: skip
            c_cum = tl.where(c_in[:, None], c_cum, cum_last[None, :])
            c_k_ref = tl.trans((c_k * tl.exp(ref[None, :] - c_cum)).to(dot_dtype))
            a_kk = r_beta[:, None] * tl.dot(r_k_ref, c_k_ref, input_precision=DOT_PRECISION)
            a_qk = tl.dot(r_q_ref, c_k_ref, input_precision=DOT_PRECISION) * scale
            tl.store(aqk + ((i_c * HV + i_hv) * 64 + i_b * BLOCK + sub)[:, None] * 64
                     + j_b * BLOCK + sub[None, :], a_qk.to(aqk.dtype.element_ty))  # fmt: skip
            # Solved rows of earlier blocks (written by this program above).
            solved = (c_tok * HV + i_hv)[:, None]
            c_w = tl.load(w + solved * K + offs_k[None, :], mask=c_mask_k, other=0.0)
            c_u = tl.load(u + solved * V + offs_v[None, :], mask=c_in[:, None] & mask_v[None, :],
                          other=0.0)  # fmt: skip
            a_kk = a_kk.to(dot_dtype)
            rhs_w -= tl.dot(a_kk, c_w.to(dot_dtype), input_precision=DOT_PRECISION)
            rhs_u -= tl.dot(a_kk, c_u.to(dot_dtype), input_precision=DOT_PRECISION)

        causal = sub[:, None] >= sub[None, :]
        if SAFE_GATE:  # every in-block factor stays below e^80
            d_k_ref = tl.trans((r_k * tl.exp(ref[None, :] - r_cum)).to(dot_dtype))
            d_kk = tl.dot(r_k_ref, d_k_ref, input_precision=DOT_PRECISION)
            d_qk = tl.dot(r_q_ref, d_k_ref, input_precision=DOT_PRECISION)
        else:  # exact pairs, one column at a time
            d_kk = tl.zeros([BLOCK, BLOCK], dtype=tl.float32)
            d_qk = tl.zeros([BLOCK, BLOCK], dtype=tl.float32)
            for j in range(0, BLOCK):
                pick = sub[:, None] == j
                col_k = tl.sum(tl.where(pick, r_k, 0.0), axis=0)
                col_cum = tl.sum(tl.where(pick, r_cum, 0.0), axis=0)
                pair = tl.where(sub[:, None] >= j, r_cum - col_cum[None, :], -float("inf"))
                decayed = col_k[None, :] * tl.exp(pair)
                d_kk = tl.where(sub[None, :] == j, tl.sum(r_k * decayed, axis=1)[:, None], d_kk)
                d_qk = tl.where(sub[None, :] == j, tl.sum(r_q * decayed, axis=1)[:, None], d_qk)
        d_kk = tl.where(sub[:, None] > sub[None, :], r_beta[:, None] * d_kk, 0.0)
        d_qk = tl.where(causal, d_qk * scale, 0.0)
        tl.store(aqk + ((i_c * HV + i_hv) * 64 + i_b * BLOCK + sub)[:, None] * 64
                 + i_b * BLOCK + sub[None, :], d_qk.to(aqk.dtype.element_ty))  # fmt: skip
        inverse = _inverse_unit_lower(d_kk, BLOCK)
        r_w = tl.dot(inverse, rhs_w, input_precision="ieee")
        r_u = tl.dot(inverse, rhs_u, input_precision="ieee")
        out = (r_tok * HV + i_hv)[:, None]
        tl.store(w + out * K + offs_k[None, :], r_w.to(w.dtype.element_ty), mask=r_mask_k)
        tl.store(u + out * V + offs_v[None, :], r_u.to(u.dtype.element_ty),
                 mask=r_in[:, None] & mask_v[None, :])  # fmt: skip
        r_qg = r_q * scale * tl.exp(r_cum)
        r_kd = r_k * tl.exp(cum_last[None, :] - r_cum)
        tl.store(qg + out * K + offs_k[None, :], r_qg.to(qg.dtype.element_ty), mask=r_mask_k)
        tl.store(kd + out * K + offs_k[None, :], r_kd.to(kd.dtype.element_ty), mask=r_mask_k)
        tl.debug_barrier()  # w, u rows of this block are read by the next blocks


@triton.jit
def chunk_recurrence_kernel(
    w, u, qg, kd, aqk, cum_g, initial_state, cu_seqlens, chunk_offsets, length,
    o, final_state, chunk_states,
    HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    HAS_INITIAL_STATE: tl.constexpr, IS_VARLEN: tl.constexpr, DOT_PRECISION: tl.constexpr,
    STORE_CHUNK_STATES: tl.constexpr,
):  # fmt: skip
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_hv = i_nh // HV, i_nh % HV
    if IS_VARLEN:
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        seq_len = tl.load(cu_seqlens + i_n + 1).to(tl.int64) - bos
        first_chunk = tl.load(chunk_offsets + i_n)
    else:
        bos = i_n.to(tl.int64) * length
        seq_len = length
        first_chunk = i_n * tl.cdiv(length, 64)
    offs_k = tl.arange(0, BK)
    offs_v = i_v * BV + tl.arange(0, BV)
    mask_k = offs_k < K
    mask_v = offs_v < V
    dot_dtype = qg.dtype.element_ty

    tile_offsets = offs_k[:, None] * V + offs_v[None, :]  # within one [K, V] state
    state_offsets = i_nh.to(tl.int64) * K * V + tile_offsets
    state_mask = mask_k[:, None] & mask_v[None, :]
    state = tl.zeros([BK, BV], dtype=tl.float32)
    if HAS_INITIAL_STATE:
        state = tl.load(initial_state + state_offsets, mask=state_mask, other=0.0)

    rows = tl.arange(0, 64)
    for c in tl.range(0, tl.cdiv(seq_len, 64), num_stages=2):
        tokens = bos + c * 64 + rows
        in_seq = c * 64 + rows < seq_len
        token_offsets = (tokens * HV + i_hv)[:, None]
        mask_rows_k = in_seq[:, None] & mask_k[None, :]
        mask_rows_v = in_seq[:, None] & mask_v[None, :]
        b_w = tl.load(w + token_offsets * K + offs_k[None, :], mask=mask_rows_k, other=0.0)
        b_qg = tl.load(qg + token_offsets * K + offs_k[None, :], mask=mask_rows_k, other=0.0)
        b_kd = tl.load(kd + token_offsets * K + offs_k[None, :], mask=mask_rows_k, other=0.0)
        b_u = tl.load(u + token_offsets * V + offs_v[None, :], mask=mask_rows_v, other=0.0)
        chunk_id = (first_chunk + c).to(tl.int64) * HV + i_hv
        if STORE_CHUNK_STATES:  # the state entering this chunk
            tl.store(chunk_states + chunk_id * K * V + tile_offsets, state, mask=state_mask)
        b_aqk = tl.load(aqk + (chunk_id * 64 + rows)[:, None] * 64 + rows[None, :])
        # Blocks above the diagonal are never written (no zero-filled buffer needed).
        b_aqk = tl.where(rows[:, None] >= rows[None, :], b_aqk, 0.0)
        last = tl.minimum(seq_len - c * 64, 64) - 1
        decay_last = tl.exp(tl.load(cum_g + ((bos + c * 64 + last) * HV + i_hv) * K + offs_k,
                                    mask=mask_k, other=0.0))  # fmt: skip

        b_state = state.to(dot_dtype)
        v_new = b_u.to(tl.float32) - tl.dot(b_w.to(dot_dtype), b_state,
                                            input_precision=DOT_PRECISION)  # fmt: skip
        v_new = tl.where(mask_rows_v, v_new, 0.0).to(dot_dtype)
        b_o = tl.dot(b_qg.to(dot_dtype), b_state, input_precision=DOT_PRECISION)
        b_o += tl.dot(b_aqk.to(dot_dtype), v_new, input_precision=DOT_PRECISION)
        tl.store(o + token_offsets * V + offs_v[None, :], b_o.to(o.dtype.element_ty),
                 mask=mask_rows_v)  # fmt: skip
        state = state * decay_last[:, None] + tl.dot(
            tl.trans(b_kd.to(dot_dtype)), v_new, input_precision=DOT_PRECISION
        )
    tl.store(final_state + state_offsets, state, mask=state_mask)


def launch_chunk_kda(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    A_log: Optional[Tensor],
    dt_bias: Optional[Tensor],
    initial_state: Optional[Tensor],
    cu_seqlens: Optional[Tensor],
    scale: float,
    lower_bound: Optional[float],
    use_qk_l2norm: bool,
    use_beta_sigmoid: bool,
    chunk_states: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor]:
    """Chunked forward; returns o ``[B, T, HV, V]`` (v's dtype) and the fp32 final state.
    Shapes as in ``kda_ops.delta_rule``; inputs in one dtype of fp16 / bf16 / fp32.

    ``chunk_states``: optional contiguous fp32 output ``[R, HV, K, V]`` with
    ``R = chunk_state_rows(B, T, N or None)``, filled with the state at the start of every
    chunk (chunk c of sequence n at row ``n * ceil(T / 64) + c``, or
    ``chunk_offsets(cu_seqlens)[n] + c`` with packed sequences, whose rows past the last
    chunk are left untouched)."""
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    batch, length, heads, head_k = q.shape
    value_heads, head_v = v.shape[2], v.shape[3]
    if cu_seqlens is None:
        n_seqs = batch
        chunk_offsets = None
    else:
        n_seqs = cu_seqlens.shape[0] - 1
        chunk_offsets = sequence_chunk_offsets(cu_seqlens, CHUNK)
    # An upper bound with packed sequences (no host sync); programs past the end exit.
    n_chunks = chunk_state_rows(batch, length, None if cu_seqlens is None else n_seqs, CHUNK)
    # tl.dot needs every dim >= 16; masks cover the padding.
    block_k = max(16, triton.next_power_of_2(head_k))
    block_v = max(16, triton.next_power_of_2(head_v))
    # fp32 inputs get exact fp32 products; fp16 / bf16 use the tensor cores.
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    tokens_shape = (batch, length, value_heads)
    cum_g = torch.empty(*tokens_shape, head_k, device=q.device, dtype=torch.float32)
    w, qg, kd = (q.new_empty(*tokens_shape, head_k) for _ in range(3))
    u = q.new_empty(*tokens_shape, head_v)
    aqk = q.new_empty(n_chunks, value_heads, CHUNK, CHUNK)
    # fp16's range (e^11) cannot hold the in-block factors (up to e^80): exact path there.
    safe = (
        lower_bound is not None
        and A_log is not None
        and lower_bound >= SAFE_GATE_LOWER_BOUND
        and q.dtype != torch.float16
    )
    chunk_prepare_kernel[(n_chunks, value_heads)](
        q, k, v, g, beta, A_log, dt_bias, cu_seqlens, chunk_offsets,
        scale, 0.0 if lower_bound is None else lower_bound, length, n_seqs,
        cum_g, w, u, qg, kd, aqk,
        H=heads, HV=value_heads, K=head_k, V=head_v, BK=block_k, BV=block_v,
        BN=triton.next_power_of_2(n_seqs), BLOCK=BLOCK,
        SCALAR_GATE=g.dim() == 3, USE_GATE=A_log is not None, HAS_DT_BIAS=dt_bias is not None,
        USE_LOWER_BOUND=lower_bound is not None and A_log is not None, SAFE_GATE=safe,
        USE_L2NORM=use_qk_l2norm, USE_BETA_SIGMOID=use_beta_sigmoid,
        IS_VARLEN=cu_seqlens is not None, DOT_PRECISION=precision,
        num_warps=4 if block_k <= 64 else 8,
    )  # fmt: skip
    o = torch.empty_like(v)
    if initial_state is not None:
        initial_state = initial_state.contiguous()
    final_state = q.new_empty(n_seqs, value_heads, head_k, head_v, dtype=torch.float32)
    # 32 value columns per program: twice the programs of 64 (the serial chunk loop leaves
    # SMs idle at B = 1) and a state tile that fits in registers (ptxas: 96 B of stack at
    # 4 warps, against 456 B for 64 columns at 8 warps).
    split_v = min(block_v, 32)
    chunk_recurrence_kernel[(triton.cdiv(head_v, split_v), n_seqs * value_heads)](
        w, u, qg, kd, aqk, cum_g, initial_state, cu_seqlens, chunk_offsets, length,
        o, final_state, chunk_states,
        HV=value_heads, K=head_k, V=head_v, BK=block_k, BV=split_v,
        HAS_INITIAL_STATE=initial_state is not None, IS_VARLEN=cu_seqlens is not None,
        DOT_PRECISION=precision, STORE_CHUNK_STATES=chunk_states is not None, num_warps=4,
    )  # fmt: skip
    return o, final_state
