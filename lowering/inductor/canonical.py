"""One spelling per computation: exact rewrites of a post-grad graph that make equivalent
spellings of the same computation one graph, applied to the model's graph before the
pattern passes and to every pattern as it is traced (:func:`canonical_fwd_only`), so a
pattern written once matches each of them.

Every rewrite keeps the values bit for bit (a model that no pass fuses computes what it
did before):

- dims as non-negative numbers (``sum(-1)`` and ``sum(2)`` on a 3-D tensor, ``unsqueeze(-1)``
  and ``[..., None]``, ``cat(..., -1)``);
- a reduction with ``keepdim=True`` as the reduction then ``unsqueeze`` of that dim
  (``sum(-1, keepdim=True)`` and ``sum(-1).unsqueeze(-1)``);
- ``pow(a, 2)`` (``a.pow(2)``, ``a.square()``, ``a ** 2``) as ``a * a``, which is how
  the kernels compute it;
- the operands of a two-tensor ``mul`` / ``add`` in one order: the gate (a sigmoid or a
  SiLU) last, else the operand of higher rank first, else the one of the output's shape
  (``w * window`` and ``window * w``, ``sigmoid(g) * g`` and ``g * sigmoid(g)``,
  ``bias + y`` and ``y + bias``). Multiplication and addition commute exactly in IEEE
  arithmetic, and type promotion is symmetric.

- a ``slice`` with its bounds as non-negative numbers within the dim, all given
  (``[..., -1:]`` and ``[..., W - 1:]``, where the dim's size is a number);
- ``view`` as ``reshape`` (as Inductor's own post-grad passes leave it), and chained
  ``permute`` s as one, an identity one dropped (``einsum``'s decomposition permutes and
  permutes back).

Spellings that differ in rounding (``rsqrt`` against ``1 / sqrt``, SiLU decomposed against
``x * sigmoid(x)``) are not rewritten: the pattern descriptions list them instead.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch._guards import detect_fake_mode
from torch._inductor.pattern_matcher import fwd_only

aten = torch.ops.aten

# op -> (position of its dim argument, whether it is a list, rank offset: unsqueeze's dim
# counts the new axis)
_DIM_ARGS: dict[Any, tuple[int, bool, int]] = {
    aten.sum.dim_IntList: (1, True, 0),
    aten.mean.dim: (1, True, 0),
    aten.amax.default: (1, True, 0),
    aten.unsqueeze.default: (1, False, 1),
    aten.squeeze.dim: (1, False, 0),
    aten.squeeze.dims: (1, True, 0),
    aten.cat.default: (1, False, 0),
    aten.select.int: (1, False, 0),
    aten.slice.Tensor: (1, False, 0),
    aten.roll.default: (2, True, 0),
    aten.select_scatter.default: (2, False, 0),
    aten.slice_scatter.default: (2, False, 0),
}
_KEEPDIM_REDUCTIONS = (aten.sum.dim_IntList, aten.mean.dim)
_COMMUTATIVE = (aten.mul.Tensor, aten.add.Tensor)


def _val(node: object) -> Any:
    return node.meta.get("val") if isinstance(node, torch.fx.Node) else None


def _rank(node: torch.fx.Node) -> int | None:
    if node.target is aten.cat.default:
        tensors = node.args[0]
        first = _val(tensors[0]) if isinstance(tensors, (list, tuple)) and tensors else None
    else:
        first = _val(node.args[0]) if node.args else None
    return first.dim() if isinstance(first, torch.Tensor) else None


def _set_val(node: torch.fx.Node) -> None:
    """``node.meta["val"]`` computed from its inputs' (in their fake mode)."""
    args, kwargs = torch.fx.map_arg((node.args, node.kwargs), _val)
    fake_mode = detect_fake_mode([v for v in (*args, *kwargs.values()) if v is not None])
    if fake_mode is None:
        return
    with fake_mode:
        node.meta["val"] = node.target(*args, **kwargs)


def _non_negative_dims(node: torch.fx.Node) -> bool:
    position, is_list, extra = _DIM_ARGS[node.target]
    rank = _rank(node)
    if rank is None:
        return False
    rank += extra
    args = list(node.args)
    if len(args) <= position:
        return False
    dims = args[position]

    def fix(dim: object) -> object:
        return dim + rank if isinstance(dim, int) and dim < 0 else dim

    if is_list and isinstance(dims, (list, tuple)):
        fixed: object = [fix(d) for d in dims]
    elif not is_list:
        fixed = fix(dims)
    else:
        return False
    if fixed == (list(dims) if is_list else dims):
        return False
    args[position] = fixed
    node.args = tuple(args)
    return True


def _keepdim_as_unsqueeze(graph: torch.fx.Graph, node: torch.fx.Node) -> bool:
    """``sum(a, [d], True)`` -> ``unsqueeze(sum(a, [d], False), d)`` (one dim only)."""
    args = node.args
    if len(args) < 3 or args[2] is not True or not isinstance(args[1], (list, tuple)):
        return False
    if len(args[1]) != 1 or not isinstance(args[1][0], int) or args[1][0] < 0:
        return False
    with graph.inserting_after(node):
        reduced = graph.call_function(node.target, (args[0], list(args[1]), False), node.kwargs)
        _set_val(reduced)
        with graph.inserting_after(reduced):
            expanded = graph.call_function(aten.unsqueeze.default, (reduced, args[1][0]))
        expanded.meta = {**node.meta, "val": node.meta.get("val")}
    reduced.meta.setdefault("stack_trace", node.meta.get("stack_trace", ""))
    node.replace_all_uses_with(expanded)
    graph.erase_node(node)
    return True


