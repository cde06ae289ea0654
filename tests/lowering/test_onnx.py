"""lowering.onnx: the hybrid model's steps in portable ONNX run in onnxruntime (from a
process without torch) and match PyTorch over several T; every op's portable translation
matches its reference; plugin mode gives one kda-domain node per op with TensorRT's plugin
attributes and registered schemas that shape inference uses."""

import pathlib
import subprocess
import sys

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

import kda_ops
from examples.export_onnx import export_hybrid, io_names
from kda_ops.kernels.chunk import FORWARD_CHUNK
from lowering import export
from lowering import onnx as kda_onnx
from tests.examples.cases import tiny_model

RUNNER = pathlib.Path(__file__).with_name("ort_runner.py")


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return tiny_model()


@pytest.fixture(scope="module")
def onnx_files(model, tmp_path_factory):
    return export_hybrid(model, tmp_path_factory.mktemp("onnx"))


def _save_case(path, model_path, names, inputs, outputs):
    arrays = {f"in.{n}": t.numpy() for n, t in zip(names[0], inputs)}
    arrays.update({f"out.{n}": t.numpy() for n, t in zip(names[1], outputs)})
    np.savez(path, model=str(model_path), **arrays)


def test_portable_steps_run_in_onnxruntime_without_torch(model, onnx_files, tmp_path):
    names = io_names(model)
    for batch, length in [(1, 1), (2, 3), (3, 17), (2, 40)]:
        ids = torch.randint(0, model.config.vocab_size, (batch, length))
        inputs = (ids, *export.flatten_cache(model.new_cache(batch)))
        outputs = export.ExplicitStateStep(model, "prefill")(*inputs)
        _save_case(tmp_path / f"prefill_{batch}_{length}.npz", onnx_files["prefill", "portable"],
                   names, inputs, outputs)  # fmt: skip
        next_ids = torch.randint(0, model.config.vocab_size, (batch, 1))
        inputs = (next_ids, *outputs[1:])
        outputs = export.ExplicitStateStep(model, "decode")(*inputs)
        _save_case(tmp_path / f"decode_{batch}_{length}.npz", onnx_files["decode", "portable"],
                   names, inputs, outputs)  # fmt: skip
    result = subprocess.run(
        [sys.executable, str(RUNNER), str(tmp_path)], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
    assert "ok 8 cases" in result.stdout


def test_portable_graphs_use_standard_ops_only(onnx_files):
    for step in ("prefill", "decode"):
        graph = onnx.load(onnx_files[step, "portable"]).graph
        assert {node.domain for node in graph.node} <= {"", "ai.onnx"}
        assert "Scan" in {node.op_type for node in graph.node}


class PackedLayer(torch.nn.Module):
    """A KDA core and a short conv over packed sequences, every state explicit."""

    def forward(self, q, k, v, g, beta, A_log, dt_bias, state, cu_seqlens, x, weight, bias,
                conv_state):  # fmt: skip
        o, final = kda_ops.chunk_kda(
            q, k, v, g, beta, initial_state=state, output_final_state=True,
            use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
            use_beta_sigmoid_in_kernel=True, A_log=A_log, dt_bias=dt_bias, lower_bound=-5.0,
            cu_seqlens=cu_seqlens,
        )  # fmt: skip
        y, conv_final = kda_ops.causal_conv1d(x, weight, bias, conv_state, "silu", cu_seqlens)
        return o, final, y, conv_final


def packed_inputs(cu_seqlens, heads=1, value_heads=2, dim=8, channels=6, width=4):
    n_seqs, length = len(cu_seqlens) - 1, cu_seqlens[-1]
    tokens = (1, length)
    return (
        torch.randn(*tokens, heads, dim), torch.randn(*tokens, heads, dim),
        torch.randn(*tokens, value_heads, dim), torch.randn(*tokens, value_heads, dim),
        torch.randn(*tokens, value_heads), torch.randn(value_heads),
        torch.randn(value_heads * dim), torch.randn(n_seqs, value_heads, dim, dim),
        torch.tensor(cu_seqlens, dtype=torch.int32), torch.randn(*tokens, channels),
        torch.randn(channels, width), torch.randn(channels),
        torch.randn(n_seqs, channels, width - 1),
    )  # fmt: skip


def test_portable_packed_sequences_run_in_onnxruntime(tmp_path):
    """cu_seqlens as a graph input with a dynamic number of sequences and tokens: empty,
    one-token and history-only sequences, against PyTorch."""
    torch.manual_seed(0)
    layer = PackedLayer()
    tokens, seqs = torch.export.Dim("tokens", min=2, max=4096), torch.export.Dim("seqs", max=64)
    per_token = {1: tokens}
    dynamic = (per_token,) * 5 + (None, None, {0: seqs}, {0: seqs + 1}, per_token, None, None,
                                  {0: seqs})  # fmt: skip
    program = torch.export.export(layer, packed_inputs([0, 3, 9]), dynamic_shapes=dynamic)
    path = tmp_path / "packed.onnx"
    kda_onnx.export_onnx(program, str(path), "portable")
    names = ([f"in{i}" for i in range(13)], ["o", "final", "y", "conv_final"])
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    feeds_names = [i.name for i in session.get_inputs()]
    for cu_seqlens in ([0, 3, 9], [0, 1, 1, 7, 20], [0, 2, 2, 5]):
        inputs = packed_inputs(cu_seqlens)
        expected = layer(*inputs)
        got = session.run(None, {n: t.numpy() for n, t in zip(feeds_names, inputs)})
        for name, want, have in zip(names[1], expected, got):
            np.testing.assert_allclose(have, want.numpy(), rtol=1e-5, atol=1e-5, err_msg=name)


def _plugin_nodes(path):
    return [node for node in onnx.load(path).graph.node if node.domain == "kda"]


@pytest.mark.parametrize(
    "step, expected",
    [
        (
            "prefill",
            {
                "chunk_prepare": 3,
                "chunk_recurrence": 3,
                "causal_conv1d_output": 9,
                "causal_conv1d_state": 9,
            },
        ),
        ("decode", {"recurrent": 3}),
    ],
)
def test_plugin_mode_has_one_node_per_op_with_tensorrt_attributes(onnx_files, step, expected):
    nodes = _plugin_nodes(onnx_files[step, "plugin"])
    counts = {op_type: sum(n.op_type == op_type for n in nodes) for op_type in expected}
    assert counts == expected
    for node in nodes:
        attributes = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        assert attributes["plugin_namespace"] == b"kda"
        assert attributes["plugin_version"] == b"1"
    graph = onnx.load(onnx_files[step, "plugin"]).graph
    assert "Scan" not in {node.op_type for node in graph.node}


def test_plugin_schemas_drive_shape_inference(onnx_files):
    kda_onnx.register_plugin_schemas()
    proto = onnx.load(onnx_files["decode", "plugin"])
    onnx.checker.check_model(proto)
    proto.graph.ClearField("value_info")  # forget what the exporter recorded
    inferred = onnx.shape_inference.infer_shapes(proto, strict_mode=True)  # checks outputs too
    node = _plugin_nodes(onnx_files["decode", "plugin"])[0]
    o = next(v.type.tensor_type for v in inferred.graph.value_info if v.name == node.output[0])
    assert o.elem_type == onnx.TensorProto.FLOAT
    assert [d.dim_value for d in o.shape.dim[1:]] == [1, 2, 16]  # [B, 1, HV, V]
    state = next(v for v in inferred.graph.output if v.name == node.output[1])
    assert state.type.tensor_type.elem_type == onnx.TensorProto.FLOAT


def test_chunk_plugin_chain_shape_inference(onnx_files):
    """Prefill: the schema gives chunk_prepare's six intermediates their types and dims
    (from the inputs' shapes the exporter recorded; the chunk count stays unknown)."""
    kda_onnx.register_plugin_schemas()
    proto = onnx.load(onnx_files["prefill", "plugin"])
    prepare = next(n for n in proto.graph.node if n.op_type == "chunk_prepare")
    proto.graph.ClearField("value_info")
    proto.graph.value_info.extend(
        v for v in onnx.load(onnx_files["prefill", "plugin"]).graph.value_info
        if v.name in prepare.input
    )  # fmt: skip
    inferred = onnx.shape_inference.infer_shapes(proto, strict_mode=True)
    types = {v.name: v.type.tensor_type for v in inferred.graph.value_info}
    decay, w, u, qg, kd, aqk = (types[name] for name in prepare.output)
    assert decay.elem_type == onnx.TensorProto.FLOAT
    assert [d.dim_value for d in decay.shape.dim[1:]] == [2, 16]  # [chunks, HV, K]
    assert [d.dim_value for d in aqk.shape.dim[1:]] == [2, FORWARD_CHUNK, FORWARD_CHUNK]
    for per_token in (w, u, qg, kd):
        assert per_token.elem_type == onnx.TensorProto.FLOAT
        assert [d.dim_value for d in per_token.shape.dim[2:]] == [2, 16]


def test_plugin_schema_inference_without_the_exporter():
    """A hand-built node: the registered schema alone gives its outputs' types and shapes."""
    kda_onnx.register_plugin_schemas()
    x = onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT16, ["B", "T", 2, 8])
    w = onnx.helper.make_tensor_value_info("w", onnx.TensorProto.FLOAT16, [8])
    plugin = dict(domain="kda", plugin_namespace="kda", plugin_version="1")
    node = onnx.helper.make_node("gated_rms_norm", ["x", "x", "w"], ["y"], eps=1e-5, silu=0,
                                 **plugin)  # fmt: skip
    gate = onnx.helper.make_node("gate", ["x", "w", "w"], ["d"], lower_bound=-5.0,
                                 use_lower_bound=1, **plugin)  # fmt: skip
    graph = onnx.helper.make_graph([node, gate], "g", [x, w], [])
    proto = onnx.helper.make_model(
        graph, opset_imports=[onnx.helper.make_opsetid("", 18), onnx.helper.make_opsetid("kda", 1)]
    )
    inferred = {
        v.name: v.type.tensor_type
        for v in onnx.shape_inference.infer_shapes(proto).graph.value_info
    }
    assert inferred["y"].elem_type == onnx.TensorProto.FLOAT16
    assert inferred["d"].elem_type == onnx.TensorProto.FLOAT
    assert [d.dim_param or d.dim_value for d in inferred["d"].shape.dim] == ["B", "T", 2, 8]


