"""TensorRT Quickly Deployable Plugin (QDP) definitions of the ``kda`` ops, and their
Torch-TensorRT converters.

Each plugin of :data:`lowering.tensorrt.PLUGINS` becomes ``kda::<name>``:

- ``@tensorrt.plugin.register``: output ``TensorDesc`` s from the input descriptors
  (shapes only, symbolic ``ShapeExpr`` arithmetic; dtype of an input, or float32);
- ``@tensorrt.plugin.autotune``: the dtype combinations (fp16 / bf16 / fp32 model dtype;
  states and gate parameters always fp32), linear layout;
- ``@tensorrt.plugin.aot_impl``: the Triton kernel AOT-compiled to sm_90 PTX, its launch
  parameters (the planned grid over shape expressions, ``32 * num_warps`` threads, static
  shared memory) and its int32 scalars as ``SymInt32`` shape expressions. No Python at
  run time.

Plugin attributes are the ``kda``-domain ONNX node attributes of ``lowering.onnx``'s plugin
mode (``scale``, ``lower_bound``, ``use_*`` flags, ``eps``, ``silu``); head counts and
widths are read from the inputs' static dims. The chunk prefill is the chain
``chunk_prepare`` → ``chunk_recurrence`` (FlashKDA's two kernels; the six intermediates
are plugin outputs / inputs), as in plugin-mode ONNX.

Everything that needs TensorRT is imported inside :func:`register_plugins` and
:func:`register_torch_tensorrt_converters`; the descriptor logic (:func:`output_shapes`,
:func:`kernel_config`, :func:`launch_grid`, :func:`int_args`) is plain Python over ints or
``ShapeExpr`` s. None of the TensorRT paths has ever run: TensorRT cannot be installed on
the machines this was written on.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Optional

from kda_ops.kernels.chunk import FORWARD_CHUNK
from lowering.tensorrt import PLUGINS, PluginKernel, Shapes, chunk_count, compile_for_tensorrt

NAMESPACE = "kda"
MODEL_DTYPES = ("FP16", "BF16", "FP32")  # TensorRT type names, in autotune order

DELTA_ATTRIBUTES: dict[str, type] = {
    "scale": float,
    "lower_bound": float,
    "use_gate": int,
    "use_lower_bound": int,
    "use_qk_l2norm": int,
    "use_beta_sigmoid": int,
}


@dataclasses.dataclass(frozen=True)
class Output:
    """A plugin output: its shape from the input shapes, and the input whose dtype it takes
    (``None``: float32)."""

    shape: Callable[[Shapes], tuple]
    like: Optional[str]


@dataclasses.dataclass(frozen=True)
class PluginSpec:
    """What TensorRT needs beyond the kernel: attributes (name -> QDP type, in order), the
    kernel config from static input dims + attributes, and the outputs (plugin order)."""

    kernel: PluginKernel
    attributes: Mapping[str, type]
    config: Callable[[Shapes, Mapping[str, Any]], dict[str, object]]
    outputs: Mapping[str, Output]


def _delta_config(shapes: Shapes, attrs: Mapping[str, Any]) -> dict[str, object]:
    q, v = shapes["q"], shapes["v"]
    return dict(
        heads=q[2],
        value_heads=v[2],
        head_k=q[3],
        head_v=v[3],
        scale=float(attrs["scale"]),
        lower_bound=float(attrs["lower_bound"]) if attrs["use_lower_bound"] else None,
        use_gate=bool(attrs["use_gate"]),
        scalar_gate=len(shapes["g"]) == 3,
        use_qk_l2norm=bool(attrs["use_qk_l2norm"]),
        use_beta_sigmoid=bool(attrs["use_beta_sigmoid"]),
    )


def _recurrence_config(shapes: Shapes, attrs: Mapping[str, Any]) -> dict[str, object]:
    return dict(value_heads=shapes["w"][2], head_k=shapes["w"][3], head_v=shapes["u"][3])


def _conv_config(shapes: Shapes, attrs: Mapping[str, Any]) -> dict[str, object]:
    silu = attrs.get("silu", 1)
    return dict(
        channels=shapes["weight"][0], width=shapes["weight"][1], activation="silu" if silu else None
    )


def _conv_state_config(shapes: Shapes, attrs: Mapping[str, Any]) -> dict[str, object]:
    return dict(channels=shapes["state_in"][1], width=shapes["state_in"][2] + 1)


def _norm_config(shapes: Shapes, attrs: Mapping[str, Any]) -> dict[str, object]:
    activation = "silu" if attrs["silu"] else "sigmoid"
    return dict(dim=shapes["x"][-1], eps=float(attrs["eps"]), activation=activation)


def _gate_config(shapes: Shapes, attrs: Mapping[str, Any]) -> dict[str, object]:
    lower_bound = float(attrs["lower_bound"]) if attrs["use_lower_bound"] else None
    return dict(value_heads=shapes["g"][-2], head_k=shapes["g"][-1], lower_bound=lower_bound)


def _same(name: str) -> Callable[[Shapes], tuple]:
    return lambda s: tuple(s[name])


def _tokens(width_of: str) -> Callable[[Shapes], tuple]:
    """``[B, T, HV, width]``: B, T from q, HV from v, width = last dim of ``width_of``."""
    return lambda s: (s["q"][0], s["q"][1], s["v"][2], s[width_of][-1])


SPECS: dict[str, PluginSpec] = {
    "recurrent": PluginSpec(
        kernel=PLUGINS["recurrent"],
        attributes=DELTA_ATTRIBUTES,
        config=_delta_config,
        outputs={
            "o": Output(_same("v"), "v"),
            "state_out": Output(_same("state_in"), None),
        },
    ),
    "chunk_prepare": PluginSpec(
        kernel=PLUGINS["chunk_prepare"],
        attributes=DELTA_ATTRIBUTES,
        config=_delta_config,
        outputs={
            "chunk_decay": Output(lambda s: (chunk_count(s), s["v"][2], s["q"][-1]), None),
            "w": Output(_tokens("q"), "q"),
            "u": Output(_tokens("v"), "q"),
            "qg": Output(_tokens("q"), "q"),
            "kd": Output(_tokens("q"), "q"),
            "aqk": Output(lambda s: (chunk_count(s), s["v"][2], FORWARD_CHUNK, FORWARD_CHUNK), "q"),
        },
    ),
    "chunk_recurrence": PluginSpec(
        kernel=PLUGINS["chunk_recurrence"],
        attributes={},
        config=_recurrence_config,
        outputs={
            "o": Output(_same("u"), "u"),
            "final_state": Output(_same("initial_state"), None),
        },
    ),
    "causal_conv1d_output": PluginSpec(
        kernel=PLUGINS["causal_conv1d_output"],
        attributes={"silu": int},
        config=_conv_config,
        outputs={"y": Output(_same("x"), "x")},
    ),
    "causal_conv1d_state": PluginSpec(
        kernel=PLUGINS["causal_conv1d_state"],
        attributes={},
        config=_conv_state_config,
        outputs={"state_out": Output(_same("state_in"), "state_in")},
    ),
    "gated_rms_norm": PluginSpec(
        kernel=PLUGINS["gated_rms_norm"],
        attributes={"eps": float, "silu": int},
        config=_norm_config,
        outputs={"y": Output(_same("x"), "x")},
    ),
    "gate": PluginSpec(
        kernel=PLUGINS["gate"],
        attributes={"lower_bound": float, "use_lower_bound": int},
        config=_gate_config,
        outputs={"out": Output(_same("g"), None)},
    ),
}


# ----------------------------------------------------------------- descriptor logic


def output_shapes(name: str, shapes: Shapes) -> dict[str, tuple]:
    """Output shapes (ints or ``ShapeExpr`` s) of plugin ``name`` from its input shapes."""
    return {out: spec.shape(shapes) for out, spec in SPECS[name].outputs.items()}


def kernel_config(name: str, shapes: Shapes, attrs: Mapping[str, Any], dtype: str) -> dict:
    """The kernel config (``PluginKernel.compile``'s) for static input dims and attributes;
    ``dtype`` is the model dtype ("float16", ...)."""
    return {**SPECS[name].config(shapes, attrs), "dtype": dtype}


def launch_grid(name: str, shapes: Shapes, config: Mapping[str, object]) -> tuple:
    """The launch grid (ints or ``ShapeExpr`` s) for input shapes and a kernel config."""
    return SPECS[name].kernel.grid(shapes, config)


def int_args(name: str, shapes: Shapes, config: Mapping[str, object]) -> list:
    """The int32 scalars passed between inputs and outputs, for input shapes and a kernel
    config."""
    return SPECS[name].kernel.launch_args(shapes, config)


def io_float32(name: str) -> list[bool]:
    """Per plugin I/O (inputs then outputs): whether it is float32 whatever the model dtype."""
    spec = SPECS[name]
    inputs = [n in spec.kernel.float32_params for n in spec.kernel.inputs]
    outputs = [
        out.like is None or out.like in spec.kernel.float32_params for out in spec.outputs.values()
    ]
    return inputs + outputs


def autotune_types(name: str) -> str:
    """The QDP type combination string: model-dtype positions vary together
    (``FP16|BF16|FP32``), float32 positions stay float32."""
    fixed = "|".join(["FP32"] * len(MODEL_DTYPES))
    model = "|".join(MODEL_DTYPES)
    return ", ".join(fixed if f32 else model for f32 in io_float32(name))


def combinations(name: str) -> list[tuple[str, ...]]:
    """The type combinations :func:`autotune_types` declares (inputs then outputs), one per
    model dtype: QDP pairs the ``|`` alternatives of every position index by index."""
    positions = [t.split("|") for t in autotune_types(name).split(", ")]
    return list(zip(*positions))


def cast_plan(name: str, dtypes: Sequence[str]) -> list[str]:
    """The type each input of plugin ``name`` must have (TensorRT type names) given those
    of the tensors feeding it: FP32 at float32 positions, elsewhere the model dtype (the
    first such input's). TensorRT 11 networks are strongly typed: only a declared
    combination builds, so the converter casts where the two differ."""
    fixed = io_float32(name)[: len(dtypes)]
    model = next(d for d, f32 in zip(dtypes, fixed) if not f32)
    return ["FP32" if f32 else model for f32 in fixed]


def static_dims(shape: Sequence[Any]) -> tuple[Optional[int], ...]:
    """Constant dims of a shape of ints or ``ShapeExpr`` s; ``None`` for dynamic ones."""
    return tuple(
        d if isinstance(d, int) else (d.constant_value() if d.is_constant else None) for d in shape
    )


# ----------------------------------------------------------------- tensorrt.plugin


def field_types() -> dict[type, Any]:
    """QDP annotation of each attribute kind: one-element float32 / int32 arrays, the field
    types TensorRT's ONNX parser passes; for ``float`` / ``int`` QDP's creator would call
    ``float(field.data)`` on a 1-D array, a TypeError from NumPy 2.4 on."""
    import numpy as np
    import numpy.typing as npt

    return {float: npt.NDArray[np.float32], int: npt.NDArray[np.int32]}


def attribute_field(value: Any, kind: type) -> Any:
    """An attribute value as the one-element array :func:`field_types` declares."""
    import numpy as np

    return np.array([attribute_value(value, kind)], dtype=np.float32 if kind is float else np.int32)


def _signature(names: Sequence[str], attrs: Mapping[str, type], extra: Sequence[tuple]) -> Any:
    """An ``inspect.Signature``: one TensorDesc per input, then the attributes, then
    ``extra`` (name, annotation) parameters. QDP reads plugin schemas from signatures."""
    import tensorrt.plugin as trtp

    kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
    fields = field_types()
    params = [inspect.Parameter(n, kind, annotation=trtp.TensorDesc) for n in names]
    params += [inspect.Parameter(n, kind, annotation=fields[t]) for n, t in attrs.items()]
    params += [inspect.Parameter(n, kind, annotation=t) for n, t in extra]
    return params


def _bound(fn: Callable, name: str, params: list, returns: Any) -> Callable:
    """``fn`` with ``name`` bound first, as a plain function carrying the plugin's
    signature (QDP reads the schema from ``inspect.signature``)."""

    def call(*args: Any, **kwargs: Any) -> Any:
        return fn(name, *args, **kwargs)

    call.__name__ = call.__qualname__ = f"{name}{fn.__name__}"
    call.__signature__ = inspect.Signature(params, return_annotation=returns)
    return call


def attribute_value(value: Any, kind: type) -> Any:
    """A plugin attribute as ``kind`` (``float`` / ``int``) from a Python or NumPy scalar or
    a one-element array of any numeric type: TensorRT's ONNX parser hands attributes over
    as FLOAT32 / INT32 fields whatever the creator declares (QDP's are FLOAT64 / INT64)."""
    import numpy as np

    array = np.asarray(value)
    if array.size != 1 or array.dtype.kind not in "biuf":
        raise TypeError(f"a plugin attribute must be one number, got {value!r}")
    scalar = array.reshape(()).item()
    if kind is int and scalar != int(scalar):
        raise TypeError(f"an int plugin attribute got {value!r}")
    return kind(scalar)


def parse_attributes(name: str, values: Sequence[Any]) -> dict[str, Any]:
    """Plugin ``name``'s attribute values (in declared order) by name, typed as declared."""
    attributes = SPECS[name].attributes
    if len(values) != len(attributes):
        raise TypeError(f"{name} takes attributes {list(attributes)}, got {len(values)} values")
    return {n: attribute_value(v, t) for (n, t), v in zip(attributes.items(), values)}


def _split(name: str, args: Sequence[Any]) -> tuple[dict, dict]:
    """Positional QDP arguments -> ({input: TensorDesc}, {attribute: value})."""
    spec = SPECS[name]
    inputs = dict(zip(spec.kernel.inputs, args))
    attrs = parse_attributes(name, args[len(inputs) :])
    return inputs, attrs


def _describe(name: str, *args: Any, **kwargs: Any) -> tuple:
    """``register`` body: output TensorDescs from input TensorDescs."""
    import tensorrt as trt
    import tensorrt.plugin as trtp

    # QDP passes the attributes here by keyword (to aot_impl positionally): unused.
    descs = dict(zip(SPECS[name].kernel.inputs, args))
    shapes = {n: d.shape_expr for n, d in descs.items()}
    outputs = []
    for out, shape in output_shapes(name, shapes).items():
        like = SPECS[name].outputs[out].like
        dtype = trt.float32 if like is None else descs[like].dtype
        outputs.append(trtp.from_shape_expr(shape, dtype=dtype))
    return tuple(outputs)


def _autotune(name: str, *args: Any) -> list:
    import tensorrt.plugin as trtp

    return [trtp.AutoTuneCombination(autotune_types(name), "LINEAR")]


def _compile_aot(name: str, *args: Any) -> tuple:
    """``aot_impl`` body: (kernel name, PTX, launch params, int32 scalar expressions)."""
    import tensorrt as trt
    import tensorrt.plugin as trtp

    spec = SPECS[name]
    descs, attrs = _split(name, args[:-2])
    shapes = {n: d.shape_expr for n, d in descs.items()}
    model_input = next(n for n, f32 in zip(spec.kernel.inputs, io_float32(name)) if not f32)
    dtype = {trt.float16: "float16", trt.bfloat16: "bfloat16", trt.float32: "float32"}[
        descs[model_input].dtype
    ]
    static = {n: static_dims(s) for n, s in shapes.items()}
    config = kernel_config(name=name, shapes=static, attrs=attrs, dtype=dtype)
    compiled = compile_for_tensorrt(spec.kernel, dtype, config)
    params = trtp.KernelLaunchParams()
    params.grid_x, params.grid_y, params.grid_z = launch_grid(name, shapes, config)
    params.block_x = 32 * spec.kernel.warps(config)
    params.shared_mem = compiled.metadata.shared
    scalars = [trtp.SymInt32(e) for e in int_args(name, shapes, config)]
    scalars = trtp.SymIntExprs.from_tuple(scalars)
    return compiled.metadata.name, compiled.asm["ptx"], params, scalars


def return_annotations(name: str, trtp: Any) -> dict[str, Any]:
    """The return annotations QDP's validators require of ``name``'s three functions, from
    the ``tensorrt.plugin`` module ``trtp``: ``register`` a tuple of one ``TensorDesc`` per
    output, ``autotune`` ``list[AutoTuneCombination]``, ``aot_impl`` ``(kernel name, PTX,
    KernelLaunchParams, SymIntExprs)`` (a bare ``list`` / ``tuple`` is refused)."""
    return {
        "register": tuple[(trtp.TensorDesc,) * len(SPECS[name].outputs)],
        "autotune": list[trtp.AutoTuneCombination],
        "aot_impl": tuple[str | bytes, str | bytes, trtp.KernelLaunchParams, trtp.SymIntExprs],
    }


def _register_one(name: str) -> None:
    import tensorrt.plugin as trtp

    spec = SPECS[name]
    plugin_id = f"{NAMESPACE}::{name}"
    inputs, attrs = spec.kernel.inputs, spec.attributes
    returns = return_annotations(name, trtp)
    # ``outputs`` / ``tactic`` stay unannotated (QDP's annotations are optional there).
    outputs = [("outputs", inspect.Parameter.empty)]
    register_params = _signature(inputs, attrs, ())
    trtp.register(plugin_id)(
        _bound(fn=_describe, name=name, params=register_params, returns=returns["register"])
    )
    autotune_params = _signature(inputs, {}, outputs)
    trtp.autotune(plugin_id)(
        _bound(fn=_autotune, name=name, params=autotune_params, returns=returns["autotune"])
    )
    aot_params = _signature(inputs, attrs, [*outputs, ("tactic", inspect.Parameter.empty)])
    trtp.aot_impl(plugin_id)(
        _bound(fn=_compile_aot, name=name, params=aot_params, returns=returns["aot_impl"])
    )


@functools.cache
def register_plugins() -> tuple[str, ...]:
    """Register every ``kda::<name>`` QDP with TensorRT (once); returns the plugin ids.
    Raises ``ImportError`` when TensorRT (10.x with ``tensorrt.plugin``) is missing."""
    import tensorrt.plugin  # noqa: F401

    for name in SPECS:
        _register_one(name)
    return tuple(f"{NAMESPACE}::{name}" for name in SPECS)


# ----------------------------------------------------------------- Torch-TensorRT

OPTIONAL_TENSORS = ("A_log", "dt_bias", "initial_state", "bias")
# Absent ones a converter fills with zeros (as plugin-mode ONNX does): a conv without bias.
ZERO_FILLED = ("bias",)


def bind_arguments(schema: Any, args: Sequence[Any], kwargs: Mapping[str, Any]) -> dict:
    """A ``torch.FunctionSchema`` call's arguments by name, defaults filled in."""
    bound = {}
    for index, argument in enumerate(schema.arguments):
        if index < len(args):
            bound[argument.name] = args[index]
        elif argument.name in kwargs:
            bound[argument.name] = kwargs[argument.name]
        else:
            bound[argument.name] = argument.default_value
    return bound


def convertible(bound: Mapping[str, Any]) -> bool:
    """Whether a ``kda`` op call has a plugin form: every optional tensor present (TensorRT
    plugins take no optional inputs) and no packed sequences."""
    required = (n for n in OPTIONAL_TENSORS if n not in ZERO_FILLED)
    present = all(bound.get(n, True) is not None for n in required)
    return present and bound.get("cu_seqlens") is None


def _zero_bias(ctx: Any, weight: Any, name: str) -> Any:
    """A zero conv bias ``[D]`` in the weight's dtype, for a plugin that takes no optional
    inputs; ``weight`` is a ``torch.Tensor`` constant or a TensorRT ``ITensor``."""
    import numpy as np
    import torch
    from torch_tensorrt.dynamo.conversion.converter_utils import get_trt_tensor

    channels = weight.shape[0]
    if isinstance(weight, torch.Tensor):
        return get_trt_tensor(ctx, torch.zeros(channels, dtype=weight.dtype), name)
    zeros = get_trt_tensor(ctx, np.zeros(channels, dtype=np.float32), name)
    return ctx.net.add_cast(zeros, weight.dtype).get_output(0)


def delta_attributes(bound: Mapping[str, Any]) -> dict[str, Any]:
    """Plugin attributes of a ``kda.chunk`` / ``kda.recurrent`` call."""
    lower_bound = bound["lower_bound"]
    return dict(
        scale=float(bound["scale"]),
        lower_bound=float(lower_bound or 0.0),
        use_gate=1,
        use_lower_bound=int(lower_bound is not None),
        use_qk_l2norm=int(bound["use_qk_l2norm"]),
        use_beta_sigmoid=int(bound["use_beta_sigmoid"]),
    )


def plugin_chain(op: str, bound: Mapping[str, Any]) -> list[tuple[str, dict, dict]]:
    """The plugins replacing ``kda.<op>``: ``[(plugin, {input: source}, attributes)]``;
    a source is an op argument name or ``"<plugin>.<output>"`` of an earlier plugin."""
    delta = {n: n for n in ("q", "k", "v", "g", "beta", "A_log", "dt_bias")}
    if op == "recurrent":
        return [("recurrent", {**delta, "state_in": "initial_state"}, delta_attributes(bound))]
    if op == "chunk":
        carried = {n: f"chunk_prepare.{n}" for n in ("w", "u", "qg", "kd", "aqk", "chunk_decay")}
        recurrence = {**carried, "initial_state": "initial_state"}
        return [
            ("chunk_prepare", delta, delta_attributes(bound)),
            ("chunk_recurrence", recurrence, {}),
        ]
    if op == "causal_conv1d":
        silu = int(bound["activation"] == "silu")
        return [
            (
                "causal_conv1d_output",
                dict(x="x", weight="weight", bias="bias", state="initial_state"),
                dict(silu=silu),
            ),
            ("causal_conv1d_state", dict(x="x", state_in="initial_state"), {}),
        ]
    if op == "gated_rms_norm":
        attrs = dict(eps=float(bound["eps"]), silu=int(bound["activation"] == "silu"))
        return [("gated_rms_norm", dict(x="x", gate="gate", weight="weight"), attrs)]
    if op == "gate":
        lower_bound = bound["lower_bound"]
        attrs = dict(
            lower_bound=float(lower_bound or 0.0), use_lower_bound=int(lower_bound is not None)
        )
        return [("gate", dict(g="g", A_log="A_log", dt_bias="dt_bias"), attrs)]
    raise ValueError(f"kda.{op} has no TensorRT plugin form")


# The op's outputs, as "<plugin>.<output>" sources.
OP_OUTPUTS = {
    "recurrent": ("recurrent.o", "recurrent.state_out"),
    "chunk": ("chunk_recurrence.o", "chunk_recurrence.final_state"),
    "causal_conv1d": ("causal_conv1d_output.y", "causal_conv1d_state.state_out"),
    "gated_rms_norm": ("gated_rms_norm.y",),
    "gate": ("gate.out",),
}


# The dtype of each op output (the ops' fakes): that of an op argument, or float32 (None).
OP_OUTPUT_DTYPES = {
    "recurrent": ("v", None),
    "chunk": ("v", None),
    "causal_conv1d": ("x", "initial_state"),
    "gated_rms_norm": ("x",),
    "gate": (None,),
}


def _cast(ctx: Any, tensor: Any, dtype: str, name: str) -> Any:
    """``tensor`` as TensorRT type ``dtype`` ("FP16", ...), through a cast layer if needed."""
    import tensorrt as trt

    types = {"FP16": trt.float16, "BF16": trt.bfloat16, "FP32": trt.float32}
    if tensor.dtype == types[dtype]:
        return tensor
    layer = ctx.net.add_cast(tensor, types[dtype])
    layer.name = name
    return layer.get_output(0)


def _type_name(tensor: Any) -> str:
    import tensorrt as trt

    return {trt.float16: "FP16", trt.bfloat16: "BF16", trt.float32: "FP32"}[tensor.dtype]


def _convert(op: str, ctx: Any, target: Any, args: tuple, kwargs: dict, name: str) -> Any:
    """Torch-TensorRT converter body: add ``op``'s plugin chain (AOT plugins) to the
    network, with casts to the declared input types and back to the op's output types."""
    import tensorrt.plugin as trtp
    from torch_tensorrt.dynamo.conversion.converter_utils import get_trt_tensor

    bound = bind_arguments(target._schema, args, kwargs)
    if op == "causal_conv1d" and bound["bias"] is None:
        bound["bias"] = _zero_bias(ctx, bound["weight"], f"{name}_bias")
    values: dict[str, Any] = {}
    arguments: dict[str, Any] = {}
    for plugin, sources, attrs in plugin_chain(op, bound):
        for s in sources.values():
            if "." not in s and s not in arguments:
                arguments[s] = get_trt_tensor(ctx, bound[s], f"{name}_{s}")
        inputs = [values[s] if "." in s else arguments[s] for s in sources.values()]
        plan = cast_plan(plugin, [_type_name(t) for t in inputs])
        inputs = [
            _cast(ctx=ctx, tensor=t, dtype=d, name=f"{name}_{plugin}_{n}_cast")
            for t, d, n in zip(inputs, plan, sources)
        ]
        kinds = SPECS[plugin].attributes
        fields = {n: attribute_field(v, kinds[n]) for n, v in attrs.items()}
        layer = ctx.net.add_plugin(getattr(trtp.op.kda, plugin)(*inputs, **fields), aot=True)
        layer.name = f"[{target}]-[{name}]-{plugin}"
        for index, output in enumerate(SPECS[plugin].outputs):
            values[f"{plugin}.{output}"] = layer.get_output(index)
    outputs = tuple(
        _cast(
            ctx=ctx,
            tensor=values[s],
            dtype="FP32" if like is None else _type_name(arguments[like]),
            name=f"{name}_{s}_cast",
        )
        for s, like in zip(OP_OUTPUTS[op], OP_OUTPUT_DTYPES[op])
    )
    return outputs[0] if len(outputs) == 1 else outputs


def _validator(op: str) -> Callable[..., bool]:
    def validate(node: Any, settings: Any = None) -> bool:
        return convertible(bind_arguments(node.target._schema, node.args, node.kwargs))

    return validate


@functools.cache
def register_torch_tensorrt_converters() -> tuple[str, ...]:
    """Register a Torch-TensorRT converter for every functional ``kda`` op (once), each
    adding the op's AOT plugin chain; calls with an absent optional tensor or packed
    sequences stay in PyTorch (the validator rejects them). Returns the op names.
    Raises ``ImportError`` when ``torch_tensorrt`` / TensorRT is missing."""
    import torch
    from torch_tensorrt.dynamo.conversion import dynamo_tensorrt_converter

    import kda_ops  # noqa: F401  (registers torch.ops.kda)

    register_plugins()
    for op in OP_OUTPUTS:
        converter = _bound(fn=_convert, name=op, params=[], returns=Any)
        del converter.__signature__  # Torch-TensorRT calls (ctx, target, args, kwargs, name)
        overload = getattr(torch.ops.kda, op).default
        dynamo_tensorrt_converter(
            overload, capability_validator=_validator(op), supports_dynamic_shapes=True
        )(converter)
    return tuple(OP_OUTPUTS)
