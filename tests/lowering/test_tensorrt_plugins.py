"""lowering.tensorrt_plugins: the QDP descriptor logic (output shapes and dtypes, kernel
config, launch grid, int32 scalars) drives every plugin kernel, launched as TensorRT's AOT
launcher would (NaN-filled outputs, baked constexprs): on a GPU their PTX through the CUDA
driver with TensorRT's argument list, on the CPU under the Triton interpreter, to the
reference's results; the same logic evaluates over symbolic dims
using only the operators TensorRT's ``ShapeExpr`` has; registration and engine building
need TensorRT and skip without it."""

from __future__ import annotations

import importlib.util
import math
import pathlib
import subprocess
import sys
import types
import typing

import numpy as np
import pytest
import torch

import kda_ops  # noqa: F401  (registers torch.ops.kda)
from kda_ops import reference
from kda_ops.kernels.chunk import FORWARD_CHUNK
from kda_ops.kernels.sizes import cdiv
from lowering import tensorrt_plugins as qdp
from lowering.tensorrt import Placeholders, compile_for_tensorrt, shape_expression
from tests.lowering.ptx_launch import launch_ptx

HEADS, HEAD_K, HEAD_V, CHANNELS, WIDTH = 2, 16, 16, 8, 4
DELTA_ATTRS = dict(scale=HEAD_K**-0.5, lower_bound=-5.0, use_gate=1, use_lower_bound=1,
                   use_qk_l2norm=1, use_beta_sigmoid=1)  # fmt: skip


def launch_like_tensorrt(name: str, inputs: dict, attrs: dict) -> dict[str, torch.Tensor]:
    """Run plugin ``name``'s kernel with everything TensorRT would take from the plugin
    definition: output buffers (NaN, never zeroed), grid, int32 scalars, constexprs. On a
    GPU its PTX as ``aot_impl`` returns it, launched through the CUDA driver; without one
    the kernel through Triton's interpreter (how CI runs these)."""
    spec = qdp.SPECS[name]
    shapes = {n: tuple(t.shape) for n, t in inputs.items()}
    config = qdp.kernel_config(name, shapes, attrs, "float32")
    outputs = {}
    for out, shape in qdp.output_shapes(name, shapes).items():
        like = spec.outputs[out].like
        dtype = torch.float32 if like is None else inputs[like].dtype
        outputs[out] = torch.full(shape, math.nan, dtype=dtype)
    grid = qdp.launch_grid(name, shapes, config)
    if torch.cuda.is_available():
        return _launch_ptx(name, config, grid, inputs, outputs)
    ints = dict(zip(spec.kernel.int_args, qdp.int_args(name, shapes, config)))
    arguments = {**inputs, **ints, **outputs, **spec.kernel.constexprs(config),
                 **dict.fromkeys(spec.kernel.absent)}  # fmt: skip
    spec.kernel.kernel[grid](**arguments, num_warps=spec.kernel.warps(config))
    return outputs


def _launch_ptx(name: str, config: dict, grid: tuple, inputs: dict, outputs: dict) -> dict:
    """TensorRT's AOT launch with the PTX, grid, block and shared memory ``aot_impl`` gives;
    outputs come back on the CPU."""
    kernel = qdp.SPECS[name].kernel
    written = {n: t.cuda() for n, t in outputs.items()}
    shapes = {n: tuple(t.shape) for n, t in inputs.items()}
    launch_ptx(compile_for_tensorrt(kernel, "float32", config), grid, 32 * kernel.warps(config),
               [inputs[n].cuda() for n in kernel.inputs], qdp.int_args(name, shapes, config),
               [written[n] for n in kernel.outputs])  # fmt: skip
    return {n: t.cpu() for n, t in written.items()}


def _delta_inputs(batch: int, length: int) -> dict[str, torch.Tensor]:
    q, k = (torch.randn(batch, length, HEADS, HEAD_K) for _ in range(2))
    return dict(
        q=q, k=k, v=torch.randn(batch, length, HEADS, HEAD_V),
        g=torch.randn(batch, length, HEADS, HEAD_K), beta=torch.randn(batch, length, HEADS),
        A_log=torch.randn(HEADS), dt_bias=torch.randn(HEADS * HEAD_K),
        state_in=torch.randn(batch, HEADS, HEAD_K, HEAD_V),
    )  # fmt: skip


