"""The gated RMSNorm kernels against the reference."""

import pytest
import torch

from kda_ops import reference
from kda_ops.gated_norm import gated_rms_norm_backward_reference
from kda_ops.kernels.gated_norm import launch_gated_rms_norm, launch_gated_rms_norm_backward
from tests.kda_ops.kernels.devices import DEVICE, DTYPES, TOLERANCE, relative_error


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", ["sigmoid", "silu"])
@pytest.mark.parametrize("width", [10, 128])
def test_gated_rms_norm(dtype, activation, width):
    x, gate = torch.randn(2, 3, 7, width, device=DEVICE, dtype=dtype).unbind(0)
    weight = torch.randn(width, device=DEVICE)
    y = launch_gated_rms_norm(x, gate, weight, 1e-5, activation)
    expected = reference.gated_rms_norm(
        x.double(), gate.double(), weight.double(), 1e-5, activation
    )
    assert y.dtype == dtype
    assert relative_error(y, expected) < TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", ["sigmoid", "silu"])
@pytest.mark.parametrize("width", [10, 128])
def test_gated_rms_norm_backward(dtype, activation, width):
    """dx, dgate, dweight against autograd through the float64 reference; 21 rows, so the
    last program's block is partly empty and several weight shares are summed."""
    x, gate, grad_y = torch.randn(3, 3, 7, width, device=DEVICE, dtype=dtype).unbind(0)
    weight = torch.randn(width, device=DEVICE)
    grads = launch_gated_rms_norm_backward(x, gate, weight, grad_y, 1e-5, activation)
    expected = gated_rms_norm_backward_reference(
        x.double(), gate.double(), weight.double(), grad_y.double(), 1e-5, activation
    )
    for name, got, want, like in zip(("x", "gate", "weight"), grads, expected, (x, gate, weight)):
        assert got.dtype == like.dtype and got.shape == like.shape, name
        assert relative_error(got, want) < TOLERANCE[dtype], name
