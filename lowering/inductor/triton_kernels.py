"""The last kda pass: on CUDA, a kda op becomes its Triton launches, each as Inductor's own
functional Triton-kernel node (``triton_kernel_wrapper_functional``).

A custom-op node in the compiled graph is called from the generated code through the
dispatcher into the op's Python body, which plans the launch and enters Triton's Python
launch path: host time that, in a decode step, exceeds what the kernels take on the GPU.
As a kernel node, Inductor compiles the kernel with the graph and launches it with its own
launcher, its re-inplacing pass writes a state update into the model's own buffer (as it
does for ``auto_functionalized``), and an AOTInductor package embeds the kernel.

Lowered, with the op's own launch planning (:mod:`kda_ops.kernels`), from static or
symbolic shapes (a graph compiled with dynamic shapes, an exported program):

- ``kda.gated_rms_norm`` and ``kda.gate``;
- ``kda.recurrent``, and the in-place ``kda.recurrent_`` under ``auto_functionalized``;
- ``kda.chunk``: the prepare kernel's launches, then the recurrence in one serial scan per
  sequence (shapes that the op itself would run in segments keep the op);
- ``kda.causal_conv1d``, the prefill kernels for any T;
- the decode step (one token, a dense state) of the in-place conv update
  ``auto_functionalized(kda.causal_conv1d_update_)``.

Where a launch choice compares a symbolic batch with the SM count, the plan takes the
choice of a batch that fills the SMs (``recurrence_launches``, ``step_launch``). The rest
stays as the op: float64 (the reference's), CPU, shapes the chunk kernels do not serve,
and the in-place ops called by the model itself (``auto_functionalized_v2``; the passes
write v1).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import Tensor
from torch._higher_order_ops.auto_functionalize import auto_functionalized
from torch._inductor.pattern_matcher import (
    CallFunctionVarArgs,
    Match,
    PatternMatcherPass,
    register_graph_pattern,
)
from torch.fx.operator_schemas import normalize_function

import kda_ops  # noqa: F401  (registers torch.ops.kda)
from kda_ops import arguments, kernels
from kda_ops.delta_rule_ops import chunk_kernels_run_as_given
from kda_ops.kernels.launches import LaunchPlan
from kda_ops.signature import DeltaRuleInputs, DeltaRuleOptions
from lowering.inductor.base import KDAInductorPass, PatternPass, source_hash

KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

Arguments = dict[str, Any]  # an op's arguments by schema name


@dataclass(frozen=True)
class Lowering:
    """How one op becomes its kernel launches: ``fits`` decides on the arguments' values
    (fake tensors and constants); ``plan`` plans the launches from the traced arguments
    and ``outputs`` makes the op's outputs from the plan's results."""

    fits: Callable[[Arguments], bool]
    plan: Callable[[Arguments], LaunchPlan]
    outputs: Callable[[dict[str, Tensor]], Any]


def _on_kernels(args: Arguments) -> bool:
    """Every tensor argument is on CUDA, and every float one in a dtype the kernels compute
    (float64 is the oracle's: the op's reference serves it)."""
    tensors = [v for v in args.values() if isinstance(v, Tensor)]
    return all(t.is_cuda for t in tensors) and all(
        t.dtype in KERNEL_DTYPES for t in tensors if t.is_floating_point()
    )


def _conv_step_fits(args: Arguments) -> bool:
    x, state = args["x"], args["conv_state"]
    one_token = isinstance(x.shape[1], int) and x.shape[1] == 1
    return _on_kernels(args) and one_token and state.is_contiguous()


def _conv_prefill_fits(args: Arguments) -> bool:
    """The prefill kernels keep a ``[N, D, W - 1]`` state (the op's own layout)."""
    state = args["initial_state"]
    kept = args["weight"].shape[1] - 1
    return _on_kernels(args) and (state is None or state.shape[-1] == kept)


def _grouped(args: Arguments, kind: type) -> Any:
    """The op's arguments of a ``kda_ops.signature`` type's fields, as that type."""
    return kind(**{name: args[name] for name in kind._fields})


def _chunk_fits(args: Arguments) -> bool:
    """Shapes the chunk kernels serve in the inputs' dtype (``kda_ops.plan``: inputs they
    compute in another keep the op, which converts them), in one serial scan per sequence:
    static shapes the op would run in segments keep the op (``recurrence_segments``)."""
    from kda_ops.kernels.chunk.segments import recurrence_segments

    inputs = _grouped(args, DeltaRuleInputs)
    if not (_on_kernels(args) and chunk_kernels_run_as_given(inputs)):
        return False
    batch, length, value_heads, head_v = inputs.v.shape
    if not all(isinstance(size, int) for size in (batch, length)):
        return True
    segments = recurrence_segments(
        batch=batch,
        length=length,
        value_heads=value_heads,
        head_v=head_v,
        cu_seqlens=args["cu_seqlens"],
        device=inputs.v.device,
    )
    return segments == 1


def _gated_rms_norm_plan(args: Arguments) -> LaunchPlan:
    from kda_ops.kernels.gated_norm import gated_rms_norm_launch

    return gated_rms_norm_launch(
        x=args["x"],
        gate=args["gate"],
        weight=args["weight"],
        eps=args["eps"],
        activation=args["activation"],
    ).plan()


def _gate_plan(args: Arguments) -> LaunchPlan:
    from kda_ops.kernels.gate import gate_launch

    return gate_launch(
        g=args["g"], A_log=args["A_log"], dt_bias=args["dt_bias"], lower_bound=args["lower_bound"]
    ).plan()


def _conv_step_plan(args: Arguments) -> LaunchPlan:
    from kda_ops.kernels.conv.step import step_launch

    state = args["conv_state"]
    return step_launch(
        x=args["x"],
        weight=args["weight"],
        bias=args["bias"],
        state_in=state,
        state_out=state,
        state_indices=args["state_indices"],
        activation=args["activation"],
    ).plan()


def _conv_prefill_plan(args: Arguments) -> LaunchPlan:
    from kda_ops.kernels.conv.forward import prefill_plan

    x, weight, state = args["x"], args["weight"], args["initial_state"]
    cu_seqlens = args["cu_seqlens"]
    n_seqs = x.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
    # The op's final state: the initial state's dtype, else x's.
    final = x.new_empty(
        n_seqs, x.shape[2], weight.shape[1] - 1, dtype=x.dtype if state is None else state.dtype
    )
    if state is not None:
        state = state.contiguous()
    return prefill_plan(
        x=x,
        weight=weight,
        bias=args["bias"],
        state_in=state,
        state_out=final,
        state_indices=None,
        cu_seqlens=cu_seqlens,
        activation=args["activation"],
    )


def _chunk_plan(args: Arguments) -> LaunchPlan:
    from kda_ops.kernels.chunk.launch import chunk_plan

    return chunk_plan(
        inputs=_grouped(args, DeltaRuleInputs),
        initial_state=args["initial_state"],
        cu_seqlens=args["cu_seqlens"],
        options=_grouped(args, DeltaRuleOptions),
    )


def _recurrent_plan(args: Arguments, state_in: Optional[Tensor], state_out: Tensor) -> LaunchPlan:
    from kda_ops.kernels.recurrent import recurrent_launch

    return recurrent_launch(
        inputs=_grouped(args, DeltaRuleInputs),
        state_in=state_in,
        state_out=state_out,
        state_indices=args.get("state_indices"),
        cu_seqlens=args["cu_seqlens"],
        options=_grouped(args, DeltaRuleOptions),
    ).plan()


def _recurrent_functional_plan(args: Arguments) -> LaunchPlan:
    state = arguments.new_final_state(args["q"], args["v"], args["cu_seqlens"])
    return _recurrent_plan(args, args["initial_state"], state)


def _recurrent_inplace_plan(args: Arguments) -> LaunchPlan:
    return _recurrent_plan(args, args["state_pool"], args["state_pool"])


def _output_and_state(output: str, state: str) -> Callable[[dict[str, Tensor]], Any]:
    return lambda written: (written[output], written[state])


LOWERINGS: dict[Any, Lowering] = {
    torch.ops.kda.gated_rms_norm.default: Lowering(
        _on_kernels, _gated_rms_norm_plan, lambda written: written["y"]
    ),
    torch.ops.kda.gate.default: Lowering(_on_kernels, _gate_plan, lambda written: written["out"]),
    torch.ops.kda.recurrent.default: Lowering(
        _on_kernels, _recurrent_functional_plan, _output_and_state("o", "state_out")
    ),
    torch.ops.kda.chunk.default: Lowering(
        _chunk_fits, _chunk_plan, _output_and_state("o", "final_state")
    ),
    torch.ops.kda.causal_conv1d.default: Lowering(
        _conv_prefill_fits, _conv_prefill_plan, _output_and_state("y", "state_out")
    ),
}
"""Functional ops, lowered where they appear as themselves."""

INPLACE_LOWERINGS: dict[Any, Lowering] = {
    torch.ops.kda.recurrent_.default: Lowering(
        _on_kernels, _recurrent_inplace_plan, _output_and_state("o", "state_out")
    ),
    torch.ops.kda.causal_conv1d_update_.default: Lowering(
        _conv_step_fits, _conv_step_plan, _output_and_state("y", "state_out")
    ),
}
"""In-place ops, lowered where they appear under ``auto_functionalized``: the outputs are
the op's output and the mutated argument's new value, which the launch writes in place."""


def _values(args: Arguments) -> Arguments:
    return {name: v.meta["val"] if isinstance(v, torch.fx.Node) else v for name, v in args.items()}


def _arguments(node: torch.fx.Node) -> tuple[Optional[Lowering], Arguments]:
    """The node's lowering (None if it has none) and its op's arguments by name."""
    if node.target is auto_functionalized:
        op = node.args[0]
        return INPLACE_LOWERINGS.get(op), dict(node.kwargs)
    bound = normalize_function(
        node.target, node.args, node.kwargs, normalize_to_only_use_kwargs=True
    )
    return LOWERINGS.get(node.target), bound.kwargs


def _fits(match: Match) -> bool:
    (node,) = match.nodes
    lowering, args = _arguments(node)
    nodes = [v for v in args.values() if isinstance(v, torch.fx.Node)]
    if lowering is None or not all("val" in n.meta for n in nodes):
        return False  # not lowered, or an argument without a value to plan from
    return lowering.fits(_values(args))


def _replace(match: Match, *args: Any, **kwargs: Any) -> None:
    (node,) = match.nodes
    lowering, arguments = _arguments(node)
    names = [name for name, v in arguments.items() if isinstance(v, torch.fx.Node)]

    def launched(*tensors: Tensor) -> Any:
        traced = {**arguments, **dict(zip(names, tensors))}
        return lowering.outputs(lowering.plan(traced).functional())

    match.replace_by_example(launched, [arguments[n] for n in names], run_functional_passes=False)


class TritonKernelsPass(PatternPass):
    """Replaces the kda ops listed in the module doc by their kernel launches on CUDA."""

    name = "triton_kernels"

    def register(self, patterns: PatternMatcherPass) -> None:
        if not kernels.AVAILABLE:
            return
        for target in (*LOWERINGS, auto_functionalized):
            words = "an in-place op" if target is auto_functionalized else target._schema.name
            register_graph_pattern(
                CallFunctionVarArgs(target),
                pass_dict=patterns,
                extra_check=self.logged(words, _fits),
            )(_replace)

    def uuid(self) -> str:
        """Hash of this file, the base and the launch planning it traces: a cached graph
        holds the launches as they were planned."""
        from kda_ops.kernels import gate, gated_norm, launches, recurrent
        from kda_ops.kernels.chunk import launch, planning
        from kda_ops.kernels.chunk import recurrence as chunk_recurrence
        from kda_ops.kernels.conv import forward, step

        return source_hash(
            type(self),
            KDAInductorPass,
            launches,
            gated_norm,
            gate,
            recurrent,
            step,
            forward,
            launch,
            planning,
            chunk_recurrence,
        )
