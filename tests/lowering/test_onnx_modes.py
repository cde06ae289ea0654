"""lowering.onnx's standard mode (opset 27: LinearAttention, CausalConvWithState) and the
chunked portable form (opset 18): every op's export runs in onnxruntime equal to the
PyTorch op in fp32 (KDA and Gated DeltaNet, grouped value heads, both gate forms, beta
scaled by allow_neg_eigval, V-first states, initial state in and final state out, T = 1,
T > 64 not a multiple of 64 and T over one 256-token step), passes onnx's full check, and
holds the nodes its mode promises (onnx's reference evaluator agrees on the standard
graphs); packed sequences are refused in standard mode."""

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx.reference import ReferenceEvaluator

import kda_ops
from lowering import onnx as kda_onnx
from lowering import onnx_standard
from tests.lowering.test_onnx import OpCase

MODES = ("standard", "portable")
LENGTHS = (1, 70, 130, 300)  # one token, 2 and 3 chunks of 64 (neither a multiple of 64),
# and more than one 256-token step of the chunked form, its last partial
DIM = 8


def _delta_rule(heads, value_heads, per_head, gate, initial_state, v_first=False,
                neg_eigval=False):  # fmt: skip
    """chunk_kda then fused_recurrent_kda from its final state. gate: "safe", "softplus"
    or None (g is a log-decay <= 0 computed outside)."""
    gate_width = 1 if per_head else DIM
    A_log, dt_bias = torch.randn(value_heads), torch.randn(value_heads * gate_width)
    state = torch.randn(2, value_heads, DIM, DIM) if initial_state else None
    kwargs = dict(output_final_state=True, use_qk_l2norm_in_kernel=True,
                  use_beta_sigmoid_in_kernel=True, allow_neg_eigval=neg_eigval,
                  state_v_first=v_first)  # fmt: skip
    if gate is not None:
        kwargs.update(use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias,
                      lower_bound=-5.0 if gate == "safe" else None)  # fmt: skip

    def fn(q, k, v, g, beta):
        g = g if gate is not None else -torch.nn.functional.softplus(g)
        o, final = kda_ops.chunk_kda(q, k, v, g, beta, initial_state=state, **kwargs)
        first = (x[:, :1] for x in (q, k, v, g, beta))
        o2, final2 = kda_ops.fused_recurrent_kda(*first, initial_state=final, **kwargs)
        return o, final, o2, final2

    def inputs(length):
        tokens = (2, length)
        g_shape = (*tokens, value_heads) + (() if per_head else (DIM,))
        return (torch.randn(*tokens, heads, DIM), torch.randn(*tokens, heads, DIM),
                torch.randn(*tokens, value_heads, DIM), torch.randn(g_shape),
                torch.randn(*tokens, value_heads))  # fmt: skip

    return fn, inputs


def _conv_norm_gate():
    """Both conv flavours (bias + state + SiLU; neither, no activation), the gated RMSNorm
    with both activations and the gate in both forms."""
    channels, width = 6, 4
    weight, bias = torch.randn(channels, width), torch.randn(channels)
    conv_state = torch.randn(2, channels, width - 1)
    norm_weight, A_log, dt_bias = torch.randn(DIM), torch.randn(2), torch.randn(2 * DIM)

    def fn(x, h, gate, g):
        y, state = kda_ops.causal_conv1d(x, weight, bias, conv_state, "silu")
        y2, state2 = kda_ops.causal_conv1d(x, weight, None, None, None)
        y3, state3 = kda_ops.causal_conv1d_update(x, conv_state, weight, bias)
        return (
            y, state, y2, state2, y3, state3,
            kda_ops.gated_rms_norm(h, gate, norm_weight, activation="sigmoid"),
            kda_ops.gated_rms_norm(h, gate, norm_weight, activation="silu"),
            kda_ops.kda_gate(g, A_log, dt_bias, -5.0), kda_ops.kda_gate(g, A_log, dt_bias),
        )  # fmt: skip

    def inputs(length):
        per_head = (2, length, 2, DIM)
        return (torch.randn(2, length, channels), torch.randn(per_head), torch.randn(per_head),
                torch.randn(per_head))  # fmt: skip

    return fn, inputs


