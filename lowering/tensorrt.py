"""TensorRT plugin kernels: the Triton kernels of the ``kda`` ops AOT-compiled to sm_90 PTX
in the argument order TensorRT's Quickly Deployable Plugins (``tensorrt.plugin.aot_impl``)
launch them with.

TensorRT's AOT launcher passes, in order: the plugin's input tensors, then int scalars
(symbolic expressions of the input shapes), then the output tensors; it cannot pass float
scalars or absent inputs. Triton appends hidden scratch pointers (:func:`scratch_params`)
that must stay unused. Each :class:`PluginKernel` says which kernel parameters are inputs,
int scalars and outputs; everything else comes from the op's own launcher
(``kda_ops.kernels``, the launch plans the eager op runs and Inductor's kernel nodes take):
the launcher plans over fake CUDA tensors of the plugin's shapes, its batch and token dims
symbolic, for :data:`TARGET` (the sm_90 GPUs the PTX is for). Its grid and int scalars are
then expressions of those dims, which :meth:`PluginKernel.grid` and
:meth:`PluginKernel.launch_args` evaluate over TensorRT's shape expressions; every other
argument (block sizes, flags, pipeline stages, float scalars) is baked into the PTX as a
constexpr, and its launch options (warps) are the compile options. A planned launch that
depends on those dims other than through its grid and int scalars is refused.

Plugins (namespace ``kda``, the op types of ``lowering.onnx``'s plugin mode):

- ``recurrent``: one kernel, ``recurrent_kda_kernel`` (any T; T = 1 for decode).
- ``chunk_prepare`` then ``chunk_recurrence``: the two-kernel chunk pipeline of
  ``kernels/chunk/`` (``chunk_plan`` with one prepare launch) as a chain of two
  single-kernel plugins; the prepare plugin's outputs (chunk decay, w, u, qg, kd, Aqk) are
  the recurrence plugin's inputs.
- ``causal_conv1d``: a chain of two single-kernel plugins, ``causal_conv1d_output`` (y)
  then ``causal_conv1d_state`` (final state): ``prefill_plan`` with the final state by
  its own kernel.
- ``gated_rms_norm`` and ``gate``: one kernel each.

The ``tensorrt.plugin`` definitions built on these live in ``lowering.tensorrt_plugins``.
"""

from __future__ import annotations

import dataclasses
import math
import re
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import sympy
import torch
import triton
from torch import SymInt, Tensor
from torch.utils._sympy.functions import FloorDiv
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import CUDAOptions
from triton.compiler import ASTSource

from kda_ops.kernels.chunk import FORWARD_CHUNK
from kda_ops.kernels.chunk.launch import chunk_plan
from kda_ops.kernels.chunk.prepare import chunk_prepare_kernel
from kda_ops.kernels.chunk.recurrence import chunk_recurrence_kernel
from kda_ops.kernels.conv.forward import causal_conv1d_kernel, conv_final_state_kernel, prefill_plan
from kda_ops.kernels.gate import gate_launch, kda_gate_kernel
from kda_ops.kernels.gated_norm import gated_rms_norm_kernel, gated_rms_norm_launch
from kda_ops.kernels.launches import LAUNCH_OPTIONS, KernelLaunch, LaunchPlan
from kda_ops.kernels.recurrent import recurrent_kda_kernel, recurrent_launch
from kda_ops.kernels.sizes import HOPPER, DeviceSizes
from kda_ops.signature import DeltaRuleInputs, DeltaRuleOptions

SM90 = GPUTarget("cuda", 90, 32)
TARGET = HOPPER  # the device the launches are planned for: the sm_90 GPUs of the PTX
TRITON_DTYPES = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}
TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
ELEMENT_TYPES = {TORCH_DTYPES[name]: element for name, element in TRITON_DTYPES.items()}

Shapes = Mapping[str, tuple[Any, ...]]  # plugin input name -> shape (ints or ShapeExprs)
Config = Mapping[str, object]  # a plugin's dims and attributes, and "dtype"

