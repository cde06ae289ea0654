"""lowering/inductor/conv_update_transformers.py: transformers' torch_causal_conv1d_update
(the function itself, from Qwen3-Next's modeling file), fused in place on its W-column
state."""

import pytest
import torch

from tests.lowering.conv_cases import BATCH, CHANNELS, check_formulation

modeling = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
# The PyTorch function the kernel wrapper falls back to without causal-conv1d installed.
torch_causal_conv1d_update = getattr(
    modeling.causal_conv1d_update, "__wrapped__", modeling.causal_conv1d_update
)


def transformers_update(x, conv_state, weight, bias, activation):
    return torch_causal_conv1d_update(x, conv_state, weight, bias, activation)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_transformers_update_fuses_in_place_every_variant(dtype):
    check_formulation(transformers_update, "conv_update_transformers", dtype, (BATCH, CHANNELS, 1))