CASES = {
    "kda_gva_safe_gate_state": lambda: _delta_rule(1, 2, False, "safe", True),
    "kda_softplus_gate_v_first_state": lambda: _delta_rule(
        2, 2, False, "softplus", True, v_first=True
    ),
    "gdn_gva_softplus_gate_state": lambda: _delta_rule(1, 2, True, "softplus", True),
    "gdn_log_decay_neg_eigval": lambda: _delta_rule(2, 4, True, None, False, neg_eigval=True),
    "conv_norm_gate": _conv_norm_gate,
}
NODES = {  # what each mode's delta rule / conv must be made of (CumSum: the chunked form)
    "standard": {"delta": {"LinearAttention"}, "conv": {"CausalConvWithState"}},
    "portable": {"delta": {"Scan", "CumSum"}, "conv": {"Conv"}},
    "token": {"delta": {"Scan"}, "conv": {"Conv"}},
}
RUNS = [(case, mode) for case in sorted(CASES) for mode in MODES] + [
    ("kda_gva_safe_gate_state", "token")
]


def _op_types(graph) -> set:
    """The op types of a graph's nodes and of its subgraphs' (Loop and Scan bodies)."""
    types = set()
    for node in graph.node:
        types.add(node.op_type)
        for attribute in node.attribute:
            if attribute.type == onnx.AttributeProto.GRAPH:
                types |= _op_types(attribute.g)
    return types


def _export(case, mode, path):
    fn, inputs = CASES[case]()
    module = OpCase(fn)
    args = inputs(6)
    length = torch.export.Dim("T", min=1, max=4096)
    program = torch.export.export(module, args, dynamic_shapes=(({1: length},) * len(args),))
    kda_onnx.export_onnx(program, str(path), mode)
    return module, inputs


@pytest.mark.parametrize("case, mode", RUNS)
def test_onnxruntime_matches_pytorch(case, mode, tmp_path):
    torch.manual_seed(0)
    path = tmp_path / "op.onnx"
    module, inputs = _export(case, mode, path)
    proto = onnx.load(str(path))
    onnx.checker.check_model(proto, full_check=True)
    assert proto.opset_import[0].version == kda_onnx.MODE_OPSETS[mode]
    op_types = _op_types(proto.graph)
    assert NODES[mode]["conv" if case.startswith("conv") else "delta"] <= op_types
    if mode == "standard":
        assert "Scan" not in op_types  # nothing token-serial outside the standard ops
    if mode == "token":
        assert "CumSum" not in op_types
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    for length in LENGTHS:
        args = inputs(length)
        feeds = {i.name: a.numpy() for i, a in zip(session.get_inputs(), args)}
        outputs, expected = session.run(None, feeds), module(*args)
        assert len(outputs) == len(expected)
        for got, want in zip(outputs, expected):
            torch.testing.assert_close(torch.from_numpy(got), want)
    if mode == "standard":  # onnx's own reading of the opset-27 ops agrees
        evaluator = ReferenceEvaluator(proto)
        args = inputs(LENGTHS[-1])
        feeds = {name: a.numpy() for name, a in zip(evaluator.input_names, args)}
        for got, want in zip(evaluator.run(None, feeds), module(*args)):
            torch.testing.assert_close(torch.from_numpy(np.asarray(got)), want)


def test_portable_chunk_is_chunked_and_standard_has_no_varlen(tmp_path):
    """Portable mode's prefill is a Scan over steps of chunks (its body carries the state
    [B HV, 1, K, V] and batches its products over the step's chunks), not over tokens; the
    decode step is the token Scan; a packed-sequence call has no standard translation."""
    fn, inputs = CASES["kda_gva_safe_gate_state"]()
    program = torch.export.export(OpCase(fn), inputs(6))
    proto = kda_onnx.export_onnx(program, str(tmp_path / "p.onnx"), "portable")
    scans = [node for node in proto.graph.node if node.op_type == "Scan"]
    assert len(scans) == 2  # the chunked prefill and the token decode step
    bodies = [
        {node.op_type for node in onnx.helper.get_attribute_value(a).node}
        for scan in scans for a in scan.attribute if a.name == "body"
    ]  # fmt: skip
    chunked = [body for body in bodies if "CumSum" in body]
    assert len(chunked) == 1 and "MatMul" in chunked[0]
    assert not {"Scan", "Loop"} & chunked[0]
    with pytest.raises(ValueError, match="cu_seqlens"):
        onnx_standard.standard_delta_rule(*[None] * 8, object(), 1.0, None, True, True)
    with pytest.raises(ValueError, match="cu_seqlens"):
        onnx_standard.standard_causal_conv1d(None, None, None, None, object(), "silu")


