"""The launchers' host-side block sizes and grid extents equal Triton's."""

import torch
import triton

from kda_ops.kernels.sizes import cdiv, next_power_of_2, processors


def test_next_power_of_2_matches_triton():
    for n in range(1, 5000):
        assert next_power_of_2(n) == triton.next_power_of_2(n), n
    assert next_power_of_2(2**40 + 1) == 2**41


def test_cdiv_matches_triton():
    for numerator in range(0, 300):
        for denominator in (1, 2, 3, 7, 16, 64, 128):
            assert cdiv(numerator, denominator) == triton.cdiv(numerator, denominator)


def test_processors_is_one_off_cuda():
    assert processors(torch.device("cpu")) == 1
