"""The decode conv update (one new input column into a depthwise causal conv's state)
from one description, :func:`window_update`, parametrised by spelling, and what the
conv-update passes share: the in-place replacement, the argument checks, registration.

A spelling (:class:`ConvSpelling`) is a choice on each axis where models differ:

- the state (the pass): ``tail`` keeps the last ``W - 1`` inputs (the window is
  ``cat([state, x])``, the new state its last ``W - 1`` columns); ``cat`` and ``roll`` keep
  the whole window of W (``cat([state[..., 1:], x])``, or ``roll(state, -1)`` and the new
  input assigned to its last column);
- the new input: x ``[B, D]`` made a column with ``unsqueeze(-1)`` / ``[..., None]``, or
  x already ``[B, D, 1]``;
- the weighted sum: ``(window * weight).sum(-1)`` (any dim spelling, either operand order,
  ``torch.sum``), the same with ``keepdim=True`` (y ``[B, D, 1]``), ``einsum("bdw,dw->bd")``,
  or ``F.conv1d`` over the window with ``groups=D`` (weight ``[D, W]`` unsqueezed, or the
  ``[D, 1, W]`` of ``nn.Conv1d``; its bias inside the conv; y ``[B, D, 1]`` or squeezed);
- the precision: in x's dtype, or upcast (``window.float() * weight.float()``, y cast back);
- bias or none, SiLU or no activation.

The :mod:`~lowering.inductor.canonical` rewrites make more spellings one graph (dims,
keepdim, operand order); the axes above are the spellings that remain distinct graphs.
The replacement is ``auto_functionalized(kda.causal_conv1d_update_)`` on the model's own
state tensor, whatever its width S (W - 1 or W), so Inductor re-inplaces the op onto it:
no window tensor, no state copy.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor
from torch._higher_order_ops.auto_functionalize import auto_functionalized
from torch._inductor.pattern_matcher import (
    Match,
    stable_topological_sort,
)

import kda_ops  # noqa: F401  (registers torch.ops.kda)
from lowering.inductor import canonical
from lowering.inductor.base import KDAInductorPass, Replacement, ReplacementPass, source_hash

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
        INPLACE,
        x=tokens,
        conv_state=conv_state,
        weight=weight,
        bias=bias,
        state_indices=None,
        activation=activation,
    )
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
    ``[B, D, S]`` with S >= W - 1, weight ``[D, W]`` (or ``[D, 1, W]``), bias ``[D]``; all
    one float dtype."""
    x, state, weight = _val(match, "x"), _val(match, "conv_state"), _val(match, "weight")
    bias = _val(match, "bias")
    if x is None or state is None or weight is None or ("bias" in match.kwargs and bias is None):
        return False
    tensors = [x, state, weight] + ([] if bias is None else [bias])
    if len({t.dtype for t in tensors}) != 1 or x.dtype not in DTYPES:
        return False
    if weight.dim() == 3 and weight.shape[1] == 1:  # nn.Conv1d's depthwise [D, 1, W]
        weight = weight[:, 0]
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


aten = torch.ops.aten
CONVERT = torch.ops.prims.convert_element_type.default
SLICE_SCATTER = torch.ops.aten.slice_scatter.default


class ConvFormulationPass(ReplacementPass):
    """Formulations of the decode conv update. Subclasses set ``channels_dim`` (x's
    channel dim) and give the :meth:`replacements`."""

    formulation = ""
    channels_dim = 1
    write_back = True  # match only where the model writes the new state back

    def check(self, match: Match) -> bool:
        if not shapes_fit(match, self.channels_dim):
            return False
        return not self.write_back or written_back(match, match.output_nodes()[1])

    def write_back_ops(self) -> frozenset[object]:
        """What a graph that writes the state back calls (nothing without write-back)."""
        return frozenset(WRITE_BACKS[:1]) if self.write_back else frozenset()

    def uuid(self) -> str:
        """Hash of the formulation's file, this shared one, the canonical form, the base."""
        return source_hash(type(self), ConvFormulationPass, canonical, KDAInductorPass)

    def apply(self, graph: torch.fx.Graph) -> int:
        count = super().apply(graph)
        if count:
            drop_write_back_copies(graph)
            # The replacement goes in before the match's first output (the new state),
            # which models may compute before the weight they pass (transformers'
            # ``self.conv1d.weight.squeeze(1)``): put every node after its inputs again.
            stable_topological_sort(graph)
        return count


