"""KDA and Gated DeltaNet: the public functions and their ``torch.ops.kda`` ops.

Ops (schemas are inferred from the reference kernels' annotations below, with
``DeltaRuleInputs`` and ``DeltaRuleOptions`` spread into their fields: ``kda_ops.signature``):

- ``kda::chunk`` / ``kda::recurrent``: functional, ``(o, final_state)``; chunkwise and
  token-recurrent kernels of the same math.
- ``kda::chunk_states``: ``kda::chunk`` plus the state at the start of every 64-token chunk
  (prefix-cache snapshots), ``(o, final_state, chunk_states)``; inference only.
- ``kda::recurrent_``: in-place serving flavour; reads and writes a state pool at
  ``state_indices`` (for CUDA-graph decode).
- ``kda::delta_rule_backward``: the gradients of both functional ops (on CUDA, the Triton
  chunk backward of ``kernels/chunk/backward/``; float64 differentiates the reference).
- ``kda::chunk_train``: ``kda::chunk`` for training (plus ``keep_rows``), ``(o,
  final_state, saved)``: on CUDA ``saved`` is what the backward's first kernel would
  compute (``SavedForBackward``; w, u, qg, kd only with ``keep_rows``), made by the
  forward so that the backward need not run it; elsewhere it is empty and the
  backward is ``kda::delta_rule_backward``'s. ``chunk_kda`` calls it when autograd
  records the call (not while exporting), ``keep_rows=disable_recompute``.
- ``kda::chunk_backward``: the chunk backward from ``saved`` without the rows, which it
  only reads (a graph may be backpropagated again, ``retain_graph``).
- ``kda::chunk_backward_``: the same from ``saved`` with the rows, which it overwrites
  (its buffers are the backward's scratch), so such a graph's saved tensors serve one
  backward: a second one fails autograd's in-place check instead of reading them.
"""

from collections.abc import Callable
from typing import Optional

import torch
from torch import Tensor

from kda_ops import arguments, kernels, reference
from kda_ops.plan import (
    TRAIN_OP_DTYPE,
    DeltaRulePlan,
    announce,
    compute_inputs,
    plan_delta_rule,
)
from kda_ops.signature import (
    DeltaRuleInputs,
    DeltaRuleOptions,
    cuda_kernel,
    define_op,
    fake_kernel,
    group_arguments,
)
from kda_ops.validation import INDEX_DTYPES, ArgumentChecker


def delta_rule_reference(
    form: reference.DeltaRuleForm,
) -> Callable[..., tuple[Tensor, Tensor]]:
    """The reference kernel of an op whose math is ``form``: ``(o, final_state)``."""

    def kernel(
        inputs: DeltaRuleInputs,
        initial_state: Optional[Tensor],
        cu_seqlens: Optional[Tensor],
        options: DeltaRuleOptions,
    ) -> tuple[Tensor, Tensor]:
        return reference.delta_rule(form, *inputs, initial_state, cu_seqlens, *options)

    return kernel


chunk_reference = delta_rule_reference(reference.chunk_delta_rule)
recurrent_reference = delta_rule_reference(reference.recurrent_delta_rule)
chunk_op = define_op("kda::chunk", chunk_reference)
recurrent_op = define_op("kda::recurrent", recurrent_reference)


@fake_kernel(chunk_op, recurrent_op)
def _delta_rule_fake(
    inputs: DeltaRuleInputs,
    initial_state: Optional[Tensor],
    cu_seqlens: Optional[Tensor],
    options: DeltaRuleOptions,
) -> tuple[Tensor, Tensor]:
    q, v = inputs.q, inputs.v
    torch._check(inputs.k.shape == q.shape)
    torch._check(v.shape[2] % q.shape[2] == 0)
    return v.new_empty(v.shape), arguments.new_final_state(q, v, cu_seqlens)


