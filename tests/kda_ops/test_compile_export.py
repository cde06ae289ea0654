"""The ops under torch.compile (fullgraph, CPU) and torch.export (dynamic T)."""

import pytest
import torch
from torch._dynamo.utils import counters
from torch.fx.experimental.proxy_tensor import make_fx

import kda_ops
from tests.kda_ops.inputs import delta_rule_inputs

GATE = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
            use_beta_sigmoid_in_kernel=True, lower_bound=-5.0)  # fmt: skip


def prefill_decode_norm(q, k, v, g, beta, A_log, dt_bias, norm_gate, norm_weight,
                        disable_recompute=False):  # fmt: skip
    """Prefill all but the last token, decode the last one, gated-norm every output."""
    o, state = kda_ops.chunk_kda(
        q[:, :-1], k[:, :-1], v[:, :-1], g[:, :-1], beta[:, :-1], output_final_state=True,
        A_log=A_log, dt_bias=dt_bias, disable_recompute=disable_recompute, **GATE,
    )  # fmt: skip
    o_last, state = kda_ops.fused_recurrent_kda(
        q[:, -1:], k[:, -1:], v[:, -1:], g[:, -1:], beta[:, -1:], A_log, dt_bias,
        initial_state=state, output_final_state=True, **GATE,
    )  # fmt: skip
    o = torch.cat([o, o_last], dim=1)
    return kda_ops.gated_rms_norm(o, norm_gate, norm_weight, activation="sigmoid"), state


def model_inputs(length, requires_grad=False):
    x = delta_rule_inputs(
        length=length, heads=2, value_heads=4, raw_gate=True, unit_qk=False,
        dtype=torch.float32, requires_grad=requires_grad,
    )  # fmt: skip
    norm_gate = torch.randn_like(x.v, requires_grad=requires_grad)
    norm_weight = torch.randn(x.v.shape[-1], requires_grad=requires_grad)
    return (x.q, x.k, x.v, x.g, x.beta, x.A_log, x.dt_bias, norm_gate, norm_weight)


def test_compile_fullgraph_matches_eager_without_graph_breaks():
    torch._dynamo.reset()
    counters.clear()
    inputs = model_inputs(20)
    compiled = torch.compile(prefill_decode_norm, fullgraph=True)
    got, got_state = compiled(*inputs)
    expected, expected_state = prefill_decode_norm(*inputs)
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(got_state, expected_state)
    assert sum(counters["graph_break"].values()) == 0


@pytest.mark.parametrize("disable_recompute", [False, True])
def test_compile_training_step_matches_eager_gradients(disable_recompute):
    torch._dynamo.reset()
    counters.clear()
    inputs = model_inputs(12, requires_grad=True)

    def loss_fn(*args):
        out, state = prefill_decode_norm(*args, disable_recompute=disable_recompute)
        return out.square().mean() + state.square().mean()

    eager_grads = torch.autograd.grad(loss_fn(*inputs), inputs)
    compiled = torch.compile(loss_fn, fullgraph=True)
    compiled_grads = torch.autograd.grad(compiled(*inputs), inputs)
    for got, expected in zip(compiled_grads, eager_grads):
        torch.testing.assert_close(got, expected)
    assert sum(counters["graph_break"].values()) == 0


@pytest.mark.parametrize("disable_recompute", [False, True])
def test_training_op_only_when_differentiated(disable_recompute):
    """chunk_kda calls kda::chunk_train (keeping w, u, qg, kd with disable_recompute) when
    autograd records it, kda::chunk otherwise."""
    inputs = model_inputs(12, requires_grad=True)

    def graph_calls():
        def prefill(q, k, v, g, beta, A_log, dt_bias, *_):
            return kda_ops.chunk_kda(q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias,
                                     disable_recompute=disable_recompute, **GATE)[0]  # fmt: skip

        graph = make_fx(prefill)(*inputs).graph
        return [node for node in graph.nodes if node.op == "call_function"]

    chunk, chunk_train = torch.ops.kda.chunk.default, torch.ops.kda.chunk_train.default
    trained = [node for node in graph_calls() if node.target in (chunk, chunk_train)]
    assert [node.target for node in trained] == [chunk_train]
    assert trained[0].args[-1] is disable_recompute  # keep_rows
    with torch.no_grad():
        inferred = {node.target for node in graph_calls()}
    assert chunk in inferred and chunk_train not in inferred


