"""The torch.library registrations: opcheck (schema, fake kernel, autograd registration,
AOT dispatch) on every op and float64 gradcheck of every differentiable input."""

import functools

import pytest
import torch
from torch.library import opcheck

import kda_ops
from tests.kda_ops.inputs import delta_rule_inputs
from tests.sweeps import sweep

DELTA_RULE_OPS = [torch.ops.kda.chunk.default, torch.ops.kda.recurrent.default]
DELTA_RULE_IDS = ["chunk", "recurrent"]


def delta_rule_op_args(x, *, gate, initial_state, cu_seqlens=None, lower_bound=None):
    """Positional arguments of kda::chunk / kda::recurrent."""
    return (
        x.q, x.k, x.v, x.g, x.beta,
        x.A_log if gate else None, x.dt_bias if gate else None,
        x.initial_state if initial_state else None, cu_seqlens,
        0.5, lower_bound, gate, gate,
    )  # fmt: skip


@pytest.mark.parametrize("op", DELTA_RULE_OPS, ids=DELTA_RULE_IDS)
@pytest.mark.parametrize(
    ("length", "gate", "initial_state", "scalar_gate", "lower_bound"),
    [
        (1, False, False, False, None),
        (5, True, True, False, -5.0),
        (19, True, False, True, None),
        (70, False, True, False, None),
    ],
)
@pytest.mark.parametrize("requires_grad", [False, True])
def test_opcheck_delta_rule(
    op, length, gate, initial_state, scalar_gate, lower_bound, requires_grad
):
    x = delta_rule_inputs(
        length=length, value_heads=4, scalar_gate=scalar_gate, raw_gate=gate,
        requires_grad=requires_grad,
    )  # fmt: skip
    args = delta_rule_op_args(x, gate=gate, initial_state=initial_state, lower_bound=lower_bound)
    opcheck(op, args)


@pytest.mark.parametrize("op", DELTA_RULE_OPS, ids=DELTA_RULE_IDS)
def test_opcheck_delta_rule_varlen(op):
    x = delta_rule_inputs(length=40, n_seqs=3, raw_gate=True, requires_grad=True)
    cu_seqlens = torch.tensor([0, 7, 30, 40], dtype=torch.int32)
    opcheck(op, delta_rule_op_args(x, gate=True, initial_state=True, cu_seqlens=cu_seqlens))


@pytest.mark.parametrize("keep_rows", [False, True])
@pytest.mark.parametrize("varlen", [False, True])
@pytest.mark.parametrize("requires_grad", [False, True])
def test_opcheck_chunk_train(keep_rows, varlen, requires_grad):
    x = delta_rule_inputs(length=40, n_seqs=3 if varlen else None, raw_gate=True,
                          requires_grad=requires_grad)  # fmt: skip
    cu_seqlens = torch.tensor([0, 7, 30, 40], dtype=torch.int32) if varlen else None
    args = delta_rule_op_args(x, gate=True, initial_state=True, cu_seqlens=cu_seqlens,
                              lower_bound=-5.0)  # fmt: skip
    opcheck(torch.ops.kda.chunk_train.default, (*args, keep_rows))


@pytest.mark.parametrize(
    ("length", "gate", "initial_state", "scalar_gate", "cu_seqlens"),
    [
        (1, False, False, False, None),
        (5, True, True, False, None),
        (70, True, False, True, None),
        (130, True, True, False, [0, 1, 66, 130]),
    ],
)
def test_opcheck_chunk_states(length, gate, initial_state, scalar_gate, cu_seqlens):
    """Inference only: no autograd formula, so no requires_grad inputs."""
    n_seqs = None if cu_seqlens is None else len(cu_seqlens) - 1
    x = delta_rule_inputs(length=length, n_seqs=n_seqs, value_heads=4, scalar_gate=scalar_gate,
                          raw_gate=gate)  # fmt: skip
    if cu_seqlens is not None:
        cu_seqlens = torch.tensor(cu_seqlens, dtype=torch.int32)
    args = delta_rule_op_args(x, gate=gate, initial_state=initial_state, cu_seqlens=cu_seqlens,
                              lower_bound=-5.0 if gate else None)  # fmt: skip
    opcheck(torch.ops.kda.chunk_states.default, args)


def test_opcheck_delta_rule_backward():
    x = delta_rule_inputs(length=9, raw_gate=True)
    o, state = torch.ops.kda.chunk(*delta_rule_op_args(x, gate=True, initial_state=True))
    for gate in (False, True):
        args = delta_rule_op_args(x, gate=gate, initial_state=gate)
        backward_args = (*args[:9], o, state, *args[9:])
        opcheck(torch.ops.kda.delta_rule_backward.default, backward_args)
        # kda::chunk_train saves nothing off the Triton path: the chunk backward is then
        # kda::delta_rule_backward's.
        for chunk_backward in (torch.ops.kda.chunk_backward, torch.ops.kda.chunk_backward_):
            opcheck(chunk_backward.default, (*args[:9], o, state, [], *args[9:]))


