"""The in-place serving flavours: state pools advanced at ``state_indices``."""

import pytest
import torch

import kda_ops
from tests.kda_ops.inputs import delta_rule_inputs

GATE_KWARGS = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                   use_beta_sigmoid_in_kernel=True, lower_bound=-5.0)  # fmt: skip


@pytest.mark.parametrize("tokens", [1, 4])
def test_recurrent_inplace_equals_functional_and_leaves_other_slots(tokens):
    x = delta_rule_inputs(batch=3, length=tokens, raw_gate=True, unit_qk=False)
    pool = torch.randn(8, 2, 8, 4, dtype=torch.float64)
    indices = torch.tensor([5, -1, 2])
    before = pool.clone()
    args = (x.q, x.k, x.v, x.g, x.beta)
    gate = dict(A_log=x.A_log, dt_bias=x.dt_bias, **GATE_KWARGS)
    o = kda_ops.fused_recurrent_kda_inplace(*args, pool, indices, **gate)
    # Padding (index -1) runs from a zero state.
    start = torch.stack([before[5], torch.zeros_like(before[0]), before[2]])
    o_ref, final = kda_ops.fused_recurrent_kda(
        *args, initial_state=start, output_final_state=True, **gate
    )
    torch.testing.assert_close(o, o_ref, rtol=0, atol=0)
    torch.testing.assert_close(pool[5], final[0], rtol=0, atol=0)
    torch.testing.assert_close(pool[2], final[2], rtol=0, atol=0)
    untouched = [0, 1, 3, 4, 6, 7]
    assert torch.equal(pool[untouched], before[untouched])


def test_recurrent_inplace_without_indices_updates_every_slot():
    x = delta_rule_inputs(batch=2, length=1)
    pool = torch.randn(2, 2, 8, 4, dtype=torch.float64)
    o_ref, final = kda_ops.fused_recurrent_kda(
        x.q, x.k, x.v, x.g, x.beta, initial_state=pool.clone(), output_final_state=True
    )
    o = kda_ops.fused_recurrent_kda_inplace(x.q, x.k, x.v, x.g, x.beta, pool)
    torch.testing.assert_close(o, o_ref, rtol=0, atol=0)
    torch.testing.assert_close(pool, final, rtol=0, atol=0)


def test_recurrent_inplace_decode_loop_matches_prefill():
    x = delta_rule_inputs(batch=2, length=12)
    o_whole, s_whole = kda_ops.chunk_kda(x.q, x.k, x.v, x.g, x.beta, output_final_state=True)
    pool = torch.zeros(4, 2, 8, 4, dtype=torch.float64)
    indices = torch.tensor([3, 1], dtype=torch.int32)
    steps = []
    for t in range(12):
        step = (tensor[:, t : t + 1] for tensor in (x.q, x.k, x.v, x.g, x.beta))
        steps.append(kda_ops.fused_recurrent_kda_inplace(*step, pool, indices))
    torch.testing.assert_close(torch.cat(steps, dim=1), o_whole)
    torch.testing.assert_close(pool[[3, 1]], s_whole)


def test_conv_update_inplace_equals_functional_and_leaves_other_slots():
    x = torch.randn(3, 6)
    weight, bias = torch.randn(6, 4), torch.randn(6)
    pool = torch.randn(5, 6, 3)
    before = pool.clone()
    indices = torch.tensor([4, 0, -1])
    y = kda_ops.causal_conv1d_update_inplace(x, pool, weight, bias, state_indices=indices)
    start = torch.stack([before[4], before[0], torch.zeros_like(before[0])])
    y_ref, new_state = kda_ops.causal_conv1d_update(x, start, weight, bias)
    torch.testing.assert_close(y, y_ref, rtol=0, atol=0)
    torch.testing.assert_close(pool[[4, 0]], new_state[:2], rtol=0, atol=0)
    assert torch.equal(pool[1:4], before[1:4])
    assert y.shape == x.shape


def test_conv_update_inplace_several_tokens_without_indices():
    x = torch.randn(2, 3, 6)
    weight = torch.randn(6, 4)
    pool = torch.randn(2, 6, 3)
    y_ref, new_state = kda_ops.causal_conv1d(x, weight, initial_state=pool.clone())
    y = kda_ops.causal_conv1d_update_inplace(x, pool, weight)
    torch.testing.assert_close(y, y_ref, rtol=0, atol=0)
    torch.testing.assert_close(pool, new_state, rtol=0, atol=0)


@pytest.mark.parametrize("length", [1, 3])
def test_conv_update_inplace_whole_window_state_as_transformers(length):
    """A ``[N, D, W]`` state (transformers' and Mamba's layout) is advanced in place as
    transformers' ``torch_causal_conv1d_update`` does: the last W inputs kept."""
    x = torch.randn(2, length, 6)
    weight, bias = torch.randn(6, 4), torch.randn(6)
    state = torch.randn(2, 6, 4)
    inputs = torch.cat([state, x.transpose(1, 2)], dim=-1)
    conv = torch.nn.functional.conv1d(inputs, weight.unsqueeze(1), bias, groups=6)
    y_ref = torch.nn.functional.silu(conv[..., -length:]).transpose(1, 2)
    y = kda_ops.causal_conv1d_update_inplace(x, state, weight, bias)
    torch.testing.assert_close(y, y_ref)
    torch.testing.assert_close(state, inputs[..., -4:], rtol=0, atol=0)


def test_conv_update_inplace_rejects_a_state_shorter_than_the_window():
    with pytest.raises(ValueError, match="S >= W - 1"):
        state = torch.randn(2, 6, 2)
        kda_ops.causal_conv1d_update_inplace(torch.randn(2, 6), state, torch.randn(6, 4))


def test_recurrent_inplace_bf16_pool_rounds_once_per_step():
    x = delta_rule_inputs(batch=2, length=1, dtype=torch.float32)
    pool16 = torch.randn(3, 2, 8, 4).bfloat16()
    start = pool16.float()
    indices = torch.tensor([2, 0])
    args = (x.q, x.k, x.v, x.g, x.beta)
    o16 = kda_ops.fused_recurrent_kda_inplace(*args, pool16, indices)
    # Same as an fp32 step from the bf16 states, rounded to bf16 on write-back.
    o32 = kda_ops.fused_recurrent_kda_inplace(*args, start, indices)
    torch.testing.assert_close(o16, o32, rtol=0, atol=0)
    assert pool16.dtype == torch.bfloat16
    assert torch.equal(pool16, start.bfloat16())
