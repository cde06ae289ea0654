"""The forward's launch planning (``planning.py``)."""

import pytest

from kda_ops.kernels.chunk.planning import scan_config, scan_launches
from kda_ops.kernels.sizes import SM90_SHARED_MEMORY

SMS = 132  # an H200's


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


@pytest.mark.parametrize(
    "block_k, block_v, heads, itemsize, store_output, pipelined, expected",
    [
        (128, 128, 64, 2, True, True, (64, 3)),  # one wave at 64 columns
        (128, 128, 96, 2, True, True, (64, 3)),
        (128, 128, 16, 2, True, True, (32, 3)),  # idle SMs: the narrowest blocks
        (128, 128, 96, 4, True, True, (128, 2)),  # fp32: no third stage at 64
        (128, 128, 96, 4, True, False, (128, 1)),  # the backward's fp32 dS scan
        (64, 64, 96, 2, True, True, (64, 3)),
        (128, 256, 96, 2, False, True, (64, 3)),  # the maps pass (V + K columns)
        (16, 16, 4, 2, True, True, (16, 3)),
        (256, 256, 96, 2, True, True, (64, 1)),  # past 128 key columns
        (256, 256, 16, 2, True, True, (32, 1)),
        (256, 16, 96, 2, True, True, (16, 2)),
        (256, 256, 96, 4, True, True, (32, 1)),
        (256, 512, 96, 2, False, True, (64, 2)),
    ],
)
def test_scan_config(block_k, block_v, heads, itemsize, store_output, pipelined, expected):
    """Up to 128 columns the scans launch as tuned on the H200; past them within its
    shared memory and registers."""
    got = scan_config(block_k, block_v, heads, SMS, itemsize, itemsize, store_output,
                      SM90_SHARED_MEMORY, pipelined)  # fmt: skip
    assert got == expected