@dataclass(frozen=True)
class ConvSpelling:
    """One spelling of the decode conv update (module doc): ``shift`` in ``tail`` / ``cat``
    / ``roll``; ``column`` in ``unsqueeze`` / ``column``; ``reduce`` in :data:`REDUCTIONS`;
    ``upcast`` whether the weighted sum is computed in float32."""

    shift: str
    column: str
    reduce: str
    upcast: bool

    @property
    def y_column(self) -> bool:
        """Whether y is ``[B, D, 1]`` (else ``[B, D]``)."""
        return self.reduce in ("sum_keepdim", "conv1d", "conv1d_module")

    def needs(self, activation: str) -> frozenset[object]:
        """Ops every graph of this spelling calls (after the decompositions)."""
        if self.shift == "roll":
            ops = {aten.index.Tensor, aten.fmod.Scalar}
            ops.add(aten.select_scatter.default if self.column == "unsqueeze" else SLICE_SCATTER)
        else:
            ops = {aten.cat.default}
            ops |= {aten.unsqueeze.default} if self.column == "unsqueeze" else set()
        ops.add(REDUCTION_OPS[self.reduce])
        ops |= {CONVERT} if self.upcast else set()
        ops |= {aten.exp.default} if activation == "silu" else set()  # SiLU decomposed
        return frozenset(ops)

    def words(self) -> str:
        x = "x [B, D] unsqueezed" if self.column == "unsqueeze" else "x [B, D, 1]"
        precision = ", fp32" if self.upcast else ""
        return f"{self.shift} shift, {x}, {self.reduce}{precision}"


SHIFTS = ("tail", "cat", "roll")
COLUMNS = ("unsqueeze", "column")
REDUCTIONS = ("sum", "sum_keepdim", "einsum", "conv1d", "conv1d_squeezed", "conv1d_module")
REDUCTION_OPS = {
    "sum": aten.sum.dim_IntList,
    "sum_keepdim": aten.sum.dim_IntList,
    "einsum": aten.bmm.default,
    "conv1d": aten.convolution.default,
    "conv1d_squeezed": aten.convolution.default,
    "conv1d_module": aten.convolution.default,
}


def _shifted(spelling: ConvSpelling, x: Tensor, conv_state: Tensor) -> tuple[Tensor, Tensor]:
    """(the W-column window, the new state)."""
    column = x.unsqueeze(-1) if spelling.column == "unsqueeze" else x
    if spelling.shift == "tail":
        window = torch.cat([conv_state, column], dim=-1)
        return window, window[..., 1:]
    if spelling.shift == "cat":
        window = torch.cat([conv_state[..., 1:], column], dim=-1)
        return window, window
    # roll: functionalization writes ``state[:, :, -1] = x`` (``[:, :, -1:]`` for a
    # column) as a copy into that view of the rolled state, scattered back.
    rolled = torch.roll(conv_state, shifts=-1, dims=-1)
    if spelling.column == "unsqueeze":
        last = torch.ops.aten.copy.default(rolled.select(2, -1), x)
        window = torch.select_scatter(rolled, last, 2, -1)
    else:
        width = rolled.shape[-1]
        last = torch.ops.aten.copy.default(rolled[:, :, width - 1 :], x)
        window = torch.slice_scatter(rolled, last, 2, width - 1)
    return window, window


def _weighted_sum(
    spelling: ConvSpelling, window: Tensor, weight: Tensor, bias: Optional[Tensor]
) -> Tensor:
    if spelling.reduce.startswith("conv1d"):
        kernel = weight if spelling.reduce == "conv1d_module" else weight.unsqueeze(1)
        y = F.conv1d(window, kernel, bias, groups=window.shape[1])
        return y.squeeze(-1) if spelling.reduce == "conv1d_squeezed" else y
    if spelling.reduce == "einsum":
        y = torch.einsum("bdw,dw->bd", window, weight)
    else:
        y = (window * weight).sum(-1, keepdim=spelling.reduce == "sum_keepdim")
    if bias is None:
        return y
    return y + (bias.unsqueeze(-1) if spelling.y_column else bias)


