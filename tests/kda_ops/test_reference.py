"""The math contract: the seeds' executable examples, chunk form == recurrent form, and
the reference against independent formulations."""

import itertools

import pytest
import torch
import torch.nn.functional as F

import kda_ops
from kda_ops import reference
from tests.kda_ops.inputs import delta_rule_inputs
from tests.sweeps import sweep


def seed_delta_scan(keys, values, beta, state=None):
    """The seed's delta rule, verbatim in spirit: no decay, read after write."""
    state = values.new_zeros(keys.size(1), values.size(1)) if state is None else state
    output = []
    for key, value, rate in zip(keys, values, beta):
        state = state + rate * torch.outer(key, value - key @ state)
        output.append(key @ state)
    return torch.stack(output), state


def run_single_head(keys, values, beta, log_decay=None, state=None, op=kda_ops.chunk_kda):
    """Runs [T, K] keys / [T, V] values through a kda_ops function as B = H = 1, q = k."""
    length, head_k = keys.shape
    as_batch = lambda x: x[None, :, None]  # noqa: E731
    g = torch.zeros(length, head_k, dtype=keys.dtype) if log_decay is None else log_decay
    o, final = op(
        as_batch(keys), as_batch(keys), as_batch(values), as_batch(g), beta[None, :, None],
        scale=1.0, initial_state=None if state is None else state[None, None],
        output_final_state=True,
    )  # fmt: skip
    return o[0, :, 0], final[0, 0]


@pytest.mark.parametrize("op", [kda_ops.chunk_kda, kda_ops.fused_recurrent_kda])
def test_seed_overwrite_example(op):
    keys = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 0.0]])
    values = torch.tensor([[2.0, 3.0], [-1.0, 4.0], [7.0, 5.0]])
    whole, final = run_single_head(keys, values, torch.ones(3), op=op)
    # The second write to key e0 overwrites 2, 3 with 7, 5.
    torch.testing.assert_close(final, torch.tensor([[7.0, 5.0], [-1.0, 4.0]]))
    torch.testing.assert_close(whole, torch.tensor([[2.0, 3.0], [-1.0, 4.0], [7.0, 5.0]]))
    left, middle = run_single_head(keys[:2], values[:2], torch.ones(2), op=op)
    right, chunked = run_single_head(keys[2:], values[2:], torch.ones(1), state=middle, op=op)
    torch.testing.assert_close(torch.cat((left, right)), whole)
    torch.testing.assert_close(chunked, final)


def test_recurrence_matches_seed_delta_scan_without_decay():
    keys = F.normalize(torch.randn(40, 6, dtype=torch.float64), dim=-1)
    values, beta = torch.randn(40, 3, dtype=torch.float64), torch.rand(40, dtype=torch.float64)
    expected, expected_state = seed_delta_scan(keys, values, beta)
    for op in (kda_ops.chunk_kda, kda_ops.fused_recurrent_kda):
        out, state = run_single_head(keys, values, beta, op=op)
        torch.testing.assert_close(out, expected)
        torch.testing.assert_close(state, expected_state)


def seed_kda_fragments(keys, values, beta, alpha):
    eye = torch.eye(keys.size(1), dtype=keys.dtype)
    transition = torch.stack(
        [(eye - r * torch.outer(k, k)) @ torch.diag(a) for k, r, a in zip(keys, beta, alpha)]
    )
    write = torch.stack([r * torch.outer(k, v) for k, v, r in zip(keys, values, beta)])
    return transition, write


def seed_summarize(transition, write):
    matrix, state = torch.eye(transition.size(-1), dtype=write.dtype), torch.zeros_like(write[0])
    for current, update in zip(transition, write):
        matrix, state = current @ matrix, current @ state + update
    return matrix, state


def compose(right, left):
    return right[0] @ left[0], right[0] @ left[1] + right[1]


def segment_affine_map(keys, values, beta, log_decay):
    """(M, E) of a segment from kda_ops alone: E runs from a zero state; M is the state
    reached from the identity with zero values, since then S_end = M S_0."""
    _, zero_state_end = run_single_head(keys, values, beta, log_decay)
    identity = torch.eye(keys.shape[1], dtype=keys.dtype)
    _, transition = run_single_head(keys, torch.zeros_like(keys), beta, log_decay, identity)
    return transition, zero_state_end


