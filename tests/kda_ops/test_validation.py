"""Bad input raises ValueError / TypeError naming the argument, before any kernel runs."""

import pytest
import torch

import kda_ops
from tests.kda_ops.inputs import delta_rule_inputs


def call(function, x, **overrides):
    args = dict(q=x.q, k=x.k, v=x.v, g=x.g, beta=x.beta)
    args.update(overrides)
    return function(**args)


DELTA_RULE_FUNCTIONS = [kda_ops.chunk_kda, kda_ops.fused_recurrent_kda]


@pytest.fixture
def x():
    return delta_rule_inputs(batch=2, length=6, heads=2, value_heads=4, dtype=torch.float32)


@pytest.mark.parametrize("function", DELTA_RULE_FUNCTIONS)
@pytest.mark.parametrize(
    ("name", "make_bad", "message"),
    [
        ("k", lambda x: x.k[:, :, :, :4], "`k` must have shape"),
        ("v", lambda x: x.v[:, :5], "`v` must have shape"),
        ("g", lambda x: x.g[..., :3], "`g` must have shape"),
        ("beta", lambda x: x.beta[..., :1], "`beta` must have shape"),
        ("q", lambda x: x.q[0], "`q` must be 4-D"),
        ("v", lambda x: torch.randn(2, 6, 3, 4), "multiple of the q/k heads"),
        ("q", lambda x: torch.randn(2, 6, 2, 257), "K = 257 exceeds 256"),
        ("v", lambda x: torch.randn(2, 6, 4, 300), "V = 300 exceeds 256"),
    ],
)
def test_shape_errors(function, x, name, make_bad, message):
    bad = make_bad(x)
    overrides = {name: bad}
    if name == "q":
        overrides["k"] = bad
    with pytest.raises(ValueError, match=message):
        call(function, x, **overrides)


@pytest.mark.parametrize("function", DELTA_RULE_FUNCTIONS)
def test_type_errors(function, x):
    with pytest.raises(TypeError, match=r"`q` must be a torch\.Tensor, got list"):
        call(function, x, q=x.q.tolist())
    with pytest.raises(TypeError, match="`beta` must have dtype in"):
        call(function, x, beta=x.beta.int())


@pytest.mark.parametrize("function", DELTA_RULE_FUNCTIONS)
def test_state_must_be_a_float_with_the_right_shape(function, x):
    with pytest.raises(TypeError, match=r"`initial_state` must have dtype in \(torch\.float32\)"):
        call(function, x, initial_state=x.initial_state.int())
    with pytest.raises(ValueError, match="`initial_state` must have shape"):
        call(function, x, initial_state=x.initial_state[:1])


@pytest.mark.parametrize("function", DELTA_RULE_FUNCTIONS)
def test_cu_seqlens_rules(function, x):
    with pytest.raises(ValueError, match="with `cu_seqlens` the batch size must be 1"):
        call(function, x, cu_seqlens=torch.tensor([0, 6]))
    one = delta_rule_inputs(length=6, dtype=torch.float32)
    with pytest.raises(TypeError, match="`cu_seqlens` must have dtype in"):
        call(function, one, cu_seqlens=torch.tensor([0.0, 6.0]))
    with pytest.raises(ValueError, match="`cu_seqlens` must be 1-D"):
        call(function, one, cu_seqlens=torch.tensor([[0, 6]]))


@pytest.mark.parametrize("function", DELTA_RULE_FUNCTIONS)
def test_gate_flag_rules(function, x):
    with pytest.raises(ValueError, match="`use_gate_in_kernel=True` needs `A_log`"):
        call(function, x, use_gate_in_kernel=True)
    gate = dict(use_gate_in_kernel=True, A_log=x.A_log, dt_bias=x.dt_bias)
    for bound in (0.0, 5.0):
        with pytest.raises(ValueError, match="`lower_bound` must be negative"):
            call(function, x, lower_bound=bound, **gate)
    with pytest.raises(ValueError, match="`A_log` must have shape"):
        call(function, x, use_gate_in_kernel=True, A_log=x.A_log[:2])
    with pytest.raises(ValueError, match="`dt_bias` must have shape"):
        call(function, x, use_gate_in_kernel=True, A_log=x.A_log, dt_bias=x.dt_bias[:4])


