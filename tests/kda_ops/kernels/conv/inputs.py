"""Random inputs of the conv kernel tests."""

import torch

from tests.kda_ops.kernels.devices import DEVICE


def conv_inputs(dtype, batch, length, channels=10, width=4):
    x = torch.randn(batch, length, channels, device=DEVICE, dtype=dtype)
    weight = torch.randn(channels, width, device=DEVICE)
    return x, weight, torch.randn(channels, device=DEVICE)
