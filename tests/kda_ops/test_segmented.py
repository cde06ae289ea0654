"""Segment affine maps (kda_ops.affine) and in-device context parallelism
(kda_ops.segmented): equal to chunk_kda in float64, outputs, final states and gradients."""

import pytest
import torch

import kda_ops
from kda_ops.affine import prefix_adjoints, prefix_states, segment_maps
from kda_ops.arguments import delta_rule_arguments
from kda_ops.segmented import chunk_kda_segmented, plan_segments
from tests.kda_ops.inputs import delta_rule_inputs
from tests.sweeps import sweep

OPTIONS = {
    "plain": {},
    "in_kernel": {
        "use_qk_l2norm_in_kernel": True,
        "use_gate_in_kernel": True,
        "use_beta_sigmoid_in_kernel": True,
        "lower_bound": -5.0,
    },
}


def _kwargs(x, variant, initial_state):
    kwargs = dict(OPTIONS[variant], output_final_state=True)
    if variant == "in_kernel":
        kwargs.update(A_log=x.A_log, dt_bias=x.dt_bias)
    if initial_state:
        kwargs["initial_state"] = x.initial_state
    return kwargs


def _inputs(variant, **kw):
    return delta_rule_inputs(raw_gate=variant == "in_kernel", **kw)


@pytest.mark.parametrize(
    ("variant", "length_segments", "initial_state"),
    sweep(
        OPTIONS,
        [(24, 2), (24, 3), (130, 5), (128, 2)],  # (length, segments)
        [False, True],
        keep=[("in_kernel", (130, 5), True), ("plain", (24, 3), False)],
    ),
)
def test_segmented_equals_chunk(variant, length_segments, initial_state):
    length, segments = length_segments
    x = _inputs(variant, batch=2, length=length, heads=2, value_heads=4)
    kwargs = _kwargs(x, variant, initial_state)
    o, state = kda_ops.chunk_kda(x.q, x.k, x.v, x.g, x.beta, **kwargs)
    o_seg, state_seg = chunk_kda_segmented(
        x.q, x.k, x.v, x.g, x.beta, num_segments=segments, **kwargs
    )
    torch.testing.assert_close(o_seg, o)
    torch.testing.assert_close(state_seg, state)


@pytest.mark.parametrize("scalar_gate", [False, True])
def test_segmented_gradients_equal_chunk(scalar_gate):
    x = _inputs("in_kernel", length=36, value_heads=4, scalar_gate=scalar_gate,
                requires_grad=True)  # fmt: skip
    kwargs = _kwargs(x, "in_kernel", initial_state=True)
    weights = torch.randn(1, 36, 4, 4, dtype=torch.float64), torch.randn(1, 4, 8, 4).double()

    def grads(fn, **extra):
        o, state = fn(x.q, x.k, x.v, x.g, x.beta, **kwargs, **extra)
        loss = (o * weights[0]).sum() + (state * weights[1]).sum()
        return torch.autograd.grad(loss, x.tensors())

    for got, want in zip(grads(chunk_kda_segmented, num_segments=3), grads(kda_ops.chunk_kda)):
        torch.testing.assert_close(got, want)


def test_segment_maps_compose_and_plain_sum_is_wrong():
    x = delta_rule_inputs(length=40, value_heads=2)
    inputs, options = delta_rule_arguments(
        "test", x.q, x.k, x.v, x.g, x.beta, scale=None, initial_state=None,
        use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False,
        use_beta_sigmoid_in_kernel=False, A_log=None, dt_bias=None, lower_bound=None,
    )  # fmt: skip
    _, whole = kda_ops.chunk_kda(x.q, x.k, x.v, x.g, x.beta, output_final_state=True)
    halves = [
        segment_maps(inputs.map_tokens(lambda t, sl=sl: t[:, sl]), options)
        for sl in (slice(0, 25), slice(25, 40))
    ]
    packed = torch.stack([h.packed for h in halves])
    incoming = prefix_states(packed, head_v=4)
    torch.testing.assert_close(halves[1].end_state(incoming[1]), whole)
    plain_sum = halves[0].packed[..., :4] + halves[1].packed[..., :4]
    assert not torch.allclose(plain_sum, whole, atol=1e-3)


def test_segment_maps_in_column_blocks_equal_one_run():
    x = delta_rule_inputs(batch=2, length=20, value_heads=2, requires_grad=True)
    inputs, options = delta_rule_arguments(
        "test", x.q, x.k, x.v, x.g, x.beta, scale=None, initial_state=None,
        use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False,
        use_beta_sigmoid_in_kernel=False, A_log=None, dt_bias=None, lower_bound=None,
    )  # fmt: skip
    whole = segment_maps(inputs, options, start=x.initial_state)
    blocks = segment_maps(inputs, options, start=x.initial_state, max_columns=5)
    for name in ("base_output", "readout", "packed"):
        torch.testing.assert_close(getattr(blocks, name), getattr(whole, name))
    (grad_whole,) = torch.autograd.grad(whole.packed.sum(), x.k)
    (grad_blocks,) = torch.autograd.grad(blocks.packed.sum(), x.k)
    torch.testing.assert_close(grad_blocks, grad_whole)


def test_prefix_adjoints_equal_autograd():
    packed = torch.randn(4, 2, 3, 5, 2 + 5, dtype=torch.float64, requires_grad=True)
    grads = torch.randn(4, 2, 3, 5, 2, dtype=torch.float64)
    states = prefix_states(packed, head_v=2)
    (want,) = torch.autograd.grad(states, packed, grads)
    got = prefix_adjoints(packed.detach(), states.detach(), grads)
    torch.testing.assert_close(got, want)


def test_plan_segments_keeps_cpu_unsplit():
    assert plan_segments(1, 131072, 16, torch.device("cpu")) == 1


@pytest.mark.parametrize("segments", [0, 5, 2.0])
def test_segmented_rejects_bad_num_segments(segments):
    x = delta_rule_inputs(length=24)
    with pytest.raises(ValueError, match="chunk_kda_segmented: `num_segments`"):
        chunk_kda_segmented(x.q, x.k, x.v, x.g, x.beta, num_segments=segments)
