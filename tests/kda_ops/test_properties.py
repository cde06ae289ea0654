"""Property tests on random shapes (hypothesis)."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch._subclasses.fake_tensor import FakeTensorMode

import kda_ops
from tests.kda_ops.inputs import delta_rule_inputs

SETTINGS = settings(max_examples=25, deadline=None)

shapes = st.fixed_dictionaries(
    {
        "batch": st.integers(1, 3),
        "length": st.integers(1, 140),
        "heads": st.integers(1, 2),
        "group": st.integers(1, 3),
        "head_k": st.sampled_from([1, 4, 8, 16]),
        "head_v": st.sampled_from([1, 3, 8]),
        "scalar_gate": st.booleans(),
        "raw_gate": st.booleans(),
    }
)


def make(shape):
    return delta_rule_inputs(
        batch=shape["batch"], length=shape["length"], heads=shape["heads"],
        value_heads=shape["heads"] * shape["group"], head_k=shape["head_k"],
        head_v=shape["head_v"], scalar_gate=shape["scalar_gate"], raw_gate=shape["raw_gate"],
        unit_qk=not shape["raw_gate"],
    )  # fmt: skip


def options(x, raw_gate):
    return dict(
        initial_state=x.initial_state, output_final_state=True,
        use_qk_l2norm_in_kernel=raw_gate, use_gate_in_kernel=raw_gate,
        use_beta_sigmoid_in_kernel=raw_gate, A_log=x.A_log, dt_bias=x.dt_bias,
    )  # fmt: skip


@SETTINGS
@given(shapes)
def test_chunk_equals_recurrent_on_random_shapes(shape):
    x = make(shape)
    args = (x.q, x.k, x.v, x.g, x.beta)
    o_chunk, s_chunk = kda_ops.chunk_kda(*args, **options(x, shape["raw_gate"]))
    o_rec, s_rec = kda_ops.fused_recurrent_kda(*args, **options(x, shape["raw_gate"]))
    torch.testing.assert_close(o_chunk, o_rec, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(s_chunk, s_rec, rtol=1e-9, atol=1e-9)
    assert o_chunk.shape == x.v.shape and s_chunk.shape == x.initial_state.shape


@SETTINGS
@given(st.lists(st.integers(0, 70), min_size=1, max_size=4), st.booleans())
def test_varlen_equals_split_runs(lengths, raw_gate):
    bounds = torch.tensor([0, *lengths]).cumsum(0)
    x = delta_rule_inputs(length=int(bounds[-1]), n_seqs=len(lengths), raw_gate=raw_gate)
    o, states = kda_ops.chunk_kda(
        x.q, x.k, x.v, x.g, x.beta, cu_seqlens=bounds, **options(x, raw_gate)
    )
    for n in range(len(lengths)):
        start, end = int(bounds[n]), int(bounds[n + 1])
        piece = (t[:, start:end] for t in (x.q, x.k, x.v, x.g, x.beta))
        single = options(x, raw_gate) | {"initial_state": x.initial_state[n : n + 1]}
        o_n, s_n = kda_ops.fused_recurrent_kda(*piece, **single)
        torch.testing.assert_close(o[:, start:end], o_n, rtol=1e-9, atol=1e-9)
        torch.testing.assert_close(states[n : n + 1], s_n, rtol=1e-9, atol=1e-9)


@settings(max_examples=10, deadline=None)
@given(shapes)
def test_fake_kernels_agree_with_real_shapes(shape):
    x = make(shape)
    real = kda_ops.chunk_kda(x.q, x.k, x.v, x.g, x.beta, **options(x, shape["raw_gate"]))
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake_inputs = make(shape)
        for name, t in vars(fake_inputs).items():
            setattr(fake_inputs, name, mode.from_tensor(t))
        fake = kda_ops.chunk_kda(
            fake_inputs.q, fake_inputs.k, fake_inputs.v, fake_inputs.g, fake_inputs.beta,
            **options(fake_inputs, shape["raw_gate"]),
        )  # fmt: skip
    for r, f in zip(real, fake):
        assert (r.shape, r.dtype) == (f.shape, f.dtype)
        assert r.is_contiguous() and f.is_contiguous()


@SETTINGS
@given(st.integers(1, 3), st.integers(1, 12), st.integers(1, 9), st.integers(2, 5))
def test_conv_prefill_then_updates_equals_one_prefill(batch, length, channels, width):
    x = torch.randn(batch, length + 1, channels, dtype=torch.float64)
    weight = torch.randn(channels, width, dtype=torch.float64)
    whole, whole_state = kda_ops.causal_conv1d(x, weight)
    head, state = kda_ops.causal_conv1d(x[:, :length], weight)
    last, state = kda_ops.causal_conv1d_update(x[:, length], state, weight)
    torch.testing.assert_close(torch.cat([head, last[:, None]], dim=1), whole)
    torch.testing.assert_close(state, whole_state)
