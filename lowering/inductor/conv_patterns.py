"""What the conv-update formulation passes share: the in-place replacement, the argument
checks, and registration over every dtype, bias and activation.

Each formulation (one module each) gives a search function per (bias, activation) and the
layout of its input x; the replacement is ``auto_functionalized(kda.causal_conv1d_update_)``
on the model's own state tensor, whatever its width S (W - 1 or W), and a match is taken
only where the model writes the new state back into that tensor, so Inductor re-inplaces
the op onto it: no window tensor, no state copy.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor
from torch._higher_order_ops.auto_functionalize import auto_functionalized
from torch._inductor.pattern_matcher import (
    Match,
    PatternMatcherPass,
    fwd_only,
    register_replacement,
    stable_topological_sort,
)

import kda_ops  # noqa: F401  (registers torch.ops.kda)
from lowering.inductor.base import KDAInductorPass, PatternPass, source_hash

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
ACTIVATIONS: dict[str, Callable[[Tensor], Tensor]] = {"silu": F.silu, "identity": lambda y: y}
INPLACE = torch.ops.kda.causal_conv1d_update_.default
WRITE_BACKS = (torch.ops.aten.copy_.default, torch.ops.aten.copy.default)

SearchFn = Callable[..., tuple[Tensor, Tensor]]


def fused_update(
    tokens: Tensor, conv_state: Tensor, weight: Tensor, bias: Optional[Tensor], activation: str
) -> tuple[Tensor, Tensor]:
    """y ``[B, T, D]`` and the updated state, from the in-place op through
    ``auto_functionalized``."""
    y, new_state = auto_functionalized(
        INPLACE, x=tokens, conv_state=conv_state, weight=weight, bias=bias,
        state_indices=None, activation=activation,
    )  # fmt: skip
    return y, new_state


def with_signature(fn: Callable[..., tuple[Tensor, Tensor]], bias: bool) -> SearchFn:
    """``fn(x, conv_state, weight, *bias)`` with the explicit signature that
    register_replacement reads the argument names from."""
    if bias:
        return lambda x, conv_state, weight, bias: fn(x, conv_state, weight, bias)
    return lambda x, conv_state, weight: fn(x, conv_state, weight)


def _val(match: Match, name: str) -> Optional[Tensor]:
    node = match.kwargs.get(name)
    return node.meta.get("val") if isinstance(node, torch.fx.Node) else None


def shapes_fit(match: Match, channels_dim: int) -> bool:
    """x ``[B, D]`` / ``[B, D, T]`` / ``[B, T, D]`` (D at ``channels_dim``), conv_state
    ``[B, D, S]`` with S >= W - 1, weight ``[D, W]``, bias ``[D]``; all one float dtype."""
    x, state, weight = _val(match, "x"), _val(match, "conv_state"), _val(match, "weight")
    bias = _val(match, "bias")
    if x is None or state is None or weight is None or ("bias" in match.kwargs and bias is None):
        return False
    tensors = [x, state, weight] + ([] if bias is None else [bias])
    if len({t.dtype for t in tensors}) != 1 or x.dtype not in DTYPES:
        return False
    if state.dim() != 3 or weight.dim() != 2 or x.dim() not in (2, 3):
        return False
    batch, channels, kept = state.shape
    if x.shape[0] != batch or x.shape[channels_dim] != channels or kept < weight.shape[1] - 1:
        return False
    if weight.shape[0] != channels or weight.shape[1] < 2:
        return False
    return bias is None or tuple(bias.shape) == (channels,)


def written_back(match: Match, new_state: torch.fx.Node) -> bool:
    """Whether the model copies ``new_state`` into the conv_state it read (directly, or
    through functionalization's ``aten.copy``), i.e. this is a state update and not just a
    weighted sum of a concatenation."""
    state = match.kwargs["conv_state"]
    return any(
        user.target in WRITE_BACKS and user.args[:2] == (state, new_state)
        for user in new_state.users
    )


def drop_write_back_copies(graph: torch.fx.Graph) -> None:
    """``aten.copy(state, new_state)`` where new_state is the updated state out of a fused
    ``auto_functionalized`` node: the values are new_state's, so use it directly (then the
    ``copy_`` into the graph input is of the re-inplaced state itself: no copy)."""
    for fused in graph.find_nodes(op="call_function", target=auto_functionalized):
        if fused.args[0] is not INPLACE:
            continue
        state = fused.kwargs["conv_state"]
        for item in [u for u in fused.users if u.target is operator.getitem and u.args[1] == 1]:
            for user in list(item.users):
                if user.target is torch.ops.aten.copy.default and user.args == (state, item):
                    user.replace_all_uses_with(item)
                    graph.erase_node(user)


class ConvFormulationPass(PatternPass):
    """One formulation of the decode conv update, every dtype, with and without bias,
    SiLU or no activation. Subclasses set ``formulation`` (the log's words),
    ``channels_dim`` (x's channel dim), :meth:`search` and :meth:`replace`, and
    :meth:`examples` (x, conv_state, weight for W = 4 in the model's layout)."""

    formulation = ""
    channels_dim = 1

    def search(self, bias: bool, activation: str) -> SearchFn:
        raise NotImplementedError

    def replace(self, bias: bool, activation: str) -> SearchFn:
        raise NotImplementedError

    def examples(self, dtype: torch.dtype) -> list[Tensor]:
        raise NotImplementedError

    def check(self, match: Match) -> bool:
        return shapes_fit(match, self.channels_dim) and written_back(match, match.output_nodes()[1])

    def uuid(self) -> str:
        """Hash of the formulation's file, this shared one and the base."""
        return source_hash(type(self), ConvFormulationPass, KDAInductorPass)

    def register(self, patterns: PatternMatcherPass) -> None:
        for dtype in DTYPES:
            for bias in (False, True):
                example = self.examples(dtype) + ([torch.empty(8, dtype=dtype)] if bias else [])
                for activation in ACTIVATIONS:
                    words = f"{self.formulation} ({'bias, ' if bias else ''}{activation})"
                    register_replacement(
                        self.search(bias, activation), self.replace(bias, activation), example,
                        fwd_only, patterns, extra_check=self.logged(words, self.check),
                        skip_duplicates=True,
                    )  # fmt: skip

    def apply(self, graph: torch.fx.Graph) -> int:
        count = super().apply(graph)
        if count:
            drop_write_back_copies(graph)
            # The replacement goes in before the match's first output (the new state),
            # which models may compute before the weight they pass (transformers'
            # ``self.conv1d.weight.squeeze(1)``): put every node after its inputs again.
            stable_topological_sort(graph)
        return count
