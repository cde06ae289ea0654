"""The chunked backward's launchers: ``launch_chunk_kda_training``, the forward that keeps
what the backward needs, and ``launch_chunk_kda_backward``, which allocates the
backward's buffers and launches its kernels in order (kernel 1 and the recurrence only
when nothing was kept, the row rebuild when the rows were not), each kernel family's
launch in its own module.
"""

from collections.abc import Sequence
from typing import Optional

import torch
from torch import Tensor

from kda_ops.kernels.chunk.backward.gate import gate_blocks, launch_gate_backward
from kda_ops.kernels.chunk.backward.layout import plan_layout
from kda_ops.kernels.chunk.backward.pairs import launch_pairs, pair_columns
from kda_ops.kernels.chunk.backward.prepare import prepare_backward, scan_saved
from kda_ops.kernels.chunk.backward.qk import launch_qk_backward
from kda_ops.kernels.chunk.backward.recompute import rebuild_rows
from kda_ops.kernels.chunk.backward.saved import ROWS, SavedForBackward
from kda_ops.kernels.chunk.backward.state import launch_state_scan
from kda_ops.kernels.chunk.backward.wy import launch_wy
from kda_ops.kernels.sizes import cdiv
from kda_ops.signature import DeltaRuleInputs, DeltaRuleOptions


def launch_chunk_kda_training(
    inputs: DeltaRuleInputs,
    initial_state: Optional[Tensor],
    cu_seqlens: Optional[Tensor],
    options: DeltaRuleOptions,
    keep_rows: bool = True,
) -> tuple[Tensor, Tensor, tuple[Tensor, ...]]:
    """``launch_chunk_kda`` (same arguments, o and final state) for training: the
    prepare step is the backward's kernel 1, whose outputs are returned for
    ``launch_chunk_kda_backward(..., saved=)`` (``SavedForBackward``; without the rows
    unless ``keep_rows``): about 0.55 GB without the rows, 1.4 GB with them, at B = 1,
    T = 8192, H = 64, bf16 (step times against FLA's in ``docs/benchmarks.md``)."""
    inputs = inputs.map_tokens(Tensor.contiguous)
    q, v = inputs.q, inputs.v
    layout = plan_layout(inputs, cu_seqlens, options)
    saved = prepare_backward(
        inputs=inputs, cu_seqlens=cu_seqlens, options=options, layout=layout, with_g=keep_rows
    )
    if initial_state is not None:
        initial_state = initial_state.contiguous()
    o = torch.empty_like(v)
    final_state = q.new_empty(
        layout.n_seqs, v.shape[2], q.shape[3], v.shape[3], dtype=torch.float32
    )
    scan_saved(
        saved=saved,
        initial_state=initial_state,
        cu_seqlens=cu_seqlens,
        layout=layout,
        o=o,
        final_state=final_state,
    )
    return o, final_state, saved if keep_rows else saved[: -len(ROWS)]


