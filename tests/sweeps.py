"""Sweeps in two parts: a representative few cases that the default run
(``python3 -m pytest -q``) takes, and the rest of the sweep, marked ``exhaustive``
(``python3 -m pytest -q -m exhaustive``; CI runs both, so every case still runs there)."""

import itertools
from collections.abc import Iterable, Sequence

import pytest


def sweep(*axes: Sequence, keep: Iterable[tuple]) -> list:
    """The cross product of ``axes`` as ``pytest.param`` cases for one ``parametrize`` over
    as many names, in ``itertools.product`` order; the combinations not in ``keep`` carry
    the ``exhaustive`` mark. ``keep`` names each kept combination as a tuple, one value an
    axis; a tuple outside the product raises ``ValueError`` (a sweep edited without its
    kept cases)."""
    combinations = list(itertools.product(*axes))
    kept = [tuple(combination) for combination in keep]
    missing = [combination for combination in kept if combination not in combinations]
    if missing:
        raise ValueError(f"keep: {missing} are not combinations of the sweep's axes")
    if not kept:
        raise ValueError("keep: a sweep keeps at least one case in the default run")
    return [
        pytest.param(*combination, marks=() if combination in kept else pytest.mark.exhaustive)
        for combination in combinations
    ]
