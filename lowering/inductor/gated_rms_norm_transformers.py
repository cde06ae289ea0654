"""transformers' gated RMSNorm modules -> ``kda::gated_rms_norm``.

``Qwen3NextRMSNormGated.forward`` (silu gate)::

    input_dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
    h = self.weight * h.to(input_dtype)          # the normed x rounded to x's dtype first
    h = h * F.silu(gate.to(torch.float32))
    return h.to(input_dtype)

``KimiLinearRMSNormGated.forward`` and ``Glm5NextTextRMSNormGated.forward`` (the same
code, "strict fp32 norm"; sigmoid gate)::

    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
    h = self.weight.to(torch.float32) * h
    h = h * torch.sigmoid(gate.to(torch.float32))
    return h.to(input_dtype)

each with either gate activation, x and gate ``[..., D]`` float32 / bfloat16 / float16,
weight ``[D]`` in x's dtype or float32, eps the module's attribute. For float32 x every
cast is a no-op and the two are one graph. The fused op computes in float32 and rounds
once, so for 16-bit x it differs from Qwen3-Next's by the rounding of the normed x
(within the dtype's precision).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from lowering.inductor.norm_patterns import NormFn, NormFormulationPass

QWEN3_NEXT = "Qwen3NextRMSNormGated"
KIMI = "KimiLinearRMSNormGated / Glm5NextTextRMSNormGated"


def qwen3_next(act: Callable[[Tensor], Tensor]) -> NormFn:
    def search(x: Tensor, gate: Tensor, weight: Tensor, eps: float) -> Tensor:
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        h = weight * h.to(x.dtype)
        h = h * act(gate.to(torch.float32))
        return h.to(x.dtype)

    return search


def kimi(act: Callable[[Tensor], Tensor]) -> NormFn:
    def search(x: Tensor, gate: Tensor, weight: Tensor, eps: float) -> Tensor:
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        h = weight.to(torch.float32) * h
        h = h * act(gate.to(torch.float32))
        return h.to(x.dtype)

    return search


class GatedRMSNormTransformersPass(NormFormulationPass):
    """transformers' gated norms (see module doc)."""

    name = "gated_rms_norm_transformers"

    def formulations(self) -> dict[str, Callable[[Callable[[Tensor], Tensor]], NormFn]]:
        return {QWEN3_NEXT: qwen3_next, KIMI: kimi}

    def label(self, formulation: str, dtype: torch.dtype, weight_dtype: torch.dtype) -> str:
        if dtype == weight_dtype == torch.float32:
            return f"{QWEN3_NEXT} = {KIMI} (one graph in fp32)"
        return formulation