def test_compiled_training_calls_the_training_op():
    """Under torch.compile, chunk_kda takes the training op as in eager (Dynamo before
    pytorch/pytorch#176499 folds torch.compiler.is_exporting() to True under any compile,
    which sent compiled training to kda::chunk)."""
    torch._dynamo.reset()
    inputs = model_inputs(12, requires_grad=True)
    graphs = []

    def recording_backend(graph_module, example_inputs):
        graphs.append(graph_module.graph)
        return graph_module

    def prefill(q, k, v, g, beta, A_log, dt_bias, *_):
        return kda_ops.chunk_kda(q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, **GATE)[0]

    torch.compile(prefill, backend=recording_backend, fullgraph=True)(*inputs)
    called = {node.target for graph in graphs for node in graph.nodes}
    assert torch.ops.kda.chunk_train.default in called
    assert torch.ops.kda.chunk.default not in called


def test_compile_with_dynamic_length_does_not_recompile():
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(prefill_decode_norm, fullgraph=True, dynamic=True)
    for length in (9, 13, 40):  # none equal to a head dim, which duck sizing would tie
        inputs = model_inputs(length)
        torch.testing.assert_close(compiled(*inputs)[0], prefill_decode_norm(*inputs)[0])
    assert counters["stats"]["unique_graphs"] == 1


class PrefillWithState(torch.nn.Module):
    """A KDA prefill whose recurrent and conv states are explicit inputs and outputs."""

    def __init__(self, heads: int = 2, head_k: int = 8, head_v: int = 4, width: int = 4) -> None:
        super().__init__()
        self.A_log = torch.nn.Parameter(torch.zeros(heads))
        self.dt_bias = torch.nn.Parameter(torch.zeros(heads * head_k))
        self.conv_weight = torch.nn.Parameter(torch.randn(heads * head_v, width))

    def forward(self, q, k, v, g, beta, state, conv_state):
        v, conv_state = kda_ops.causal_conv1d(
            v.flatten(2), self.conv_weight, initial_state=conv_state
        )
        o, state = kda_ops.chunk_kda(
            q, k, v.unflatten(2, (q.shape[2], -1)), g, beta, initial_state=state,
            output_final_state=True, A_log=self.A_log, dt_bias=self.dt_bias, **GATE,
        )  # fmt: skip
        return o, state, conv_state


def test_export_dynamic_length_keeps_kda_nodes_and_explicit_state():
    module = PrefillWithState()
    x = delta_rule_inputs(length=6, raw_gate=True, unit_qk=False, dtype=torch.float32)
    conv_state = torch.randn(1, 8, 3)
    args = (x.q, x.k, x.v, x.g, x.beta, x.initial_state, conv_state)
    length = torch.export.Dim("T", min=2, max=4096)
    dynamic = ({1: length},) * 5 + (None, None)
    program = torch.export.export(module, args, dynamic_shapes=dynamic)

    targets = {node.target for node in program.graph.nodes if node.op == "call_function"}
    # The module's parameters require grad, yet an export keeps the inference op.
    assert torch.ops.kda.chunk.default in targets
    assert torch.ops.kda.chunk_train.default not in targets
    assert torch.ops.kda.causal_conv1d.default in targets
    signature = program.graph_signature
    assert "state" in signature.user_inputs and "conv_state" in signature.user_inputs
    assert len(signature.user_outputs) == 3 and not signature.buffers_to_mutate

    longer = delta_rule_inputs(length=37, raw_gate=True, unit_qk=False, dtype=torch.float32)
    args = (longer.q, longer.k, longer.v, longer.g, longer.beta, longer.initial_state, conv_state)
    for got, expected in zip(program.module()(*args), module(*args)):
        torch.testing.assert_close(got, expected)
