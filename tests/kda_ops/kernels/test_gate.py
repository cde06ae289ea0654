"""The gate kernel against the reference."""

import pytest
import torch

from kda_ops import reference
from kda_ops.kernels.gate import launch_kda_gate
from tests.kda_ops.kernels.devices import DEVICE, DTYPES


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lower_bound", [None, -5.0])
@pytest.mark.parametrize("with_bias", [False, True])
def test_kda_gate(dtype, lower_bound, with_bias):
    g = torch.randn(2, 5, 3, 6, device=DEVICE, dtype=dtype) * 10
    A_log, dt_bias = torch.randn(3, device=DEVICE), torch.randn(18, device=DEVICE)
    bias = dt_bias if with_bias else None
    out = launch_kda_gate(g, A_log, bias, lower_bound)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, reference.kda_gate(g, A_log, bias, lower_bound))
