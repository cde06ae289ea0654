"""Fused recurrent KDA / Gated DeltaNet: gate, l2norm and beta sigmoid in one kernel.

One program owns a ``[K, BV]`` slice of one sequence's state for one value head and walks
its tokens; the state never leaves registers between tokens. The same kernel serves the
functional op (read ``initial_state[n]``, write a new state), the in-place pool op (read
and write ``pool[state_indices[n]]``; a negative index is padding: zero start, no write)
and speculative verify (read the pool, write the state after every token instead of the
final one, ``STORE_STEP_STATES``).
"""

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from kda_ops.kernels.chunk.device import L2NORM_EPS, value_block_program
from kda_ops.kernels.gate import gate_activation, gate_parameters
from kda_ops.kernels.launches import KernelLaunch
from kda_ops.kernels.sizes import cdiv, next_power_of_2
from kda_ops.signature import DeltaRuleInputs, DeltaRuleOptions


@triton.jit
def recurrent_kda_kernel(
    q,
    k,
    v,
    g,
    beta,
    A_log,
    dt_bias,
    state_in,
    state_indices,
    cu_seqlens,
    scale,
    lower_bound,
    length,
    o,
    state_out,
    step_states,
    H: tl.constexpr,
    HV: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    SCALAR_GATE: tl.constexpr,
    USE_GATE: tl.constexpr,
    HAS_DT_BIAS: tl.constexpr,
    USE_LOWER_BOUND: tl.constexpr,
    USE_L2NORM: tl.constexpr,
    USE_BETA_SIGMOID: tl.constexpr,
    HAS_STATE_IN: tl.constexpr,
    USE_INDICES: tl.constexpr,
    IS_VARLEN: tl.constexpr,
    STORE_FINAL_STATE: tl.constexpr,
    STORE_STEP_STATES: tl.constexpr,
    STATE_IN_V_FIRST: tl.constexpr = False,
    STATE_OUT_V_FIRST: tl.constexpr = False,
):
    i_v, i_nh = value_block_program(V, BV)
    i_n, i_hv = i_nh // HV, i_nh % HV
    i_h = i_hv // (HV // H)
    if IS_VARLEN:
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        length = tl.load(cu_seqlens + i_n + 1).to(tl.int64) - bos
    else:
        bos = i_n.to(tl.int64) * length

    offs_k = tl.arange(0, BK)
    offs_v = i_v * BV + tl.arange(0, BV)
    mask_k = offs_k < K
    mask_v = offs_v < V
    mask_state = mask_k[:, None] & mask_v[None, :]
    slot = i_n.to(tl.int64)
    if USE_INDICES:
        slot = tl.load(state_indices + i_n).to(tl.int64)
        mask_state = mask_state & (offs_k * 0 + slot >= 0)[:, None]
    state_offsets = (slot * HV + i_hv) * K * V + offs_k[:, None] * V + offs_v[None, :]
    # A pool's slots may be V-first ([V, K], SGLang's and vLLM's layout): read in place.
    v_first_offsets = (slot * HV + i_hv) * K * V + offs_k[:, None] + offs_v[None, :] * K
    state = tl.zeros([BK, BV], dtype=tl.float32)
    if HAS_STATE_IN:
        in_offsets = v_first_offsets if STATE_IN_V_FIRST else state_offsets
        state = tl.load(state_in + in_offsets, mask=mask_state, other=0.0).to(tl.float32)

    rate, gate_bias = gate_parameters(
        A_log=A_log,
        dt_bias=dt_bias,
        i_hv=i_hv,
        offs_k=offs_k,
        mask_k=mask_k,
        K=K,
        SCALAR_GATE=SCALAR_GATE,
        USE_GATE=USE_GATE,
        HAS_DT_BIAS=HAS_DT_BIAS,
    )

    for t in range(0, length):
        token = bos + t
        b_q = tl.load(q + (token * H + i_h) * K + offs_k, mask=mask_k, other=0.0).to(tl.float32)
        b_k = tl.load(k + (token * H + i_h) * K + offs_k, mask=mask_k, other=0.0).to(tl.float32)
        b_v = tl.load(v + (token * HV + i_hv) * V + offs_v, mask=mask_v, other=0.0).to(tl.float32)
        b_beta = tl.load(beta + token * HV + i_hv).to(tl.float32)
        if SCALAR_GATE:
            b_g = tl.load(g + token * HV + i_hv).to(tl.float32)
        else:
            b_g = tl.load(g + (token * HV + i_hv) * K + offs_k, mask=mask_k, other=0.0)
            b_g = b_g.to(tl.float32)
        if USE_GATE:
            if HAS_DT_BIAS:
                b_g = b_g + gate_bias
            b_g = gate_activation(
                x=b_g, rate=rate, lower_bound=lower_bound, USE_LOWER_BOUND=USE_LOWER_BOUND
            )
        if USE_L2NORM:
            b_q = b_q / tl.sqrt(tl.sum(b_q * b_q) + L2NORM_EPS)
            b_k = b_k / tl.sqrt(tl.sum(b_k * b_k) + L2NORM_EPS)
        if USE_BETA_SIGMOID:
            b_beta = tl.sigmoid(b_beta)

        if SCALAR_GATE:
            state = state * tl.exp(b_g)
        else:
            state = state * tl.exp(b_g)[:, None]
        v_hat = tl.sum(state * b_k[:, None], axis=0)
        state += b_k[:, None] * ((b_v - v_hat) * b_beta)[None, :]
        b_o = tl.sum(state * b_q[:, None], axis=0) * scale
        tl.store(o + (token * HV + i_hv) * V + offs_v, b_o.to(o.dtype.element_ty), mask=mask_v)
        if STORE_STEP_STATES:  # [N, T, HV, K, V], padding sequences included
            step = ((i_n.to(tl.int64) * length + t) * HV + i_hv) * K * V
            tl.store(
                step_states + step + offs_k[:, None] * V + offs_v[None, :],
                state.to(step_states.dtype.element_ty),
                mask=mask_k[:, None] & mask_v[None, :],
            )

    if STORE_FINAL_STATE:
        out_offsets = v_first_offsets if STATE_OUT_V_FIRST else state_offsets
        tl.store(state_out + out_offsets, state.to(state_out.dtype.element_ty), mask=mask_state)