def _delta_reference(inputs: dict, lower_bound=-5.0) -> tuple[torch.Tensor, torch.Tensor]:
    args = [inputs[n] for n in ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "state_in")]
    return reference.delta_rule(reference.recurrent_delta_rule, *args, None,
                                DELTA_ATTRS["scale"], lower_bound, True, True)  # fmt: skip


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(got, want.to(got.dtype), atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize("length", [1, 3])
def test_recurrent_plugin_matches_reference(length):
    inputs = _delta_inputs(2, length)
    got = launch_like_tensorrt("recurrent", inputs, DELTA_ATTRS)
    o, state = _delta_reference(inputs)
    _close(got["o"], o)
    _close(got["state_out"], state)


@pytest.mark.parametrize("batch, length", [(2, 5), (1, 70)])
def test_chunk_plugin_chain_matches_reference(batch, length):
    """prepare -> recurrence, the six intermediates passed as plugin outputs / inputs;
    T = 70 spans five 16-token chunks, the last one partial."""
    inputs = _delta_inputs(batch, length)
    state = inputs.pop("state_in")
    prepared = launch_like_tensorrt("chunk_prepare", inputs, DELTA_ATTRS)
    assert prepared["aqk"].shape[0] == batch * math.ceil(length / FORWARD_CHUNK)
    recurrence_inputs = {n: prepared[n] for n in ("w", "u", "qg", "kd", "aqk", "chunk_decay")}
    got = launch_like_tensorrt("chunk_recurrence", {**recurrence_inputs, "initial_state": state},
                               {})  # fmt: skip
    o, final = _delta_reference({**inputs, "state_in": state})
    _close(got["o"], o)
    _close(got["final_state"], final)


def test_chunk_plugin_chain_with_unbounded_gate_redoes_overflowing_chunks():
    """The softplus gate in the plugin's single prepare launch: each chunk takes the dense
    diagonal dots first; the decays of ~10 a token of the first 64 tokens overflow them,
    so those chunks' programs redo them by the dyadic split, overwriting every output."""
    inputs = _delta_inputs(1, 130)
    inputs["g"][:, :64] += 10.0
    state = inputs.pop("state_in")
    attrs = dict(DELTA_ATTRS, use_lower_bound=0)
    prepared = launch_like_tensorrt("chunk_prepare", inputs, attrs)
    recurrence_inputs = {n: prepared[n] for n in ("w", "u", "qg", "kd", "aqk", "chunk_decay")}
    got = launch_like_tensorrt("chunk_recurrence", {**recurrence_inputs, "initial_state": state},
                               {})  # fmt: skip
    o, final = _delta_reference({**inputs, "state_in": state}, lower_bound=None)
    _close(got["o"], o)
    _close(got["final_state"], final)


def test_conv_plugin_chain_matches_reference():
    x, state = torch.randn(2, 5, CHANNELS), torch.randn(2, CHANNELS, WIDTH - 1)
    weight, bias = torch.randn(CHANNELS, WIDTH), torch.randn(CHANNELS)
    conv_inputs = dict(x=x, weight=weight, bias=bias, state=state)
    y = launch_like_tensorrt("causal_conv1d_output", conv_inputs, dict(silu=1))
    final = launch_like_tensorrt("causal_conv1d_state", dict(x=x, state_in=state), {})
    want_y, want_state = reference.causal_conv1d(x, weight, bias, state, None, "silu")
    _close(y["y"], want_y)
    _close(final["state_out"], want_state)


def test_gated_rms_norm_and_gate_plugins_match_reference():
    x, gate, weight = torch.randn(3, 5, 16), torch.randn(3, 5, 16), torch.randn(16)
    y = launch_like_tensorrt("gated_rms_norm", dict(x=x, gate=gate, weight=weight),
                             dict(eps=1e-6, silu=0))  # fmt: skip
    _close(y["y"], reference.gated_rms_norm(x, gate, weight, 1e-6, "sigmoid"))
    g, A_log, dt_bias = torch.randn(2, 3, HEADS, HEAD_K), torch.randn(HEADS), torch.randn(32)
    out = launch_like_tensorrt("gate", dict(g=g, A_log=A_log, dt_bias=dt_bias),
                               dict(lower_bound=-5.0, use_lower_bound=1))  # fmt: skip
    _close(out["out"], reference.kda_gate(g, A_log, dt_bias, -5.0))


class Dim:
    """A symbolic dim with exactly TensorRT ``ShapeExpr``'s operators (``+ - * //`` with the
    expression on the left; no reflected operators, no ``bool``), evaluated later."""

    def __init__(self, fn):
        self.fn = fn

    def _op(self, other, op):
        rhs = other.fn if isinstance(other, Dim) else (lambda env: other)
        return Dim(lambda env: op(self.fn(env), rhs(env)))

    def __add__(self, other):
        return self._op(other, int.__add__)

    def __sub__(self, other):
        return self._op(other, int.__sub__)

    def __mul__(self, other):
        return self._op(other, int.__mul__)

    def __floordiv__(self, other):
        return self._op(other, int.__floordiv__)

    def __bool__(self):
        raise TypeError("a symbolic dim has no truth value")


def _evaluate(value, env):
    if isinstance(value, Dim):
        return value.fn(env)
    if isinstance(value, (tuple, list)):
        return type(value)(_evaluate(v, env) for v in value)
    if isinstance(value, dict):
        return {k: _evaluate(v, env) for k, v in value.items()}
    return value


PLUGIN_SHAPES = {  # input shapes with B, T symbolic ("B", "T") and the rest static
    "recurrent": dict(q=("B", "T", 2, 16), k=("B", "T", 2, 16), v=("B", "T", 2, 16),
                      g=("B", "T", 2, 16), beta=("B", "T", 2), A_log=(2,), dt_bias=(32,),
                      state_in=("B", 2, 16, 16)),
    "chunk_recurrence": dict(w=("B", "T", 2, 16), u=("B", "T", 2, 16), qg=("B", "T", 2, 16),
                             kd=("B", "T", 2, 16), aqk=("B", 2, 64, 64), chunk_decay=("B", 2, 16),
                             initial_state=("B", 2, 16, 16)),
    "causal_conv1d_output": dict(x=("B", "T", 8), weight=(8, 4), bias=(8,), state=("B", 8, 3)),
    "causal_conv1d_state": dict(x=("B", "T", 8), state_in=("B", 8, 3)),
    "gated_rms_norm": dict(x=("B", "T", 16), gate=("B", "T", 16), weight=(16,)),
    "gate": dict(g=("B", "T", 2, 16), A_log=(2,), dt_bias=(32,)),
}  # fmt: skip
PLUGIN_SHAPES["chunk_prepare"] = {k: v for k, v in PLUGIN_SHAPES["recurrent"].items()
                                  if k != "state_in"}  # fmt: skip
PLUGIN_ATTRS = {"chunk_recurrence": {}, "causal_conv1d_output": dict(silu=1),
                "causal_conv1d_state": {}, "gated_rms_norm": dict(eps=1e-6, silu=1),
                "gate": dict(lower_bound=-5.0, use_lower_bound=1)}  # fmt: skip


def _shapes(name, dims):
    return {n: tuple(dims.get(d, d) for d in shape) for n, shape in PLUGIN_SHAPES[name].items()}


@pytest.mark.parametrize("name", sorted(qdp.SPECS))
def test_descriptor_logic_is_shape_expression_safe(name):
    """Output shapes, grid and int32 scalars over symbolic B, T (ShapeExpr's operators
    only) equal the same functions over concrete B, T."""
    assert set(PLUGIN_SHAPES) == set(qdp.SPECS)
    attrs = PLUGIN_ATTRS.get(name, DELTA_ATTRS)
    symbolic = _shapes(name, {"B": Dim(lambda e: e["B"]), "T": Dim(lambda e: e["T"])})
    static = {n: qdp.static_dims([d if isinstance(d, int) else 1 for d in s])
              for n, s in symbolic.items()}  # fmt: skip
    config = qdp.kernel_config(name, static, attrs, "float16")
    for env in ({"B": 3, "T": 5}, {"B": 1, "T": 130}):
        concrete = _shapes(name, env)
        assert _evaluate(qdp.output_shapes(name, symbolic), env) == qdp.output_shapes(
            name, concrete
        )
        assert _evaluate(qdp.launch_grid(name, symbolic, config), env) == qdp.launch_grid(
            name, concrete, config
        )
        assert _evaluate(qdp.int_args(name, symbolic, config), env) == qdp.int_args(
            name, concrete, config
        )


def _substituted(extent, planned, kernel, shapes) -> int:
    """A planned extent (an int, or a SymInt of the planning's symbols) at concrete input
    shapes, by sympy's substitution."""
    if isinstance(extent, int):
        return extent
    values = {planned.symbols[n]: kernel.dims[n](shapes) for n in planned.symbols}
    return int(extent.node.expr.subs(values))


@pytest.mark.parametrize("name", sorted(qdp.SPECS))
def test_grid_int_args_and_outputs_are_the_launchers_plan(name):
    """Over concrete shapes, the plugin's grid and int32 scalars are the extents its
    launcher planned over symbolic dims (substituted by sympy, not by the ShapeExpr-safe
    evaluation the plugin uses), and its output descriptors the shapes of the tensors the
    launch writes (the norm's and the gate's rows flattened into one dim R)."""
    kernel = qdp.SPECS[name].kernel
    attrs = PLUGIN_ATTRS.get(name, DELTA_ATTRS)
    config = qdp.kernel_config(name, _shapes(name, {"B": 1, "T": 1}), attrs, "bfloat16")
    planned = kernel.planned(config)
    launch = planned.launch
    for env in ({"B": 3, "T": 5}, {"B": 1, "T": 130}, {"B": 7, "T": 4097}):
        shapes = _shapes(name, env)
        args = dict(planned=planned, kernel=kernel, shapes=shapes)
        grid = tuple(_substituted(e, **args) for e in (*launch.grid, 1, 1)[:3])
        assert qdp.launch_grid(name, shapes, config) == grid
        ints = [_substituted(launch.args[n], **args) for n in kernel.int_args]
        assert qdp.int_args(name, shapes, config) == ints
        for out, shape in qdp.output_shapes(name, shapes).items():
            written = tuple(_substituted(d, **args) for d in launch.args[out].shape)
            if "R" in planned.symbols:  # [R, ...]: the same elements and row shape
                assert math.prod(written) == math.prod(shape)
                assert written[1:] == shape[len(shape) - len(written) + 1 :]
            else:
                assert written == shape


def test_shape_expression_uses_only_shape_expression_operators():
    """Planned extents (sums, differences, products, floor and ceiling divisions by ints)
    evaluate over symbolic dims with ShapeExpr's operators to the extents' values; an int
    minus a dim has no such form."""
    tensors = Placeholders(torch.float32)
    batch, length = tensors.size("B"), tensors.size("T")
    dims = {
        tensors.symbols["B"]: Dim(lambda e: e["B"]),
        tensors.symbols["T"]: Dim(lambda e: e["T"]),
    }
    extents = {
        "ceil": (cdiv(batch * length * 3, 8), lambda b, t: -(-b * t * 3 // 8)),
        "blocks": ((length + 15) // 16 * batch, lambda b, t: (t + 15) // 16 * b),
        "minus": (length - 1, lambda b, t: t - 1),
        "mixed": (
            2 * batch + length * 3 - 4 * batch * length,
            lambda b, t: 2 * b + 3 * t - 4 * b * t,
        ),
        "constant": (batch - batch + 7, lambda b, t: 7),
    }
    for name, (extent, want) in extents.items():
        for env in ({"B": 1, "T": 1}, {"B": 3, "T": 130}, {"B": 8, "T": 4097}):
            got = _evaluate(shape_expression(extent, dims), env)
            assert got == want(env["B"], env["T"]), (name, env)
    with pytest.raises(ValueError, match="an int minus a shape"):
        shape_expression(5 - length, dims)


def test_chunk_prepare_grid_and_intermediates_match_launch_chunk_kda():
    """The plugin's grid and Aqk shape are launch_chunk_kda's: B * ceil(T / C) chunks of
    C = FORWARD_CHUNK tokens."""
    shapes = _shapes("chunk_prepare", {"B": 3, "T": 130})
    config = qdp.kernel_config("chunk_prepare", shapes, DELTA_ATTRS, "bfloat16")
    chunks, size = 3 * math.ceil(130 / FORWARD_CHUNK), FORWARD_CHUNK
    assert qdp.launch_grid("chunk_prepare", shapes, config) == (chunks, 2, 1)
    assert qdp.output_shapes("chunk_prepare", shapes)["aqk"] == (chunks, 2, size, size)
    assert qdp.SPECS["chunk_prepare"].kernel.constexprs(config)["SAFE_GATE"]
    fp16 = qdp.kernel_config("chunk_prepare", shapes, DELTA_ATTRS, "float16")
    assert not qdp.SPECS["chunk_prepare"].kernel.constexprs(fp16)["SAFE_GATE"]


def test_autotune_types_keep_states_and_gate_parameters_float32():
    model, fixed = "FP16|BF16|FP32", "FP32|FP32|FP32"
    assert qdp.autotune_types("gate") == ", ".join([model, fixed, fixed, fixed])
    recurrent = qdp.autotune_types("recurrent").split(", ")
    assert recurrent == [model] * 5 + [fixed] * 3 + [model, fixed]


def test_static_dims_keeps_ints():
    assert qdp.static_dims((3, 16)) == (3, 16)


def test_attributes_match_the_onnx_plugin_node_attributes():
    from lowering import onnx as kda_onnx

    for name in qdp.SPECS:
        assert list(qdp.SPECS[name].attributes) == kda_onnx.PLUGIN_OPS[name]["attributes"]


# The tensorrt.plugin classes the annotations name, as stand-ins: TensorRT cannot be
# installed where CI runs; test_register_plugins_with_tensorrt registers for real.
QDP_TYPES = types.SimpleNamespace(**{name: type(name, (), {}) for name in (
    "TensorDesc", "AutoTuneCombination", "KernelLaunchParams", "SymIntExprs")})  # fmt: skip


@pytest.mark.parametrize("name", sorted(qdp.SPECS))
def test_return_annotations_follow_the_qdp_contract(name):
    """QDP's validators read the return annotations and refuse a bare list or tuple:
    register returns one TensorDesc per output, autotune a list of AutoTuneCombination,
    aot_impl (kernel name, PTX) as str or bytes, then KernelLaunchParams and SymIntExprs."""
    returns = qdp.return_annotations(name, QDP_TYPES)
    assert typing.get_origin(returns["register"]) is tuple
    assert typing.get_args(returns["register"]) == (QDP_TYPES.TensorDesc,) * len(
        qdp.SPECS[name].outputs)  # fmt: skip
    assert typing.get_origin(returns["autotune"]) is list
    assert typing.get_args(returns["autotune"]) == (QDP_TYPES.AutoTuneCombination,)
    assert typing.get_origin(returns["aot_impl"]) is tuple
    kernel_name, ptx, params, scalars = typing.get_args(returns["aot_impl"])
    assert set(typing.get_args(kernel_name)) == set(typing.get_args(ptx)) == {str, bytes}
    assert (params, scalars) == (QDP_TYPES.KernelLaunchParams, QDP_TYPES.SymIntExprs)


def test_register_plugins_with_tensorrt():
    pytest.importorskip("tensorrt", reason="TensorRT is not installed (it cannot be here)")
    import tensorrt.plugin as trtp

    assert qdp.register_plugins() == tuple(f"kda::{n}" for n in qdp.SPECS)
    for name in qdp.SPECS:
        assert hasattr(trtp.op.kda, name)


OP_CALLS = {  # arguments of a convertible call of each functional kda op
    "recurrent": dict(cu_seqlens=None, scale=0.25, lower_bound=-5.0, use_qk_l2norm=True,
                      use_beta_sigmoid=False),
    "causal_conv1d": dict(cu_seqlens=None, activation="silu"),
    "gated_rms_norm": dict(eps=1e-6, activation="sigmoid"),
    "gate": dict(lower_bound=None),
}  # fmt: skip
OP_CALLS["chunk"] = OP_CALLS["recurrent"]


@pytest.mark.parametrize("op", sorted(qdp.OP_OUTPUTS))
def test_torch_op_plugin_chain_is_wired(op):
    """Each plugin gets its kernel's inputs in order, from op arguments or earlier plugin
    outputs, and exactly its attributes; the op's outputs come from the chain."""
    schema = getattr(torch.ops.kda, op).default._schema
    names = [a.name for a in schema.arguments]
    bound = qdp.bind_arguments(schema, [], {**dict.fromkeys(names, "tensor"), **OP_CALLS[op]})
    assert qdp.convertible(bound)
    available = set(names)
    for plugin, sources, attrs in qdp.plugin_chain(op, bound):
        assert tuple(sources) == qdp.SPECS[plugin].kernel.inputs
        assert set(sources.values()) <= available
        assert list(attrs) == list(qdp.SPECS[plugin].attributes)
        available |= {f"{plugin}.{out}" for out in qdp.SPECS[plugin].outputs}
    assert set(qdp.OP_OUTPUTS[op]) <= available
    assert len(qdp.OP_OUTPUTS[op]) == len(schema.returns)


def test_conv_without_bias_converts_with_a_zero_bias():
    """The example's short convs have no bias: they convert (the converter adds zeros)
    rather than stay in PyTorch, where a whole-graph engine build cannot leave them."""
    schema = torch.ops.kda.causal_conv1d.default._schema
    names = [a.name for a in schema.arguments]
    call = {**dict.fromkeys(names, "tensor"), **OP_CALLS["causal_conv1d"], "bias": None}
    assert qdp.convertible(qdp.bind_arguments(schema, [], call))


def test_calls_with_absent_optionals_or_packed_sequences_stay_in_pytorch():
    schema = torch.ops.kda.recurrent.default._schema
    full = {a.name: "tensor" for a in schema.arguments}
    assert not qdp.convertible(qdp.bind_arguments(schema, [], {**full, "initial_state": None}))
    assert not qdp.convertible(qdp.bind_arguments(schema, [], full))  # cu_seqlens given
    attrs = qdp.delta_attributes({**OP_CALLS["recurrent"], "lower_bound": None})
    assert attrs["use_lower_bound"] == 0 and attrs["use_qk_l2norm"] == 1


def test_register_torch_tensorrt_converters():
    pytest.importorskip("torch_tensorrt", reason="Torch-TensorRT is not installed (TensorRT "
                        "cannot be installed here)")  # fmt: skip
    from torch_tensorrt.dynamo.conversion import DYNAMO_CONVERTERS

    assert qdp.register_torch_tensorrt_converters() == tuple(qdp.OP_OUTPUTS)
    for op in qdp.OP_OUTPUTS:
        assert getattr(torch.ops.kda, op).default in DYNAMO_CONVERTERS


def test_export_tensorrt_example_exits_clearly_without_tensorrt(tmp_path):
    if importlib.util.find_spec("tensorrt") is not None:
        pytest.skip("TensorRT is installed: the engine test below runs instead")
    root = pathlib.Path(__file__).resolve().parents[2]
    result = subprocess.run([sys.executable, "-m", "examples.export_tensorrt", str(tmp_path)],
                            cwd=root, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert result.returncode == 1
    assert "`tensorrt` is not importable" in result.stderr
    assert not list(tmp_path.iterdir())


def test_decode_engine_builds_from_plugin_onnx(tmp_path):
    pytest.importorskip("tensorrt", reason="TensorRT is not installed (it cannot be here)")
    if not torch.cuda.is_available():
        pytest.skip("building the AOT plugins' engine needs an sm_90 GPU")
    from examples import export_onnx, export_tensorrt
    from examples.hybrid_model import HybridConfig, HybridLM

    model = HybridLM(HybridConfig()).eval().requires_grad_(False)
    files = export_onnx.export_hybrid(model, tmp_path, modes=("plugin",))
    assert export_tensorrt.build_from_onnx(files["decode", "plugin"], "decode")


@pytest.mark.parametrize("kind, value, want", [
    (float, np.array([0.25], dtype=np.float32), 0.25),  # the ONNX parser's FLOAT32 field
    (float, np.array([-5.0]), -5.0), (float, np.float32(1e-6), float(np.float32(1e-6))),
    (int, np.array([1], dtype=np.int32), 1), (int, np.array([0], dtype=np.int64), 0),
    (int, np.array([1.0], dtype=np.float32), 1), (float, 2, 2.0), (int, True, 1),
])  # fmt: skip
def test_attribute_values_accept_parser_field_types(kind, value, want):
    got = qdp.attribute_value(value, kind)
    assert got == want and type(got) is kind


@pytest.mark.parametrize("value, kind", [(np.array([1.0, 2.0]), float), ("1", int),
                                         (np.array([0.5]), int)])  # fmt: skip
def test_attribute_values_reject_non_scalars(value, kind):
    with pytest.raises(TypeError, match="attribute"):
        qdp.attribute_value(value, kind)


def test_attributes_parse_by_declared_order_from_fields():
    fields = [np.array([v], dtype=np.float32 if isinstance(v, float) else np.int32)
              for v in DELTA_ATTRS.values()]  # fmt: skip
    assert qdp.parse_attributes("recurrent", fields) == pytest.approx(DELTA_ATTRS)
    field = qdp.attribute_field(DELTA_ATTRS["scale"], float)
    assert field.dtype == np.float32 and field.shape == (1,)
    with pytest.raises(TypeError, match="takes attributes"):
        qdp.parse_attributes("gate", fields)


@pytest.mark.parametrize("name", sorted(qdp.SPECS))
@pytest.mark.parametrize("model", qdp.MODEL_DTYPES)
@pytest.mark.parametrize("fixed", qdp.MODEL_DTYPES)
def test_cast_plan_feeds_a_declared_combination(name, model, fixed):
    """Whatever the producers' types (model dtype ``model``, the float32 positions fed as
    ``fixed``), the inputs after the converter's casts plus the outputs' types (register's
    rule) are one of the combinations autotune declares."""
    spec = qdp.SPECS[name]
    fed = ["FP32" if f32 and fixed == "FP32" else (fixed if f32 else model)
           for f32 in qdp.io_float32(name)[: len(spec.kernel.inputs)]]  # fmt: skip
    plan = qdp.cast_plan(name, fed)
    types = dict(zip(spec.kernel.inputs, plan))
    outputs = ["FP32" if o.like is None else types[o.like] for o in spec.outputs.values()]
    assert tuple(plan + outputs) in qdp.combinations(name)


class FakeITensor:
    def __init__(self, dtype, source):
        self.dtype, self.source = dtype, source


def _fake_tensorrt(monkeypatch, calls):
    """Stand-ins for what the converter touches: TensorRT's dtypes, ``trtp.op.kda.<plugin>``
    (records the types it is fed), ``get_trt_tensor`` and the network's cast / plugin
    layers; the plugin layers' outputs take register's types."""
    trt = types.ModuleType("tensorrt")
    trt.float16, trt.bfloat16, trt.float32 = "FP16", "BF16", "FP32"  # _type_name's keys
    trtp = types.ModuleType("tensorrt.plugin")
    trt.plugin = trtp

    def plugin_call(plugin):
        def call(*inputs, **attrs):
            spec = qdp.SPECS[plugin]
            calls.append((plugin, [t.dtype for t in inputs], attrs))
            fed = dict(zip(spec.kernel.inputs, inputs))
            return ["FP32" if o.like is None else fed[o.like].dtype for o in spec.outputs.values()]

        return call

    trtp.op = types.SimpleNamespace(kda=types.SimpleNamespace(
        **{n: plugin_call(n) for n in qdp.SPECS}))  # fmt: skip
    utils = types.ModuleType("torch_tensorrt.dynamo.conversion.converter_utils")
    utils.get_trt_tensor = lambda ctx, value, name: value

    def layer(outs):
        return types.SimpleNamespace(get_output=lambda i: FakeITensor(outs[i], "layer"))

    net = types.SimpleNamespace(
        add_cast=lambda t, dtype: (calls.append(("cast", t.dtype, dtype)), layer([dtype]))[1],
        add_plugin=lambda outs, aot: layer(outs),
    )
    for module in ("torch_tensorrt", "torch_tensorrt.dynamo", "torch_tensorrt.dynamo.conversion"):
        monkeypatch.setitem(sys.modules, module, types.ModuleType(module))
    monkeypatch.setitem(sys.modules, "torch_tensorrt.dynamo.conversion.converter_utils", utils)
    monkeypatch.setitem(sys.modules, "tensorrt", trt)
    monkeypatch.setitem(sys.modules, "tensorrt.plugin", trtp)
    return types.SimpleNamespace(net=net)


@pytest.mark.parametrize("op", sorted(qdp.OP_OUTPUTS))
@pytest.mark.parametrize("model", ["FP16", "BF16"])
def test_converter_casts_a_half_model_to_the_declared_types(monkeypatch, op, model):
    """A ``.half()`` / ``.bfloat16()`` model: gate parameters and conv / delta states reach
    the converter in the model dtype, which the plugins declare FP32 (strongly typed
    networks build only declared combinations); the converter casts them, and casts
    outputs back to the dtypes the op's fake gives."""
    calls = []
    ctx = _fake_tensorrt(monkeypatch, calls)
    target = getattr(torch.ops.kda, op).default
    names = [a.name for a in target._schema.arguments]
    tensors = {n: FakeITensor(model, n) for n in names}
    kwargs = {**tensors, **OP_CALLS[op], "bias": tensors.get("bias")}
    kwargs = {k: v for k, v in kwargs.items() if k in names}
    outputs = qdp._convert(op, ctx, target, (), kwargs, "node")
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    plugin_calls = [c for c in calls if c[0] != "cast"]
    assert [c[0] for c in plugin_calls] == [p for p, _, _ in qdp.plugin_chain(op, kwargs)]
    for plugin, fed, attrs in plugin_calls:
        spec = qdp.SPECS[plugin]
        fed_types = dict(zip(spec.kernel.inputs, fed))
        out = ["FP32" if o.like is None else fed_types[o.like] for o in spec.outputs.values()]
        assert tuple(fed + out) in qdp.combinations(plugin)
        assert all(a.dtype in (np.float32, np.int32) and a.shape == (1,) for a in attrs.values())
    want = ["FP32" if like is None else model for like in qdp.OP_OUTPUT_DTYPES[op]]
    assert [t.dtype for t in outputs] == want


@pytest.mark.parametrize("step", ["prefill", "decode"])
def test_torch_tensorrt_engine_gets_the_documented_dynamic_ranges(monkeypatch, step):
    """The Torch-TensorRT build passes Inputs with batch 1..8 (and prefill T 1..64), the
    ranges the example documents, not the example tensors (static B = 3, T = 5)."""
    from examples import export_tensorrt
    from examples.hybrid_model import HybridConfig, HybridLM
    from lowering import export

    calls = {}
    fake = types.ModuleType("torch_tensorrt")
    fake.Input = lambda **kwargs: kwargs
    fake.dynamo = types.SimpleNamespace(
        convert_exported_program_to_serialized_trt_engine=lambda *a, **k: calls.update(
            args=a, kwargs=k) or b"engine")  # fmt: skip
    monkeypatch.setitem(sys.modules, "torch_tensorrt", fake)
    monkeypatch.setattr(qdp, "register_torch_tensorrt_converters", lambda: ())
    monkeypatch.setattr(export, "export_step", lambda model, step: "program")
    model = HybridLM(HybridConfig()).eval().requires_grad_(False)
    assert export_tensorrt.build_from_program(model, step, device="cpu") == b"engine"
    assert calls["args"] == ("program",)
    inputs = calls["kwargs"]["arg_inputs"]
    examples = export.example_inputs(model, step)
    assert len(inputs) == len(examples)
    length = (1, 32, 64) if step == "prefill" else (1, 1, 1)
    assert [inputs[0][k] for k in ("min_shape", "opt_shape", "max_shape")] == [
        (1, length[0]), (4, length[1]), (8, length[2])]  # fmt: skip
    for spec, example in zip(inputs[1:], examples[1:]):
        rest = tuple(example.shape[1:])
        assert (spec["min_shape"], spec["max_shape"]) == ((1, *rest), (8, *rest))
        assert spec["dtype"] == example.dtype