# Hints of the symbolic dims (a shape environment takes one each), odd sizes no static dim
# has. A planner that reads one records a guard, which `_plan` refuses.
DIM_HINTS = {"B": 5, "T": 1031, "R": 4099}


class Placeholders:
    """Fake CUDA tensors a launcher plans from: ``tensors("B", "T", 4)`` is one of shape
    ``[B, T, 4]`` in the model dtype (``float32=True``: float32), the named dims symbols of
    one shape environment (B: batch, T: tokens, R: rows). No GPU needed."""

    def __init__(self, dtype: torch.dtype) -> None:
        from torch._dynamo.source import ConstantSource
        from torch._subclasses.fake_tensor import FakeTensorMode
        from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv

        self.shape_env = ShapeEnv(duck_shape=False)
        self.mode = FakeTensorMode(shape_env=self.shape_env)
        self.dtype = dtype
        self.symbols: dict[str, sympy.Symbol] = {}
        self._sizes: dict[str, SymInt] = {}
        self._source, self._dynamic = ConstantSource, DimDynamic.DYNAMIC

    def size(self, name: str) -> SymInt:
        """The symbolic dim ``name`` (one of :data:`DIM_HINTS`)."""
        if name not in DIM_HINTS:
            raise ValueError(f"a symbolic dim must be one of {tuple(DIM_HINTS)}, got {name!r}")
        if name not in self._sizes:
            symbol = self.shape_env.create_symbol(
                DIM_HINTS[name], self._source(name), dynamic_dim=self._dynamic
            )
            self.symbols[name] = symbol
            self._sizes[name] = self.shape_env.create_symintnode(symbol, hint=DIM_HINTS[name])
        return self._sizes[name]

    def __call__(self, *shape: int | str, float32: bool = False) -> Tensor:
        sizes = [self.size(d) if isinstance(d, str) else d for d in shape]
        dtype = torch.float32 if float32 else self.dtype
        with self.mode:
            return torch.empty(sizes, dtype=dtype, device="cuda")


@dataclasses.dataclass(frozen=True)
class PlannedLaunch:
    """A plugin kernel's launch as its launcher plans it over :class:`Placeholders`, and
    the symbols of the named dims it was planned over."""

    launch: KernelLaunch
    symbols: Mapping[str, sympy.Symbol]


Planner = Callable[[Placeholders, Config, DeviceSizes], KernelLaunch]

DEFAULT_WARPS = CUDAOptions.num_warps  # Triton's, where a launcher passes none
MISSING = object()