def is_v_first(state: Optional[Tensor]) -> bool:
    """Whether a ``[P, HV, K, V]`` state is the transposed view of a contiguous V-first
    ``[P, HV, V, K]`` one (else it must be contiguous)."""
    return (
        state is not None
        and state.transpose(-1, -2).is_contiguous()
        and not (state.is_contiguous())
    )


def recurrent_launch(
    inputs: DeltaRuleInputs,
    state_in: Optional[Tensor],
    state_out: Optional[Tensor],
    state_indices: Optional[Tensor],
    cu_seqlens: Optional[Tensor],
    options: DeltaRuleOptions,
    step_states: Optional[Tensor] = None,
) -> KernelLaunch:
    """The recurrence's launch, writing a new o (``args["o"]``, ``[B, T, HV, V]`` in v's
    dtype), the final states into ``state_out`` (may be ``state_in``; ``None`` writes none;
    each ``[P, HV, K, V]``, contiguous or the transposed view of a contiguous V-first
    ``[P, HV, V, K]``) and, when given, the state after every token into ``step_states``
    (contiguous ``[B, T, HV, K, V]``, fixed length only). Shapes as in
    ``kda_ops.delta_rule``."""
    q, k, v, g, beta, A_log, dt_bias = inputs.map_tokens(Tensor.contiguous)
    scale, lower_bound = options.scale, options.lower_bound
    use_qk_l2norm, use_beta_sigmoid = options.use_qk_l2norm, options.use_beta_sigmoid
    if state_in is not None and state_in is not state_out and not is_v_first(state_in):
        state_in = state_in.contiguous()
    batch, length, heads, head_k = q.shape
    value_heads, head_v = v.shape[2], v.shape[3]
    n_seqs = batch if cu_seqlens is None else cu_seqlens.shape[0] - 1
    block_k = next_power_of_2(head_k)
    block_v = min(next_power_of_2(head_v), 32 if block_k <= 128 else 16)
    grid = (cdiv(head_v, block_v) * n_seqs * value_heads,)
    args = dict(
        q=q,
        k=k,
        v=v,
        g=g,
        beta=beta,
        A_log=A_log,
        dt_bias=dt_bias,
        state_in=state_in,
        state_indices=state_indices,
        cu_seqlens=cu_seqlens,
        scale=scale,
        lower_bound=0.0 if lower_bound is None else lower_bound,
        length=length,
        o=torch.empty_like(v),
        state_out=state_out,
        step_states=step_states,
        H=heads,
        HV=value_heads,
        K=head_k,
        V=head_v,
        BK=block_k,
        BV=block_v,
        SCALAR_GATE=g.dim() == 3,
        USE_GATE=A_log is not None,
        HAS_DT_BIAS=dt_bias is not None,
        USE_LOWER_BOUND=lower_bound is not None,
        USE_L2NORM=use_qk_l2norm,
        USE_BETA_SIGMOID=use_beta_sigmoid,
        HAS_STATE_IN=state_in is not None,
        USE_INDICES=state_indices is not None,
        IS_VARLEN=cu_seqlens is not None,
        STORE_FINAL_STATE=state_out is not None,
        STORE_STEP_STATES=step_states is not None,
        STATE_IN_V_FIRST=is_v_first(state_in),
        STATE_OUT_V_FIRST=is_v_first(state_out),
        num_warps=4,
    )
    writes = tuple(name for name in ("o", "state_out", "step_states") if args[name] is not None)
    return KernelLaunch(kernel=recurrent_kda_kernel, grid=grid, args=args, writes=writes)


def launch_recurrent_kda(*args: object, **kwargs: object) -> Tensor:
    """Runs :func:`recurrent_launch` (same arguments) and returns o."""
    launch = recurrent_launch(*args, **kwargs)
    launch.run()
    return launch.args["o"]
