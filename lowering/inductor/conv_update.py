"""The decode-time causal-conv1d state update written as plain torch ops -> the in-place
``kda::causal_conv1d_update_`` through ``auto_functionalized``.

Matches, for x ``[B, D]``, conv_state ``[B, D, W - 1]``, weight ``[D, W]`` (float32 /
bfloat16 / float16, all one dtype)::

    window = torch.cat([conv_state, x.unsqueeze(-1)], dim=-1)
    y = F.silu((window.float() * weight.float()).sum(-1)).to(x.dtype)
    new_state = window[..., 1:]

When the model writes ``new_state`` back (``conv_state.copy_(new_state)``, which
functionalization turns into ``copy_(conv_state, aten.copy(conv_state, new_state))`` because
the slice's strides differ from the state's), the pass also drops that intermediate
``aten.copy``, so Inductor's re-inplacing pass turns the ``auto_functionalized`` node into the
in-place op on the state itself: no window tensor, no state copy. Without the write-back it
clones the (small) state.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torch._higher_order_ops.auto_functionalize import auto_functionalized
from torch._inductor.pattern_matcher import PatternMatcherPass, fwd_only, register_replacement

import kda_ops  # noqa: F401  (registers torch.ops.kda)
from lowering.inductor.base import PatternPass
from lowering.inductor.conv_patterns import drop_write_back_copies

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
INPLACE = torch.ops.kda.causal_conv1d_update_.default


def search(x: Tensor, conv_state: Tensor, weight: Tensor) -> tuple[Tensor, Tensor]:
    window = torch.cat([conv_state, x.unsqueeze(-1)], dim=-1)
    y = F.silu((window.float() * weight.float()).sum(-1)).to(x.dtype)
    return y, window[..., 1:]


def replace(x: Tensor, conv_state: Tensor, weight: Tensor) -> tuple[Tensor, Tensor]:
    y, new_state = auto_functionalized(
        INPLACE, x=x.unsqueeze(1), conv_state=conv_state,
        weight=weight, bias=None, state_indices=None, activation="silu",
    )  # fmt: skip
    return y.squeeze(1), new_state


class ConvUpdatePass(PatternPass):
    """Replaces the plain-op conv decode step (see module doc) with the in-place kda op."""

    name = "conv_update"

    def register(self, patterns: PatternMatcherPass) -> None:
        for dtype in DTYPES:
            example = [torch.empty(2, 8, dtype=dtype), torch.empty(2, 8, 3, dtype=dtype),
                       torch.empty(8, 4, dtype=dtype)]  # fmt: skip
            register_replacement(search, replace, example, fwd_only, patterns, skip_duplicates=True)

    def apply(self, graph: torch.fx.Graph) -> int:
        count = super().apply(graph)
        if count:
            drop_write_back_copies(graph)
        return count
