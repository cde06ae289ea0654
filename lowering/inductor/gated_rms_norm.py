"""The gated RMSNorm, every spelling -> ``kda::gated_rms_norm``.

Matches ``(x * rsqrt(mean(x², -1, keepdim) + eps) * weight * act(gate)).to(x.dtype)``
computed in float32, in each spelling of
:func:`~lowering.inductor.norm_patterns.gated_rms_norm`: kda's example
(``examples/hybrid_model.py``), transformers' ``Qwen3NextRMSNormGated``,
``KimiLinearRMSNormGated`` and ``Glm5NextTextRMSNormGated``, FLA's (and Mamba2's)
``rms_norm_ref`` (norm before gate, no bias, one group), and the equivalent hand-written
forms (``1 / sqrt`` or ``rsqrt``, ``pow(2)`` or ``x * x``, ``gate * sigmoid(gate)`` or
``F.silu(gate)``); act = sigmoid (Kimi) or silu (Qwen3-Next); x and gate ``[..., D]``
float32 / bfloat16 / float16, weight ``[D]`` in x's dtype or float32, any eps.

The fused op computes in float32 and rounds once, so for 16-bit x it differs from
Qwen3-Next's (which rounds the normed x to x's dtype before the weight) by that rounding
(within the dtype's precision).
"""

from __future__ import annotations

from collections.abc import Iterator

from torch._inductor.pattern_matcher import Match

from lowering.inductor import canonical, norm_patterns
from lowering.inductor.base import KDAInductorPass, Replacement, ReplacementPass, source_hash
from lowering.inductor.norm_patterns import EXAMPLE_EPS, norm_args_fit, norm_replacements


class GatedRMSNormPass(ReplacementPass):
    """Replaces every spelling of the gated RMSNorm (see module doc) with the fused op."""

    name = "gated_rms_norm"

    def __init__(self) -> None:
        super().__init__()
        self.scalar_workaround = {"eps": EXAMPLE_EPS}

    def replacements(self) -> Iterator[Replacement]:
        return norm_replacements()

    def check(self, match: Match) -> bool:
        return norm_args_fit(match)

    def uuid(self) -> str:
        """Hash of this file, the description, the canonical form and the base."""
        return source_hash(type(self), norm_patterns, canonical, KDAInductorPass)
