"""Speculative decoding on a state pool: verify draft tokens without committing, then
commit the accepted prefix of each sequence.

Ops:

- ``kda::verify(q, k, v, g, beta, A_log?, dt_bias?, state_pool, state_indices?, scale,
  lower_bound?, use_qk_l2norm, use_beta_sigmoid) -> (o, states)``: runs the T draft tokens
  of each of the N sequences from its pool slot and returns the outputs and the state after
  every draft position, ``[N, T, HV, K, V]``. Reads the pool, never writes it.
- ``kda::commit_(state_pool!, state_indices?, states, accepted_lengths) -> ()``: writes the
  state after ``accepted_lengths[n]`` tokens (0..T; 0 keeps the slot) into slot
  ``state_indices[n]``, in place. Negative indices (padding) write nothing; slots not named
  are never touched.

Two ways to commit, with different costs per sequence (fp32 state of
``HV·K·V·4`` bytes, T draft tokens):

- :func:`commit` (per-position states): verify writes T states (T× the state traffic of one
  decode step, and T states of memory), commit copies one. Nothing is recomputed.
- :func:`commit_by_replay`: verify's states can be dropped; commit reruns the accepted
  tokens through the in-place recurrence (``kda::recurrent_``), masking each rejected
  token so it leaves the state untouched (no decay, zero write strength). One state read
  and written, T tokens recomputed; the draft inputs must be kept until commit.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from kda_ops import arguments, kernels, reference
from kda_ops.delta_rule import fused_recurrent_kda_inplace
from kda_ops.delta_rule_ops import (
    gather_pool_states,
    recurrent_kernel_runs,
    scatter_pool_states,
)
from kda_ops.signature import (
    DeltaRuleInputs,
    DeltaRuleOptions,
    cuda_kernel,
    define_op,
    fake_kernel,
)
from kda_ops.validation import INDEX_DTYPES, ArgumentChecker


def verify_reference(
    inputs: DeltaRuleInputs,
    state_pool: Tensor,
    state_indices: Optional[Tensor],
    options: DeltaRuleOptions,
) -> tuple[Tensor, Tensor]:
    """kda::verify on CPU, and for float64 on CUDA: the recurrence one token at a time from
    the pool states."""
    state = gather_pool_states(state_pool, state_indices)
    outputs, states = [], []
    for t in range(inputs.q.shape[1]):
        step = inputs.map_tokens(lambda x, t=t: x[:, t : t + 1])
        o, state = reference.delta_rule(
            reference.recurrent_delta_rule, *step, state, None, *options
        )
        outputs.append(o)
        states.append(state.to(state_pool.dtype))
    return torch.cat(outputs, dim=1), torch.stack(states, dim=1)


verify_op = define_op("kda::verify", verify_reference)


def _step_states_like(inputs: DeltaRuleInputs, state_pool: Tensor) -> Tensor:
    """``[N, T, HV, K, V]`` in the pool's dtype: the state after every draft token."""
    batch, length, value_heads, head_v = inputs.v.shape
    return state_pool.new_empty(batch, length, value_heads, inputs.q.shape[3], head_v)


@fake_kernel(verify_op)
def _(inputs, state_pool, state_indices, options):
    return inputs.v.new_empty(inputs.v.shape), _step_states_like(inputs, state_pool)


if kernels.AVAILABLE:
    from kda_ops.kernels.recurrent import launch_recurrent_kda

    @cuda_kernel(verify_op, runs=recurrent_kernel_runs)
    def _(inputs, state_pool, state_indices, options):
        """One launch of the recurrent kernel: reads the pool slots, writes the state
        after every draft token (and no final state)."""
        states = _step_states_like(inputs, state_pool)
        o = launch_recurrent_kda(inputs, state_pool, None, state_indices, None, options,
                                 step_states=states)  # fmt: skip
        return o, states


@torch.library.custom_op("kda::commit_", mutates_args=("state_pool",))
def commit_op(
    state_pool: Tensor,
    state_indices: Optional[Tensor],
    states: Tensor,
    accepted_lengths: Tensor,
) -> None:
    """Reference (every device): pick each sequence's state after its accepted prefix
    (slot state for 0) with a gather, then scatter to the valid slots."""
    current = gather_pool_states(state_pool, state_indices)
    candidates = torch.cat([current.unsqueeze(1), states], dim=1)  # [N, T + 1, HV, K, V]
    rows = torch.arange(candidates.shape[0], device=candidates.device)
    chosen = candidates[rows, accepted_lengths.long()]
    scatter_pool_states(state_pool, state_indices, chosen.clone())


@commit_op.register_fake
def _(state_pool, state_indices, states, accepted_lengths):
    return None