@dataclasses.dataclass(frozen=True, eq=False)
class PluginKernel:
    """One TensorRT plugin backed by one Triton kernel, launched as its op's launcher plans
    it.

    ``inputs`` / ``outputs``: kernel parameters that are the plugin's input / output
    tensors, in plugin order; ``int_args``: int scalar parameters, which the plan gives as
    expressions of the symbolic dims; ``absent``: pointer parameters specialized to
    ``None`` (the plan passes ``None``, or a tensor its launch does not write);
    ``float32_params``: parameters that are float32 whatever the model dtype (states, gate
    parameters). ``planner``: the launcher's launch from :class:`Placeholders` of the
    plugin's shapes, a config (the plugin's dims and attributes, and ``"dtype"``, the model
    dtype) and the device to plan for; ``dims``: each symbolic dim the planner names, from
    the plugin's input shapes. Every other kernel parameter takes its planned value as a
    constexpr.

    ``dims`` only multiply shapes (shape first), and :func:`shape_expression` only adds,
    subtracts, multiplies and floor-divides by ints, so ``grid`` and ``launch_args`` also
    take TensorRT's symbolic ``ShapeExpr`` dims."""

    name: str
    kernel: object  # a @triton.jit kernel
    inputs: tuple[str, ...]
    int_args: tuple[str, ...]
    outputs: tuple[str, ...]
    absent: tuple[str, ...]
    planner: Planner
    dims: Mapping[str, Callable[[Shapes], Any]]
    float32_params: tuple[str, ...] = ()
    _plans: dict = dataclasses.field(default_factory=dict, init=False, repr=False)

    def planned(self, config: Config) -> PlannedLaunch:
        """The launch for ``config`` as the launcher plans it for :data:`TARGET` (once per
        config; ``config["stages"]`` is no planning input, see :meth:`constexprs`)."""
        key = tuple(sorted((k, v) for k, v in config.items() if k != "stages"))
        if key not in self._plans:
            self._plans[key] = _plan(self, config)
        return self._plans[key]

    def constexprs(self, config: Config) -> dict[str, object]:
        """The kernel's compile-time values for ``config``: the planned values of its
        parameters that are no input, output, int scalar or absent pointer (dims, block
        sizes, flags, pipeline stages, float scalars); ``config["stages"]``, where set,
        replaces the planned ``STAGES`` (:func:`compile_for_tensorrt`)."""
        args = self.planned(config).launch.args
        roles = {*self.inputs, *self.int_args, *self.outputs, *self.absent}
        values = {name: args[name] for name in self.kernel.arg_names if name not in roles}
        if config.get("stages"):
            if "STAGES" not in values:
                raise ValueError(f"{self.name}: `stages` given, but the kernel has no STAGES")
            values["STAGES"] = config["stages"]
        return values

    def options(self, config: Config) -> dict[str, object]:
        """The planned launch options (``num_warps``, ...): Triton's compile options."""
        args = self.planned(config).launch.args
        return {name: args[name] for name in LAUNCH_OPTIONS if name in args}

    def warps(self, config: Config) -> int:
        """Warps per program for ``config``."""
        return self.options(config).get("num_warps", DEFAULT_WARPS)

    def grid(self, shapes: Shapes, config: Config) -> tuple[Any, Any, Any]:
        """The planned grid over the plugin's input ``shapes`` (ints or ``ShapeExpr`` s)."""
        planned = self.planned(config)
        values = self._dim_values(planned, shapes)
        return tuple(
            shape_expression(extent, values) for extent in (*planned.launch.grid, 1, 1)[:3]
        )

    def launch_args(self, shapes: Shapes, config: Config) -> list[Any]:
        """The int scalars TensorRT passes between inputs and outputs, over ``shapes``."""
        planned = self.planned(config)
        values = self._dim_values(planned, shapes)
        return [shape_expression(planned.launch.args[name], values) for name in self.int_args]

    def _dim_values(self, planned: PlannedLaunch, shapes: Shapes) -> dict[sympy.Symbol, Any]:
        missing = set(planned.symbols) - set(self.dims)
        if missing:
            raise ValueError(f"{self.name}: no input dim gives the symbolic {sorted(missing)}")
        return {symbol: self.dims[name](shapes) for name, symbol in planned.symbols.items()}

    def signature(self, dtype: str, config: Config) -> tuple[dict, dict]:
        """Triton (signature, constexprs) for tensors of ``dtype`` ("float16", ...)."""
        if dtype not in TRITON_DTYPES:
            raise ValueError(f"`dtype` must be one of {tuple(TRITON_DTYPES)}, got {dtype!r}")
        config = {**config, "dtype": dtype}
        args = self.planned(config).launch.args
        constants = {**self.constexprs(config), **dict.fromkeys(self.absent)}
        signature = {}
        for name in self.kernel.arg_names:
            if name in constants:
                signature[name] = "constexpr"
            elif name in self.int_args:
                signature[name] = "i32"
            else:  # an input or an output (_check_roles)
                element = "fp32" if name in self.float32_params else TRITON_DTYPES[dtype]
                planned = args[name]
                if planned is not None and ELEMENT_TYPES.get(planned.dtype) != element:
                    raise ValueError(
                        f"{self.name}: the launcher plans {name} in "
                        f"{planned.dtype}, the plugin declares {element}"
                    )
                signature[name] = f"*{element}"
        return signature, constants

    def compile(self, dtype: str, config: Config) -> triton.compiler.CompiledKernel:
        """AOT-compile for sm_90 (no GPU needed); ``.asm["ptx"]`` is the plugin's PTX."""
        signature, constants = self.signature(dtype, config)
        source = ASTSource(_compilable(self.kernel), signature, constexprs=constants)
        options = self.options({**config, "dtype": dtype})
        return triton.compile(source, target=SM90, options=options)