def _square_as_mul(graph: torch.fx.Graph, node: torch.fx.Node) -> bool:
    if len(node.args) != 2 or node.kwargs or node.args[1] not in (2, 2.0):
        return False
    if isinstance(node.args[1], bool):
        return False
    base = node.args[0]
    with graph.inserting_before(node):
        product = graph.call_function(aten.mul.Tensor, (base, base))
    product.meta = dict(node.meta)
    node.replace_all_uses_with(product)
    graph.erase_node(node)
    return True


def _is_silu(node: torch.fx.Node) -> bool:
    """SiLU as the decompositions write it: ``a / (exp(-a) + 1)``."""
    if node.target is not aten.div.Tensor or len(node.args) != 2:
        return False
    a, denominator = node.args
    if not isinstance(denominator, torch.fx.Node) or denominator.target is not aten.add.Tensor:
        return False
    exp = denominator.args[0]
    if not isinstance(exp, torch.fx.Node) or exp.target is not aten.exp.default:
        return False
    neg = exp.args[0]
    return isinstance(neg, torch.fx.Node) and neg.target is aten.neg.default and neg.args[0] is a


def _is_gate(node: torch.fx.Node) -> bool:
    """A sigmoid or a SiLU (decomposed, or by hand as ``a * sigmoid(a)`` in either order)."""
    if node.target in (aten.sigmoid.default, aten.silu.default) or _is_silu(node):
        return True
    if node.target is not aten.mul.Tensor or len(node.args) != 2:
        return False
    a, b = node.args
    return any(
        isinstance(s, torch.fx.Node) and s.target is aten.sigmoid.default and s.args[0] is t
        for s, t in ((a, b), (b, a))
    )


def _order_key(node: torch.fx.Node, shape: Sequence[int]) -> tuple[bool, int, bool] | None:
    val = _val(node)
    if not isinstance(val, torch.Tensor):
        return None
    return (_is_gate(node), -val.dim(), tuple(val.shape) != tuple(shape))


def _commuted(node: torch.fx.Node) -> bool:
    if len(node.args) != 2 or node.kwargs.get("alpha", 1) != 1:
        return False
    a, b = node.args
    out = _val(node)
    if not (isinstance(a, torch.fx.Node) and isinstance(b, torch.fx.Node)) or out is None:
        return False
    key_a, key_b = _order_key(a, out.shape), _order_key(b, out.shape)
    if key_a is None or key_b is None or not key_b < key_a:
        return False
    node.args = (b, a)
    return True


def _composed_permute(node: torch.fx.Node) -> bool:
    """``permute(permute(a, q), p)`` -> ``permute(a, q[p])``; an identity permute -> its input."""
    source, order = node.args[0], list(node.args[1])
    if isinstance(source, torch.fx.Node) and source.target is aten.permute.default:
        inner = list(source.args[1])
        node.args = (source.args[0], [inner[i] for i in order])
        source, order = node.args
        rewritten = True
    else:
        rewritten = False
    if order == sorted(order) and _val(source) is not None:
        node.replace_all_uses_with(source)
        node.graph.erase_node(node)
        return True
    return rewritten


_SLICES = {aten.slice.Tensor: 1, aten.slice_scatter.default: 2}  # op -> position of dim


def _slice_bounds(node: torch.fx.Node) -> bool:
    """``slice(a, d, start, end, step)`` with 0 <= start <= end <= size, every argument
    given (a dim of a number size only; :func:`_non_negative_dims` has run)."""
    position = _SLICES[node.target]
    args = list(node.args) + [None] * (position + 4 - len(node.args))
    if node.kwargs:
        return False
    val = _val(node.args[0])
    dim, start, end, step = args[position : position + 4]
    dim = 0 if dim is None else dim
    if not isinstance(val, torch.Tensor) or not isinstance(dim, int) or dim >= val.dim():
        return False
    size = val.shape[dim]
    if not isinstance(size, int) or any(
        b is not None and not isinstance(b, int) for b in (start, end, step)
    ):
        return False

    def bound(b: int | None, default: int) -> int:
        b = default if b is None else b
        return min(max(b + size if b < 0 else b, 0), size)

    start, end = bound(start, 0), bound(end, size)
    fixed = [dim, start, max(end, start), 1 if step is None else step]
    if args[position : position + 4] == fixed:
        return False
    node.args = (*args[:position], *fixed)
    return True


def canonicalize(graph: torch.fx.Graph) -> int:
    """Rewrite ``graph`` in place into the canonical spelling (see module doc); returns
    the number of rewrites. Idempotent."""
    rewrites = 0
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        if node.target in _DIM_ARGS:
            rewrites += _non_negative_dims(node)
        if node.target in _KEEPDIM_REDUCTIONS and _keepdim_as_unsqueeze(graph, node):
            rewrites += 1
            continue
        if node.target in _SLICES:
            rewrites += _slice_bounds(node)
        if node.target is aten.view.default:
            node.target = aten.reshape.default
            rewrites += 1
        if node.target is aten.permute.default and _composed_permute(node):
            rewrites += 1
            continue
        if node.target is aten.pow.Tensor_Scalar and _square_as_mul(graph, node):
            rewrites += 1
            continue
        if node.target in _COMMUTATIVE:
            rewrites += _commuted(node)
    return rewrites


def canonical_fwd_only(
    fn: Callable[..., Any], args: Sequence[Any], **kwargs: Any
) -> torch.fx.GraphModule:
    """``fwd_only`` (the inference trace ``register_replacement`` matches with; ``kwargs``
    as the installed torch passes them), then :func:`canonicalize`: the trace function of
    every kda pattern."""
    gm = fwd_only(fn, args, **kwargs)
    if canonicalize(gm.graph):
        gm.graph.eliminate_dead_code()
        gm.recompile()
    return gm
