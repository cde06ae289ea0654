"""TensorRT plugin kernels: the Triton kernels of the ``kda`` ops AOT-compiled to sm_90 PTX
in the argument order TensorRT's Quickly Deployable Plugins (``tensorrt.plugin.aot_impl``)
launch them with.

TensorRT's AOT launcher passes, in order: the plugin's input tensors, then int scalars
(symbolic expressions of the input shapes), then the output tensors; it cannot pass float
scalars or absent inputs. Triton appends two hidden scratch pointers (global and profile
scratch) that must stay unused. Each :class:`PluginKernel` says which kernel parameters
are inputs, int scalars and outputs, bakes every float (scale, eps, lower bound) and every
flag into constexprs, and gives the launch grid from shapes alone.

Plugins (namespace ``kda``, the op types of ``lowering.onnx``'s plugin mode):

- ``recurrent``: one kernel, ``recurrent_kda_kernel`` (any T; T = 1 for decode).
- ``chunk_prepare`` then ``chunk_recurrence``: the two-kernel chunk pipeline of
  ``kernels/chunk/`` as a chain of two single-kernel plugins; the prepare plugin's
  outputs (chunk decay, w, u, qg, kd, Aqk) are the recurrence plugin's inputs.
- ``causal_conv1d``: a chain of two single-kernel plugins, ``causal_conv1d_output`` (y)
  then ``causal_conv1d_state`` (final state).
- ``gated_rms_norm`` and ``gate``: one kernel each.

The ``tensorrt.plugin`` definitions built on these live in ``lowering.tensorrt_plugins``.
"""

from __future__ import annotations

import dataclasses
import re
import warnings
from collections.abc import Callable, Mapping

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kda_ops.kernels.chunk import FORWARD_CHUNK
from kda_ops.kernels.chunk.device import BLOCK
from kda_ops.kernels.chunk.planning import prepare_warps, scan_stages, uses_safe_gate
from kda_ops.kernels.chunk.prepare import chunk_prepare_kernel
from kda_ops.kernels.chunk.recurrence import chunk_recurrence_kernel, unmasked_full_steps
from kda_ops.kernels.conv.device import token_grid
from kda_ops.kernels.conv.forward import causal_conv1d_kernel, conv_final_state_kernel
from kda_ops.kernels.gate import kda_gate_kernel
from kda_ops.kernels.gated_norm import gated_rms_norm_kernel
from kda_ops.kernels.recurrent import recurrent_kda_kernel
from kda_ops.kernels.sizes import SM90_SHARED_MEMORY, next_power_of_2

SM90 = GPUTarget("cuda", 90, 32)
TRITON_DTYPES = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}
HIDDEN_SCRATCH_PARAMS = 2  # Triton's global and profile scratch pointers, always last

Shapes = Mapping[str, tuple[int, ...]]  # plugin input name -> shape


@dataclasses.dataclass(frozen=True)
class PluginKernel:
    """One TensorRT plugin backed by one Triton kernel.

    ``inputs`` / ``outputs``: kernel parameters that are the plugin's input / output
    tensors, in plugin order; ``int_args``: int scalar parameters, each a function of the
    input shapes; ``absent``: pointer parameters specialized to ``None``; ``constexprs``:
    the kernel's compile-time values for a config (dims, flags, float scalars; the config
    also holds ``"dtype"`` when compiling); ``grid``: launch grid from the input shapes and
    constexprs; ``float32_params``: parameters that are float32 whatever the model dtype
    (states, gate parameters); ``num_warps``: a count, or a function of the constexprs.

    ``grid`` and ``int_args`` only add, subtract, multiply and floor-divide shapes by ints
    (shape first), so they also take TensorRT's symbolic ``ShapeExpr`` dims."""

    name: str
    kernel: object  # a @triton.jit kernel
    inputs: tuple[str, ...]
    int_args: Mapping[str, Callable[[Shapes], int]]
    outputs: tuple[str, ...]
    absent: tuple[str, ...]
    constexprs: Callable[[Mapping[str, object]], dict[str, object]]
    grid: Callable[[Shapes, Mapping[str, object]], tuple[int, int, int]]
    float32_params: tuple[str, ...] = ()
    num_warps: int | Callable[[Mapping[str, object]], int] = 4

    def warps(self, config: Mapping[str, object]) -> int:
        """Warps per program for ``config``."""
        if callable(self.num_warps):
            return self.num_warps(self.constexprs(config))
        return self.num_warps

    def signature(self, dtype: str, config: Mapping[str, object]) -> tuple[dict, dict]:
        """Triton (signature, constexprs) for tensors of ``dtype`` ("float16", ...)."""
        if dtype not in TRITON_DTYPES:
            raise ValueError(f"`dtype` must be one of {tuple(TRITON_DTYPES)}, got {dtype!r}")
        constants = {**self.constexprs({**config, "dtype": dtype}), **dict.fromkeys(self.absent)}
        signature = {}
        for name in self.kernel.arg_names:
            if name in constants:
                signature[name] = "constexpr"
            elif name in self.int_args:
                signature[name] = "i32"
            elif name in self.inputs or name in self.outputs:
                element = "fp32" if name in self.float32_params else TRITON_DTYPES[dtype]
                signature[name] = f"*{element}"
            else:
                raise ValueError(f"{self.name}: kernel parameter {name!r} has no role")
        return signature, constants

    def compile(self, dtype: str, config: Mapping[str, object]) -> triton.compiler.CompiledKernel:
        """AOT-compile for sm_90 (no GPU needed); ``.asm["ptx"]`` is the plugin's PTX."""
        signature, constants = self.signature(dtype, config)
        source = ASTSource(_compilable(self.kernel), signature, constexprs=constants)
        options = {"num_warps": self.warps({**config, "dtype": dtype})}
        return triton.compile(source, target=SM90, options=options)

    def launch_args(self, shapes: Shapes) -> list[int]:
        """The int scalars TensorRT passes between inputs and outputs."""
        return [fn(shapes) for fn in self.int_args.values()]