def _plan(plugin: PluginKernel, config: Config) -> PlannedLaunch:
    """Run ``plugin``'s planner over fresh placeholders; refuse a plan that branched on a
    symbolic dim (a guard) or whose arguments do not fit the plugin's roles."""
    dtype = config.get("dtype")
    if dtype not in TORCH_DTYPES:
        raise ValueError(f'config["dtype"] must be one of {tuple(TORCH_DTYPES)}, got {dtype!r}')
    tensors = Placeholders(TORCH_DTYPES[dtype])
    with tensors.mode:
        launch = plugin.planner(tensors, config, TARGET)
    guards = [str(guard.expr) for guard in tensors.shape_env.guards]
    if guards:
        raise ValueError(
            f"{plugin.name}: the launch plan depends on the symbolic dims "
            f"({guards}); a plugin's launch must hold for any"
        )
    _check_roles(plugin, launch)
    return PlannedLaunch(launch, dict(tensors.symbols))


def _check_roles(plugin: PluginKernel, launch: KernelLaunch) -> None:
    """Each kernel parameter's planned value fits its role: inputs tensors (or ``None``:
    not read in this specialization), outputs tensors the launch writes, int scalars ints,
    absent pointers ``None`` or tensors the launch does not write, constexprs neither
    tensors nor ``None`` nor symbolic; and the launch writes outputs only."""
    if launch.kernel is not plugin.kernel:
        raise ValueError(
            f"{plugin.name}: the launcher planned {launch.kernel}, not {plugin.kernel}"
        )
    unwritten = sorted(set(launch.writes) - set(plugin.outputs))
    if unwritten:
        raise ValueError(f"{plugin.name}: the launch writes {unwritten}, which are no outputs")
    for name in plugin.kernel.arg_names:
        value = launch.args.get(name, MISSING)
        if name in plugin.inputs:
            fits = value is None or isinstance(value, Tensor)
        elif name in plugin.outputs:
            fits = isinstance(value, Tensor) and name in launch.writes
        elif name in plugin.int_args:
            fits = isinstance(value, (int, SymInt)) and not isinstance(value, bool)
        elif name in plugin.absent:
            fits = value is None or (isinstance(value, Tensor) and name not in launch.writes)
        else:
            fits = value is not MISSING and not isinstance(value, (Tensor, SymInt, type(None)))
        if not fits:
            planned = "a tensor" if isinstance(value, Tensor) else repr(value)
            raise ValueError(
                f"{plugin.name}: kernel parameter {name!r} is planned as "
                f"{planned}, which its role does not take"
            )


def _compilable(kernel: object) -> triton.JITFunction:
    if not isinstance(kernel, triton.JITFunction):
        raise TypeError(
            "AOT compilation needs real @triton.jit kernels: unset TRITON_INTERPRET in this "
            "process (its interpreted kernels cannot be compiled)"
        )
    return kernel


def shape_expression(value: int | SymInt, dims: Mapping[sympy.Symbol, Any]) -> Any:
    """``value``, an int or an expression of the planned symbolic dims, with each symbol
    taking its value in ``dims`` (ints or TensorRT ``ShapeExpr`` s), computed with ``+ - *
    //`` by ints and products of dims only, the symbolic operand first (``ShapeExpr`` has
    no reflected operators); Triton's host ``cdiv`` form ``-((-a) // d)`` as
    ``(a + d - 1) // d``."""
    if isinstance(value, bool) or not isinstance(value, (int, SymInt)):
        raise TypeError(f"a planned extent must be an int or a SymInt, got {value!r}")
    if isinstance(value, int):
        return value
    return _evaluate(sympy.sympify(value.node.expr), dims)


