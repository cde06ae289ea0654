"""What the gated-RMSNorm formulation passes share: the replacement by
``kda::gated_rms_norm``, the argument checks, and registration over every activation and
(x dtype, weight dtype) pair, eps matched as a wildcard (a module attribute such as
``self.variance_epsilon`` is burned into the graph as a literal)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor
from torch._inductor.pattern_matcher import (
    Match,
    PatternMatcherPass,
    fwd_only,
    register_replacement,
)

import kda_ops  # noqa: F401  (registers torch.ops.kda)
from lowering.inductor.base import KDAInductorPass, PatternPass, source_hash

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
ACTIVATIONS: dict[str, Callable[[Tensor], Tensor]] = {"sigmoid": torch.sigmoid, "silu": F.silu}
EXAMPLE_EPS = 1e-6  # traced in place of eps, then matched as a wildcard (scalar_workaround)
WEIGHT_DTYPES = ("activation", torch.float32)  # the weight in x's dtype, or kept in fp32

NormFn = Callable[[Tensor, Tensor, Tensor, float], Tensor]


def norm_args_fit(match: Match) -> bool:
    """x, gate ``[..., D]`` of one shape and dtype, weight ``[D]``."""
    vals = [match.kwargs[name].meta.get("val") for name in ("x", "gate", "weight")]
    if any(v is None for v in vals):
        return False
    x, gate, weight = vals
    if x.dim() < 1 or gate.shape != x.shape or gate.dtype != x.dtype:
        return False
    return weight.dim() == 1 and weight.shape[0] == x.shape[-1]


def _replace(activation: str) -> NormFn:
    def replace(x: Tensor, gate: Tensor, weight: Tensor, eps: float) -> Tensor:
        return torch.ops.kda.gated_rms_norm.default(x, gate, weight, eps, activation)

    return replace


class NormFormulationPass(PatternPass):
    """Formulations of the gated RMSNorm, each over :data:`DTYPES` x :data:`WEIGHT_DTYPES`
    x :data:`ACTIVATIONS`. Subclasses give :meth:`formulations`: the log's words and a
    search function per activation, and may rename a formulation per dtype in
    :meth:`label` (where formulations trace to one graph, the first registered wins)."""

    def formulations(self) -> dict[str, Callable[[Callable[[Tensor], Tensor]], NormFn]]:
        raise NotImplementedError

    def label(self, formulation: str, dtype: torch.dtype, weight_dtype: torch.dtype) -> str:
        return formulation

    def uuid(self) -> str:
        """Hash of the formulation's file, this shared one and the base."""
        return source_hash(type(self), NormFormulationPass, KDAInductorPass)

    def register(self, patterns: PatternMatcherPass) -> None:
        for formulation, search in self.formulations().items():
            for dtype in DTYPES:
                x, gate = torch.empty(2, 8, dtype=dtype), torch.empty(2, 8, dtype=dtype)
                for weight_dtype in WEIGHT_DTYPES:
                    weight = torch.empty(
                        8, dtype=dtype if weight_dtype == "activation" else weight_dtype
                    )
                    for activation, act in ACTIVATIONS.items():
                        words = self.label(formulation, dtype, weight.dtype)
                        words = f"{words} ({activation}, x {dtype}, weight {weight.dtype})"
                        register_replacement(
                            search(act), _replace(activation), [x, gate, weight, EXAMPLE_EPS],
                            fwd_only, patterns, extra_check=self.logged(words, norm_args_fit),
                            scalar_workaround={"eps": EXAMPLE_EPS}, skip_duplicates=True,
                        )  # fmt: skip
