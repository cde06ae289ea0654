"""Compiling small functions with ``backend="kda"`` on CPU for the pass tests: fresh (no
FX graph cache hit, which would skip the passes), one graph, and the match counts."""

from __future__ import annotations

import ast
from collections.abc import Callable
from typing import Any

import torch
from torch._dynamo.utils import counters
from torch._inductor.utils import run_and_get_code

from lowering.inductor import PASS_MANAGER

CONV_UPDATE_OP = "kda.causal_conv1d_update_.default"
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 3e-2, torch.float16: 3e-3}


def compile_kda(fn: Callable[..., Any], *args: Any) -> tuple[Any, dict[str, int], str]:
    """``torch.compile(fn, backend="kda", fullgraph=True)(*args)``: its output, the match
    counts of every pass that matched, and Inductor's code; asserts no graph break."""
    torch._dynamo.reset()
    counters.clear()
    PASS_MANAGER.reset_counts()
    with torch._inductor.config.patch(fx_graph_cache=False):
        out, (code,) = run_and_get_code(torch.compile(fn, backend="kda", fullgraph=True), *args)
    assert sum(counters["graph_break"].values()) == 0
    return out, {name: n for name, n in PASS_MANAGER.counts.items() if n}, code


def op_arguments(code: str, op: str, position: int) -> list[str]:
    """The source text of argument ``position`` of every call to ``op`` in ``code``."""
    found = []
    for line in code.splitlines():
        if f"{op}(" in line and "=" in line:
            call = ast.parse(line.split("=", 1)[1].strip()).body[0].value
            found.append(ast.unparse(call.args[position]))
    return found


def assert_close(actual: Any, expected: Any, dtype: torch.dtype) -> None:
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(actual, expected, rtol=tol, atol=tol)
