"""transformers' ``torch_causal_conv1d_update`` (Qwen3-Next, Kimi Linear, GLM5-next, ...)
-> in-place ``kda::causal_conv1d_update_``.

Matches, for x ``[B, D, T]`` (channels first, as the models' ``mixed_qkv.transpose(1, 2)``),
conv_state ``[B, D, S]`` (the cache's: S = W), weight ``[D, W]``, optional bias ``[D]``
(float32 / bfloat16 / float16, all one dtype)::

    hidden_states_new = torch.cat([conv_state, x], dim=-1).to(weight.dtype)
    conv_state.copy_(hidden_states_new[:, :, -state_len:])
    out = F.conv1d(hidden_states_new, weight.unsqueeze(1), bias, padding=0, groups=D)
    out = F.silu(out[:, :, -seq_len:])            # or ACT2FN[...], or no activation
    return out.to(x.dtype)

The op reads and writes the cache's W-column state in place in its layout: the copy of
the concatenation's tail back into the state, and the concatenation itself, are gone.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import Tensor

from lowering.inductor.base import Replacement
from lowering.inductor.conv_patterns import (
    ACTIVATIONS,
    DTYPES,
    ConvFormulationPass,
    SearchFn,
    fused_update,
    with_signature,
)

NEEDS = frozenset({torch.ops.aten.cat.default, torch.ops.aten.convolution.default})


class ConvUpdateTransformersPass(ConvFormulationPass):
    """transformers' reference conv update (see module doc)."""

    name = "conv_update_transformers"
    formulation = "transformers torch_causal_conv1d_update"
    channels_dim = 1

    def search(self, bias: bool, activation: str) -> SearchFn:
        act = ACTIVATIONS[activation]

        def search(x: Tensor, conv_state: Tensor, weight: Tensor, *rest: Tensor):
            _, channels, length = x.shape
            kept = conv_state.shape[-1]
            inputs = torch.cat([conv_state, x], dim=-1)
            b = rest[0] if rest else None
            out = F.conv1d(inputs, weight.unsqueeze(1), b, padding=0, groups=channels)
            return act(out[:, :, -length:]), inputs[:, :, -kept:]

        return with_signature(search, bias)

    def replace(self, bias: bool, activation: str) -> SearchFn:
        def replace(x: Tensor, conv_state: Tensor, weight: Tensor, *rest: Tensor):
            b = rest[0] if rest else None
            y, new_state = fused_update(
                tokens=x.transpose(1, 2),
                conv_state=conv_state,
                weight=weight,
                bias=b,
                activation=activation,
            )
            return y.transpose(1, 2), new_state

        return with_signature(replace, bias)

    def replacements(self) -> Iterator[Replacement]:
        for dtype, bias, activation in itertools.product(DTYPES, (False, True), ACTIVATIONS):
            example = [
                torch.empty(2, 8, 1, dtype=dtype),
                torch.empty(2, 8, 4, dtype=dtype),
                torch.empty(8, 4, dtype=dtype),
            ]
            example += [torch.empty(8, dtype=dtype)] if bias else []
            words = f"{self.formulation} ({'bias, ' if bias else ''}{activation})"
            yield Replacement(
                words=words,
                search=self.search(bias, activation),
                replace=self.replace(bias, activation),
                example=example,
                needs=NEEDS | self.write_back_ops(),
            )
