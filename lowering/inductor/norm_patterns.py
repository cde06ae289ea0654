"""The gated RMSNorm from one description, :func:`gated_rms_norm`, parametrised by
spelling, and its replacement by ``kda::gated_rms_norm``.

A spelling (:class:`NormSpelling`) is a choice on each axis where models differ in a way
the :mod:`~lowering.inductor.canonical` rewrites cannot remove (they differ in rounding):

- the inverse root: ``x * rsqrt(var + eps)``, ``x * (1 / sqrt(var + eps))`` (FLA's
  ``rms_norm_ref``), or ``x / sqrt(var + eps)``;
- the weight: on the float32 normed x (``normed * weight.float()``: kda's example, Kimi
  Linear's and GLM5-next's modules, FLA), or on the normed x rounded to x's dtype first
  (``weight * normed.to(x.dtype)``: Qwen3-Next's module);
- the gate: ``sigmoid(gate)``, ``F.silu(gate)``, or ``gate * sigmoid(gate)`` (SiLU by hand).

The canonical rewrites make the rest one graph: ``pow(2)`` / ``square()`` / ``x * x``,
``mean(-1)`` / ``mean(dim=D - 1)``, either operand order of every product, the gate's
factors in either order; eps (``self.variance_epsilon``, ``self.eps``, an argument) is a
literal in the graph, matched as a wildcard (``scalar_workaround``). Each spelling is
registered for x float32 / bfloat16 / float16 and the weight in x's dtype or float32.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor
from torch._inductor.pattern_matcher import Match

import kda_ops  # noqa: F401  (registers torch.ops.kda)
from lowering.inductor.base import Replacement

aten = torch.ops.aten
CONVERT = torch.ops.prims.convert_element_type.default
EXAMPLE_EPS = 1e-6  # traced in place of eps, then matched as a wildcard (scalar_workaround)

NormFn = Callable[[Tensor, Tensor, Tensor, float], Tensor]

ROOTS = ("rsqrt", "reciprocal", "divide")
WEIGHTS = ("fp32", "rounded")
# gate spelling -> (the function, the fused op's activation)
GATES: dict[str, tuple[Callable[[Tensor], Tensor], str]] = {
    "sigmoid": (torch.sigmoid, "sigmoid"),
    "silu": (F.silu, "silu"),
    "x*sigmoid": (lambda g: g * torch.sigmoid(g), "silu"),
}
ROOT_OPS = {
    "rsqrt": {aten.rsqrt.default},
    "reciprocal": {aten.reciprocal.default},
    "divide": {aten.sqrt.default, aten.div.Tensor},
}
GATE_OPS = {
    "sigmoid": aten.sigmoid.default,
    "silu": aten.exp.default,
    "x*sigmoid": aten.sigmoid.default,
}
# (x dtype, weight dtype) traced; float16 traces as bfloat16 does (dtypes are wildcards in
# the first match, and the match is traced again in the model's dtypes)
EXAMPLE_DTYPES = (
    (torch.float32, torch.float32),
    (torch.bfloat16, torch.bfloat16),
    (torch.bfloat16, torch.float32),
)
# the spellings of known modules, for the log
KNOWN = {
    ("rsqrt", "rounded"): "Qwen3NextRMSNormGated",
    ("rsqrt", "fp32"): "KimiLinearRMSNormGated / Glm5NextTextRMSNormGated / kda's example",
    ("reciprocal", "fp32"): "FLA rms_norm_ref",
}


@dataclass(frozen=True)
class NormSpelling:
    """One spelling of the gated RMSNorm (module doc): ``root`` in :data:`ROOTS`,
    ``weight`` in :data:`WEIGHTS`, ``gate`` in :data:`GATES`."""

    root: str
    weight: str
    gate: str

    @property
    def activation(self) -> str:
        return GATES[self.gate][1]

    def words(self) -> str:
        known = KNOWN.get((self.root, self.weight))
        return (
            f"gated RMSNorm ({self.root}, weight on {self.weight} normed x, {self.gate} "
            f"gate{f': {known}' if known else ''})"
        )

    def needs(self, dtype: torch.dtype) -> frozenset[object]:
        """Ops every graph of this spelling calls (after the decompositions)."""
        ops = {aten.mean.dim, GATE_OPS[self.gate], *ROOT_OPS[self.root]}
        return frozenset(ops | ({CONVERT} if dtype != torch.float32 else set()))


def gated_rms_norm(spelling: NormSpelling) -> NormFn:
    """The search function of one spelling: x, gate ``[..., D]``, weight ``[D]``, eps ->
    ``[..., D]`` in x's dtype, computed in float32."""
    act = GATES[spelling.gate][0]

    def search(x: Tensor, gate: Tensor, weight: Tensor, eps: float) -> Tensor:
        xf = x.float()
        variance = (xf * xf).mean(-1, keepdim=True)
        if spelling.root == "rsqrt":
            normed = xf * torch.rsqrt(variance + eps)
        elif spelling.root == "reciprocal":
            normed = xf * (1 / torch.sqrt(variance + eps))
        else:
            normed = xf / torch.sqrt(variance + eps)
        if spelling.weight == "fp32":
            h = normed * weight.float()
        else:
            h = normed.to(x.dtype) * weight
        return (h * act(gate.float())).to(x.dtype)

    return search


def fused_norm(activation: str) -> NormFn:
    def replace(x: Tensor, gate: Tensor, weight: Tensor, eps: float) -> Tensor:
        return torch.ops.kda.gated_rms_norm.default(x, gate, weight, eps, activation)

    return replace


def norm_args_fit(match: Match) -> bool:
    """x, gate ``[..., D]`` of one shape and dtype, weight ``[D]``."""
    vals = [match.kwargs[name].meta.get("val") for name in ("x", "gate", "weight")]
    if any(v is None for v in vals):
        return False
    x, gate, weight = vals
    if x.dim() < 1 or gate.shape != x.shape or gate.dtype != x.dtype:
        return False
    return weight.dim() == 1 and weight.shape[0] == x.shape[-1]


def spellings() -> Iterator[NormSpelling]:
    for root, weight, gate in itertools.product(ROOTS, WEIGHTS, GATES):
        yield NormSpelling(root, weight, gate)


def norm_replacements() -> Iterator[Replacement]:
    """Every spelling, for every traced (x dtype, weight dtype)."""
    for spelling in spellings():
        for dtype, weight_dtype in EXAMPLE_DTYPES:
            example = [
                torch.empty(2, 8, dtype=dtype),
                torch.empty(2, 8, dtype=dtype),
                torch.empty(8, dtype=weight_dtype),
                EXAMPLE_EPS,
            ]
            search, replace = gated_rms_norm(spelling), fused_norm(spelling.activation)
            yield Replacement(
                words=spelling.words(),
                search=search,
                replace=replace,
                example=example,
                needs=spelling.needs(dtype),
            )