def _evaluate(expr: sympy.Expr, dims: Mapping[sympy.Symbol, Any]) -> Any:
    if expr.is_Integer:
        return int(expr)
    if expr.is_Symbol:
        if expr not in dims:
            raise ValueError(f"no value for the symbolic dim {expr}")
        return dims[expr]
    if isinstance(expr, FloorDiv):
        return _evaluate(expr.args[0], dims) // _divisor(expr)
    if expr.is_Mul:
        coefficient, factors = expr.as_coeff_Mul()
        if coefficient < 0 and isinstance(factors, FloorDiv):  # -((-a) // d) = ceil(a / d)
            divisor = _divisor(factors)
            ceiling = _sum([_evaluate(-factors.args[0], dims), divisor - 1]) // divisor
            return _product([ceiling, int(-coefficient)])
        if coefficient < 0 or not coefficient.is_Integer:
            raise ValueError(f"a shape expression has no negative or fractional factor: {expr}")
        return _product(
            [int(coefficient), *(_evaluate(f, dims) for f in sympy.Mul.make_args(factors))]
        )
    if expr.is_Add:
        added, subtracted = [], []
        for term in expr.args:
            coefficient, factors = term.as_coeff_Mul()
            if coefficient < 0 and not isinstance(factors, FloorDiv):
                subtracted.append(_evaluate(-term, dims))
            else:
                added.append(_evaluate(term, dims))
        total = _sum(added)
        for value in subtracted:
            if isinstance(total, int) and not isinstance(value, int):
                raise ValueError(f"{expr}: an int minus a shape is no shape expression")
            total = total - value
        return total
    raise ValueError(f"a shape expression has only + - * // of dims and ints, got {expr}")


def _sum(values: list[Any]) -> Any:
    """The sum, symbolic terms first and the ints' sum last."""
    symbolic = [v for v in values if not isinstance(v, int)]
    constant = sum(v for v in values if isinstance(v, int))
    if not symbolic:
        return constant
    total = symbolic[0]
    for value in symbolic[1:]:
        total = total + value
    if constant:
        total = total + constant if constant > 0 else total - (-constant)
    return total


def _product(values: list[Any]) -> Any:
    """The product, symbolic factors first and the ints' product last."""
    symbolic = [v for v in values if not isinstance(v, int)]
    constant = math.prod(v for v in values if isinstance(v, int))
    if not symbolic or constant == 0:
        return constant
    product = symbolic[0]
    for value in symbolic[1:]:
        product = product * value
    return product * constant if constant != 1 else product


def _divisor(floor_division: sympy.Expr) -> int:
    divisor = floor_division.args[1]
    if not (divisor.is_Integer and divisor > 0):
        raise ValueError(f"a shape expression divides by positive ints only: {floor_division}")
    return int(divisor)


def ptx_params(ptx: str) -> list[str]:
    """The PTX types of the entry's parameters, e.g. ``[".u64", ".u32", ...]``."""
    match = re.search(r"\.entry\s+\w+\s*\((.*?)\)", ptx, re.S)
    if match is None:
        raise ValueError("no .entry in the PTX")
    return re.findall(r"\.param\s+(\.\w+)", match.group(1))


def scratch_params(metadata: Any) -> tuple[str, ...]:
    """The scratch buffers a compiled kernel takes as hidden pointer parameters after its
    own, one for each ``<name>_scratch_size`` of its metadata (the installed Triton's: the
    global and the profile scratch). TensorRT passes nothing there (null pointers):
    ``tests/lowering/test_tensorrt.py`` checks that their sizes are 0."""
    suffix = "_scratch_size"
    return tuple(name[: -len(suffix)] for name in metadata._fields if name.endswith(suffix))


def expected_abi(plugin: PluginKernel, scratch: int) -> list[str]:
    """What TensorRT's AOT launcher passes: input pointers, int32 scalars, output pointers,
    then the kernel's ``scratch`` hidden scratch pointers (:func:`scratch_params`; passed
    as null)."""
    return (
        [".u64"] * len(plugin.inputs)
        + [".u32"] * len(plugin.int_args)
        + [".u64"] * (len(plugin.outputs) + scratch)
    )


def leading_product(shapes: Shapes, name: str, trailing: int) -> Any:
    """Product of the dims of ``shapes[name]`` but its last ``trailing`` (shape first:
    ``ShapeExpr`` safe); 1 if there are none."""
    count: Any = 1
    for dim in shapes[name][: len(shapes[name]) - trailing]:
        count = dim if isinstance(count, int) and count == 1 else count * dim
    return count


