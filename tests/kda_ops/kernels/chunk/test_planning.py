"""The forward's launch planning (``planning.py``)."""

import pytest

from kda_ops.kernels.chunk.planning import scan_launches


@pytest.mark.parametrize(
    "block_v, heads, columns, sm_count, launches",
    [
        (128, 96, 64, 132, [(0, 66, 64), (66, 30, 32)]),  # the rest fits one wave at 32
        (128, 64, 64, 132, [(0, 64, 64)]),  # one wave
        (128, 128, 64, 132, [(0, 128, 64)]),  # 62 heads past the wave: 248 programs at 32
        (256, 128, 64, 132, [(0, 128, 64)]),  # the maps pass: V + K columns
        (128, 200, 128, 132, [(0, 200, 128)]),  # 68 past the wave: 136 programs at 64
        (32, 5, 16, 4, [(0, 5, 16)]),  # no dot narrower than 16
    ],
)
def test_scan_launches(block_v, heads, columns, sm_count, launches):
    assert scan_launches(block_v, heads, columns, sm_count) == launches
