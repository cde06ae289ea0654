"""Bad input raises ValueError / TypeError naming the argument, before any kernel runs."""

import pytest
import torch

import kda_ops
from kda_ops.arguments import host_seqlens
from kda_ops.validation import (
    CHECK_SEQLENS_ENV,
    ArgumentChecker,
    check_delta_rule,
    check_device_seqlens,
)
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


BAD_OFFSETS = [
    ([1, 3, 6], "`cu_seqlens` must start at 0, got 1"),
    ([0, 4, 2, 6], r"`cu_seqlens` must be non-decreasing, got cu_seqlens\[1\] = 4 > "),
    ([0, 3, 5], "`cu_seqlens` must end at the packed length T = 6, got 5"),
    ([0, 3, 7], "`cu_seqlens` must end at the packed length T = 6, got 7"),
]


@pytest.mark.parametrize("function", DELTA_RULE_FUNCTIONS)
@pytest.mark.parametrize(("offsets", "message"), BAD_OFFSETS)
def test_host_cu_seqlens_values(function, offsets, message):
    """A CPU cu_seqlens is on the host: its offsets are checked with no sync to pay."""
    one = delta_rule_inputs(length=6, dtype=torch.float32)
    with pytest.raises(ValueError, match=message):
        call(function, one, cu_seqlens=torch.tensor(offsets))


@pytest.mark.parametrize("function", DELTA_RULE_FUNCTIONS)
def test_cu_seqlens_must_be_on_the_inputs_device(function):
    one = delta_rule_inputs(length=6, dtype=torch.float32)
    with pytest.raises(ValueError, match="`q` is on cpu but `cu_seqlens` is on meta"):
        call(function, one, cu_seqlens=torch.tensor([0, 3, 6], device="meta"))


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_valid_cu_seqlens_pass_including_an_empty_sequence(dtype):
    one = delta_rule_inputs(length=6, dtype=torch.float32)
    for function in DELTA_RULE_FUNCTIONS:
        o, _ = call(function, one, cu_seqlens=torch.tensor([0, 2, 2, 6], dtype=dtype))
        assert o.shape == one.v.shape


@pytest.mark.parametrize(("offsets", "message"), BAD_OFFSETS[:2])
def test_cu_seqlens_cpu_values(offsets, message):
    """FLA's host copy: checked under its own name."""
    one = delta_rule_inputs(length=6, dtype=torch.float32)
    host = torch.tensor(offsets)
    with pytest.raises(ValueError, match=message.replace("cu_seqlens", "cu_seqlens_cpu")):
        valid = torch.linspace(0, 6, len(offsets)).long()
        call(kda_ops.chunk_kda, one, cu_seqlens=valid, cu_seqlens_cpu=host)


def test_cu_seqlens_cpu_end_is_checked_against_the_length():
    check = ArgumentChecker("f")
    host = torch.tensor([0, 3, 5])
    with pytest.raises(ValueError, match="`cu_seqlens_cpu` must end at the packed length T = 6"):
        host_seqlens(check, host, host, length=6)
    host_seqlens(check, host, host, length=5)
    # chunk_kda passes its T: a host copy that ends short of it is caught there too
    one = delta_rule_inputs(length=6, dtype=torch.float32)
    with pytest.raises(ValueError, match="`cu_seqlens_cpu` must end at the packed length T = 6"):
        call(kda_ops.chunk_kda, one, cu_seqlens=torch.tensor([0, 3, 5]), cu_seqlens_cpu=host)


def test_cu_seqlens_cpu_kind_errors():
    one = delta_rule_inputs(length=6, dtype=torch.float32)
    device = torch.tensor([0, 3, 6])
    with pytest.raises(TypeError, match="`cu_seqlens_cpu` must have dtype in"):
        call(kda_ops.chunk_kda, one, cu_seqlens=device, cu_seqlens_cpu=device.float())
    with pytest.raises(ValueError, match="`cu_seqlens_cpu` must be 1-D"):
        call(kda_ops.chunk_kda, one, cu_seqlens=device, cu_seqlens_cpu=device[None])
    with pytest.raises(ValueError, match="`cu_seqlens_cpu` must be on the CPU"):
        call(kda_ops.chunk_kda, one, cu_seqlens=device, cu_seqlens_cpu=device.to("meta"))
    with pytest.raises(ValueError, match="`cu_seqlens_cpu` needs `cu_seqlens`"):
        call(kda_ops.chunk_kda, one, cu_seqlens_cpu=device)


def test_device_cu_seqlens_values_are_read_only_in_the_debug_mode(monkeypatch):
    """Off by default a device cu_seqlens is never copied to the host (no sync); in the
    debug mode it is, and checked."""
    copied = []

    class OnDevice(torch.Tensor):
        """Offsets that say they are on a GPU and record their host copies (CI has none)."""

        @property
        def device(self):
            return torch.device("cuda", 0)

        def cpu(self):
            copied.append(True)
            return self.as_subclass(torch.Tensor)

    check = ArgumentChecker("f")
    bad = torch.tensor([1, 3, 6]).as_subclass(OnDevice)
    monkeypatch.delenv(CHECK_SEQLENS_ENV, raising=False)
    assert not check_device_seqlens()
    check.cu_seqlens(bad, batch=1, length=6)
    assert copied == []
    monkeypatch.setenv(CHECK_SEQLENS_ENV, "1")
    assert check_device_seqlens()
    with pytest.raises(ValueError, match="`cu_seqlens` must start at 0, got 1"):
        check.cu_seqlens(bad, batch=1, length=6)
    assert copied == [True]


def test_context_parallel_offsets_are_left_to_the_caller():
    """chunk_kda_cp's global offsets span every rank's tokens: it checks them against
    the ranks' total itself, so the shared checks read no value of them."""
    one = delta_rule_inputs(length=6, dtype=torch.float32)
    args = (one.q, one.k, one.v, one.g, one.beta)
    gate = dict(A_log=None, dt_bias=None, lower_bound=None, use_gate_in_kernel=False)
    offsets = torch.tensor([0, 4, 12])
    assert check_delta_rule("f", *args, cu_seqlens=offsets, global_offsets=True, **gate) == 2
    with pytest.raises(ValueError, match="`cu_seqlens` must end at the packed length T = 6"):
        check_delta_rule("f", *args, cu_seqlens=offsets, **gate)


def test_conv_cu_seqlens_values():
    x, weight = torch.randn(1, 5, 6), torch.randn(6, 4)
    with pytest.raises(ValueError, match="`cu_seqlens` must end at the packed length T = 5"):
        kda_ops.causal_conv1d(x, weight, cu_seqlens=torch.tensor([0, 2, 4]))
    with pytest.raises(ValueError, match="`cu_seqlens` must be non-decreasing"):
        kda_ops.causal_conv1d(x, weight, cu_seqlens=torch.tensor([0, 3, 2, 5]))


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