def cdiv(dim: Any, block: int) -> Any:
    """``ceil(dim / block)`` for an int or symbolic ``dim`` and an int ``block``."""
    return (dim + (block - 1)) // block


def chunk_count(shapes: Shapes, name: str = "q") -> Any:
    """Prepare chunks of a padded batch ``[B, T, ...]``: ``B * ceil(T / FORWARD_CHUNK)``
    (``chunk_state_rows``), the rows of the prepare plugin's ``chunk_decay`` and ``aqk``."""
    return shapes[name][0] * cdiv(shapes[name][1], FORWARD_CHUNK)


# ----------------------------------------------------------------- the launchers' plans


def _delta_arguments(tensors: Placeholders, config: Config) -> tuple:
    """``kda_ops.signature``'s (inputs, options) of a delta-rule plugin: q, k ``[B, T, H,
    K]``, v ``[B, T, HV, V]``, g ``[B, T, HV, K]`` (``[B, T, HV]`` for a scalar gate), beta
    ``[B, T, HV]``, and with the in-kernel gate (``use_gate``, the default) A_log ``[HV]``
    and dt_bias ``[HV * K]`` (``[HV]``), float32."""
    heads, value_heads = config["heads"], config["value_heads"]
    head_k, head_v = config["head_k"], config["head_v"]
    scalar_gate, use_gate = bool(config.get("scalar_gate", False)), _use_gate(config)
    gate_width = () if scalar_gate else (head_k,)
    inputs = DeltaRuleInputs(
        q=tensors("B", "T", heads, head_k),
        k=tensors("B", "T", heads, head_k),
        v=tensors("B", "T", value_heads, head_v),
        g=tensors("B", "T", value_heads, *gate_width),
        beta=tensors("B", "T", value_heads),
        A_log=tensors(value_heads, float32=True) if use_gate else None,
        dt_bias=tensors(value_heads * math.prod(gate_width), float32=True) if use_gate else None,
    )
    lower_bound = config.get("lower_bound")
    options = DeltaRuleOptions(
        scale=float(config.get("scale") or head_k**-0.5),
        lower_bound=None if lower_bound is None else float(lower_bound),
        use_qk_l2norm=bool(config.get("use_qk_l2norm", True)),
        use_beta_sigmoid=bool(config.get("use_beta_sigmoid", True)),
    )
    return inputs, options


def _use_gate(config: Config) -> bool:
    """Whether the gate is computed in-kernel from A_log / dt_bias (the default)."""
    return bool(config.get("use_gate", True))


def _state(tensors: Placeholders, config: Config) -> Tensor:
    """A key-first float32 state ``[B, HV, K, V]``."""
    return tensors("B", config["value_heads"], config["head_k"], config["head_v"], float32=True)


def _recurrent_launch(tensors: Placeholders, config: Config, target: DeviceSizes) -> KernelLaunch:
    inputs, options = _delta_arguments(tensors, config)
    state = _state(tensors, config)
    return recurrent_launch(
        inputs=inputs,
        state_in=state,
        state_out=torch.empty_like(state),
        state_indices=None,
        cu_seqlens=None,
        options=options,
    )


def _chunk_launches(
    tensors: Placeholders, config: Config, target: DeviceSizes
) -> tuple[KernelLaunch, KernelLaunch]:
    """(prepare, recurrence): ``chunk_plan`` with the prepare in one launch (a plugin is
    one kernel). The recurrence plugin's config has no prepare settings (heads, gate,
    scale), which its launch does not depend on: planned with H = HV and the defaults."""
    config = {"heads": config["value_heads"], **config}
    inputs, options = _delta_arguments(tensors, config)
    plan = chunk_plan(
        inputs=inputs,
        initial_state=_state(tensors, config),
        cu_seqlens=None,
        options=options,
        target=target,
        single_prepare_launch=True,
    )
    return _pair(plan, "chunk_plan")