def delta_rule_backward_reference(
    inputs: DeltaRuleInputs,
    initial_state: Optional[Tensor],
    cu_seqlens: Optional[Tensor],
    grad_o: Tensor,
    grad_final_state: Tensor,
    options: DeltaRuleOptions,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Gradients for (q, k, v, g, beta, A_log, dt_bias, initial_state); an absent
    optional input gets an empty tensor."""

    def forward(*primals: Optional[Tensor]) -> tuple[Tensor, Tensor]:
        return reference.delta_rule(reference.chunk_delta_rule, *primals, cu_seqlens, *options)

    return reference.vjp(forward, (*inputs, initial_state), (grad_o, grad_final_state))


delta_rule_backward_op = define_op("kda::delta_rule_backward", delta_rule_backward_reference)


def _delta_rule_setup_context(ctx, inputs, output) -> None:
    """For kda::chunk, kda::recurrent and kda::chunk_train (whose keep_rows follows the
    arguments of kda::chunk, and whose third output, what it keeps for its backward, is
    saved after them)."""
    tensors, initial_state, cu_seqlens, options, *keep_rows = group_arguments(chunk_op, inputs)
    kept = output[2] if len(output) == 3 else ()
    ctx.save_for_backward(*tensors, initial_state, cu_seqlens, *kept)
    ctx.options = options
    ctx.keeps_rows = any(keep_rows)  # chunk_train's; the others have none
    ctx.n_arguments = len(inputs)
    # No zero-filled gradients for unused outputs (chunk_train's kept ones are large).
    ctx.set_materialize_grads(False)


def _delta_rule_backward(ctx, grad_o: Optional[Tensor], grad_final_state: Optional[Tensor],
                         *_grad_kept: Optional[Tensor]):  # fmt: skip
    # Read once: under torch.utils.checkpoint each read of saved_tensors unpacks (recomputes).
    saved = ctx.saved_tensors
    n_inputs = len(DeltaRuleInputs._fields)
    inputs = DeltaRuleInputs._make(saved[:n_inputs])
    initial_state, cu_seqlens, *kept = saved[n_inputs:]
    q, v = inputs.q, inputs.v
    if grad_o is None:  # an output the loss does not use: o is v-shaped, in v's dtype
        grad_o = torch.zeros_like(v)
    if grad_final_state is None:
        grad_final_state = q.new_zeros(
            arguments.final_state_shape(q, v, cu_seqlens), dtype=arguments.state_dtype(q)
        )
    cotangents = (grad_o, grad_final_state)
    if kept:
        backward = chunk_backward_scratch_op if ctx.keeps_rows else chunk_backward_op
        grads = backward(*inputs, initial_state, cu_seqlens, *cotangents, kept, *ctx.options)
    else:
        grads = delta_rule_backward_op(*inputs, initial_state, cu_seqlens, *cotangents,
                                       *ctx.options)  # fmt: skip
    primals = (*inputs, initial_state)
    grads = tuple(None if p is None else grad for p, grad in zip(primals, grads))
    return grads + (None,) * (ctx.n_arguments - len(grads))


def chunk_plan(inputs: DeltaRuleInputs) -> DeltaRulePlan:
    """The plan (``kda_ops.plan``) of a chunk op on these inputs."""
    return plan_delta_rule(inputs.q, "chunk")


def chunk_kernels_run(inputs: DeltaRuleInputs) -> bool:
    """Whether the Triton chunk kernels serve these CUDA inputs (:func:`chunk_plan`): in
    the plan's compute dtype, into which the forward and backward ops convert q, k and v
    (the public functions convert them before the call)."""
    return chunk_plan(inputs).implementation == "triton"


def chunk_kernels_run_as_given(inputs: DeltaRuleInputs) -> bool:
    """Whether the Triton chunk kernels serve these inputs in their own dtype (what the
    Inductor pass that launches the kernels from the graph needs: it converts nothing)."""
    plan = chunk_plan(inputs)
    return plan.implementation == "triton" and plan.compute_dtype == inputs.q.dtype


def _keeps_saved(inputs: DeltaRuleInputs) -> bool:
    """Whether ``kda::chunk_train`` returns the backward's saved tensors: the Triton path in
    the inputs' own dtype (the saved tensors' dtype is the inputs'; ``chunk_kda`` converts
    its inputs to the plan's compute dtype before the call, so only an op called directly
    with other inputs takes the reference here, and is told so)."""
    plan = chunk_plan(inputs)
    if plan.implementation != "triton":
        return False
    if plan.compute_dtype != inputs.q.dtype:
        announce(DeltaRulePlan("chunk", "reference", inputs.q.dtype, (TRAIN_OP_DTYPE,)))
        return False
    return True


def _in_compute_dtype(inputs: DeltaRuleInputs) -> DeltaRuleInputs:
    """``inputs`` with q, k, v in the chunk plan's compute dtype (announced)."""
    q, k, v = compute_inputs(inputs.q, inputs.k, inputs.v, "chunk")
    return inputs._replace(q=q, k=k, v=v)


def recurrent_kernel_runs(inputs: DeltaRuleInputs) -> bool:
    """Whether the Triton recurrent kernel serves these CUDA inputs (``kda_ops.plan``: it
    computes in fp32 whatever its inputs, so only float64, the oracle's dtype, runs the
    reference)."""
    return plan_delta_rule(inputs.q, "recurrent").implementation == "triton"


