"""KDA and Gated DeltaNet's public functions, with FLA's signatures: :func:`chunk_kda`,
:func:`fused_recurrent_kda`, :func:`fused_recurrent_kda_inplace` and :func:`chunk_offsets`.

Each maps FLA's argument forms onto the ops' canonical inputs (``kda_ops.arguments``) and
calls the ``torch.ops.kda`` ops of ``kda_ops.delta_rule_ops``: ``chunk_kda`` calls
``kda::chunk``, ``kda::chunk_train`` when autograd records the call (not while exporting),
or ``kda::chunk_states`` with ``return_intermediate_states``; ``fused_recurrent_kda`` calls
``kda::recurrent``, ``fused_recurrent_kda_inplace`` ``kda::recurrent_``. The checks that
pick ``chunk_kda``'s op (autograd, export, ``return_intermediate_states``,
``disable_recompute``) stay here beside it.
"""

from typing import Optional

import torch
from torch import Tensor

from kda_ops import arguments, reference
from kda_ops.delta_rule_ops import (
    chunk_op,
    chunk_states_op,
    chunk_train_op,
    recurrent_inplace_op,
    recurrent_op,
)
from kda_ops.plan import compute_inputs
from kda_ops.validation import INDEX_DTYPES, ArgumentChecker


def _differentiated(tensors: tuple[Optional[Tensor], ...]) -> bool:
    """Whether autograd records an op that takes these inputs."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _trains(
    disable_recompute: object,
    return_intermediate_states: bool,
    inputs: tuple[Optional[Tensor], ...],
) -> bool:
    """Validates ``disable_recompute`` of :func:`chunk_kda`; whether it calls
    ``kda::chunk_train``: when autograd records the call, and never while exporting
    (exported graphs hold ``kda::chunk``)."""
    check = ArgumentChecker("chunk_kda")
    if not isinstance(disable_recompute, bool):
        got = type(disable_recompute).__name__
        check.fail(TypeError, f"`disable_recompute` must be a bool, got {got}")
    if disable_recompute and return_intermediate_states:
        check.fail(
            ValueError,
            "`return_intermediate_states=True` is inference only and "
            "`disable_recompute=True` is for training: pass at most one",
        )
    return _differentiated(inputs) and not _exporting()


def _exporting() -> bool:
    """``torch.compiler.is_exporting()``, read from the flag that torch.export sets: the
    function itself is folded to True under any torch.compile by Dynamo before
    pytorch/pytorch#176499 (torch 2.11 among them), which sent every compiled
    training call to ``kda::chunk``."""
    return torch.compiler._is_exporting_flag


def chunk_kda(
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
    allow_neg_eigval: bool = False,
    safe_gate: bool = False,
    lower_bound: Optional[float] = None,
    disable_recompute: bool = False,
    return_intermediate_states: bool = False,
    state_v_first: bool = False,
    cu_seqlens: Optional[Tensor] = None,
    cu_seqlens_cpu: Optional[Tensor] = None,
    cp_context: None = None,
    use_graph: bool = False,
    max_num_seqs: Optional[int] = None,
    *,
    A_log: Optional[Tensor] = None,
    dt_bias: Optional[Tensor] = None,
    chunk_size: int = 64,
    transpose_state_layout: Optional[bool] = None,
) -> tuple[Tensor, Optional[Tensor]] | tuple[Tensor, Optional[Tensor], Tensor]:
    """Chunkwise KDA / Gated DeltaNet (prefill and training): ``fla.ops.kda.chunk_kda``'s
    signature, positional order and meaning.

    Args:
        q, k: ``[B, T, H, K]``, float16 / bfloat16 / float32 / float64; q, k and v of
            different dtypes are computed in the widest of them; float16 in float32
            (``kda_ops.plan``; ``kda_ops.explain`` says how a call runs).
        v: ``[B, T, HV, V]`` with ``HV % H == 0``; value head ``hv`` reads q/k head
            ``hv // (HV // H)``. K, V <= 256.
        g: log-decay ``[B, T, HV, K]`` (KDA) or ``[B, T, HV]`` (Gated DeltaNet), or the raw
            gate with ``use_gate_in_kernel``.
        beta: ``[B, T, HV]``, post-sigmoid unless ``use_beta_sigmoid_in_kernel``.
        scale: query scale, default ``K ** -0.5``.
        initial_state: ``[N, HV, K, V]`` (``[N, HV, V, K]`` with ``state_v_first``), any
            float dtype; computed in float32 (float64 for float64 inputs).
        output_final_state: return the final state (else ``None``).
        use_qk_l2norm_in_kernel: divide q and k by ``sqrt(sum(x²) + 1e-6)`` first.
        use_gate_in_kernel: g is raw; the log-decay is ``kda_gate(g, A_log, dt_bias,
            lower_bound)``. Without it ``A_log``, ``dt_bias`` and ``lower_bound`` are
            ignored, as in FLA.
        use_beta_sigmoid_in_kernel: apply sigmoid to beta.
        allow_neg_eigval: beta is ``2 * sigmoid(beta)`` (needs
            ``use_beta_sigmoid_in_kernel``).
        safe_gate: FLA's hint that ``lower_bound`` lies in [-5, 0) (checked with
            ``use_gate_in_kernel``); kda_ops picks its kernels from ``lower_bound`` itself.
        lower_bound: negative lower bound of the safe gate (Kimi K3 uses -5).
        disable_recompute: FLA's option to keep more of the forward for the backward.
            When autograd records the call (CUDA), the forward runs the backward's first
            kernel and keeps its Aqk, T and the chunk-start states, from which the
            backward rebuilds the rest; with ``disable_recompute=True`` it keeps those
            too and uses them as the backward's scratch, so that graph can be
            backpropagated once (a second backward with ``retain_graph=True`` raises).
            Without autograd, and off CUDA, it changes nothing.
        return_intermediate_states: also return h, the state at the start of every chunk
            of 64 tokens (inference only: no input may require grad while grad mode is on).
        state_v_first: states (initial, final, h) are ``[..., V, K]``, the layout of
            SGLang's and vLLM's pools.
        cu_seqlens: int32/int64 ``[N + 1]`` packed-sequence offsets; needs ``B == 1``.
        cu_seqlens_cpu: a host copy of ``cu_seqlens``; with it, h has exactly FLA's
            ``sum(ceil(len_n / 64))`` rows (without it, an upper bound, below).
        cp_context: FLA's context parallelism; not supported (``kda_ops.distributed``).
        use_graph, max_num_seqs: FLA's CUDA-graph mode for packed sequences. kda_ops'
            kernels read ``cu_seqlens`` on the device only, so every call can be captured;
            ``max_num_seqs`` is checked against ``cu_seqlens``.
        A_log: ``[HV]`` float32 (any shape holding HV values); ``None`` with
            ``lower_bound`` means the gate ``lower_bound * sigmoid(g + dt_bias)``.
        dt_bias: ``[HV * K]`` (``[HV]`` for GDN) float32, or ``[HV, K]``.
        chunk_size: 32 or 64 (FLA's choices; the result is the same, kda_ops runs 64).
        transpose_state_layout: FLA's deprecated name of ``state_v_first``.

    Returns:
        o ``[B, T, HV, V]`` in v's dtype, and the final state (float32, float64 for float64
        inputs) or ``None``. With ``return_intermediate_states``, a third value h in q's
        dtype: ``[B, NT, HV, K, V]`` with ``NT = ceil(T / 64)`` and ``h[b, c]`` the state
        of sequence b before token ``64 c`` (``h[:, 0]`` is the initial state); with
        ``cu_seqlens``, ``[1, R, HV, K, V]`` where sequence n's chunks are rows
        ``chunk_offsets(cu_seqlens)[n]`` to ``[n + 1]`` (exclusive); ``R`` is
        ``sum(ceil(len_n / 64))`` given ``cu_seqlens_cpu``, else the upper bound
        ``T // 64 + N`` (no host sync) with zero rows past the last chunk.
    """
    check = ArgumentChecker("chunk_kda")
    arguments.no_context_parallel(check, cp_context)
    arguments.chunk_size(check, chunk_size, return_intermediate_states is True)
    length = q.shape[1] if isinstance(q, Tensor) and q.dim() == 4 else None
    arguments.host_seqlens(check, cu_seqlens_cpu, cu_seqlens, length=length)
    arguments.graph_mode(check, use_graph, max_num_seqs, cu_seqlens)
    v_first = arguments.state_v_first(check, state_v_first, transpose_state_layout)
    initial_state = arguments.initial_state(arguments.key_first(initial_state, v_first), q)
    output_dtype = v.dtype if isinstance(v, Tensor) else None
    h_dtype = q.dtype if isinstance(q, Tensor) else None
    q, k, v, beta, A_log, dt_bias, use_beta_sigmoid = arguments.fla_inputs(
        check, q, k, v, beta, g, use_gate_in_kernel, A_log, dt_bias, lower_bound,
        use_beta_sigmoid_in_kernel, allow_neg_eigval,
    )  # fmt: skip
    if isinstance(q, Tensor):
        q, k, v = compute_inputs(q, k, v, "chunk")
    inputs, options = arguments.delta_rule_arguments(
        "chunk_kda", q, k, v, g, beta, scale=scale, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        use_gate_in_kernel=use_gate_in_kernel, use_beta_sigmoid_in_kernel=use_beta_sigmoid,
        A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound, initial_state=initial_state,
        cu_seqlens=cu_seqlens, safe_gate=safe_gate,
    )  # fmt: skip
    primals = (*inputs, initial_state)
    args = (*inputs, initial_state, cu_seqlens, *options)
    intermediate = _check_return_intermediate_states(return_intermediate_states, primals)
    if _trains(disable_recompute, intermediate, primals):
        o, final_state, _ = chunk_train_op(*args, disable_recompute)
    elif not intermediate:
        o, final_state = chunk_op(*args)
    else:
        o, final_state, chunk_states = chunk_states_op(*args)
    o = o.to(output_dtype)
    final_state = arguments.caller_layout(final_state, v_first) if output_final_state else None
    if not intermediate:
        return o, final_state
    if cu_seqlens is None:
        h = chunk_states.unflatten(0, (q.shape[0], chunk_states.shape[0] // q.shape[0]))
    else:
        if cu_seqlens_cpu is not None:
            chunk_states = chunk_states[: int(reference.chunk_offsets(cu_seqlens_cpu)[-1])]
        h = chunk_states.unsqueeze(0)
    return o, final_state, arguments.caller_layout(h.to(h_dtype), v_first)


def _check_return_intermediate_states(flag: object, inputs: tuple[Optional[Tensor], ...]) -> bool:
    """Validates ``return_intermediate_states`` of :func:`chunk_kda`; returns it."""
    check = ArgumentChecker("chunk_kda")
    if not isinstance(flag, bool):
        got = type(flag).__name__
        check.fail(TypeError, f"`return_intermediate_states` must be a bool, got {got}")
    if flag and _differentiated(inputs):
        check.fail(
            ValueError,
            "`return_intermediate_states=True` is inference only (kda::chunk_states has no "
            "backward), but an input requires grad: call it under torch.no_grad() or "
            "torch.inference_mode(), or pass detached inputs",
        )
    return flag


def chunk_offsets(cu_seqlens: Tensor) -> Tensor:
    """Rows of each packed sequence in ``chunk_kda(..., cu_seqlens=cu_seqlens,
    return_intermediate_states=True)``'s h (and ``kda::chunk_states``' third output).

    Args:
        cu_seqlens: int32/int64 ``[N + 1]`` packed-sequence offsets.

    Returns:
        int32 ``[N + 1]`` on cu_seqlens' device: sequence n's ``ceil(len_n / 64)`` chunk
        states are rows ``out[n]`` to ``out[n + 1]`` (exclusive); ``out[N]`` rows are used
        in all. Computed on the device, no host sync.
    """
    seqlens = ArgumentChecker("chunk_offsets").tensor(
        "cu_seqlens", cu_seqlens, dims=1, dtypes=INDEX_DTYPES
    )
    return reference.chunk_offsets(seqlens)


def fused_recurrent_kda(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    A_log: Optional[Tensor] = None,
    dt_bias: Optional[Tensor] = None,
    scale: Optional[float] = None,
    initial_state: Optional[Tensor] = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    lower_bound: Optional[float] = None,
    state_v_first: bool = False,
    cu_seqlens: Optional[Tensor] = None,
    *,
    transpose_state_layout: Optional[bool] = None,
) -> tuple[Tensor, Optional[Tensor]]:
    """Token-recurrent KDA / Gated DeltaNet (decode): ``fla.ops.kda.fused_recurrent_kda``'s
    signature and positional order (``A_log`` and ``dt_bias`` follow ``beta``).

    Same arguments, shapes and results as :func:`chunk_kda`; differentiable too. A
    V-first ``initial_state`` is read in place by the CUDA kernel (no transposed copy).
    """
    check = ArgumentChecker("fused_recurrent_kda")
    v_first = arguments.state_v_first(check, state_v_first, transpose_state_layout)
    initial_state = arguments.initial_state(arguments.key_first(initial_state, v_first), q)
    output_dtype = v.dtype if isinstance(v, Tensor) else None
    q, k, v, beta, A_log, dt_bias, use_beta_sigmoid = arguments.fla_inputs(
        check, q, k, v, beta, g, use_gate_in_kernel, A_log, dt_bias, lower_bound,
        use_beta_sigmoid_in_kernel, allow_neg_eigval,
    )  # fmt: skip
    inputs, options = arguments.delta_rule_arguments(
        "fused_recurrent_kda", q, k, v, g, beta, scale=scale,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_gate_in_kernel=use_gate_in_kernel,
        use_beta_sigmoid_in_kernel=use_beta_sigmoid, A_log=A_log, dt_bias=dt_bias,
        lower_bound=lower_bound, initial_state=initial_state, cu_seqlens=cu_seqlens,
    )  # fmt: skip
    o, final_state = recurrent_op(*inputs, initial_state, cu_seqlens, *options)
    final_state = arguments.caller_layout(final_state, v_first) if output_final_state else None
    return o.to(output_dtype), final_state


def fused_recurrent_kda_inplace(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    state_pool: Tensor,
    state_indices: Optional[Tensor] = None,
    A_log: Optional[Tensor] = None,
    dt_bias: Optional[Tensor] = None,
    scale: Optional[float] = None,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    lower_bound: Optional[float] = None,
    cu_seqlens: Optional[Tensor] = None,
    allow_neg_eigval: bool = False,
    state_v_first: bool = False,
) -> Tensor:
    """Recurrent KDA that advances states inside a pool, for serving with CUDA graphs.

    Args:
        state_pool: contiguous ``[P, HV, K, V]`` (``[P, HV, V, K]`` with ``state_v_first``,
            read and written in place, no transposed copy) float32, or bfloat16 to halve
            its memory (each step still runs in fp32 and rounds the state once on
            write-back; float64 for float64 inputs), updated in place.
        state_indices: int32/int64 ``[N]``: sequence n reads and writes slot
            ``state_indices[n]``; a negative index marks a padding sequence (zero start
            state, nothing written). Without it, ``P == N`` and slot n is sequence n.
        The rest as in :func:`fused_recurrent_kda`; T >= 1 tokens per sequence.

    Returns:
        o ``[B, T, HV, V]`` in v's dtype. Not differentiable.
    """
    function = "fused_recurrent_kda_inplace"
    check = ArgumentChecker(function)
    if isinstance(state_pool, Tensor) and not state_pool.is_contiguous():
        check.fail(ValueError, "`state_pool` must be contiguous (it is updated in place)")
    state_pool = arguments.key_first(state_pool, bool(state_v_first))
    output_dtype = v.dtype if isinstance(v, Tensor) else None
    q, k, v, beta, A_log, dt_bias, use_beta_sigmoid = arguments.fla_inputs(
        check, q, k, v, beta, g, use_gate_in_kernel, A_log, dt_bias, lower_bound,
        use_beta_sigmoid_in_kernel, allow_neg_eigval,
    )  # fmt: skip
    inputs, options = arguments.delta_rule_arguments(
        function, q, k, v, g, beta, scale=scale, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        use_gate_in_kernel=use_gate_in_kernel, use_beta_sigmoid_in_kernel=use_beta_sigmoid,
        A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound, cu_seqlens=cu_seqlens,
    )  # fmt: skip
    n_seqs = arguments.final_state_shape(q, v, cu_seqlens)[0]
    check.state_pool(state_pool, state_indices, n_seqs, q, v, allow_bf16=True)
    o = recurrent_inplace_op(*inputs, state_pool, state_indices, cu_seqlens, *options)
    return o.to(output_dtype)


__all__ = [
    "chunk_kda",
    "chunk_offsets",
    "fused_recurrent_kda",
    "fused_recurrent_kda_inplace",
]