def _compilable(kernel: object) -> triton.JITFunction:
    if not isinstance(kernel, triton.JITFunction):
        raise TypeError(
            "AOT compilation needs real @triton.jit kernels: unset TRITON_INTERPRET in this "
            "process (its interpreted kernels cannot be compiled)"
        )
    return kernel


def ptx_params(ptx: str) -> list[str]:
    """The PTX types of the entry's parameters, e.g. ``[".u64", ".u32", ...]``."""
    match = re.search(r"\.entry\s+\w+\s*\((.*?)\)", ptx, re.S)
    if match is None:
        raise ValueError("no .entry in the PTX")
    return re.findall(r"\.param\s+(\.\w+)", match.group(1))


def expected_abi(plugin: PluginKernel) -> list[str]:
    """What TensorRT's AOT launcher passes: input pointers, int32 scalars, output pointers,
    then Triton's two hidden scratch pointers (passed as null)."""
    return (
        [".u64"] * len(plugin.inputs)
        + [".u32"] * len(plugin.int_args)
        + [".u64"] * (len(plugin.outputs) + HIDDEN_SCRATCH_PARAMS)
    )


def _rows(shapes: Shapes, name: str) -> int:
    """Product of every dim but the last (shape-first products: ``ShapeExpr`` safe)."""
    shape = shapes[name]
    count = shape[0]
    for dim in shape[1:-1]:
        count = count * dim
    return count


def cdiv(dim: int, block: int) -> int:
    """``ceil(dim / block)`` for an int or symbolic ``dim`` and an int ``block``."""
    return (dim + (block - 1)) // block


def _recurrent_constexprs(config: Mapping[str, object]) -> dict[str, object]:
    head_k, head_v = config["head_k"], config["head_v"]
    block_k = next_power_of_2(head_k)
    lower_bound = config.get("lower_bound")
    return dict(
        scale=float(config.get("scale") or head_k**-0.5),
        lower_bound=0.0 if lower_bound is None else float(lower_bound),
        H=config["heads"], HV=config["value_heads"], K=head_k, V=head_v, BK=block_k,
        BV=min(next_power_of_2(head_v), 32 if block_k <= 128 else 16),
        SCALAR_GATE=bool(config.get("scalar_gate", False)), USE_GATE=_use_gate(config),
        HAS_DT_BIAS=_use_gate(config), USE_LOWER_BOUND=lower_bound is not None,
        USE_L2NORM=bool(config.get("use_qk_l2norm", True)),
        USE_BETA_SIGMOID=bool(config.get("use_beta_sigmoid", True)),
        HAS_STATE_IN=True, USE_INDICES=False, IS_VARLEN=False, STORE_FINAL_STATE=True,
        STORE_STEP_STATES=False,
        STATE_IN_V_FIRST=False,  # the plugin's states are key-first [N, HV, K, V]
        STATE_OUT_V_FIRST=False,
    )  # fmt: skip


def _use_gate(config: Mapping[str, object]) -> bool:
    """Whether the gate is computed in-kernel from A_log / dt_bias (the default)."""
    return bool(config.get("use_gate", True))


