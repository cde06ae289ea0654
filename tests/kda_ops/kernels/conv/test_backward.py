"""The causal conv1d backward (``launch_causal_conv1d_backward``) against autograd
through the float64 reference."""

import pytest
import torch

from kda_ops.conv import causal_conv1d_backward_reference
from kda_ops.kernels.conv.backward import launch_causal_conv1d_backward
from tests.kda_ops.kernels.conv.inputs import conv_inputs
from tests.kda_ops.kernels.devices import DEVICE, DTYPES, TOLERANCE, relative_error

CONV_GRADS = ("x", "weight", "bias", "initial_state")


def check_conv_backward(x, weight, bias, initial, cu_seqlens, activation, dtype):
    """Kernel gradients against autograd through the float64 reference, for random
    cotangents of y and of the final state."""
    n_seqs = x.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
    grad_y = torch.randn_like(x)
    grad_final = torch.randn(n_seqs, x.shape[2], weight.shape[1] - 1, device=DEVICE)
    primals = (x, weight, bias, initial)
    got = launch_causal_conv1d_backward(*primals, cu_seqlens, grad_y, grad_final, activation)
    double = tuple(None if p is None else p.double() for p in primals)
    expected = causal_conv1d_backward_reference(*double, cu_seqlens, grad_y.double(),
                                                grad_final.double(), activation)  # fmt: skip
    for name, primal, grad, want in zip(CONV_GRADS, primals, got, expected):
        if primal is None:
            assert grad.numel() == 0, name
            continue
        assert grad.dtype == primal.dtype and grad.shape == primal.shape, name
        assert relative_error(grad, want) < TOLERANCE[dtype], name


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("length", [1, 3, 70])
@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize(("width", "activation"), [(2, "identity"), (4, "silu")])
def test_causal_conv1d_backward(dtype, length, with_state, width, activation):
    """Sequences shorter than the window (1, 3 < W - 1 = 3 for W = 4 at 1) pass the final
    state's gradient back to the initial state's entries."""
    x, weight, bias = conv_inputs(dtype, 2, length, width=width)
    initial = torch.randn(2, 10, width - 1, device=DEVICE, dtype=dtype) if with_state else None
    check_conv_backward(x, weight, bias, initial, None, activation, dtype)


@pytest.mark.parametrize("offsets", [[0, 2, 3, 40, 41], [0, 62, 63, 66, 129, 140]])
def test_causal_conv1d_backward_varlen(offsets):
    """Several sequences start in one 64-token tile; in the second case one starts at a
    tile's last row, so its first W - 1 tokens (which read the state) cross tiles."""
    x, weight, bias = conv_inputs(torch.float32, 1, offsets[-1])
    cu_seqlens = torch.tensor(offsets, device=DEVICE)
    initial = torch.randn(len(offsets) - 1, 10, 3, device=DEVICE)
    check_conv_backward(x, weight, bias, initial, cu_seqlens, "silu", torch.float32)
    check_conv_backward(x, weight, bias, None, cu_seqlens, "identity", torch.float32)