def test_seed_kcp_affine_composition():
    dtype = torch.float64
    keys = F.normalize(torch.randn(8, 3, dtype=dtype), dim=-1)
    values, beta = torch.randn(8, 3, dtype=dtype), torch.sigmoid(torch.randn(8, dtype=dtype))
    log_decay = -2 * torch.sigmoid(torch.randn(8, 3, dtype=dtype))
    # The seed's explicit construction agrees with kda_ops on the whole sequence.
    whole = seed_summarize(*seed_kda_fragments(keys, values, beta, log_decay.exp()))
    _, whole_state = run_single_head(keys, values, beta, log_decay)
    torch.testing.assert_close(whole_state, whole[1])
    # Composition of the two segments' affine maps is the whole run.
    left = segment_affine_map(keys[:3], values[:3], beta[:3], log_decay[:3])
    right = segment_affine_map(keys[3:], values[3:], beta[3:], log_decay[3:])
    merged = compose(right, left)
    torch.testing.assert_close(merged[0], whole[0])
    torch.testing.assert_close(merged[1], whole_state)
    # The plain sum of zero-state segment states is wrong.
    assert not torch.allclose(left[1] + right[1], whole_state)


LENGTHS = [1, 2, 15, 16, 63, 64, 65, 130, 300]


VARIANTS = ["kda", "kda_softplus_gate", "kda_safe_gate", "gdn", "gdn_gate", "gva", "no_state"]