def launch_chunk_kda_backward(
    inputs: DeltaRuleInputs,
    initial_state: Optional[Tensor],
    cu_seqlens: Optional[Tensor],
    grad_o: Tensor,
    grad_final_state: Tensor,
    options: DeltaRuleOptions,
    saved: Optional[Sequence[Tensor]] = None,
) -> tuple[Tensor, ...]:
    """Gradients of ``launch_chunk_kda`` (same arguments, shapes and dtypes) given
    ``grad_o`` ``[B, T, HV, V]`` (v's dtype) and ``grad_final_state`` ``[N, HV, K, V]``
    fp32. Returns the gradients of (q, k, v, g, beta, A_log, dt_bias, initial_state), each
    in its input's dtype and shape; an absent optional input gets an empty tensor
    (``kda::delta_rule_backward``'s convention). No host sync, varlen included.
    ``saved``: kernel 1's outputs from ``launch_chunk_kda_training`` (then kernel 1 does
    not run). Without the rows, ``chunk_bwd_recompute_kernel`` rebuilds them and ``saved``
    is only read; with them, the backward overwrites its Aqk, T and, when K == V, qg and
    kd (they serve one backward).

    Scratch, with R chunk rows (``chunk_state_rows``): the chunk states and their
    gradients (``[R, HV, K, V]`` each, q's dtype), dv_new, three row-gradient buffers (fp32
    ``[B, T, HV, K or V]``), v_new and dRu (input dtype), dβ's shares over the key-column
    blocks, and unless given, ``SavedForBackward``; at B = 1, T = 8192, HV = 64, K = V =
    128, bf16, about 2.5 GB besides the outputs."""
    inputs = inputs.map_tokens(Tensor.contiguous)
    q, k, v, g, beta, A_log, dt_bias = inputs
    grad_o = grad_o.contiguous()
    grad_final_state = grad_final_state.to(torch.float32).contiguous()
    if initial_state is not None:
        initial_state = initial_state.contiguous()
    batch, length, _, head_k = q.shape
    value_heads, head_v = v.shape[2], v.shape[3]
    layout = plan_layout(inputs, cu_seqlens, options)
    # Kept tensors are scratch only when kept with their rows (disable_recompute).
    owns_saved = saved is None or len(saved) == len(SavedForBackward._fields)
    if saved is None:  # nothing kept: kernel 1 and the recurrence for the chunk states here
        saved = prepare_backward(inputs, cu_seqlens, options, layout)
        final_state = q.new_empty(layout.n_seqs, value_heads, head_k, head_v, dtype=torch.float32)
        scan_saved(
            saved=saved,
            initial_state=initial_state,
            cu_seqlens=cu_seqlens,
            layout=layout,
            o=None,
            final_state=final_state,
        )
    elif not owns_saved:
        saved = rebuild_rows(
            inputs=inputs, cu_seqlens=cu_seqlens, options=options, kept=saved, layout=layout
        )
    aqk, solve, chunk_decay, q_norm, k_norm, unbounded, chunk_states, cum_g, w, u, qg, kd = saved
    del saved  # so that, when kernel 1 ran here, u is freed once dead
    n_chunks, block_k = layout.n_chunks, layout.block_k
    f32 = dict(device=q.device, dtype=torch.float32)
    lower = 0.0 if options.lower_bound is None else options.lower_bound
    tokens_shape = (batch, length, value_heads)

    del u, chunk_decay

    dv_new = torch.empty(*tokens_shape, head_v, **f32)
    dstates = torch.empty_like(chunk_states)
    d_initial = None if initial_state is None else torch.empty_like(grad_final_state)
    launch_state_scan(
        q=q,
        w=w,
        qg=qg,
        kd=kd,
        aqk=aqk,
        cum_g=cum_g,
        grad_o=grad_o,
        grad_final_state=grad_final_state,
        cu_seqlens=cu_seqlens,
        length=length,
        layout=layout,
        dv_new=dv_new,
        dstates=dstates,
        d_initial=d_initial,
    )

    # The WY kernel's pass 1 to pass 2, v_new and dRu, over qg and kd (dead: only the scan
    # reads them) when K == V.
    if head_k == head_v:
        v_new_rows, d_ru_rows = qg, kd
    else:
        v_new_rows, d_ru_rows = (q.new_empty(*tokens_shape, head_v) for _ in range(2))
    del qg, kd
    scalar_gate = layout.flags["SCALAR_GATE"]
    # dA and scale·dAqk (fp32) for the pairs kernel, over T and Aqk (read no more) unless
    # another backward may need them; over Aqk only where it is fp32 (it is kept in the dot
    # dtype). The scalar gate's pair terms stay in the WY kernel: no tiles.
    d_a_tiles = d_aqk_tiles = d_a_low = d_aqk_low = None
    if not scalar_gate:
        d_a_tiles = solve if owns_saved else torch.empty_like(solve)
        d_aqk_tiles = aqk if owns_saved and aqk.dtype == torch.float32 else torch.empty_like(solve)
        # The pairs kernel's off-diagonal tiles in the dot dtype: half the bytes (bf16 /
        # fp16), loaded up front (they enter its dots in that dtype anyway). fp32 inputs:
        # none, the pairs kernel reads every tile from the fp32 buffers.
        if q.dtype != torch.float32:
            d_a_low, d_aqk_low = (torch.empty_like(solve, dtype=q.dtype) for _ in range(2))
    dq_hat, dk_hat = (torch.empty(*tokens_shape, head_k, **f32) for _ in range(2))
    # dG: one a row for the scalar gate (the WY kernel sums the key columns).
    d_cum = torch.empty(*tokens_shape, *(() if scalar_gate else (head_k,)), **f32)
    dv = torch.empty_like(v)
    dbeta_rows = torch.empty(*tokens_shape, **f32)
    launch_wy(
        q=q,
        k=k,
        v=v,
        beta=beta,
        cu_seqlens=cu_seqlens,
        cum_g=cum_g,
        q_norm=q_norm,
        k_norm=k_norm,
        w=w,
        chunk_states=chunk_states,
        dstates=dstates,
        grad_o=grad_o,
        dv_new=dv_new,
        scale=options.scale,
        length=length,
        layout=layout,
        solve=solve,
        d_aqk_tiles=d_aqk_tiles,
        d_a_tiles=d_a_tiles,
        d_aqk_low=d_aqk_low,
        d_a_low=d_a_low,
        v_new_rows=v_new_rows,
        d_ru_rows=d_ru_rows,
        dq_hat=dq_hat,
        dk_hat=dk_hat,
        d_cum=d_cum,
        dv=dv,
        dbeta_rows=dbeta_rows,
        use_qk_l2norm=options.use_qk_l2norm,
        use_beta_sigmoid=options.use_beta_sigmoid,
    )
    # Freed before the pairs and l2norm kernels allocate theirs: the peak stays at this one.
    del w, chunk_states, dstates, dv_new, v_new_rows, d_ru_rows

    # The pairs and the gate kernels split the key columns (each its N_K blocks): the sums
    # over them come back as shares (the pairs kernel's dβ; the gate kernel's dA_log).
    n_pair_k = 0 if scalar_gate else cdiv(head_k, pair_columns(block_k, q.device))
    n_gate_k = gate_blocks(head_k, layout, q.device)
    dg = torch.empty(*tokens_shape, 1, **f32) if scalar_gate else torch.empty_like(g)
    dbeta_part = torch.empty(*tokens_shape, n_pair_k, **f32)
    # Chunks' shares of the gate-parameter gradients; rows of absent varlen chunks stay 0.
    dA_log_part = torch.zeros(n_chunks, value_heads, n_gate_k, **f32)
    ddt_part = torch.zeros(n_chunks, value_heads, n_gate_k if scalar_gate else head_k, **f32)
    if not scalar_gate:
        launch_pairs(
            q=q,
            k=k,
            beta=beta,
            cu_seqlens=cu_seqlens,
            cum_g=cum_g,
            q_norm=q_norm,
            k_norm=k_norm,
            d_aqk_tiles=d_aqk_tiles,
            d_a_tiles=d_a_tiles,
            pair_low_tiles=(d_aqk_tiles, d_a_tiles) if d_a_low is None else (d_aqk_low, d_a_low),
            unbounded=unbounded,
            length=length,
            layout=layout,
            dq_hat=dq_hat,
            dk_hat=dk_hat,
            d_cum=d_cum,
            dbeta_part=dbeta_part,
        )
    dbeta = torch.empty_like(beta)
    launch_gate_backward(
        g=g,
        A_log=A_log,
        dt_bias=dt_bias,
        beta=beta,
        cu_seqlens=cu_seqlens,
        d_cum=d_cum,
        dbeta_rows=dbeta_rows,
        dbeta_part=dbeta_part,
        lower=lower,
        length=length,
        layout=layout,
        dg=dg,
        dA_log_part=dA_log_part,
        ddt_part=ddt_part,
        dbeta=dbeta,
        head_k=head_k,
    )
    # Grouped value heads share q and k: each head sums its group before the l2norm backward.
    dq, dk = torch.empty_like(q), torch.empty_like(k)
    for x, d_unit, dx in ((q, dq_hat, dq), (k, dk_hat, dk)):
        launch_qk_backward(x, d_unit, dx, options.use_qk_l2norm)

    if scalar_gate:  # one share: the gate kernel takes every key column in one program
        dg = dg.squeeze(-1).to(g.dtype)
    # A fresh empty tensor for each absent input: an op's outputs may not alias.
    d_A_log = q.new_empty(0) if A_log is None else dA_log_part.sum((0, 2)).to(A_log.dtype)
    # [HV, K] for the per-channel gate, [HV, 1] for the scalar one: dt_bias's layout either way.
    d_dt = ddt_part.sum(0)
    d_dt_bias = q.new_empty(0) if dt_bias is None else d_dt.flatten().to(dt_bias.dtype)
    d_initial = q.new_empty(0) if d_initial is None else d_initial.to(initial_state.dtype)
    return dq, dk, dv, dg, dbeta, d_A_log, d_dt_bias, d_initial