class OpCase(torch.nn.Module):
    """One kda op call on inputs with dynamic T (dim 1)."""

    def __init__(self, fn) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, *args):
        return self.fn(*args)


def _delta_rule_case(heads, value_heads, scalar_gate, gate_in_kernel, with_state):
    batch, length, dim = 2, 6, 8
    q, k = (torch.randn(batch, length, heads, dim) for _ in range(2))
    v = torch.randn(batch, length, value_heads, dim)
    g_shape = (batch, length, value_heads) + (() if scalar_gate else (dim,))
    g = torch.randn(g_shape) if gate_in_kernel else -torch.rand(g_shape)
    beta = torch.randn(batch, length, value_heads)
    A_log = torch.randn(value_heads)
    dt_bias = torch.randn(value_heads * (1 if scalar_gate else dim))
    state = torch.randn(batch, value_heads, dim, dim) if with_state else None

    def fn(q, k, v, g, beta):
        kwargs = dict(output_final_state=True, use_qk_l2norm_in_kernel=True,
                      use_beta_sigmoid_in_kernel=True)  # fmt: skip
        if gate_in_kernel:
            kwargs.update(use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias, lower_bound=-5.0)
        o, final = kda_ops.chunk_kda(q, k, v, g, beta, initial_state=state, **kwargs)
        o2, final2 = kda_ops.fused_recurrent_kda(q, k, v, g, beta, initial_state=final, **kwargs)
        return o, final, o2, final2

    return fn, (q, k, v, g, beta)


