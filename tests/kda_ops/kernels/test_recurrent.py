"""The fused recurrent kernel against the reference (interpreter on CPU, fp32)."""

import pytest
import torch

from kda_ops import reference
from kda_ops.kernels.recurrent import launch_recurrent_kda
from kda_ops.signature import DeltaRuleInputs, DeltaRuleOptions
from kda_ops.speculative import verify_reference
from tests.kda_ops.inputs import delta_rule_inputs
from tests.kda_ops.kernels.devices import DEVICE, DTYPES, TOLERANCE, relative_error


def make(dtype, **shape):
    x = delta_rule_inputs(raw_gate=True, unit_qk=False, dtype=torch.float32, **shape)
    for name, t in vars(x).items():
        low = name in ("q", "k", "v", "g", "beta")
        setattr(x, name, t.to(DEVICE, dtype if low else torch.float32))
    return x


def tensors(x):
    return DeltaRuleInputs(x.q, x.k, x.v, x.g, x.beta, x.A_log, x.dt_bias)


def options(lower_bound):
    return DeltaRuleOptions(scale=0.3, lower_bound=lower_bound, use_qk_l2norm=True,
                            use_beta_sigmoid=True)  # fmt: skip


def expected(x, cu_seqlens, lower_bound, initial_state):
    return reference.delta_rule(
        reference.recurrent_delta_rule, x.q, x.k, x.v, x.g, x.beta, x.A_log, x.dt_bias,
        initial_state, cu_seqlens, 0.3, lower_bound, True, True,
    )  # fmt: skip


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scalar_gate", [False, True])
@pytest.mark.parametrize("lower_bound", [None, -5.0])
@pytest.mark.parametrize(("head_k", "head_v"), [(8, 40), (32, 16)])
def test_functional(dtype, scalar_gate, lower_bound, head_k, head_v):
    x = make(dtype, batch=2, length=5, heads=1, value_heads=2, head_k=head_k, head_v=head_v,
             scalar_gate=scalar_gate)  # fmt: skip
    state = torch.empty_like(x.initial_state)
    o = launch_recurrent_kda(tensors(x), x.initial_state, state, None, None, options(lower_bound))
    o_ref, state_ref = expected(x, None, lower_bound, x.initial_state)
    assert o.dtype == dtype
    assert relative_error(o, o_ref) < TOLERANCE[dtype]
    assert relative_error(state, state_ref) < TOLERANCE[dtype]


def test_varlen_without_initial_state():
    x = make(torch.float32, length=9, n_seqs=3, head_k=16, head_v=8)
    cu_seqlens = torch.tensor([0, 1, 1, 9], device=DEVICE, dtype=torch.int32)
    state = torch.empty_like(x.initial_state)
    o = launch_recurrent_kda(tensors(x), None, state, None, cu_seqlens, options(-5.0))
    o_ref, state_ref = expected(x, cu_seqlens, -5.0, None)
    torch.testing.assert_close(o, o_ref.float())
    torch.testing.assert_close(state, state_ref)


def test_pool_in_place_leaves_other_slots_bit_identical():
    x = make(torch.float32, batch=3, length=2, head_k=16, head_v=8)
    pool = torch.randn(6, 2, 16, 8, device=DEVICE)
    before = pool.clone()
    indices = torch.tensor([4, -1, 0], device=DEVICE)
    o = launch_recurrent_kda(tensors(x), pool, pool, indices, None, options(None))
    start = torch.stack([before[4], torch.zeros_like(before[0]), before[0]])
    o_ref, state_ref = expected(x, None, None, start)
    torch.testing.assert_close(o, o_ref.float())
    torch.testing.assert_close(pool[[4, 0]], state_ref[[0, 2]])
    assert torch.equal(pool[[1, 2, 3, 5]], before[[1, 2, 3, 5]])


def test_bf16_pool_round_trip():
    x = make(torch.float32, batch=2, length=1, head_k=16, head_v=8)
    pool = torch.randn(3, 2, 16, 8, device=DEVICE).bfloat16()
    start = torch.stack([pool[2].float(), pool[0].float()])
    indices = torch.tensor([2, 0], device=DEVICE)
    o = launch_recurrent_kda(tensors(x), pool, pool, indices, None, options(-5.0))
    o_ref, state_ref = expected(x, None, -5.0, start)
    torch.testing.assert_close(o, o_ref.float())
    torch.testing.assert_close(pool[[2, 0]], state_ref.bfloat16())


@pytest.mark.parametrize("scalar_gate", [False, True])
def test_step_states_for_speculative_verify(scalar_gate):
    """STORE_STEP_STATES without a final state: the state after every token of every
    sequence (padding included), the pool untouched; what kda::verify runs on CUDA."""
    x = make(torch.float32, batch=3, length=4, head_k=16, head_v=8, scalar_gate=scalar_gate)
    pool = torch.randn(5, 2, 16, 8, device=DEVICE)
    before = pool.clone()
    indices = torch.tensor([3, -1, 0], device=DEVICE)
    steps = torch.empty(3, 4, 2, 16, 8, device=DEVICE)
    o = launch_recurrent_kda(
        tensors(x), pool, None, indices, None, options(-5.0), step_states=steps
    )
    o_ref, steps_ref = verify_reference(tensors(x), pool, indices, options(-5.0))
    torch.testing.assert_close(o, o_ref)
    torch.testing.assert_close(steps, steps_ref)
    assert torch.equal(pool, before)
