"""transformers prefill and decode steps with every cache state as an explicit input and
output, for ``torch.export`` (with :func:`kda_ops.integrations.enable` on).

transformers keeps hybrid-model state in a ``DynamicCache`` that the model mutates in place
(``conv_state.copy_``, ``recurrent_states[...].copy_``, KV ``torch.cat``). Exported as is, the
cache is a Python object, not graph I/O. :class:`DecodeStep` takes the states as tensors,
builds a fresh cache from them inside the traced function (the cache copies them, so no
input is mutated), runs the model and returns the logits and the new states: per layer
``(conv_state [B, D, W], recurrent_state [B, HV, K, V])`` for linear attention and
``(keys, values)`` (``[B, heads, L, d]``, L grows by the step's tokens) for full attention.
:class:`PrefillStep` starts from no state and returns the same states.

**Prompt length.** transformers' own prefill pads the conv state when the prompt is shorter
than the conv width W (``cache.update_conv_state``: ``if T < W: pad``), a branch on T that a
dynamic-length export cannot keep: it specializes, or fails with ``Constraints violated``
unless T's lower bound is W. :class:`PrefillStep` seeds every linear-attention layer's conv
state with zeros first, so the model takes its continuation path (``cat(state, x)``), which
is the same computation (zero history) with no branch on T: any T >= 2 exports (T = 1
specializes in ``torch.export``; a one-token prompt is a :class:`DecodeStep` from zero
states, or an eager call).
"""

from __future__ import annotations

from os import PathLike
from pathlib import Path
from typing import Any, Optional, Union

import torch
from torch import Tensor

LayerState = tuple[Tensor, Tensor]


def _is_linear(layer_type: str) -> bool:
    return layer_type == "linear_attention"


def layer_types(model: torch.nn.Module) -> list[str]:
    """The model's ``layer_types`` (its text config's, for a multimodal model)."""
    return list(model.config.get_text_config().layer_types)


def _conv_weights(model: torch.nn.Module, layer_types: list[str]) -> list[Tensor]:
    """The depthwise conv weight ``[D, 1, W]`` of each linear-attention layer, in order: the
    ``Conv1d`` named ``conv1d`` inside the decoder layer (every transformers delta-rule model
    names it so)."""
    layers = model.get_decoder().layers
    weights = []
    for index, layer_type in enumerate(layer_types):
        if not _is_linear(layer_type):
            continue
        convs = [m for n, m in layers[index].named_modules() if n.rsplit(".", 1)[-1] == "conv1d"]
        if len(convs) != 1 or not isinstance(convs[0], torch.nn.Conv1d):
            raise ValueError(
                f"PrefillStep: linear-attention layer {index} of {type(model).__name__} has "
                f"{len(convs)} `conv1d` convolutions, expected one"
            )
        weights.append(convs[0].weight)
    return weights


def cache_states(cache: Any, layer_types: list[str]) -> list[LayerState]:
    """The tensors of a filled transformers ``DynamicCache``, in :class:`DecodeStep`'s order."""
    states = []
    for layer, layer_type in zip(cache.layers, layer_types):
        if _is_linear(layer_type):
            states.append((layer.conv_states[0], layer.recurrent_states[0]))
        else:
            states.append((layer.keys, layer.values))
    return states