def _recurrent() -> PluginKernel:
    return PluginKernel(
        name="recurrent",
        kernel=recurrent_kda_kernel,
        inputs=("q", "k", "v", "g", "beta", "A_log", "dt_bias", "state_in"),
        int_args={"length": lambda s: s["q"][1]},
        outputs=("o", "state_out"),
        absent=("state_indices", "cu_seqlens", "step_states"),
        constexprs=_recurrent_constexprs,
        grid=lambda s, c: (s["q"][0] * (cdiv(c["V"], c["BV"]) * c["HV"]), 1, 1),
        float32_params=("A_log", "dt_bias", "state_in", "state_out"),
    )


CONV_BLOCK_T = 16


def _conv_constexprs(config: Mapping[str, object]) -> dict[str, object]:
    channels, width = config["channels"], config["width"]
    return dict(
        D=channels, W=width, BT=CONV_BLOCK_T, BD=min(next_power_of_2(channels), 256),
        BN=1, BW=next_power_of_2(width - 1), HAS_BIAS=True, HAS_STATE=True,
        USE_INDICES=False, IS_VARLEN=False,
        SILU=config.get("activation", "silu") == "silu", FINAL_STATE=False,
    )  # fmt: skip


def _conv_state_constexprs(config: Mapping[str, object]) -> dict[str, object]:
    base = _conv_constexprs(config)
    return dict(D=base["D"], W=base["W"], BD=base["BD"], BW=base["BW"], HAS_STATE=True,
                USE_INDICES=False, IS_VARLEN=False)  # fmt: skip


