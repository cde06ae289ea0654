"""lowering/inductor/conv_update_roll.py: the Mamba / causal-conv1d reference update
(roll, assign the last column, weighted sum), fused in place on its W-column state."""

import pytest
import torch
import torch.nn.functional as F

from tests.lowering.conv_cases import BATCH, CHANNELS, check_formulation


def roll_update(x, conv_state, weight, bias, activation):
    """causal-conv1d's ``causal_conv1d_update_ref`` / Mamba's ``step`` (one token)."""
    dtype = x.dtype
    conv_state.copy_(torch.roll(conv_state, shifts=-1, dims=-1))
    conv_state[:, :, -1] = x
    y = torch.sum(conv_state * weight, dim=-1)
    if bias is not None:
        y = y + bias
    return (F.silu(y) if activation == "silu" else y).to(dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_roll_update_fuses_in_place_every_variant(dtype):
    check_formulation(roll_update, "conv_update_roll", dtype, (BATCH, CHANNELS))
