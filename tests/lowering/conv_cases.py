"""The conv-update formulation tests: each formulation applied to four states at once
(with and without bias, SiLU or none), compiled, against eager."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from tests.lowering.compiled import CONV_UPDATE_OP, assert_close, compile_kda, op_arguments

VARIANTS = [(False, "silu"), (True, "silu"), (False, None), (True, None)]  # (bias, act)
BATCH, CHANNELS, WIDTH = 3, 16, 4

# One update: (x, conv_state, weight, bias or None, activation or None) -> y
Update = Callable[[Tensor, Tensor, Tensor, "Tensor | None", "str | None"], Tensor]


def inputs(
    dtype: torch.dtype,
    x_shape: tuple[int, ...],
    state_width: int = WIDTH,
    weight_shape: tuple[int, ...] = (CHANNELS, WIDTH),
) -> list[tuple]:
    """Per variant: x, a state (W columns unless ``state_width``), weight, bias or None,
    activation."""
    cases = []
    for with_bias, activation in VARIANTS:
        x = torch.randn(*x_shape, dtype=dtype)
        state = torch.randn(BATCH, CHANNELS, state_width, dtype=dtype)
        weight = torch.randn(*weight_shape, dtype=dtype)
        bias = torch.randn(CHANNELS, dtype=dtype) if with_bias else None
        cases.append((x, state, weight, bias, activation))
    return cases


def check_formulation(
    update: Update, pass_name: str, dtype: torch.dtype, x_shape, **shapes: object
) -> None:
    """Fused at all four sites, in place on the model's own states (the op's state argument
    is a graph input, no copy), outputs and states as eager's. ``shapes``: the state width
    and weight shape of :func:`inputs`."""
    cases = inputs(dtype, x_shape, **shapes)

    def step(*flat):
        return [update(*flat[i : i + 5]) for i in range(0, len(flat), 5)]

    flat = [item for case in cases for item in case]
    eager_flat = [t.clone() if isinstance(t, Tensor) else t for t in flat]
    expected = step(*eager_flat)
    out, counts, code = compile_kda(step, *flat)
    assert counts == {pass_name: len(VARIANTS)}
    states = op_arguments(code, CONV_UPDATE_OP, 1)
    assert len(states) == len(VARIANTS) and all(s.startswith("arg") for s in states)
    for got, want in zip(out, expected):
        assert_close(got, want, dtype)
    for i in range(1, len(flat), 5):
        torch.testing.assert_close(flat[i], eager_flat[i], rtol=0, atol=0)