@pytest.mark.parametrize("with_indices", [False, True])
@pytest.mark.parametrize("length", [1, 3])
def test_opcheck_recurrent_inplace(with_indices, length):
    x = delta_rule_inputs(batch=3, length=length, raw_gate=True)
    pool = torch.randn(6 if with_indices else 3, 2, 8, 4, dtype=torch.float64)
    indices = torch.tensor([4, -1, 0]) if with_indices else None
    args = delta_rule_op_args(x, gate=True, initial_state=False)
    opcheck(torch.ops.kda.recurrent_.default, (*args[:7], pool, indices, *args[8:]))


@pytest.mark.parametrize("dt_bias", [False, True])
@pytest.mark.parametrize("lower_bound", [None, -5.0])
@pytest.mark.parametrize("requires_grad", [False, True])
def test_opcheck_gate(dt_bias, lower_bound, requires_grad):
    g = torch.randn(2, 7, 3, 4, dtype=torch.float64, requires_grad=requires_grad)
    A_log = torch.randn(3, dtype=torch.float64, requires_grad=requires_grad)
    bias = torch.randn(12, dtype=torch.float64, requires_grad=requires_grad) if dt_bias else None
    opcheck(torch.ops.kda.gate.default, (g, A_log, bias, lower_bound))
    if not requires_grad:  # backward ops take plain tensors (no double backward)
        grad = torch.randn_like(g)
        args = (g, A_log, bias, grad, lower_bound)
        opcheck(torch.ops.kda.gate_backward.default, args)


