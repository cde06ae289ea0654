"""AOTInductor packages of kda programs: a ``.pt2`` that C++ loads with
``torch::inductor::AOTIModelPackageLoader`` and runs with no Python interpreter.

A kda op's kernels are Python functions, which a package cannot call without Python.

- **CUDA**: the kda passes run in the package's compile (``backend="kda"``'s post-grad
  passes), whose last pass turns every inference op into its Triton launches as kernel
  nodes (``lowering/inductor/triton_kernels.py``); Inductor compiles those kernels into the
  package as cubins and launches them from its C++. An op the pass leaves (shapes the
  kernels do not serve) is refused, naming it (:class:`UnsupportedOpError`).
- **CPU**: :func:`decompose` first replaces every inference op (``kda.chunk``,
  ``kda.recurrent``, ``kda.causal_conv1d``, ``kda.gated_rms_norm``, ``kda.gate``) by its
  reference formulation in aten ops, and Inductor generates the package's code from that.
  The delta rule becomes its token recurrence as a ``scan`` (a loop in the package;
  unrolled for a static count of up to :data:`UNROLLED_TOKENS`, a decode step), for
  ``kda.chunk`` too: the chunked form pads T to whole chunks, and tracing that specializes
  the prompt length. Such a package computes what the ops compute, with Inductor's kernels
  rather than kda's fused Triton kernels; it needs torch >= :data:`OLDEST_TORCH`.

Packages take fixed-length batches (``cu_seqlens`` must be ``None``) and functional ops
only: an in-place op (``kda.recurrent_``, ``kda.causal_conv1d_update_``) writes state that a
package would not carry between calls, which :func:`lowering.export.check_explicit_state`
refuses at export already.

:func:`package_steps` writes a hybrid model's prefill and decode steps as
``prefill.pt2`` / ``decode.pt2``; ``examples/aoti_runner/`` is a C++ program that loads
them, prefills prompts and decodes greedily on the device the packages were built for.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Optional, Union

import torch
from torch import Tensor
from torch._higher_order_ops.scan import scan_op
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch.export import ExportedProgram

from kda_ops import reference
from kda_ops.delta_rule_ops import chunk_op, delta_rule_reference, recurrent_op
from kda_ops.signature import DeltaRuleInputs, DeltaRuleOptions, flat_kernel
from lowering.export import StatefulLM, export_step, flatten_cache, state_names
from lowering.inductor.pass_manager import KDAPassManager

# Metadata keys of a step package, read by the C++ runner.
STATE_NAMES_KEY = "kda.state_names"
STATE_SPECS_KEY = "kda.state_specs"
DEVICE_KEY = "kda.device"

# torch 2.11's C++ wrapper cannot generate the scan's loop of a CPU package (2.13.0 and
# 2.14.1 can); CUDA packages hold no loop.
OLDEST_TORCH = "2.13"


class UnsupportedOpError(ValueError):
    """A program holds a ``kda`` op that :func:`decompose` has no formulation for."""


def _fixed_length(op: str, cu_seqlens: Optional[Tensor]) -> None:
    if cu_seqlens is not None:
        raise ValueError(
            f"{op}: an AOTInductor package takes fixed-length batches; `cu_seqlens` must be "
            "None (pad the sequences into a batch)"
        )


def _batch_bound_scan(
    step: Callable[[Tensor, list[Tensor]], tuple[Tensor, tuple[Tensor, ...]]],
    state: Tensor,
    xs: list[Tensor],
) -> tuple[Tensor, tuple[Tensor, ...]]:
    """A :data:`kda_ops.reference.Scan` as the ``scan`` higher-order op, for the reference
    token recurrence, whose per-step outputs lead with the state's batch dim.

    Two workarounds. Inductor lowers a scan to a while_loop and sizes its stacked outputs
    from the scan's SymInt inputs alone, so the batch size is one (an additional input) and
    the step reshapes its outputs with it. And the op is called directly, not through
    ``torch._higher_order_ops.scan.scan``, whose ``torch.compile`` wrapper keeps a Dynamo
    cache entry that breaks the next export trace of a different program (a tensor
    constant missing from the program).
    """
    batch = state.shape[0]
    dynamic = (batch,) if isinstance(batch, torch.SymInt) else ()  # a static size needs none

    def flat_step(carry: Tensor, *rest: object) -> list[Tensor]:
        carry, ys = step(carry, list(rest[: len(xs)]))
        size = rest[len(xs)] if dynamic else batch
        return [carry, *(y.reshape(size, *y.shape[1:]) for y in ys)]

    final, *ys = scan_op(flat_step, [state], list(xs), dynamic)
    return final, tuple(ys)


# A static token count up to this (a decode step, a few draft tokens) runs unrolled: the
# package then has no loop, nor the loop's per-iteration index bookkeeping.
UNROLLED_TOKENS = 8


def _token_scan(
    step: Callable[[Tensor, list[Tensor]], tuple[Tensor, tuple[Tensor, ...]]],
    state: Tensor,
    xs: list[Tensor],
) -> tuple[Tensor, tuple[Tensor, ...]]:
    length = xs[0].shape[0]
    if isinstance(length, int) and length <= UNROLLED_TOKENS:
        return reference.python_scan(step, state, xs)
    return _batch_bound_scan(step, state, xs)


def _delta_rule(op: str) -> Callable[..., tuple[Tensor, Tensor]]:
    form = functools.partial(reference.recurrent_delta_rule, scan=_token_scan)
    kernel = delta_rule_reference(form)

    def decomposition(
        inputs: DeltaRuleInputs,
        initial_state: Optional[Tensor],
        cu_seqlens: Optional[Tensor],
        options: DeltaRuleOptions,
    ) -> tuple[Tensor, Tensor]:
        _fixed_length(op, cu_seqlens)
        return kernel(inputs, initial_state, cu_seqlens, options)

    return decomposition


def _causal_conv1d(
    x: Tensor,
    weight: Tensor,
    bias: Optional[Tensor],
    initial_state: Optional[Tensor],
    cu_seqlens: Optional[Tensor],
    activation: str,
) -> tuple[Tensor, Tensor]:
    _fixed_length("kda.causal_conv1d", cu_seqlens)
    return reference.causal_conv1d(
        x=x,
        weight=weight,
        bias=bias,
        initial_state=initial_state,
        cu_seqlens=None,
        activation=activation,
    )


def decompositions() -> dict[torch._ops.OpOverload, Callable[..., object]]:
    """The aten formulation of each functional inference op, keyed by its overload (a
    table for ``ExportedProgram.run_decompositions``)."""
    kda = torch.ops.kda
    return {
        kda.chunk.default: flat_kernel(chunk_op, _delta_rule("kda.chunk")),
        kda.recurrent.default: flat_kernel(recurrent_op, _delta_rule("kda.recurrent")),
        kda.causal_conv1d.default: _causal_conv1d,
        kda.gated_rms_norm.default: reference.gated_rms_norm,
        kda.gate.default: reference.kda_gate,
    }


def _kda_ops_left(graph: torch.fx.Graph) -> list[str]:
    return sorted(
        {
            str(node.target)
            for node in graph.nodes
            if node.op == "call_function" and str(node.target).startswith("kda.")
        }
    )


def decompose(program: ExportedProgram) -> ExportedProgram:
    """``program`` with every ``kda`` op replaced by aten ops (:func:`decompositions`) and
    the default decompositions applied; raises :class:`UnsupportedOpError` naming any kda
    op left (training, backward and in-place ops have no package formulation)."""
    table = decompositions()
    decomposed = program.run_decompositions(table)
    left = _kda_ops_left(decomposed.graph)
    if left:
        raise UnsupportedOpError(
            f"no AOTInductor formulation for {', '.join(left)}; a package takes the "
            "functional inference ops: " + ", ".join(sorted(map(str, table)))
        )
    return decomposed


class KernelNodesOnly(CustomGraphPass):
    """The kda passes (:class:`KDAPassManager`), then a check that no kda op is left: in a
    CUDA package every kda op must have become its kernel launches."""

    def __init__(self) -> None:
        self.passes = KDAPassManager()

    def __call__(self, graph: torch.fx.Graph) -> None:
        self.passes(graph)
        left = _kda_ops_left(graph)
        if left:
            raise UnsupportedOpError(
                f"{', '.join(left)} did not become Triton kernel launches, so a CUDA package "
                "would call its Python kernel: fixed-length, non-float64 inputs of head dims "
                "the chunk kernels serve are lowered (lowering/inductor/triton_kernels.py)"
            )

    def uuid(self) -> str:
        return self.passes.uuid()


def program_device(program: ExportedProgram) -> torch.device:
    """The device of the program's inputs (parameters, buffers and user inputs)."""
    for node in program.graph.find_nodes(op="placeholder"):
        value = node.meta.get("val")
        if isinstance(value, Tensor):
            return value.device
    return torch.device("cpu")


