"""The delta-rule ops of ``torch.ops.kda``: their definitions (from the reference kernels),
fake kernels, autograd formulas and CUDA kernels.

Kept apart from the public functions of ``kda_ops.delta_rule``, which map FLA's argument
forms onto these ops' inputs and call them: the modules built on the ops themselves
(``speculative``, ``segmented``, ``affine``, ``lowering``) import them from here, below the
FLA-compatible layer.

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
        return _reference_delta_rule(
            form=form,
            inputs=inputs,
            initial_state=initial_state,
            cu_seqlens=cu_seqlens,
            options=options,
        )

    return kernel


def _reference_delta_rule(
    form: reference.DeltaRuleForm,
    inputs: DeltaRuleInputs,
    initial_state: Optional[Tensor],
    cu_seqlens: Optional[Tensor],
    options: DeltaRuleOptions,
) -> tuple[Tensor, ...]:
    """``reference.delta_rule`` with ``form`` on grouped inputs and options (by field)."""
    return reference.delta_rule(
        form=form,
        **inputs._asdict(),
        initial_state=initial_state,
        cu_seqlens=cu_seqlens,
        **options._asdict(),
    )


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
        *tensors, state = primals
        return _reference_delta_rule(
            form=reference.chunk_delta_rule,
            inputs=DeltaRuleInputs._make(tensors),
            initial_state=state,
            cu_seqlens=cu_seqlens,
            options=options,
        )

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


def _delta_rule_backward(
    ctx, grad_o: Optional[Tensor], grad_final_state: Optional[Tensor], *_grad_kept: Optional[Tensor]
):
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
    arguments_by_name = {
        **inputs._asdict(),
        "initial_state": initial_state,
        "cu_seqlens": cu_seqlens,
        "grad_o": grad_o,
        "grad_final_state": grad_final_state,
        **ctx.options._asdict(),
    }
    if kept:
        backward = chunk_backward_scratch_op if ctx.keeps_rows else chunk_backward_op
        grads = backward(**arguments_by_name, saved=kept)
    else:
        grads = delta_rule_backward_op(**arguments_by_name)
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
    if not _keeps_saved(inputs):
        return o, final, []
    return (
        o,
        final,
        saved_like(
            q=q, v=v, cu_seqlens=cu_seqlens, keep_rows=keep_rows, scalar_gate=inputs.g.dim() == 3
        ),
    )


def saved_like(
    q: Tensor, v: Tensor, cu_seqlens: Optional[Tensor], keep_rows: bool, scalar_gate: bool
) -> list[Tensor]:
    """Empty tensors shaped as ``kda::chunk_train``'s saved outputs on the Triton path
    (``kernels.chunk.backward.saved.SavedForBackward``; its rows w, u, qg, kd only with
    ``keep_rows``; G one a row for a ``scalar_gate``)."""
    saved = list(empty_saved(q, v, _chunk_state_rows(q, cu_seqlens), scalar_gate))
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
        inputs=inputs,
        initial_state=initial_state,
        cu_seqlens=cu_seqlens,
        grad_o=grad_o,
        grad_final_state=grad_final_state,
        options=options,
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
    o, final, starts = _reference_delta_rule(
        form=reference.chunk_delta_rule_with_states,
        inputs=inputs,
        initial_state=initial_state,
        cu_seqlens=cu_seqlens,
        options=options,
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
    o, final = _reference_delta_rule(
        form=reference.recurrent_delta_rule,
        inputs=inputs,
        initial_state=states,
        cu_seqlens=cu_seqlens,
        options=options,
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
        o, final = launch_chunk_kda(_in_compute_dtype(inputs), initial_state, cu_seqlens, options)
        return o.to(inputs.v.dtype), final

    @cuda_kernel(chunk_states_op, runs=chunk_kernels_run)
    def _(inputs, initial_state, cu_seqlens, options):
        q, v = inputs.q, inputs.v
        shape = (_chunk_state_rows(q, cu_seqlens), v.shape[2], q.shape[3], v.shape[3])
        # Packed sequences leave rows past the last chunk unwritten: zero them.
        alloc = torch.empty if cu_seqlens is None else torch.zeros
        chunk_states = alloc(shape, device=q.device, dtype=torch.float32)
        o, final = launch_chunk_kda(
            inputs=_in_compute_dtype(inputs),
            initial_state=initial_state,
            cu_seqlens=cu_seqlens,
            options=options,
            chunk_states=chunk_states,
        )
        return o.to(v.dtype), final, chunk_states

    @cuda_kernel(delta_rule_backward_op, runs=chunk_kernels_run)
    def _(inputs, initial_state, cu_seqlens, grad_o, grad_final_state, options):
        # The gradients of kda::chunk and kda::recurrent alike (one math, one backward).
        computed = _in_compute_dtype(inputs)
        grads = launch_chunk_kda_backward(
            inputs=computed,
            initial_state=initial_state,
            cu_seqlens=cu_seqlens,
            grad_o=grad_o.to(computed.v.dtype),
            grad_final_state=grad_final_state,
            options=options,
        )
        dq, dk, dv = (grad.to(x.dtype) for grad, x in zip(grads[:3], inputs[:3]))
        return (dq, dk, dv, *grads[3:])

    @cuda_kernel(chunk_train_op, runs=_keeps_saved)
    def _(inputs, initial_state, cu_seqlens, options, keep_rows):
        o, final_state, saved = launch_chunk_kda_training(
            inputs=inputs,
            initial_state=initial_state,
            cu_seqlens=cu_seqlens,
            options=options,
            keep_rows=keep_rows,
        )
        return o, final_state, list(saved)

    @cuda_kernel(chunk_backward_op, chunk_backward_scratch_op, runs=_keeps_saved)
    def _(inputs, initial_state, cu_seqlens, grad_o, grad_final_state, saved, options):
        # The launch overwrites saved exactly when it holds the rows (kda::chunk_backward_).
        return launch_chunk_kda_backward(
            inputs=inputs,
            initial_state=initial_state,
            cu_seqlens=cu_seqlens,
            grad_o=grad_o,
            grad_final_state=grad_final_state,
            options=options,
            saved=saved,
        )

    @cuda_kernel(recurrent_op, runs=recurrent_kernel_runs)
    def _(inputs, initial_state, cu_seqlens, options):
        q, v = inputs.q, inputs.v
        state = arguments.new_final_state(q, v, cu_seqlens)
        o = launch_recurrent_kda(
            inputs=inputs,
            state_in=initial_state,
            state_out=state,
            state_indices=None,
            cu_seqlens=cu_seqlens,
            options=options,
        )
        return o, state

    @cuda_kernel(recurrent_inplace_op, runs=recurrent_kernel_runs)
    def _(inputs, state_pool, state_indices, cu_seqlens, options):
        return launch_recurrent_kda(
            inputs=inputs,
            state_in=state_pool,
            state_out=state_pool,
            state_indices=state_indices,
            cu_seqlens=cu_seqlens,
            options=options,
        )