@pytest.mark.parametrize("activation", ["sigmoid", "silu"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
@pytest.mark.parametrize("requires_grad", [False, True])
def test_opcheck_gated_rms_norm(activation, dtype, requires_grad):
    x, gate = (torch.randn(2, 5, 3, 16, dtype=dtype, requires_grad=requires_grad) for _ in "xg")
    weight = torch.randn(16, dtype=torch.float32, requires_grad=requires_grad)
    opcheck(torch.ops.kda.gated_rms_norm.default, (x, gate, weight, 1e-5, activation))
    if requires_grad:  # backward ops take plain tensors (no double backward)
        return
    args = (x, gate, weight, torch.randn_like(x), 1e-6, activation)
    opcheck(torch.ops.kda.gated_rms_norm_backward.default, args)


@pytest.mark.parametrize("length", [1, 6])
@pytest.mark.parametrize("optionals", [False, True])
@pytest.mark.parametrize("requires_grad", [False, True])
def test_opcheck_causal_conv1d(length, optionals, requires_grad):
    def make(*shape):
        return torch.randn(*shape, dtype=torch.float64, requires_grad=requires_grad)

    x, weight = make(2, length, 5), make(5, 4)
    bias, state = (make(5), make(2, 5, 3)) if optionals else (None, None)
    opcheck(torch.ops.kda.causal_conv1d.default, (x, weight, bias, state, None, "silu"))
    varlen = torch.tensor([0, 2, length + 3])
    x1 = make(1, length + 3, 5)
    opcheck(torch.ops.kda.causal_conv1d.default, (x1, weight, bias, state, varlen, "identity"))
    if requires_grad:  # backward ops take plain tensors (no double backward)
        return
    y, final = torch.ops.kda.causal_conv1d(x, weight, bias, state, None, "silu")
    backward_args = (x, weight, bias, state, None, y.detach(), final.detach(), "silu")
    backward_op = torch.ops.kda.causal_conv1d_backward.default
    opcheck(backward_op, backward_args)


@pytest.mark.parametrize("with_indices", [False, True])
@pytest.mark.parametrize("kept", [3, 4], ids=["kda_state", "whole_window_state"])
def test_opcheck_conv_update_inplace(with_indices, kept):
    x = torch.randn(3, 1, 5, dtype=torch.float64)
    pool = torch.randn(7 if with_indices else 3, 5, kept, dtype=torch.float64)
    indices = torch.tensor([6, -1, 2]) if with_indices else None
    args = (x, pool, torch.randn(5, 4, dtype=torch.float64), None, indices, "silu")
    opcheck(torch.ops.kda.causal_conv1d_update_.default, args)


GRADCHECK_FUNCTIONS = {
    "chunk": kda_ops.chunk_kda,
    "chunk_disable_recompute": functools.partial(kda_ops.chunk_kda, disable_recompute=True),
    "recurrent": kda_ops.fused_recurrent_kda,
}


@pytest.mark.parametrize(
    ("function_name", "variant"),
    sweep(
        GRADCHECK_FUNCTIONS,
        ["softplus", "safe_gate", "gdn", "preactivated", "varlen"],
        keep=[("chunk", "safe_gate"), ("chunk", "varlen"), ("recurrent", "gdn")],
    ),
)
def test_gradcheck_delta_rule(function_name, variant):
    function = GRADCHECK_FUNCTIONS[function_name]
    gate = variant != "preactivated"
    varlen = variant == "varlen"
    x = delta_rule_inputs(
        length=9, heads=1, value_heads=2, head_k=4, head_v=3, n_seqs=2 if varlen else None,
        scalar_gate=variant == "gdn", raw_gate=gate, unit_qk=not gate, requires_grad=True,
    )  # fmt: skip

    def run(q, k, v, g, beta, A_log, dt_bias, initial_state):
        return function(
            q, k, v, g, beta, initial_state=initial_state, output_final_state=True,
            use_qk_l2norm_in_kernel=gate, use_gate_in_kernel=gate,
            use_beta_sigmoid_in_kernel=gate, A_log=A_log, dt_bias=dt_bias,
            lower_bound=-5.0 if variant == "safe_gate" else None,
            cu_seqlens=torch.tensor([0, 4, 9]) if varlen else None,
        )  # fmt: skip

    inputs = x.tensors()
    if not gate:  # A_log and dt_bias are unused without the in-kernel gate
        inputs = (*inputs[:5], None, None, inputs[7])
    assert torch.autograd.gradcheck(run, inputs)


@pytest.mark.parametrize("lower_bound", [None, -5.0])
def test_gradcheck_gate(lower_bound):
    g = torch.randn(2, 3, 3, 4, dtype=torch.float64, requires_grad=True)
    A_log = torch.randn(3, dtype=torch.float64, requires_grad=True)
    dt_bias = torch.randn(12, dtype=torch.float64, requires_grad=True)
    gate = lambda *args: kda_ops.kda_gate(*args, lower_bound=lower_bound)  # noqa: E731
    assert torch.autograd.gradcheck(gate, (g, A_log, dt_bias))


@pytest.mark.parametrize("activation", ["sigmoid", "silu"])
def test_gradcheck_gated_rms_norm(activation):
    x, gate = (torch.randn(2, 3, 8, dtype=torch.float64, requires_grad=True) for _ in "xg")
    weight = torch.randn(8, dtype=torch.float64, requires_grad=True)
    norm = lambda *args: kda_ops.gated_rms_norm(*args, eps=1e-5, activation=activation)  # noqa: E731
    assert torch.autograd.gradcheck(norm, (x, gate, weight))


@pytest.mark.parametrize("varlen", [False, True])
def test_gradcheck_causal_conv1d(varlen):
    def make(*shape):
        return torch.randn(*shape, dtype=torch.float64, requires_grad=True)

    x = make(1, 6, 3) if varlen else make(2, 5, 3)
    weight, bias, state = make(3, 4), make(3), make(2, 3, 3)
    cu_seqlens = torch.tensor([0, 2, 6]) if varlen else None

    def conv(x, weight, bias, state):
        return kda_ops.causal_conv1d(x, weight, bias, state, cu_seqlens=cu_seqlens)

    assert torch.autograd.gradcheck(conv, (x, weight, bias, state))
    update = lambda x, state, weight, bias: kda_ops.causal_conv1d_update(x, state, weight, bias)  # noqa: E731
    assert torch.autograd.gradcheck(update, (make(2, 3), state, weight, bias))


def test_backward_matches_autograd_through_the_reference():
    """The op's gradients equal plain autograd through the recurrent reference."""
    from kda_ops import reference

    x = delta_rule_inputs(length=20, value_heads=4, raw_gate=True, unit_qk=False)
    inputs = [t.detach().requires_grad_() for t in x.tensors()]
    config = (None, 0.5, -5.0, True, True)
    o, s = torch.ops.kda.chunk(*inputs, *config)
    (o.sum() + (s * s).sum()).backward()
    op_grads = [t.grad for t in inputs]
    for t in inputs:
        t.grad = None
    o, s = reference.delta_rule(reference.recurrent_delta_rule, *inputs, *config)
    (o.sum() + (s * s).sum()).backward()
    for got, expected in zip(op_grads, [t.grad for t in inputs]):
        torch.testing.assert_close(got, expected)


@pytest.mark.parametrize("use", ["output", "final_state"])
def test_training_op_with_an_unused_output(use):
    """kda::chunk_train does not zero-fill gradients for outputs the loss leaves unused
    (its saved tensors are as large as the inputs): o or the final state alone."""
    x = delta_rule_inputs(length=20, value_heads=4, raw_gate=True, unit_qk=False)
    grads = []
    for disable_recompute in (False, True):
        inputs = [t.detach().requires_grad_() for t in x.tensors()]
        q, k, v, g, beta, A_log, dt_bias, state = inputs
        o, final = kda_ops.chunk_kda(
            q, k, v, g, beta, initial_state=state, output_final_state=True,
            use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias,
            disable_recompute=disable_recompute,
        )  # fmt: skip
        (o if use == "output" else final).square().sum().backward()
        grads.append([t.grad for t in inputs])
    for got, expected in zip(*grads):
        torch.testing.assert_close(got, expected)