class DecodeStep(torch.nn.Module):
    """``forward(input_ids [B, T], states, attention_mask [B, L + T] or None) -> (logits
    [B, T, vocab], new_states)`` for a transformers hybrid causal LM
    (``KimiLinearForCausalLM``, ``Qwen3_5ForCausalLM``, ...); ``states`` as returned by
    :func:`cache_states` (L: the cached length); ``attention_mask`` the 0/1 padding mask of
    every cached and new token, as ``generate()`` passes it (a left-padded prompt's padded
    positions stay masked in the full-attention layers)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model
        self.layer_types = layer_types(model)

    def forward(
        self,
        input_ids: Tensor,
        states: list[LayerState],
        attention_mask: Optional[Tensor] = None,
    ) -> tuple[Tensor, list]:
        if len(states) != len(self.layer_types):
            raise ValueError(
                f"DecodeStep: expected {len(self.layer_types)} layer states, got {len(states)}"
            )
        if attention_mask is not None and attention_mask.dim() != 2:
            raise ValueError(
                "DecodeStep: `attention_mask` must be [B, cached + new tokens], got "
                f"{tuple(attention_mask.shape)}"
            )
        return _step_from_states(self.model, self.layer_types, input_ids, states, attention_mask)


def _step_from_states(
    model: torch.nn.Module,
    layer_types: list[str],
    input_ids: Tensor,
    states: list[LayerState],
    attention_mask: Optional[Tensor],
    position_ids: Optional[Tensor] = None,
) -> tuple[Tensor, list[LayerState]]:
    """The model on ``input_ids`` from a fresh cache filled with ``states`` (the cache
    copies them: no input is mutated); the logits and the cache's new states."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    for index, ((first, second), layer_type) in enumerate(zip(states, layer_types)):
        if _is_linear(layer_type):
            cache.update_conv_state(first, index)
            cache.update_recurrent_state(second, index)
        else:
            cache.update(first, second, index)
    logits = model(
        input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        cache=cache,
        use_cache=True,
    ).logits
    return logits, cache_states(cache, layer_types)


