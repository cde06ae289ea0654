"""Gated RMSNorm written as plain torch ops -> ``kda::gated_rms_norm``.

Matches ``(x * rsqrt(mean(x², -1, keepdim) + eps) * weight * act(gate)).to(x.dtype)``
computed in float32 (x, gate and weight upcast with ``.float()``), with act = sigmoid
(Kimi) or silu (Qwen3-Next), for float32 / bfloat16 / float16 inputs and any eps.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor
from torch._inductor.pattern_matcher import PatternMatcherPass, fwd_only, register_replacement

import kda_ops  # noqa: F401  (registers torch.ops.kda)
from lowering.inductor.base import PatternPass

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
ACTIVATIONS: dict[str, Callable[[Tensor], Tensor]] = {"sigmoid": torch.sigmoid, "silu": F.silu}
EXAMPLE_EPS = 1e-6  # traced in place of eps, then matched as a wildcard (scalar_workaround)


def _search(activation: str) -> Callable[..., Tensor]:
    act = ACTIVATIONS[activation]

    def search(x: Tensor, gate: Tensor, weight: Tensor, eps: float) -> Tensor:
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        return (normed * weight.float() * act(gate.float())).to(x.dtype)

    return search


def _replace(activation: str) -> Callable[..., Tensor]:
    def replace(x: Tensor, gate: Tensor, weight: Tensor, eps: float) -> Tensor:
        return torch.ops.kda.gated_rms_norm.default(x, gate, weight, eps, activation)

    return replace


class GatedRMSNormPass(PatternPass):
    """Replaces every plain-op gated RMSNorm (see module doc) with the fused op."""

    name = "gated_rms_norm"

    def register(self, patterns: PatternMatcherPass) -> None:
        for dtype in DTYPES:
            x, gate = torch.empty(2, 8, dtype=dtype), torch.empty(2, 8, dtype=dtype)
            weight = torch.empty(8, dtype=dtype)
            for activation in ACTIVATIONS:
                register_replacement(
                    _search(activation), _replace(activation), [x, gate, weight, EXAMPLE_EPS],
                    fwd_only, patterns, scalar_workaround={"eps": EXAMPLE_EPS},
                    skip_duplicates=True,
                )  # fmt: skip
