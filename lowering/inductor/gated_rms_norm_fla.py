"""FLA's PyTorch reference of the gated RMSNorm (``fla.modules.norm.layernorm_gated.
rms_norm_ref``, norm before gate, no bias, one group; also Mamba2's) ->
``kda::gated_rms_norm``.

Matches (silu gate; sigmoid too), x and gate ``[..., D]`` float32 / bfloat16 / float16,
weight ``[D]`` in x's dtype or float32, any eps::

    dtype = x.dtype
    weight, x, z = weight.float(), x.float(), z.float()
    rstd = 1 / torch.sqrt(x.square().mean(dim=-1, keepdim=True) + eps)
    out = x * rstd * weight
    out *= F.silu(z)
    return out.to(dtype)
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from lowering.inductor.norm_patterns import NormFn, NormFormulationPass


class GatedRMSNormFLAPass(NormFormulationPass):
    """FLA's reference gated norm (see module doc)."""

    name = "gated_rms_norm_fla"

    def formulations(self) -> dict[str, Callable[[Callable[[Tensor], Tensor]], NormFn]]:
        return {"FLA rms_norm_ref (gated)": fla_reference}


def fla_reference(act: Callable[[Tensor], Tensor]) -> NormFn:
    def search(x: Tensor, gate: Tensor, weight: Tensor, eps: float) -> Tensor:
        xf, zf = x.float(), gate.float()
        rstd = 1 / torch.sqrt(xf.square().mean(dim=-1, keepdim=True) + eps)
        out = xf * rstd * weight.float()
        out = out * act(zf)
        return out.to(x.dtype)

    return search