class PrefillStep(torch.nn.Module):
    """``forward(input_ids [B, T], attention_mask [B, T] or None) -> (logits [B, T, vocab],
    states)`` for a transformers hybrid causal LM from no state: the prompt's logits and
    every layer's state after it, in :func:`cache_states` order (what :class:`DecodeStep`
    takes). ``attention_mask`` is transformers' ``[B, T]`` 0/1 padding mask (left padding
    for hybrid models: linear-attention layers zero the padded tokens). Export with T >= 2
    (module docstring)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model
        self.layer_types = layer_types(model)
        _conv_weights(model, self.layer_types)  # the model has the layout we seed

    def forward(
        self, input_ids: Tensor, attention_mask: Optional[Tensor] = None
    ) -> tuple[Tensor, list]:
        from transformers import DynamicCache

        if input_ids.dim() != 2:
            raise ValueError(f"PrefillStep: `input_ids` must be [B, T], got {input_ids.shape}")
        if attention_mask is not None and attention_mask.shape != input_ids.shape:
            raise ValueError(
                f"PrefillStep: `attention_mask` {tuple(attention_mask.shape)} must match "
                f"`input_ids` {tuple(input_ids.shape)}"
            )
        batch = input_ids.shape[0]
        cache = DynamicCache(config=self.model.config)
        weights = iter(_conv_weights(self.model, self.layer_types))
        for index, layer_type in enumerate(self.layer_types):
            if _is_linear(layer_type):
                weight = next(weights)
                zeros = weight.new_zeros(batch, weight.shape[0], weight.shape[-1])
                cache.update_conv_state(zeros, index)
        logits = self.model(
            input_ids, attention_mask=attention_mask, cache=cache, use_cache=True
        ).logits
        return logits, cache_states(cache, self.layer_types)


class FlatStateStep(torch.nn.Module):
    """A prefill or decode step with every state a fixed-shape tensor, ``forward(input_ids
    [B, T], *states) -> (logits [B, T, vocab], *new_states)``: the calling convention of
    ``examples/aoti_runner/`` (and of ``lowering.export``'s steps), which starts from zero
    states of the shapes :func:`flat_state_specs` lists and feeds each step's states to the
    next.

    ``states``, flat: per layer ``conv_state [B, D, W]`` and ``recurrent_state [B, HV, K,
    V]`` (linear attention) or ``keys [B, heads, max_length, dk]`` and ``values [B, heads,
    max_length, dv]`` (full attention, fixed-size buffers), then ``length [B]`` (int64,
    the tokens cached so far). Only the first ``length`` positions of a KV buffer are
    keys; a decode step (T = 1) attends to them through a padding mask, appends its token's
    key and value at position ``length`` and returns ``length + 1``. The prefill starts
    from no state whatever it is given (its states are there for the runner's convention)
    and takes 2 <= T <= ``max_length`` tokens per sequence, with no padding. Prompt plus
    generated tokens must not exceed ``max_length``: eagerly a longer run raises; a
    compiled step cannot check its data, so the runner checks it (the package metadata
    holds ``max_length``). Not for a model whose attention selects keys without the padding
    mask (GLM5-next's sparse indexer): a ``ValueError`` says so."""

    def __init__(self, model: torch.nn.Module, step: str, max_length: int) -> None:
        super().__init__()
        if step not in ("prefill", "decode"):
            raise ValueError(f"FlatStateStep: `step` must be 'prefill' or 'decode', got {step!r}")
        if max_length < 2:
            raise ValueError(f"FlatStateStep: `max_length` must be >= 2, got {max_length}")
        text_config = model.config.get_text_config()
        if getattr(text_config, "index_topk", None) is not None:
            # GLM5-next: its indexer picks the top keys of the whole buffer, padding included.
            raise ValueError(
                f"FlatStateStep: {text_config.model_type}'s sparse attention selects its keys "
                "without the padding mask, so fixed-size KV buffers would change its output; "
                "export its PrefillStep / DecodeStep, whose KV caches grow"
            )
        self.model = model
        self.step = step
        self.max_length = max_length
        self.layer_types = layer_types(model)
        self.prefill = PrefillStep(model)

    def forward(self, input_ids: Tensor, *states: Tensor) -> tuple[Tensor, ...]:
        expected = 2 * len(self.layer_types) + 1
        if len(states) != expected:
            raise ValueError(f"FlatStateStep: expected {expected} states, got {len(states)}")
        if input_ids.dim() != 2:
            raise ValueError(f"FlatStateStep: `input_ids` must be [B, T], got {input_ids.shape}")
        if self.step == "prefill":
            return self._prefill(input_ids)
        return self._decode(input_ids, states)

    def _prefill(self, input_ids: Tensor) -> tuple[Tensor, ...]:
        batch, length = input_ids.shape
        if not torch.compiler.is_compiling() and length > self.max_length:
            raise ValueError(
                f"FlatStateStep: the prompt has {length} tokens, more than `max_length` "
                f"{self.max_length}"
            )
        logits, layers = self.prefill(input_ids)
        flat = []
        for (first, second), layer_type in zip(layers, self.layer_types):
            if not _is_linear(layer_type):  # the prompt's keys and values fill the buffer's start
                # (a scatter into a static buffer: padding by max_length - T would guard on T)
                first, second = (
                    torch.slice_scatter(
                        t.new_zeros(batch, t.shape[1], self.max_length, t.shape[3]), t, dim=2,
                        start=0, end=length,
                    )
                    for t in (first, second)
                )  # fmt: skip
            flat += [first, second]
        # Every row holds T tokens (no padding); summing ones keeps T symbolic in export.
        return (logits, *flat, torch.ones_like(input_ids).sum(dim=1))

    def _decode(self, input_ids: Tensor, states: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
        if input_ids.shape[1] != 1:
            raise ValueError(
                f"FlatStateStep: a decode step takes one token per sequence, got {input_ids.shape}"
            )
        length = states[-1]
        if not torch.compiler.is_compiling() and bool((length >= self.max_length).any()):
            raise ValueError(
                f"FlatStateStep: the cache holds `max_length` {self.max_length} tokens already"
            )
        slots = torch.arange(self.max_length, device=input_ids.device)
        # The buffer's first `length` positions are keys, the rest masked; the token itself
        # (appended after the buffer by the cache) is always seen.
        mask = torch.cat(
            [(slots < length[:, None]).to(input_ids.dtype), torch.ones_like(input_ids)], dim=1
        )
        layers = [(states[i], states[i + 1]) for i in range(0, len(states) - 1, 2)]
        logits, new_layers = _step_from_states(
            self.model, self.layer_types, input_ids, layers, mask, position_ids=length[:, None]
        )
        written = (slots == length[:, None])[:, None, :, None]  # [B, 1, max_length, 1]
        flat = []
        for (first, second), layer_type in zip(new_layers, self.layer_types):
            if not _is_linear(layer_type):  # move the appended token to its slot
                first, second = (
                    torch.where(written, t[:, :, self.max_length :], t[:, :, : self.max_length])
                    for t in (first, second)
                )
            flat += [first, second]
        return (logits, *flat, length + 1)


def flat_state_specs(model: torch.nn.Module, max_length: int) -> list[tuple[torch.dtype, list]]:
    """Each :class:`FlatStateStep` state's dtype and shape without the batch dim, in order
    (the shapes of a prefill of one 2-token prompt, run eagerly: they do not depend on
    the prompt)."""
    with torch.no_grad():
        device = next(model.parameters()).device
        prompt = torch.full((1, 2), 3, dtype=torch.long, device=device)
        step = FlatStateStep(model, "prefill", max_length)
        _, *states = step(prompt, *[prompt.new_zeros(1)] * (2 * len(step.layer_types) + 1))
    return [(state.dtype, list(state.shape[1:])) for state in states]


def export_flat_state_step(
    model: torch.nn.Module, step: str, max_length: int, max_batch: int = 64
) -> torch.export.ExportedProgram:
    """``torch.export`` of :class:`FlatStateStep`, dynamic batch (1..``max_batch``) and, for
    the prefill, prompt length (2..``max_length``); traced at B = 2."""
    module = FlatStateStep(model, step, max_length)
    device = next(model.parameters()).device
    batch = torch.export.Dim("batch", min=1, max=max_batch)
    length = 3 if step == "prefill" else 1
    input_ids = torch.full((2, length), 3, dtype=torch.long, device=device)
    states = [
        torch.zeros(2, *shape, dtype=dtype, device=device)
        for dtype, shape in flat_state_specs(model, max_length)
    ]
    if step == "decode":
        states[-1] = torch.full_like(states[-1], 3)  # three tokens cached
    ids_dims = {0: batch}
    if step == "prefill":
        ids_dims[1] = torch.export.Dim("length", min=2, max=max_length)
    dynamic = {"input_ids": ids_dims, "states": ({0: batch},) * len(states)}
    return torch.export.export(module, (input_ids, *states), dynamic_shapes=dynamic)


def package_flat_state_steps(
    model: torch.nn.Module, directory: Union[str, PathLike], max_length: int
) -> dict[str, str]:
    """AOTInductor packages ``directory/prefill.pt2`` and ``decode.pt2`` of the model's
    :class:`FlatStateStep` steps (``lowering.aoti.package``), the runner's metadata in each:
    the state specs (``float32 8 4`` lines), ``max_length``. Returns the paths by step."""
    from lowering import aoti

    folder = Path(directory)
    folder.mkdir(parents=True, exist_ok=True)
    specs = "\n".join(
        " ".join([str(dtype).removeprefix("torch."), *map(str, shape)])
        for dtype, shape in flat_state_specs(model, max_length)
    )
    metadata = {aoti.STATE_SPECS_KEY: specs, MAX_LENGTH_KEY: str(max_length)}
    return {
        step: aoti.package(
            export_flat_state_step(model, step, max_length), folder / f"{step}.pt2", metadata
        )
        for step in ("prefill", "decode")
    }


# The package metadata key of FlatStateStep's max_length, read by the C++ runner.
MAX_LENGTH_KEY = "kda.max_length"