def chunk_train_reference(
    inputs: DeltaRuleInputs,
    initial_state: Optional[Tensor],
    cu_seqlens: Optional[Tensor],
    options: DeltaRuleOptions,
    keep_rows: bool,
) -> tuple[Tensor, Tensor, list[Tensor]]:
    """``kda::chunk`` with nothing saved (the reference differentiates its inputs)."""
    o, final_state = chunk_reference(inputs, initial_state, cu_seqlens, options)
    return o, final_state, []


chunk_train_op = define_op("kda::chunk_train", chunk_train_reference)


@fake_kernel(chunk_train_op)
def _(inputs, initial_state, cu_seqlens, options, keep_rows):
    o, final = _delta_rule_fake(inputs, initial_state, cu_seqlens, options)
    q, v = inputs.q, inputs.v
    return o, final, saved_like(q, v, cu_seqlens, keep_rows) if _keeps_saved(inputs) else []


def saved_like(q: Tensor, v: Tensor, cu_seqlens: Optional[Tensor], keep_rows: bool) -> list[Tensor]:
    """Empty tensors shaped as ``kda::chunk_train``'s saved outputs on the Triton path
    (``kernels.chunk.backward.saved.SavedForBackward``; its rows w, u, qg, kd only with
    ``keep_rows``)."""
    saved = list(empty_saved(q, v, _chunk_state_rows(q, cu_seqlens)))
    return saved if keep_rows else saved[: -len(ROWS)]


def chunk_backward_reference(
    inputs: DeltaRuleInputs,
    initial_state: Optional[Tensor],
    cu_seqlens: Optional[Tensor],
    grad_o: Tensor,
    grad_final_state: Tensor,
    saved: list[Tensor],
    options: DeltaRuleOptions,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``kda::delta_rule_backward`` given ``kda::chunk_train``'s saved tensors (for
    ``kda::chunk_backward`` and ``kda::chunk_backward_``); off the Triton path it
    differentiates the reference and leaves them untouched."""
    return delta_rule_backward_reference(
        inputs, initial_state, cu_seqlens, grad_o, grad_final_state, options
    )


chunk_backward_op = define_op("kda::chunk_backward", chunk_backward_reference)
chunk_backward_scratch_op = define_op(
    "kda::chunk_backward_", chunk_backward_reference, mutates_args=("saved",)
)


@fake_kernel(delta_rule_backward_op, chunk_backward_op, chunk_backward_scratch_op)
def _gradients_fake(inputs, initial_state, *_):
    """The fake kernel of the backward ops: a gradient like each primal, empty for an
    absent one."""
    primals = (*inputs, initial_state)
    return tuple(inputs.q.new_empty(0) if p is None else p.new_empty(p.shape) for p in primals)


for _op in (chunk_op, recurrent_op, chunk_train_op):
    _op.register_autograd(_delta_rule_backward, setup_context=_delta_rule_setup_context)


def _chunk_state_rows(q: Tensor, cu_seqlens: Optional[Tensor]) -> int:
    """Rows of ``kda::chunk_states``' third output (SymInt-safe)."""
    n_seqs = None if cu_seqlens is None else cu_seqlens.shape[0] - 1
    return reference.chunk_state_rows(q.shape[0], q.shape[1], n_seqs)


def chunk_states_reference(
    inputs: DeltaRuleInputs,
    initial_state: Optional[Tensor],
    cu_seqlens: Optional[Tensor],
    options: DeltaRuleOptions,
) -> tuple[Tensor, Tensor, Tensor]:
    """``kda::chunk`` that also returns the state at the start of every 64-token chunk.

    Returns o, the final state and chunk states ``[R, HV, K, V]`` (the final state's
    dtype: float32, float64 for float64 inputs). Fixed length: ``R = B * NT`` with
    ``NT = ceil(T / 64)``, row ``b * NT + c`` is sequence b before token ``64 c``. Packed
    sequences: ``R = T // 64 + N`` (an upper bound, so the shape needs no sequence
    lengths); sequence n owns rows ``chunk_offsets(cu_seqlens)[n] ...[n + 1]``; the rows
    past ``chunk_offsets[N]`` are zero. Inference only: no autograd formula.
    """
    o, final, starts = reference.delta_rule(
        reference.chunk_delta_rule_with_states, *inputs, initial_state, cu_seqlens, *options
    )
    chunk_states = final.new_zeros(_chunk_state_rows(inputs.q, cu_seqlens), *final.shape[1:])
    starts = starts.flatten(0, 1)
    chunk_states[: starts.shape[0]] = starts
    return o, final, chunk_states


