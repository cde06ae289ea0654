"""``torch.export`` of the hybrid model's prefill and decode steps with every state as an
explicit graph input and output.

The exported graphs take ``(input_ids, *states)`` and return ``(logits, *new_states)``, a
flat tuple of tensors in :func:`state_names` order: per KDA layer ``i`` the conv states
``layer{i}.conv_q`` / ``conv_k`` / ``conv_v`` ``[B, D, W - 1]`` (model dtype) and the
recurrent state ``layer{i}.recurrent`` ``[B, H, K, V]`` float32; per attention layer the
KV cache ``layer{i}.key`` / ``value`` ``[B, H, max_seq_len, head_dim]`` and its length
``layer{i}.length`` ``[B]`` int64. Batch is dynamic in both steps, the prompt length T
(1 to ``max_seq_len``) in the prefill step; decode takes one token.

Only the functional flavour exports cleanly: an in-place state update becomes
``auto_functionalized_v2`` plus a buffer or input mutation, which neither the ONNX
exporter nor Torch-TensorRT handles. :func:`check_explicit_state` turns such a program into
a :class:`StateMutationError` that names the mutated tensors and points to the
explicit-state API, rather than letting a stale state through.

Load a saved program with ``import kda_ops`` first (it registers the ``kda`` ops).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple, Protocol

import torch
from torch import Tensor, nn
from torch.export import Dim, ExportedProgram

Cache = tuple[NamedTuple, ...]


class StatefulLM(Protocol):
    """What the export needs of a model (``examples.hybrid_model.StatefulLM`` is one):
    ``new_cache(batch_size)`` returning one NamedTuple of tensors per layer, and functional
    ``prefill`` / ``decode`` steps ``(input_ids, cache) -> (logits, new_cache)``."""

    config: Any

    def new_cache(self, batch_size: int) -> Cache: ...

    def prefill(self, input_ids: Tensor, cache: Cache) -> tuple[Tensor, Cache]: ...

    def decode(self, input_ids: Tensor, cache: Cache) -> tuple[Tensor, Cache]: ...


PREFILL_EXAMPLE_LENGTH = 5
EXAMPLE_BATCH = 3


class StateMutationError(ValueError):
    """An exported program mutates a buffer or an input in place: its state is not explicit
    graph I/O, so a deployed graph would silently keep a stale state."""


def _layout(model: StatefulLM) -> list[type]:
    """The NamedTuple type of each layer's state."""
    return [type(state) for state in model.new_cache(1)]


def state_names(model: StatefulLM) -> list[str]:
    """Names of the flat state tensors, in graph order (see the module docstring)."""
    return [
        f"layer{index}.{field}"
        for index, kind in enumerate(_layout(model))
        for field in kind._fields
    ]


def flatten_cache(cache: Cache) -> tuple[Tensor, ...]:
    """The cache's tensors in :func:`state_names` order."""
    return tuple(tensor for state in cache for tensor in state)


def unflatten_cache(model: StatefulLM, tensors: Sequence[Tensor]) -> Cache:
    """Inverse of :func:`flatten_cache` for ``model``'s layer layout."""
    layout = _layout(model)
    expected = sum(len(kind._fields) for kind in layout)
    if len(tensors) != expected:
        raise ValueError(f"expected {expected} state tensors, got {len(tensors)}")
    states, position = [], 0
    for kind in layout:
        width = len(kind._fields)
        states.append(kind(*tensors[position : position + width]))
        position += width
    return tuple(states)


class ExplicitStateStep(nn.Module):
    """``forward(input_ids [B, T], *states) -> (logits [B, T, vocab], *new_states)``: one
    prefill or functional decode step of a :class:`StatefulLM` on flat state tensors."""

    def __init__(self, model: StatefulLM, step: str) -> None:
        super().__init__()
        if step not in ("prefill", "decode"):
            raise ValueError(f"`step` must be 'prefill' or 'decode', got {step!r}")
        self.model, self.step = model, step

    def forward(self, input_ids: Tensor, *states: Tensor) -> tuple[Tensor, ...]:
        run = self.model.prefill if self.step == "prefill" else self.model.decode
        logits, cache = run(input_ids, unflatten_cache(self.model, states))
        # Contiguous states feed the next step as they are: a compiled package (AOTInductor)
        # reads its inputs with the strides it was traced with.
        return (logits, *(state.contiguous() for state in flatten_cache(cache)))


def _dynamic_shapes(model: StatefulLM, step: str) -> tuple[object, ...]:
    """Batch is dim 0 of every input; prefill's T is dim 1 of ``input_ids``. Shaped like
    ``forward``'s arguments: ``(input_ids, states)``."""
    batch = Dim("batch", min=1, max=1024)
    ids = {0: batch}
    if step == "prefill":
        ids[1] = Dim("length", min=1, max=model.config.max_seq_len)
    return ids, tuple({0: batch} for _ in state_names(model))


def example_inputs(model: StatefulLM, step: str) -> tuple[Tensor, ...]:
    """``(input_ids, *states)`` to trace with: batch 3 and, for prefill, T = 5 (> 1 so
    neither dim specializes); an empty cache."""
    length = PREFILL_EXAMPLE_LENGTH if step == "prefill" else 1
    states = flatten_cache(model.new_cache(EXAMPLE_BATCH))
    shape = (EXAMPLE_BATCH, length)
    ids = torch.randint(0, model.config.vocab_size, shape, device=states[0].device)
    return (ids, *states)


def check_explicit_state(program: ExportedProgram) -> ExportedProgram:
    """Raise :class:`StateMutationError` when ``program`` writes a buffer or an input in
    place; return it unchanged otherwise.

    ``torch.export`` keeps in-place ops (``copy_``, ``kda.recurrent_``) in its training IR;
    functionalizing a copy (no decompositions) lists what they mutate in the signature.
    """
    signature = program.run_decompositions({}).graph_signature
    mutated = {**signature.buffers_to_mutate, **signature.user_inputs_to_mutate}
    if mutated:
        names = ", ".join(sorted(set(mutated.values())))
        raise StateMutationError(
            f"the exported program mutates state in place ({names}); a deployed graph would "
            "not carry that state between steps. Pass every state as an input and return "
            "the new state as an output instead: use the functional ops (kda_ops.chunk_kda, "
            "fused_recurrent_kda, causal_conv1d, causal_conv1d_update) and "
            "the model's functional steps (HybridLM.prefill / decode, not decode_), as "
            "lowering.export.export_step does."
        )
    return program


def export_step(model: StatefulLM, step: str) -> ExportedProgram:
    """``torch.export`` the ``"prefill"`` or ``"decode"`` step of ``model`` with explicit
    state I/O (:class:`ExplicitStateStep`), dynamic batch (and T for prefill)."""
    module = ExplicitStateStep(model, step)
    program = torch.export.export(
        module, example_inputs(model, step), dynamic_shapes=_dynamic_shapes(model, step)
    )
    return check_explicit_state(program)


def export_module(
    module: nn.Module, args: tuple[object, ...], **export_kwargs: object
) -> ExportedProgram:
    """``torch.export.export(module, args, **export_kwargs)`` for any module, refusing
    (:class:`StateMutationError`) a program whose state lives in mutated buffers or inputs."""
    return check_explicit_state(torch.export.export(module, args, **export_kwargs))