# By default: every variant at 130 tokens (two whole chunks and a partial one), and KDA at
# every length (chunk boundaries); the rest of the grid is exhaustive.
@pytest.mark.parametrize(
    ("length", "variant"),
    sweep(
        LENGTHS,
        VARIANTS,
        keep=[*((130, v) for v in VARIANTS), *((n, "kda") for n in LENGTHS if n != 130)],
    ),
)
def test_chunk_equals_recurrent(length, variant):
    scalar_gate = variant.startswith("gdn")
    raw_gate = variant in ("kda_softplus_gate", "kda_safe_gate", "gdn_gate")
    x = delta_rule_inputs(
        length=length, heads=2, value_heads=4 if variant == "gva" else 2,
        scalar_gate=scalar_gate, raw_gate=raw_gate, unit_qk=not raw_gate,
    )  # fmt: skip
    kwargs = dict(
        initial_state=None if variant == "no_state" else x.initial_state,
        output_final_state=True,
        use_qk_l2norm_in_kernel=raw_gate,
        use_gate_in_kernel=raw_gate,
        use_beta_sigmoid_in_kernel=raw_gate,
        A_log=x.A_log,
        dt_bias=x.dt_bias,
        lower_bound=-5.0 if variant == "kda_safe_gate" else None,
    )
    args = (x.q, x.k, x.v, x.g, x.beta)
    o_chunk, s_chunk = kda_ops.chunk_kda(*args, **kwargs)
    o_rec, s_rec = kda_ops.fused_recurrent_kda(*args, **kwargs)
    torch.testing.assert_close(o_chunk, o_rec, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(s_chunk, s_rec, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("op", [kda_ops.chunk_kda, kda_ops.fused_recurrent_kda])
def test_varlen_equals_per_sequence_loop(op):
    bounds = [0, 1, 17, 80, 150]
    x = delta_rule_inputs(length=bounds[-1], n_seqs=len(bounds) - 1, raw_gate=True, unit_qk=False)
    kwargs = dict(
        output_final_state=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
        use_beta_sigmoid_in_kernel=True, A_log=x.A_log, dt_bias=x.dt_bias, lower_bound=-5.0,
    )  # fmt: skip
    o, states = op(
        x.q, x.k, x.v, x.g, x.beta, initial_state=x.initial_state,
        cu_seqlens=torch.tensor(bounds), **kwargs,
    )  # fmt: skip
    for n, (start, end) in enumerate(itertools.pairwise(bounds)):
        piece = (t[:, start:end] for t in (x.q, x.k, x.v, x.g, x.beta))
        o_n, s_n = op(*piece, initial_state=x.initial_state[n : n + 1], **kwargs)
        torch.testing.assert_close(o[:, start:end], o_n)
        torch.testing.assert_close(states[n : n + 1], s_n)


def test_gva_equals_repeated_qk_heads():
    x = delta_rule_inputs(length=40, heads=2, value_heads=6)
    o, s = kda_ops.chunk_kda(x.q, x.k, x.v, x.g, x.beta, output_final_state=True)
    # Value heads 0-2 read q/k head 0 and 3-5 read head 1.
    q, k = (t.repeat_interleave(3, dim=2) for t in (x.q, x.k))
    o_mha, s_mha = kda_ops.chunk_kda(q, k, x.v, x.g, x.beta, output_final_state=True)
    torch.testing.assert_close(o, o_mha)
    torch.testing.assert_close(s, s_mha)


def test_gdn_scalar_gate_equals_broadcast_kda_gate():
    x = delta_rule_inputs(length=70, scalar_gate=True)
    o, s = kda_ops.chunk_kda(x.q, x.k, x.v, x.g, x.beta, output_final_state=True)
    g = x.g.unsqueeze(-1).expand_as(x.q)
    o_kda, s_kda = kda_ops.chunk_kda(x.q, x.k, x.v, g, x.beta, output_final_state=True)
    torch.testing.assert_close(o, o_kda)
    torch.testing.assert_close(s, s_kda)


def test_in_kernel_options_equal_explicit_preprocessing():
    x = delta_rule_inputs(length=33, raw_gate=True, unit_qk=False)
    o, s = kda_ops.chunk_kda(
        x.q, x.k, x.v, x.g, x.beta, initial_state=x.initial_state, output_final_state=True,
        use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
        A_log=x.A_log, dt_bias=x.dt_bias,
    )  # fmt: skip
    # FLA's l2norm: eps inside the sqrt, added to the sum of squares.
    l2 = lambda t: t / torch.sqrt((t * t).sum(-1, keepdim=True) + 1e-6)  # noqa: E731
    log_decay = -x.A_log.exp()[:, None] * F.softplus(x.g + x.dt_bias.view(2, 8))
    o_ref, s_ref = kda_ops.chunk_kda(
        l2(x.q), l2(x.k), x.v, log_decay, torch.sigmoid(x.beta),
        initial_state=x.initial_state, output_final_state=True,
    )  # fmt: skip
    torch.testing.assert_close(o, o_ref)
    torch.testing.assert_close(s, s_ref)


def test_default_scale_is_inverse_sqrt_head_dim():
    x = delta_rule_inputs(length=5, head_k=16)
    o_default, _ = kda_ops.chunk_kda(x.q, x.k, x.v, x.g, x.beta)
    o_explicit, _ = kda_ops.chunk_kda(x.q, x.k, x.v, x.g, x.beta, scale=0.25)
    torch.testing.assert_close(o_default, o_explicit)


def test_final_state_is_none_unless_requested():
    x = delta_rule_inputs(length=5)
    for op in (kda_ops.chunk_kda, kda_ops.fused_recurrent_kda):
        assert op(x.q, x.k, x.v, x.g, x.beta)[1] is None


def test_extreme_gates_stay_finite():
    x = delta_rule_inputs(length=130, raw_gate=True, unit_qk=False)
    for lower_bound in (None, -5.0):
        for sign in (1, -1):
            o, s = kda_ops.chunk_kda(
                x.q, x.k, x.v, torch.full_like(x.g, 30.0 * sign), x.beta,
                output_final_state=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                use_beta_sigmoid_in_kernel=True, A_log=x.A_log, dt_bias=x.dt_bias,
                lower_bound=lower_bound,
            )  # fmt: skip
            assert torch.isfinite(o).all() and torch.isfinite(s).all()


def test_low_precision_inputs_accumulate_in_fp32():
    x64 = delta_rule_inputs(length=70)
    expected, expected_state = kda_ops.chunk_kda(
        x64.q, x64.k, x64.v, x64.g, x64.beta, output_final_state=True
    )
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        x = [t.to(dtype) for t in (x64.q, x64.k, x64.v, x64.g, x64.beta)]
        o, s = kda_ops.chunk_kda(*x, output_final_state=True)
        assert o.dtype == dtype and s.dtype == torch.float32
        error = (o.double() - expected).norm() / expected.norm()
        assert error < 1e-2, (dtype, error)
        assert (s.double() - expected_state).norm() / expected_state.norm() < 1e-2


def test_kda_gate_formulas():
    g = torch.randn(3, 5, 4, 8, dtype=torch.float64)
    A_log, dt_bias = torch.randn(4, dtype=torch.float64), torch.randn(32, dtype=torch.float64)
    shifted = g + dt_bias.view(4, 8)
    rate = A_log.exp()[:, None]
    torch.testing.assert_close(kda_ops.kda_gate(g, A_log, dt_bias), -rate * F.softplus(shifted))
    torch.testing.assert_close(
        kda_ops.kda_gate(g, A_log, dt_bias, lower_bound=-5.0),
        -5.0 * torch.sigmoid(rate * shifted),
    )
    torch.testing.assert_close(kda_ops.kda_gate(g, A_log), -rate * F.softplus(g))
    assert kda_ops.kda_gate(g.bfloat16(), A_log.float()).dtype == torch.float32


@pytest.mark.parametrize("activation", ["sigmoid", "silu"])
def test_gated_rms_norm_formula(activation):
    x, gate = torch.randn(2, 3, 4, 16, dtype=torch.float64).unbind(0)[:2]
    weight = torch.randn(16, dtype=torch.float64)
    act = torch.sigmoid if activation == "sigmoid" else F.silu
    expected = F.rms_norm(x, (16,), weight, eps=1e-5) * act(gate)
    torch.testing.assert_close(kda_ops.gated_rms_norm(x, gate, weight, 1e-5, activation), expected)
    low = kda_ops.gated_rms_norm(x.bfloat16(), gate.bfloat16(), weight.float(), 1e-5, activation)
    assert low.dtype == torch.bfloat16
    torch.testing.assert_close(low.double(), expected, rtol=2e-2, atol=2e-2)


def conv1d_oracle(x, weight, bias, history):
    """torch's grouped conv1d over [history, x] with channels first."""
    padded = torch.cat([history, x.transpose(1, 2)], dim=-1)
    return F.silu(F.conv1d(padded, weight[:, None], bias, groups=weight.shape[0])).transpose(1, 2)


@pytest.mark.parametrize("width", [2, 4])
@pytest.mark.parametrize("length", [1, 2, 7])
def test_causal_conv1d_matches_grouped_conv(width, length):
    x = torch.randn(2, length, 6, dtype=torch.float64)
    weight, bias = torch.randn(6, width, dtype=torch.float64), torch.randn(6, dtype=torch.float64)
    history = torch.randn(2, 6, width - 1, dtype=torch.float64)
    y, final = kda_ops.causal_conv1d(x, weight, bias, initial_state=history)
    torch.testing.assert_close(y, conv1d_oracle(x, weight, bias, history))
    everything = torch.cat([history, x.transpose(1, 2)], dim=-1)
    torch.testing.assert_close(final, everything[..., -(width - 1) :])
    y0, _ = kda_ops.causal_conv1d(x, weight, bias)
    torch.testing.assert_close(y0, conv1d_oracle(x, weight, bias, torch.zeros_like(history)))


def test_causal_conv1d_varlen_and_update_chain():
    bounds = [0, 2, 9, 12]
    x = torch.randn(1, 12, 5, dtype=torch.float64)
    weight = torch.randn(5, 4, dtype=torch.float64)
    history = torch.randn(3, 5, 3, dtype=torch.float64)
    y, final = kda_ops.causal_conv1d(
        x, weight, initial_state=history, cu_seqlens=torch.tensor(bounds)
    )
    for n, (s, e) in enumerate(itertools.pairwise(bounds)):
        y_n, final_n = kda_ops.causal_conv1d(x[:, s:e], weight, initial_state=history[n : n + 1])
        torch.testing.assert_close(y[:, s:e], y_n)
        torch.testing.assert_close(final[n : n + 1], final_n)
    # Prefill then token-by-token updates equal one prefill over everything.
    x2 = torch.randn(2, 10, 5, dtype=torch.float64)
    whole, whole_state = kda_ops.causal_conv1d(x2, weight)
    out, state = kda_ops.causal_conv1d(x2[:, :6], weight)
    steps = [out]
    for t in range(6, 10):
        y_t, state = kda_ops.causal_conv1d_update(x2[:, t], state, weight)
        steps.append(y_t[:, None])
    torch.testing.assert_close(torch.cat(steps, dim=1), whole)
    torch.testing.assert_close(state, whole_state)


def test_chunk_reference_handles_any_chunk_size():
    x = delta_rule_inputs(length=50)
    prepared = reference.prepare_delta_rule_inputs(
        x.q, x.k, x.v, x.g, x.beta, None, None, None, False, False
    )
    expected = reference.recurrent_delta_rule(*prepared, 0.5, x.initial_state)
    for chunk_size in (1, 16, 64):
        got = reference.chunk_delta_rule(*prepared, 0.5, x.initial_state, chunk_size)
        torch.testing.assert_close(got[0], expected[0])
        torch.testing.assert_close(got[1], expected[1])
