"""``tests.sweeps.sweep``: the kept cases unmarked, every other one ``exhaustive``."""

import pytest

from tests.sweeps import sweep


def test_only_the_kept_cases_run_by_default():
    cases = sweep([1, 2], ["a", "b"], keep=[(2, "a")])
    assert [case.values for case in cases] == [(1, "a"), (1, "b"), (2, "a"), (2, "b")]
    exhaustive = [[mark.name for mark in case.marks] == ["exhaustive"] for case in cases]
    assert exhaustive == [True, True, False, True]


def test_a_kept_case_outside_the_grid_is_refused():
    with pytest.raises(ValueError, match="keep"):
        sweep([1, 2], keep=[(3,)])
    with pytest.raises(ValueError, match="keep"):
        sweep([1, 2], keep=[])