def _norm_constexprs(config: Mapping[str, object]) -> dict[str, object]:
    width = config["dim"]
    block = next_power_of_2(width)
    return dict(eps=float(config.get("eps", 1e-5)), D=width, BD=block,
                ROWS=max(1, 2048 // block), SILU=config.get("activation") == "silu")  # fmt: skip


def _gate_constexprs(config: Mapping[str, object]) -> dict[str, object]:
    channels = config["head_k"]
    block = next_power_of_2(channels)
    lower_bound = config.get("lower_bound")
    return dict(
        lower_bound=0.0 if lower_bound is None else float(lower_bound),
        HV=config["value_heads"], K=channels, BK=block, ROWS=max(1, min(128, 8192 // block)),
        HAS_DT_BIAS=True, USE_LOWER_BOUND=lower_bound is not None,
    )  # fmt: skip


def _chunk_blocks(config: Mapping[str, object]) -> tuple[int, int, str]:
    """(BK, BV, dot precision) as ``launch_chunk_kda`` picks them."""
    block_k = max(16, next_power_of_2(config["head_k"]))
    block_v = max(16, next_power_of_2(config["head_v"]))
    return block_k, block_v, "ieee" if config.get("dtype") == "float32" else "tf32"


def _chunk_prepare_constexprs(config: Mapping[str, object]) -> dict[str, object]:
    block_k, block_v, precision = _chunk_blocks(config)
    base = _recurrent_constexprs(config)
    lower_bound = base["lower_bound"] if base["USE_LOWER_BOUND"] else None
    safe = uses_safe_gate(
        lower_bound, base["USE_GATE"], getattr(torch, config.get("dtype") or "float32")
    )
    return dict(
        scale=base["scale"], lower_bound=base["lower_bound"], H=base["H"], HV=base["HV"],
        K=base["K"], V=base["V"], BK=block_k, BV=block_v, BN=1,
        SCALAR_GATE=base["SCALAR_GATE"], USE_GATE=base["USE_GATE"],
        HAS_DT_BIAS=base["HAS_DT_BIAS"], USE_LOWER_BOUND=base["USE_LOWER_BOUND"],
        SAFE_GATE=safe, USE_L2NORM=base["USE_L2NORM"], USE_BETA_SIGMOID=base["USE_BETA_SIGMOID"],
        IS_VARLEN=False, DOT_PRECISION=precision, CHUNKS="all",
        BLOCKS=FORWARD_CHUNK // BLOCK.value, window_first=0, WINDOW=0,
    )  # fmt: skip


def _chunk_recurrence_constexprs(config: Mapping[str, object]) -> dict[str, object]:
    block_k, block_v, precision = _chunk_blocks(config)
    split_v = min(block_v, 64)
    itemsize = getattr(torch, config.get("dtype") or "float32").itemsize
    return dict(first_head=0, window_begin=0, WINDOW_STEPS=0, HV=config["value_heads"],
                K=config["head_k"],
                V=config["head_v"], WIDTH=config["head_v"], BK=block_k, BV=split_v,
                STEP=FORWARD_CHUNK, HAS_INITIAL_STATE=True, IS_VARLEN=False,
                DOT_PRECISION=precision, STORE_CHUNK_STATES=False,
                STORE_OUTPUT=True,
                UNMASKED_FULL_STEPS=unmasked_full_steps(precision, FORWARD_CHUNK),
                STAGES=config.get("stages") or scan_stages(
                    block_k, split_v, itemsize, itemsize, True, SM90_SHARED_MEMORY,
                    FORWARD_CHUNK))  # fmt: skip


def chunk_count(shapes: Shapes, name: str = "q") -> int:
    """Prepare chunks of a padded batch ``[B, T, ...]``: ``B * ceil(T / FORWARD_CHUNK)``."""
    return shapes[name][0] * cdiv(shapes[name][1], FORWARD_CHUNK)


CHUNK_INTERMEDIATES = ("chunk_decay", "w", "u", "qg", "kd", "aqk")

PLUGINS: dict[str, PluginKernel] = {
    "recurrent": _recurrent(),
    "chunk_prepare": PluginKernel(
        name="chunk_prepare",
        kernel=chunk_prepare_kernel,
        inputs=("q", "k", "v", "g", "beta", "A_log", "dt_bias"),
        int_args={"length": lambda s: s["q"][1], "n_seqs": lambda s: s["q"][0]},
        outputs=CHUNK_INTERMEDIATES,
        absent=("cu_seqlens", "chunk_offsets", "unbounded"),
        constexprs=_chunk_prepare_constexprs,
        grid=lambda s, c: (chunk_count(s), c["HV"], 1),
        float32_params=("A_log", "dt_bias", "chunk_decay"),
        num_warps=lambda c: prepare_warps(c["BK"]),
    ),
    "chunk_recurrence": PluginKernel(
        name="chunk_recurrence",
        kernel=chunk_recurrence_kernel,
        inputs=(*CHUNK_INTERMEDIATES[1:], "chunk_decay", "initial_state"),
        int_args={"length": lambda s: s["u"][1]},
        outputs=("o", "final_state"),
        absent=("cu_seqlens", "chunk_offsets", "state_chunks", "sequence_order", "chunk_states"),
        constexprs=_chunk_recurrence_constexprs,
        grid=lambda s, c: (s["u"][0] * (cdiv(c["V"], c["BV"]) * c["HV"]), 1, 1),
        float32_params=("chunk_decay", "initial_state", "final_state"),
    ),
    "causal_conv1d_output": PluginKernel(
        name="causal_conv1d_output",
        kernel=causal_conv1d_kernel,
        inputs=("x", "weight", "bias", "state"),
        int_args={"length": lambda s: s["x"][1], "n_seqs": lambda s: s["x"][0]},
        outputs=("y",),
        absent=("state_indices", "cu_seqlens", "state_out"),
        constexprs=_conv_constexprs,
        grid=lambda s, c: (*token_grid(s["x"][0], s["x"][1], c["D"], c["BT"], c["BD"]), 1, 1),
    ),
    "causal_conv1d_state": PluginKernel(
        name="causal_conv1d_state",
        kernel=conv_final_state_kernel,
        inputs=("x", "state_in"),
        int_args={"length": lambda s: s["x"][1]},
        outputs=("state_out",),
        absent=("state_indices", "cu_seqlens"),
        constexprs=_conv_state_constexprs,
        grid=lambda s, c: (s["x"][0], cdiv(c["D"], c["BD"]), 1),
    ),
    "gated_rms_norm": PluginKernel(
        name="gated_rms_norm",
        kernel=gated_rms_norm_kernel,
        inputs=("x", "gate", "weight"),
        int_args={"n_rows": lambda s: _rows(s, "x")},
        outputs=("y",),
        absent=(),
        constexprs=_norm_constexprs,
        grid=lambda s, c: (cdiv(_rows(s, "x"), c["ROWS"]), 1, 1),
    ),
    "gate": PluginKernel(
        name="gate",
        kernel=kda_gate_kernel,
        inputs=("g", "A_log", "dt_bias"),
        int_args={"n_rows": lambda s: _rows(s, "g")},
        outputs=("out",),
        absent=(),
        constexprs=_gate_constexprs,
        grid=lambda s, c: (cdiv(_rows(s, "g"), c["ROWS"]), 1, 1),
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
    scratch sizes, the PTX target and the shared memory."""
    report = {}
    for name, plugin in sorted(PLUGINS.items()):
        for dtype in dtypes:
            compiled = compile_for_tensorrt(plugin, dtype, config)
            ptx = compiled.asm["ptx"]
            report[f"{name}/{dtype}"] = dict(
                params=ptx_params(ptx), expected=expected_abi(plugin),
                global_scratch_size=compiled.metadata.global_scratch_size,
                profile_scratch_size=compiled.metadata.profile_scratch_size,
                sm_90=".target sm_90" in ptx, shared=compiled.metadata.shared,
            )  # fmt: skip
    return report