def _conv_launches(
    tensors: Placeholders, config: Config, target: DeviceSizes
) -> tuple[KernelLaunch, KernelLaunch]:
    """(output, final state): ``prefill_plan`` over x ``[B, T, D]``, weight ``[D, W]``,
    bias ``[D]`` and a state ``[B, D, W - 1]``, the final state by its own kernel."""
    channels, width = config["channels"], config["width"]
    state = tensors("B", channels, width - 1)
    plan = prefill_plan(
        x=tensors("B", "T", channels),
        weight=tensors(channels, width),
        bias=tensors(channels),
        state_in=state,
        state_out=torch.empty_like(state),
        state_indices=None,
        cu_seqlens=None,
        activation=config.get("activation", "silu"),
        fuse_final_state=False,
    )
    return _pair(plan, "prefill_plan")


def _pair(plan: LaunchPlan, planner: str) -> tuple[KernelLaunch, KernelLaunch]:
    if len(plan.launches) != 2:
        raise ValueError(f"{planner} planned {len(plan.launches)} launches, not two")
    return plan.launches


def _norm_launch(tensors: Placeholders, config: Config, target: DeviceSizes) -> KernelLaunch:
    """x, gate ``[R, D]`` (R: the rows, every dim but the last), weight ``[D]``."""
    width = config["dim"]
    return gated_rms_norm_launch(
        x=tensors("R", width),
        gate=tensors("R", width),
        weight=tensors(width),
        eps=float(config.get("eps", 1e-5)),
        activation=config.get("activation", "sigmoid"),
    )


def _gate_launch(tensors: Placeholders, config: Config, target: DeviceSizes) -> KernelLaunch:
    """g ``[R, HV, K]`` (R: every dim but the last two), A_log ``[HV]``, dt_bias
    ``[HV * K]`` float32."""
    value_heads, channels = config["value_heads"], config["head_k"]
    return gate_launch(
        g=tensors("R", value_heads, channels),
        A_log=tensors(value_heads, float32=True),
        dt_bias=tensors(value_heads * channels, float32=True),
        lower_bound=config.get("lower_bound"),
    )


def _batch_and_tokens(name: str) -> dict[str, Callable[[Shapes], Any]]:
    """B and T: the first two dims of input ``name``."""
    return {"B": lambda s: s[name][0], "T": lambda s: s[name][1]}


CHUNK_INTERMEDIATES = ("chunk_decay", "w", "u", "qg", "kd", "aqk")

PLUGINS: dict[str, PluginKernel] = {
    "recurrent": PluginKernel(
        name="recurrent",
        kernel=recurrent_kda_kernel,
        inputs=("q", "k", "v", "g", "beta", "A_log", "dt_bias", "state_in"),
        int_args=("length",),
        outputs=("o", "state_out"),
        absent=("state_indices", "cu_seqlens", "step_states"),
        planner=_recurrent_launch,
        dims=_batch_and_tokens("q"),
        float32_params=("A_log", "dt_bias", "state_in", "state_out"),
    ),
    "chunk_prepare": PluginKernel(
        name="chunk_prepare",
        kernel=chunk_prepare_kernel,
        inputs=("q", "k", "v", "g", "beta", "A_log", "dt_bias"),
        int_args=("length", "n_seqs"),
        outputs=CHUNK_INTERMEDIATES,
        absent=("cu_seqlens", "chunk_offsets", "unbounded"),
        planner=lambda *args: _chunk_launches(*args)[0],
        dims=_batch_and_tokens("q"),
        float32_params=("A_log", "dt_bias", "chunk_decay"),
    ),
    "chunk_recurrence": PluginKernel(
        name="chunk_recurrence",
        kernel=chunk_recurrence_kernel,
        inputs=(*CHUNK_INTERMEDIATES[1:], "chunk_decay", "initial_state"),
        int_args=("length",),
        outputs=("o", "final_state"),
        absent=("cu_seqlens", "chunk_offsets", "state_chunks", "sequence_order", "chunk_states"),
        planner=lambda *args: _chunk_launches(*args)[1],
        dims=_batch_and_tokens("w"),
        float32_params=("chunk_decay", "initial_state", "final_state"),
    ),
    "causal_conv1d_output": PluginKernel(
        name="causal_conv1d_output",
        kernel=causal_conv1d_kernel,
        inputs=("x", "weight", "bias", "state"),
        int_args=("length", "n_seqs"),
        outputs=("y",),
        absent=("state_indices", "cu_seqlens", "state_out"),
        planner=lambda *args: _conv_launches(*args)[0],
        dims=_batch_and_tokens("x"),
    ),
    "causal_conv1d_state": PluginKernel(
        name="causal_conv1d_state",
        kernel=conv_final_state_kernel,
        inputs=("x", "state_in"),
        int_args=("length",),
        outputs=("state_out",),
        absent=("state_indices", "cu_seqlens"),
        planner=lambda *args: _conv_launches(*args)[1],
        dims=_batch_and_tokens("x"),
    ),
    "gated_rms_norm": PluginKernel(
        name="gated_rms_norm",
        kernel=gated_rms_norm_kernel,
        inputs=("x", "gate", "weight"),
        int_args=("n_rows",),
        outputs=("y",),
        absent=(),
        planner=_norm_launch,
        dims={"R": lambda s: leading_product(s, "x", 1)},
    ),
    "gate": PluginKernel(
        name="gate",
        kernel=kda_gate_kernel,
        inputs=("g", "A_log", "dt_bias"),
        int_args=("n_rows",),
        outputs=("out",),
        absent=(),
        planner=_gate_launch,
        dims={"R": lambda s: leading_product(s, "g", 2)},
        float32_params=("A_log", "dt_bias", "out"),
    ),
}