class PackedConv(torch.nn.Module):
    def forward(self, x, cu_seqlens):
        return kda_ops.causal_conv1d(x, torch.ones(4, 4), None, None, "silu", cu_seqlens)


def test_standard_export_of_packed_sequences_names_cu_seqlens(tmp_path):
    args = (torch.randn(1, 9, 4), torch.tensor([0, 4, 9], dtype=torch.int32))
    program = torch.export.export(PackedConv(), args)
    with pytest.raises(Exception) as raised:
        kda_onnx.export_onnx(program, str(tmp_path / "p.onnx"), "standard")
    causes, error = [], raised.value
    while error is not None:
        causes.append(error)
        error = error.__cause__
    assert any(isinstance(e, ValueError) and "cu_seqlens" in str(e) for e in causes)


def test_standard_mode_needs_opset_27(tmp_path):
    program = torch.export.export(PackedConv(), (torch.randn(1, 9, 4), None))
    with pytest.raises(ValueError, match="opset_version"):
        kda_onnx.export_onnx(program, str(tmp_path / "p.onnx"), "standard", opset_version=26)


@pytest.mark.parametrize("mode", MODES)
def test_fp16_inputs(mode, tmp_path):
    """fp16 q, k, v, g, beta: the translations compute in fp32 and return fp16 outputs."""
    torch.manual_seed(0)
    fn, inputs = CASES["kda_gva_safe_gate_state"]()

    def half_inputs(length):
        return tuple(x.half() for x in inputs(length))

    module = OpCase(fn)
    length = torch.export.Dim("T", max=4096)
    program = torch.export.export(module, half_inputs(6), dynamic_shapes=(({1: length},) * 5,))
    kda_onnx.export_onnx(program, str(tmp_path / "h.onnx"), mode)
    session = ort.InferenceSession(str(tmp_path / "h.onnx"), providers=["CPUExecutionProvider"])
    args = half_inputs(70)
    feeds = {i.name: a.numpy() for i, a in zip(session.get_inputs(), args)}
    for got, expected in zip(session.run(None, feeds), module(*args)):
        assert got.dtype == expected.numpy().dtype
        torch.testing.assert_close(torch.from_numpy(np.asarray(got)), expected)


@pytest.mark.parametrize("lower_bound", [-5.0, None])
def test_portable_chunks_take_the_strongest_decays(lower_bound, tmp_path):
    """Every token at the safe gate's bound (-5: 16-token blocks factored at their first
    token reach exp(±75)) or decaying by ~e^-2000 a token (softplus gate: any factor across two
    tokens would overflow float32): the chunked form stays finite and equal to PyTorch."""
    torch.manual_seed(0)
    A_log, dt_bias = torch.full((2,), 6.5), torch.full((2 * DIM,), 3.0)

    def fn(q, k, v, g, beta):
        return kda_ops.chunk_kda(
            q, k, v, g, beta, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
            A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound, output_final_state=True,
        )  # fmt: skip

    def inputs(length):
        tokens = (1, length, 2)
        return (torch.randn(*tokens, DIM), torch.randn(*tokens, DIM), torch.randn(*tokens, DIM),
                torch.rand(*tokens, DIM), torch.rand(*tokens))  # fmt: skip

    module = OpCase(fn)
    length = torch.export.Dim("T", min=1, max=4096)
    program = torch.export.export(module, inputs(6), dynamic_shapes=(({1: length},) * 5,))
    kda_onnx.export_onnx(program, str(tmp_path / "d.onnx"), "portable")
    session = ort.InferenceSession(str(tmp_path / "d.onnx"), providers=["CPUExecutionProvider"])
    args = inputs(130)
    feeds = {i.name: a.numpy() for i, a in zip(session.get_inputs(), args)}
    for got, want in zip(session.run(None, feeds), module(*args)):
        assert np.isfinite(got).all()
        torch.testing.assert_close(torch.from_numpy(got), want)