def _conv_case(with_bias, with_state):
    x = torch.randn(2, 6, 8)
    weight, bias = torch.randn(8, 4), torch.randn(8) if with_bias else None
    state = torch.randn(2, 8, 3) if with_state else None

    def fn(x):
        return kda_ops.causal_conv1d(x, weight, bias, initial_state=state)

    return fn, (x,)


def _norm_and_gate_case(activation, lower_bound):
    x, gate, g = torch.randn(2, 6, 2, 8), torch.randn(2, 6, 2, 8), torch.randn(2, 6, 2, 8)
    weight, A_log, dt_bias = torch.randn(8), torch.randn(2), torch.randn(16)

    def fn(x, gate, g):
        y = kda_ops.gated_rms_norm(x, gate, weight, activation=activation)
        return y, kda_ops.kda_gate(g, A_log, dt_bias, lower_bound), kda_ops.kda_gate(g, A_log)

    return fn, (x, gate, g)


CASES = {
    "kda_gqa_gate_in_kernel": lambda: _delta_rule_case(1, 2, False, True, True),
    "gdn_scalar_gate_no_state": lambda: _delta_rule_case(2, 2, True, False, False),
    "gdn_gate_in_kernel": lambda: _delta_rule_case(2, 4, True, True, True),
    "conv_bias_no_state": lambda: _conv_case(True, False),
    "conv_state": lambda: _conv_case(False, True),
    "norm_sigmoid_safe_gate": lambda: _norm_and_gate_case("sigmoid", -5.0),
    "norm_silu_softplus_gate": lambda: _norm_and_gate_case("silu", None),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_each_op_portable_translation_matches_pytorch(case, tmp_path):
    fn, args = CASES[case]()
    module = OpCase(fn)
    length = torch.export.Dim("T", min=1, max=64)
    program = torch.export.export(module, args, dynamic_shapes=(({1: length},) * len(args),))
    kda_onnx.export_onnx(program, str(tmp_path / "op.onnx"), "portable")
    session = ort.InferenceSession(str(tmp_path / "op.onnx"))
    for new_length in (1, 11):
        inputs = tuple(torch.randn(a.shape[0], new_length, *a.shape[2:]) for a in args)
        if case.startswith("gdn_scalar"):
            inputs = (*inputs[:3], -inputs[3].abs(), inputs[4])  # a log-decay: <= 0
        feeds = {i.name: a.numpy() for i, a in zip(session.get_inputs(), inputs)}
        for got, expected in zip(session.run(None, feeds), module(*inputs)):
            torch.testing.assert_close(torch.from_numpy(got), expected)


def test_bad_mode_and_plugin_varlen_raise():
    with pytest.raises(ValueError, match="mode"):
        kda_onnx.translation_table("tensorrt")
    with pytest.raises(ValueError, match="cu_seqlens"):
        kda_onnx.plugin_causal_conv1d(None, None, None, None, object(), "silu")


@pytest.mark.parametrize(
    "case", ["kda_gqa_gate_in_kernel", "conv_state", "norm_silu_softplus_gate"]
)
def test_any_onnx_export_finds_the_portable_translations(case, tmp_path):
    """Importing lowering.onnx registers the portable translations with the exporter:
    torch.onnx.export without a custom_translation_table translates the kda ops."""
    fn, args = CASES[case]()
    module = OpCase(fn)
    torch.onnx.export(module, args, dynamo=True).save(str(tmp_path / "op.onnx"))
    session = ort.InferenceSession(str(tmp_path / "op.onnx"))
    feeds = {i.name: a.numpy() for i, a in zip(session.get_inputs(), args)}
    for got, expected in zip(session.run(None, feeds), module(*args)):
        torch.testing.assert_close(torch.from_numpy(got), expected)


def test_a_callers_translation_table_wins_over_the_registered_one():
    fn, args = CASES["conv_state"]()
    program = torch.export.export(OpCase(fn), args)
    table = kda_onnx.translation_table("plugin")
    model = torch.onnx.export(program, dynamo=True, custom_translation_table=table).model
    domains = {node.domain for node in model.graph}
    assert kda_onnx.PLUGIN_DOMAIN in domains