def test_safe_gate_needs_bound_in_range(x):
    gate = dict(use_gate_in_kernel=True, A_log=x.A_log, safe_gate=True)
    with pytest.raises(ValueError, match="`safe_gate=True` needs `lower_bound` in"):
        call(kda_ops.chunk_kda, x, lower_bound=-8.0, **gate)


@pytest.mark.parametrize("function", DELTA_RULE_FUNCTIONS)
def test_tensors_on_different_devices(function, x):
    with pytest.raises(ValueError, match="`q` is on cpu but `v` is on meta"):
        call(function, x, v=x.v.to("meta"))
    with pytest.raises(ValueError, match="`initial_state` is on meta"):
        call(function, x, initial_state=x.initial_state.to("meta"))


def test_inplace_pool_rules(x):
    args = (x.q, x.k, x.v, x.g, x.beta)
    pool = torch.zeros(5, 4, 8, 4)
    with pytest.raises(ValueError, match="`state_indices` must have shape"):
        kda_ops.fused_recurrent_kda_inplace(*args, pool, torch.tensor([0, 1, 2]))
    with pytest.raises(TypeError, match="`state_indices` must have dtype in"):
        kda_ops.fused_recurrent_kda_inplace(*args, pool, torch.tensor([0.0, 1.0]))
    with pytest.raises(TypeError, match=r"`state_pool` must have dtype in \(torch\.float32, "):
        kda_ops.fused_recurrent_kda_inplace(*args, pool.half(), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="`state_pool` must have shape"):
        kda_ops.fused_recurrent_kda_inplace(*args, pool)  # no indices: P must equal N


def test_gate_errors():
    g = torch.randn(2, 3, 4, 8)
    with pytest.raises(ValueError, match="`A_log` must have shape"):
        kda_ops.kda_gate(g, torch.randn(3))
    with pytest.raises(ValueError, match="`dt_bias` must have shape"):
        kda_ops.kda_gate(g, torch.randn(4), torch.randn(8))
    with pytest.raises(ValueError, match="`lower_bound` must be negative"):
        kda_ops.kda_gate(g, torch.randn(4), lower_bound=1.0)
    with pytest.raises(ValueError, match="`g` must be"):
        kda_ops.kda_gate(torch.randn(4), torch.randn(4))


def test_gated_rms_norm_errors():
    x = torch.randn(2, 4, 16)
    with pytest.raises(ValueError, match="`gate` must have shape"):
        kda_ops.gated_rms_norm(x, x[..., :8], torch.ones(16))
    with pytest.raises(ValueError, match="`weight` must have shape"):
        kda_ops.gated_rms_norm(x, x, torch.ones(8))
    with pytest.raises(ValueError, match="`activation` must be one of"):
        kda_ops.gated_rms_norm(x, x, torch.ones(16), activation="relu")
    with pytest.raises(ValueError, match="`weight` is on meta"):
        kda_ops.gated_rms_norm(x, x, torch.ones(16, device="meta"))


def test_conv_errors():
    x, weight = torch.randn(2, 5, 6), torch.randn(6, 4)
    with pytest.raises(ValueError, match="`weight` must have shape"):
        kda_ops.causal_conv1d(x, torch.randn(5, 4))
    with pytest.raises(ValueError, match="`bias` must have shape"):
        kda_ops.causal_conv1d(x, weight, torch.randn(5))
    with pytest.raises(ValueError, match="`initial_state` must have shape"):
        kda_ops.causal_conv1d(x, weight, initial_state=torch.randn(2, 6, 4))
    with pytest.raises(ValueError, match="`activation` must be one of"):
        kda_ops.causal_conv1d(x, weight, activation="gelu")
    with pytest.raises(ValueError, match="with `cu_seqlens` the batch size must be 1"):
        kda_ops.causal_conv1d(x, weight, cu_seqlens=torch.tensor([0, 5]))
    with pytest.raises(ValueError, match="`conv_state` must have shape"):
        kda_ops.causal_conv1d_update(x[:, 0], torch.randn(2, 6, 4), weight)
    with pytest.raises(ValueError, match="`x` must be 2 or 3-D"):
        kda_ops.causal_conv1d_update(x[0, 0], torch.randn(2, 6, 3), weight)
    with pytest.raises(ValueError, match="`state_indices` must have shape"):
        pool = torch.randn(4, 6, 3)
        kda_ops.causal_conv1d_update_inplace(x[:, 0], pool, weight, state_indices=torch.tensor([1]))