def verify(
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
) -> tuple[Tensor, Tensor]:
    """Run T draft tokens per sequence from the pool without writing it.

    Args as for :func:`kda_ops.fused_recurrent_kda_inplace` (no ``cu_seqlens``): q, k
    ``[N, T, H, K]``, v ``[N, T, HV, V]``, g, beta per token; ``state_pool``
    ``[P, HV, K, V]`` float32 (float64 for float64 inputs); ``state_indices`` int ``[N]``
    (negative: padding, starts from zero).

    Returns:
        o ``[N, T, HV, V]`` in v's dtype, and ``states`` ``[N, T, HV, K, V]`` in the pool's
        dtype: the state after each draft position, for :func:`commit`.
    """
    function = "kda_ops.speculative.verify"
    inputs, options = arguments.delta_rule_arguments(
        function, q, k, v, g, beta, scale=scale, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        use_gate_in_kernel=use_gate_in_kernel,
        use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, A_log=A_log, dt_bias=dt_bias,
        lower_bound=lower_bound,
    )  # fmt: skip
    ArgumentChecker(function).state_pool(state_pool, state_indices, q.shape[0], q, v)
    return verify_op(*inputs, state_pool, state_indices, *options)


def _check_accepted(check: ArgumentChecker, accepted_lengths: object, n_seqs: int) -> Tensor:
    accepted = check.tensor("accepted_lengths", accepted_lengths, dims=1, dtypes=INDEX_DTYPES)
    check.shape("accepted_lengths", accepted, (n_seqs,), "(N,)")
    return accepted


def commit(
    state_pool: Tensor,
    states: Tensor,
    accepted_lengths: Tensor,
    state_indices: Optional[Tensor] = None,
) -> None:
    """Write each sequence's state after its accepted draft prefix into the pool, in place.

    Args:
        state_pool: ``[P, HV, K, V]``, the pool :func:`verify` read.
        states: ``[N, T, HV, K, V]`` from :func:`verify`, in the pool's dtype.
        accepted_lengths: int ``[N]`` in ``0..T`` (not checked: values are never read on
            the host); 0 leaves the slot as it is.
        state_indices: int ``[N]``, as given to :func:`verify`; negative = padding.
    """
    check = ArgumentChecker("kda_ops.speculative.commit")
    states = check.tensor("states", states, dims=5)
    n_seqs = states.shape[0]
    _check_accepted(check, accepted_lengths, n_seqs)
    if not isinstance(state_pool, Tensor) or states.dtype != state_pool.dtype:
        check.fail(TypeError, "`states` and `state_pool` must be tensors of one dtype")
    pool_size = n_seqs if state_indices is None else state_pool.shape[0]
    check.shape("state_pool", state_pool, (pool_size, *states.shape[2:]), "(P, HV, K, V)")
    if state_indices is not None:
        check.state_indices(state_indices, n_seqs)
    check.same_device(states=states, state_pool=state_pool, state_indices=state_indices,
                      accepted_lengths=accepted_lengths)  # fmt: skip
    commit_op(state_pool, state_indices, states, accepted_lengths)


def _mask_rejected(
    g: Tensor,
    beta: Tensor,
    accepted_lengths: Tensor,
    use_gate_in_kernel: bool,
    use_beta_sigmoid_in_kernel: bool,
) -> tuple[Tensor, Tensor]:
    """g and beta with every token at position >= its sequence's accepted length made a
    no-op: log-decay 0 (a raw gate of -inf gives 0 through either gate activation) and
    write strength 0 (a raw beta of -inf gives sigmoid 0)."""
    positions = torch.arange(g.shape[1], device=g.device)
    rejected = positions[None, :] >= accepted_lengths[:, None].to(positions.dtype)  # [N, T]
    no_decay = -torch.inf if use_gate_in_kernel else 0.0
    no_write = -torch.inf if use_beta_sigmoid_in_kernel else 0.0
    gate_mask = rejected.view(*rejected.shape, *(1,) * (g.dim() - 2))
    return (
        torch.where(gate_mask, torch.full_like(g, no_decay), g),
        torch.where(rejected[..., None], torch.full_like(beta, no_write), beta),
    )


def commit_by_replay(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    state_pool: Tensor,
    accepted_lengths: Tensor,
    state_indices: Optional[Tensor] = None,
    A_log: Optional[Tensor] = None,
    dt_bias: Optional[Tensor] = None,
    scale: Optional[float] = None,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    lower_bound: Optional[float] = None,
) -> None:
    """Commit by replaying the accepted draft tokens into the pool (no per-position states).

    Same draft inputs and options as :func:`verify`, plus ``accepted_lengths`` int ``[N]``
    in ``0..T``. Rejected tokens are masked to no-ops and the in-place recurrence
    (``kda::recurrent_``) runs over all T positions, so the shapes stay static (CUDA-graph
    friendly).
    """
    check = ArgumentChecker("kda_ops.speculative.commit_by_replay")
    _check_accepted(check, accepted_lengths, q.shape[0] if isinstance(q, Tensor) else 0)
    g, beta = _mask_rejected(
        g, beta, accepted_lengths, use_gate_in_kernel, use_beta_sigmoid_in_kernel
    )
    fused_recurrent_kda_inplace(
        q, k, v, g, beta, state_pool, state_indices, A_log=A_log, dt_bias=dt_bias,
        scale=scale, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        use_gate_in_kernel=use_gate_in_kernel,
        use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, lower_bound=lower_bound,
    )  # fmt: skip