def package(
    program: ExportedProgram,
    path: Union[str, Path],
    metadata: Optional[dict[str, str]] = None,
) -> str:
    """Compile ``program`` into the AOTInductor package ``path`` (a ``.pt2`` file) with
    string ``metadata`` the loader returns (plus :data:`DEVICE_KEY`); returns the path. On
    CUDA the kda ops become their Triton kernels; elsewhere they are decomposed first,
    which needs torch >= :data:`OLDEST_TORCH` (module docstring)."""
    device = program_device(program)
    configs = {"aot_inductor.metadata": {**(metadata or {}), DEVICE_KEY: device.type}}
    if device.type == "cuda":
        configs["post_grad_custom_post_pass"] = KernelNodesOnly()
    else:
        if torch.torch_version.TorchVersion(torch.__version__) < OLDEST_TORCH:
            raise RuntimeError(
                f"lowering.aoti.package needs torch >= {OLDEST_TORCH} for a CPU package (this "
                f"is {torch.__version__}): older Inductor fails to generate the C++ of the "
                "delta rule's loop"
            )
        program = decompose(program)
        # Without in-place buffers: torch 2.13's C++ wrapper otherwise declares a buffer
        # that a scan's loop has written a second time (the generated C++ does not compile).
        configs["inplace_buffers"] = False
    return torch._inductor.aoti_compile_and_package(
        program, package_path=str(path), inductor_configs=configs
    )


def state_specs(model: StatefulLM) -> str:
    """Each state's dtype and shape without the batch dim, one per line in
    :func:`lowering.export.state_names` order: ``float32 2 16 16`` (what the runner needs to
    build an empty cache)."""
    states = flatten_cache(model.new_cache(1))
    return "\n".join(
        " ".join([str(state.dtype).removeprefix("torch."), *map(str, state.shape[1:])])
        for state in states
    )


def package_steps(model: StatefulLM, directory: Union[str, Path]) -> dict[str, str]:
    """Export ``model``'s prefill and decode steps (:func:`lowering.export.export_step`)
    and package each as ``directory/prefill.pt2`` / ``decode.pt2``; every package's
    metadata carries the state names and specs. Returns the paths by step."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    metadata = {STATE_NAMES_KEY: "\n".join(state_names(model)), STATE_SPECS_KEY: state_specs(model)}
    return {
        step: package(export_step(model, step), directory / f"{step}.pt2", metadata)
        for step in ("prefill", "decode")
    }
