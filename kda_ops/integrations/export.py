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

from typing import Any, Optional

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
        from transformers import DynamicCache

        if len(states) != len(self.layer_types):
            raise ValueError(
                f"DecodeStep: expected {len(self.layer_types)} layer states, got {len(states)}"
            )
        if attention_mask is not None and attention_mask.dim() != 2:
            raise ValueError(
                "DecodeStep: `attention_mask` must be [B, cached + new tokens], got "
                f"{tuple(attention_mask.shape)}"
            )
        cache = DynamicCache(config=self.model.config)
        for index, ((first, second), layer_type) in enumerate(zip(states, self.layer_types)):
            if _is_linear(layer_type):
                cache.update_conv_state(first, index)
                cache.update_recurrent_state(second, index)
            else:
                cache.update(first, second, index)
        logits = self.model(
            input_ids, attention_mask=attention_mask, cache=cache, use_cache=True
        ).logits
        return logits, cache_states(cache, self.layer_types)


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