# TensorRT launches an AOT plugin's kernel with the dynamic shared memory it declares and
# documents no opt-in past CUDA's default per-block limit, so the TensorRT path stays within.
TENSORRT_SHARED_MEMORY = 48 * 1024


def compile_for_tensorrt(plugin: PluginKernel, dtype: str, config: Mapping[str, object]):
    """``plugin.compile`` within :data:`TENSORRT_SHARED_MEMORY` where it can be: a kernel with
    pipeline stages (the chunk recurrence) drops stages until it fits. One that still does
    not fit (the bf16 recurrence at K = 128) is kept with a warning: TensorRT documents no
    opt-in past 48 KB, nor a refusal, so whether its engine launches is untested."""
    compiled = plugin.compile(dtype, config)
    stages = plugin.constexprs({**config, "dtype": dtype}).get("STAGES")
    while compiled.metadata.shared > TENSORRT_SHARED_MEMORY and stages and stages > 1:
        stages -= 1
        compiled = plugin.compile(dtype, {**config, "stages": stages})
    if compiled.metadata.shared > TENSORRT_SHARED_MEMORY:
        dims = {k: v for k, v in config.items() if k.startswith(("head", "value", "dim"))}
        warnings.warn(
            f"TensorRT plugin {plugin.name} ({dtype}, {dims}) needs {compiled.metadata.shared} "
            f"bytes of shared memory, past the {TENSORRT_SHARED_MEMORY} CUDA gives a kernel "
            "without an opt-in that TensorRT does not document: its launch is untested",
            stacklevel=2,
        )
    return compiled


def abi_report(config: Mapping[str, object], dtypes: tuple[str, ...]) -> dict[str, dict]:
    """Compile every plugin kernel for each dtype as TensorRT's path does; per
    ``"name/dtype"``: the PTX entry's parameter types, the ABI TensorRT expects, the
    scratch parameters and their sizes, the PTX target and the shared memory."""
    report = {}
    for name, plugin in sorted(PLUGINS.items()):
        for dtype in dtypes:
            compiled = compile_for_tensorrt(plugin, dtype, config)
            ptx = compiled.asm["ptx"]
            scratch = scratch_params(compiled.metadata)
            report[f"{name}/{dtype}"] = dict(
                params=ptx_params(ptx),
                expected=expected_abi(plugin, len(scratch)),
                scratch={
                    kind: getattr(compiled.metadata, f"{kind}_scratch_size") for kind in scratch
                },
                sm_90=".target sm_90" in ptx,
                shared=compiled.metadata.shared,
            )
    return report