chunk_states_op = define_op("kda::chunk_states", chunk_states_reference)


@fake_kernel(chunk_states_op)
def _(inputs, initial_state, cu_seqlens, options):
    o, final = _delta_rule_fake(inputs, initial_state, cu_seqlens, options)
    rows = _chunk_state_rows(inputs.q, cu_seqlens)
    return o, final, final.new_empty(rows, *final.shape[1:])


def recurrent_inplace_reference(
    inputs: DeltaRuleInputs,
    state_pool: Tensor,
    state_indices: Optional[Tensor],
    cu_seqlens: Optional[Tensor],
    options: DeltaRuleOptions,
) -> Tensor:
    """Recurrent step(s) on slots of ``state_pool`` ``[P, HV, K, V]``.

    Sequence n reads and writes slot ``state_indices[n]`` (slot n without indices). A
    negative index marks padding: that sequence starts from a zero state and writes
    nothing back.
    """
    states = gather_pool_states(state_pool, state_indices)
    o, final = reference.delta_rule(
        reference.recurrent_delta_rule, *inputs, states, cu_seqlens, *options
    )
    scatter_pool_states(state_pool, state_indices, final)
    return o


def gather_pool_states(state_pool: Tensor, state_indices: Optional[Tensor]) -> Tensor:
    """The states ``[N, ...]`` of the slots ``state_indices`` ``[N]`` of a pool (all slots
    without indices); a negative index (padding) reads a zero state."""
    if state_indices is None:
        return state_pool
    valid = state_indices >= 0
    gathered = state_pool[state_indices.clamp(min=0)]
    return torch.where(valid.view(-1, *(1,) * (gathered.dim() - 1)), gathered, 0)


def scatter_pool_states(
    state_pool: Tensor, state_indices: Optional[Tensor], states: Tensor
) -> None:
    """Write ``states`` ``[N, ...]`` to the slots ``state_indices`` of the pool, in place;
    negative indices (padding) write nothing."""
    if state_indices is None:
        state_pool.copy_(states)
        return
    valid = state_indices >= 0
    state_pool[state_indices[valid]] = states[valid].to(state_pool.dtype)


recurrent_inplace_op = define_op(
    "kda::recurrent_", recurrent_inplace_reference, mutates_args=("state_pool",)
)


@fake_kernel(recurrent_inplace_op)
def _(inputs, state_pool, state_indices, cu_seqlens, options):
    return inputs.v.new_empty(inputs.v.shape)


if kernels.AVAILABLE:
    from kda_ops.kernels.chunk.backward.launch import (
        launch_chunk_kda_backward,
        launch_chunk_kda_training,
    )
    from kda_ops.kernels.chunk.backward.saved import ROWS, empty_saved
    from kda_ops.kernels.chunk.launch import launch_chunk_kda
    from kda_ops.kernels.recurrent import launch_recurrent_kda

    @cuda_kernel(chunk_op, runs=chunk_kernels_run)
    def _(inputs, initial_state, cu_seqlens, options):
        o, final = launch_chunk_kda(_in_compute_dtype(inputs), initial_state, cu_seqlens,
                                    options)  # fmt: skip
        return o.to(inputs.v.dtype), final

    @cuda_kernel(chunk_states_op, runs=chunk_kernels_run)
    def _(inputs, initial_state, cu_seqlens, options):
        q, v = inputs.q, inputs.v
        shape = (_chunk_state_rows(q, cu_seqlens), v.shape[2], q.shape[3], v.shape[3])
        # Packed sequences leave rows past the last chunk unwritten: zero them.
        alloc = torch.empty if cu_seqlens is None else torch.zeros
        chunk_states = alloc(shape, device=q.device, dtype=torch.float32)
        o, final = launch_chunk_kda(_in_compute_dtype(inputs), initial_state, cu_seqlens,
                                    options, chunk_states=chunk_states)  # fmt: skip
        return o.to(v.dtype), final, chunk_states

    @cuda_kernel(delta_rule_backward_op, runs=chunk_kernels_run)
    def _(inputs, initial_state, cu_seqlens, grad_o, grad_final_state, options):
        # The gradients of kda::chunk and kda::recurrent alike (one math, one backward).
        computed = _in_compute_dtype(inputs)
        grads = launch_chunk_kda_backward(computed, initial_state, cu_seqlens,
                                          grad_o.to(computed.v.dtype), grad_final_state,
                                          options)  # fmt: skip
        dq, dk, dv = (grad.to(x.dtype) for grad, x in zip(grads[:3], inputs[:3]))
        return (dq, dk, dv, *grads[3:])

    @cuda_kernel(chunk_train_op, runs=_keeps_saved)
    def _(inputs, initial_state, cu_seqlens, options, keep_rows):
        o, final_state, saved = launch_chunk_kda_training(
            inputs, initial_state, cu_seqlens, options, keep_rows=keep_rows
        )
        return o, final_state, list(saved)

    @cuda_kernel(chunk_backward_op, chunk_backward_scratch_op, runs=_keeps_saved)
    def _(inputs, initial_state, cu_seqlens, grad_o, grad_final_state, saved, options):
        # The launch overwrites saved exactly when it holds the rows (kda::chunk_backward_).
        return launch_chunk_kda_backward(inputs, initial_state, cu_seqlens, grad_o,
                                         grad_final_state, options, saved=saved)  # fmt: skip

    @cuda_kernel(recurrent_op, runs=recurrent_kernel_runs)
    def _(inputs, initial_state, cu_seqlens, options):
        q, v = inputs.q, inputs.v
        state = arguments.new_final_state(q, v, cu_seqlens)
        o = launch_recurrent_kda(inputs, initial_state, state, None, cu_seqlens, options)
        return o, state

    @cuda_kernel(recurrent_inplace_op, runs=recurrent_kernel_runs)
    def _(inputs, state_pool, state_indices, cu_seqlens, options):
        return launch_recurrent_kda(inputs, state_pool, state_pool, state_indices, cu_seqlens,
                                    options)  # fmt: skip


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