def window_update(spelling: ConvSpelling, bias: bool, activation: str) -> SearchFn:
    """The search function of one spelling: ``(x, conv_state, weight[, bias]) -> (y,
    new_state)``."""
    act = ACTIVATIONS[activation]

    def search(x: Tensor, conv_state: Tensor, weight: Tensor, *rest: Tensor):
        window, new_state = _shifted(spelling, x, conv_state)
        b = rest[0] if rest else None
        if spelling.upcast:
            window, weight = window.float(), weight.float()
            b = None if b is None else b.float()
        y = act(_weighted_sum(spelling=spelling, window=window, weight=weight, bias=b))
        return (y.to(x.dtype) if spelling.upcast else y), new_state

    return with_signature(search, bias)


def fused_window_update(spelling: ConvSpelling, bias: bool, activation: str) -> SearchFn:
    """The replacement of :func:`window_update`: the fused op on the state in place."""

    def replace(x: Tensor, conv_state: Tensor, weight: Tensor, *rest: Tensor):
        tokens = x.unsqueeze(1) if spelling.column == "unsqueeze" else x.transpose(1, 2)
        kernel = weight.squeeze(1) if spelling.reduce == "conv1d_module" else weight
        b = rest[0] if rest else None
        y, new_state = fused_update(
            tokens=tokens, conv_state=conv_state, weight=kernel, bias=b, activation=activation
        )
        return (y.transpose(1, 2) if spelling.y_column else y.squeeze(1)), new_state

    return with_signature(replace, bias)


def window_example(spelling: ConvSpelling, bias: bool) -> list[Tensor]:
    """x, conv_state, weight (and bias) for W = 4, D = 8. Without upcast the traced graph
    is the same in every dtype (float32 traces it); upcast, it is the same in both 16-bit
    dtypes (bfloat16 traces it; in float32 the casts vanish and it is the plain one). The
    match is then traced again in the model's dtypes and shapes."""
    dtype = torch.bfloat16 if spelling.upcast else torch.float32
    x = (
        torch.empty(2, 8, dtype=dtype)
        if spelling.column == "unsqueeze"
        else torch.empty(2, 8, 1, dtype=dtype)
    )
    state = torch.empty(2, 8, 3 if spelling.shift == "tail" else 4, dtype=dtype)
    shape = (8, 1, 4) if spelling.reduce == "conv1d_module" else (8, 4)
    weight = torch.empty(*shape, dtype=dtype)
    return [x, state, weight] + ([torch.empty(8, dtype=dtype)] if bias else [])


class ConvWindowPass(ConvFormulationPass):
    """Every spelling of the decode update on one kind of state (``shift``): the search
    and replacement functions come from :func:`window_update` and
    :func:`fused_window_update`, over every column, reduction, precision, bias and
    activation."""

    shift = "cat"
    upcasts: tuple[bool, ...] = (False, True)

    def spellings(self) -> Iterator[ConvSpelling]:
        for column, reduce, upcast in itertools.product(COLUMNS, REDUCTIONS, self.upcasts):
            yield ConvSpelling(shift=self.shift, column=column, reduce=reduce, upcast=upcast)

    def replacements(self) -> Iterator[Replacement]:
        for spelling in self.spellings():
            for bias, activation in itertools.product((False, True), ACTIVATIONS):
                words = f"{self.formulation} ({spelling.words()}"
                words += f", {'bias, ' if bias else ''}{activation})"
                yield Replacement(
                    words=words,
                    search=window_update(spelling, bias, activation),
                    replace=fused_window_update(spelling, bias, activation),
                    example=window_example(spelling, bias),
                    needs=spelling.needs(activation) | self.write_back_ops(),
                )

    def check(self, match: Match) -> bool:
        """As the shared check, and the window exactly W wide: a ``[B, D, 1]`` x, a state
        of W - 1 (``tail``) or W columns."""
        if not super().check(match):
            return False
        x, state, weight = _val(match, "x"), _val(match, "conv_state"), _val(match, "weight")
        if x.dim() == 3 and x.shape[2] != 1:
            return False
        width = weight.shape[-1]
        return state.shape[2] == (width - 1 if self.shift == "tail" else width)
