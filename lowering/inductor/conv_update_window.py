"""The decode conv update on a whole-window state -> in-place ``kda::causal_conv1d_update_``.

Matches, for x ``[B, D]``, conv_state ``[B, D, W]`` (the window itself: the last W inputs),
weight ``[D, W]``, optional bias ``[D]`` (float32 / bfloat16 / float16, all one dtype)::

    window = torch.cat([conv_state[..., 1:], x.unsqueeze(-1)], -1)
    y = F.silu((window * weight).sum(-1) + bias)   # or without bias / without SiLU
    conv_state.copy_(window)

The op advances the W-column state in place in its own layout (it keeps the last S >= W - 1
inputs), so the state is neither converted nor copied.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lowering.inductor.conv_patterns import (
    ACTIVATIONS,
    ConvFormulationPass,
    SearchFn,
    fused_update,
    with_signature,
)


class ConvUpdateWindowPass(ConvFormulationPass):
    """The whole-window formulation (see module doc)."""

    name = "conv_update_window"
    formulation = "whole-window conv update"
    channels_dim = 1

    def search(self, bias: bool, activation: str) -> SearchFn:
        act = ACTIVATIONS[activation]

        def search(x: Tensor, conv_state: Tensor, weight: Tensor, *rest: Tensor):
            window = torch.cat([conv_state[..., 1:], x.unsqueeze(-1)], dim=-1)
            y = (window * weight).sum(-1)
            return act(y + rest[0] if rest else y), window

        return with_signature(search, bias)

    def replace(self, bias: bool, activation: str) -> SearchFn:
        def replace(x: Tensor, conv_state: Tensor, weight: Tensor, *rest: Tensor):
            b = rest[0] if rest else None
            y, new_state = fused_update(x.unsqueeze(1), conv_state, weight, b, activation)
            return y.squeeze(1), new_state

        return with_signature(replace, bias)

    def examples(self, dtype: torch.dtype) -> list[Tensor]:
        return [torch.empty(2, 8, dtype=dtype), torch.empty(2, 8, 4, dtype=dtype),
                torch.empty(8, 4, dtype=dtype)]  # fmt: skip