def _fla_inputs(
    check: ArgumentChecker,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    beta: Tensor,
    g: Tensor,
    use_gate_in_kernel: bool,
    A_log: Optional[Tensor],
    dt_bias: Optional[Tensor],
    lower_bound: Optional[float],
    use_beta_sigmoid: bool,
    allow_neg_eigval: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Optional[Tensor], Optional[Tensor], bool]:
    """FLA's accepted forms (``kda_ops.arguments``) as the ops' inputs: ``(q, k, v, beta,
    A_log, dt_bias, use_beta_sigmoid)``, q / k / v in one dtype."""
    dtype = arguments.common_dtype(q, k, v)
    if dtype is not None:
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    A_log, dt_bias = arguments.gate_tensors(check, use_gate_in_kernel, A_log, dt_bias,
                                            lower_bound, g)  # fmt: skip
    if isinstance(beta, Tensor):
        beta, use_beta_sigmoid = arguments.beta_for_kernel(check, beta, use_beta_sigmoid,
                                                           allow_neg_eigval)  # fmt: skip
    return q, k, v, beta, A_log, dt_bias, use_beta_sigmoid


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
            different dtypes are computed in the widest of them; float16, and bfloat16
            past 128 key columns, in float32 (``kda_ops.plan``; ``kda_ops.explain`` says
            how a call runs).
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
    _check_graph_mode(check, use_graph, max_num_seqs, cu_seqlens)
    v_first = arguments.state_v_first(check, state_v_first, transpose_state_layout)
    initial_state = arguments.initial_state(arguments.key_first(initial_state, v_first), q)
    output_dtype = v.dtype if isinstance(v, Tensor) else None
    h_dtype = q.dtype if isinstance(q, Tensor) else None
    q, k, v, beta, A_log, dt_bias, use_beta_sigmoid = _fla_inputs(
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


def _check_graph_mode(
    check: ArgumentChecker, use_graph: object, max_num_seqs: object, cu_seqlens: object
) -> None:
    """FLA's ``use_graph`` / ``max_num_seqs``: accepted (kda_ops' launches are capturable
    as they are); ``max_num_seqs`` must be the number of sequences ``cu_seqlens`` holds."""
    if not isinstance(use_graph, bool):
        check.fail(TypeError, f"`use_graph` must be a bool, got {type(use_graph).__name__}")
    if max_num_seqs is None:
        return
    if isinstance(cu_seqlens, Tensor) and max_num_seqs != cu_seqlens.shape[0] - 1:
        check.fail(
            ValueError,
            f"`max_num_seqs` ({max_num_seqs}) must equal the sequences in `cu_seqlens` "
            f"({cu_seqlens.shape[0] - 1}): pad `cu_seqlens` with empty sequences",
        )


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
    q, k, v, beta, A_log, dt_bias, use_beta_sigmoid = _fla_inputs(
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
    q, k, v, beta, A_log, dt_bias, use_beta_sigmoid = _fla_inputs(
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
