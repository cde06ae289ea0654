"""A transformers decode step with every cache state as an explicit input and output, for
``torch.export`` (with :func:`kda_ops.integrations.enable` on).

transformers keeps hybrid-model state in a ``DynamicCache`` that the model mutates in place
(``conv_state.copy_``, ``recurrent_states[...].copy_``, KV ``torch.cat``). Exported as is, the
cache is a Python object, not graph I/O. :class:`DecodeStep` takes the states as tensors,
builds a fresh cache from them inside the traced function (the cache copies them, so no
input is mutated), runs the model and returns the logits and the new states: per layer
``(conv_state [B, D, W], recurrent_state [B, HV, K, V])`` for linear attention and
``(keys, values)`` (``[B, heads, L, d]``, L grows by the step's tokens) for full attention.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

LayerState = tuple[Tensor, Tensor]


def _is_linear(layer_type: str) -> bool:
    return layer_type == "linear_attention"


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
    """``forward(input_ids [B, T], states) -> (logits [B, T, vocab], new_states)`` for a
    transformers hybrid causal LM (``KimiLinearForCausalLM``, ``Qwen3NextForCausalLM``);
    ``states`` as returned by :func:`cache_states`."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model
        self.layer_types = list(model.config.layer_types)

    def forward(self, input_ids: Tensor, states: list[LayerState]) -> tuple[Tensor, list]:
        from transformers import DynamicCache

        if len(states) != len(self.layer_types):
            raise ValueError(
                f"DecodeStep: expected {len(self.layer_types)} layer states, got {len(states)}"
            )
        cache = DynamicCache(config=self.model.config)
        for index, ((first, second), layer_type) in enumerate(zip(states, self.layer_types)):
            if _is_linear(layer_type):
                cache.update_conv_state(first, index)
                cache.update_recurrent_state(second, index)
            else:
                cache.update(first, second, index)
        logits = self.model(input_ids, cache=cache, use_cache=True).logits
        return logits, cache_states(cache, self.layer_types)
