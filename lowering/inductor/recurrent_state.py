"""The recurrent decode's state write-back -> the in-place ``kda::recurrent_`` through
``auto_functionalized``.

Matches a functional ``kda::recurrent`` whose final state is copied back into the tensor it
started from (``state.copy_(final_state)`` in the model, an ``aten.copy_`` of a graph input
after functionalization)::

    o, final = kda.recurrent(q, k, v, g, beta, ..., initial_state=state, ...)
    aten.copy_(state, final)

and rewrites it to ``auto_functionalized(kda.recurrent_, ..., state_pool=state)``, which
Inductor re-inplaces: the op updates ``state`` directly, with no new state buffer and no copy.
A ``kda::recurrent`` whose final state is not written back (the functional decode) is left
alone.
"""

from __future__ import annotations

import operator

import torch
from torch._higher_order_ops.auto_functionalize import auto_functionalized

import kda_ops  # noqa: F401  (registers torch.ops.kda)
from lowering.inductor.base import KDAInductorPass

FUNCTIONAL = torch.ops.kda.recurrent.default
INPLACE = torch.ops.kda.recurrent_.default
COPY = torch.ops.aten.copy_.default


def _bound_args(node: torch.fx.Node) -> dict[str, object]:
    names = [argument.name for argument in FUNCTIONAL._schema.arguments]
    return {**dict(zip(names, node.args)), **node.kwargs}


def _getitems(node: torch.fx.Node) -> dict[int, torch.fx.Node]:
    return {user.args[1]: user for user in node.users if user.target is operator.getitem}


def _written_back(final: torch.fx.Node, state: object) -> bool:
    """Whether ``final`` feeds ``aten.copy_(state, final)`` and has the state's dtype/shape."""
    if not isinstance(state, torch.fx.Node):
        return False
    state_val, final_val = state.meta.get("val"), final.meta.get("val")
    if state_val is None or final_val is None or state_val.dtype != final_val.dtype:
        return False
    if state_val.shape != final_val.shape:
        return False
    return any(user.target is COPY and user.args[:2] == (state, final) for user in final.users)


class RecurrentStatePass(KDAInductorPass):
    """Rewrites written-back functional recurrent decode steps to the in-place op."""

    name = "recurrent_state"

    def apply(self, graph: torch.fx.Graph) -> int:
        count = 0
        for node in list(graph.find_nodes(op="call_function", target=FUNCTIONAL)):
            args, items = _bound_args(node), _getitems(node)
            if 1 in items and _written_back(items[1], args["initial_state"]):
                self._rewrite(graph=graph, node=node, args=args, items=items)
                count += 1
        return count

    @staticmethod
    def _rewrite(
        graph: torch.fx.Graph,
        node: torch.fx.Node,
        args: dict[str, object],
        items: dict[int, torch.fx.Node],
    ) -> None:
        kwargs = {name: value for name, value in args.items() if name != "initial_state"}
        kwargs.update(state_pool=args["initial_state"], state_indices=None)
        with graph.inserting_before(node):
            fused = graph.call_function(auto_functionalized, (INPLACE,), kwargs)
            outputs = [graph.call_function(operator.getitem, (fused, i)) for i in range(2)]
        values = tuple(node.meta["val"])
        fused.meta["val"] = values
        for i, output in enumerate(outputs):
            output.meta["val"] = values[i]
            if i in items:
                items[i].replace_all_uses_with(output)
                graph.erase_node(items[i])
        graph.erase_node(node)
