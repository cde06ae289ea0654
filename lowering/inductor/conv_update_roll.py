"""The Mamba / causal-conv1d reference decode update (``causal_conv1d_update_ref``,
Mamba's ``step``) -> in-place ``kda::causal_conv1d_update_``.

Matches, for x ``[B, D]``, conv_state ``[B, D, W]``, weight ``[D, W]``, optional bias
``[D]`` (float32 / bfloat16 / float16, all one dtype)::

    conv_state.copy_(torch.roll(conv_state, shifts=-1, dims=-1))
    conv_state[:, :, -1] = x
    y = torch.sum(conv_state * weight, dim=-1) + bias   # or without bias
    y = F.silu(y)                                       # or no activation

which functionalization writes as a roll (an index by ``(i + 1) % W``), a select_scatter
of x into its last column, and the weighted sum of that. The op advances the W-column
state in place in its layout: no rolled copy, no scatter.
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


class ConvUpdateRollPass(ConvFormulationPass):
    """The roll-and-assign formulation (see module doc)."""

    name = "conv_update_roll"
    formulation = "Mamba roll-and-assign conv update"
    channels_dim = 1

    def search(self, bias: bool, activation: str) -> SearchFn:
        act = ACTIVATIONS[activation]

        def search(x: Tensor, conv_state: Tensor, weight: Tensor, *rest: Tensor):
            rolled = torch.roll(conv_state, shifts=-1, dims=-1)
            last = torch.ops.aten.copy.default(rolled.select(2, -1), x)
            new_state = torch.select_scatter(rolled, last, 2, -1)
            y = torch.sum(new_state * weight, dim=-1)
            return act(y + rest[0] if rest else y), new_state

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
