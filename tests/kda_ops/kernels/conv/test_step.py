"""The causal conv1d decode step (``step.py``) against the reference."""

import pytest
import torch

from kda_ops import reference
from kda_ops.kernels.conv.forward import launch_causal_conv1d
from kda_ops.kernels.conv.step import step_sequences_per_program
from tests.kda_ops.kernels.conv.inputs import conv_inputs
from tests.kda_ops.kernels.devices import DEVICE, DTYPES, TOLERANCE, relative_error


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("channels", [8, 24, 1040])  # 1040: a second, partial block
@pytest.mark.parametrize("batch", [3, 9])
def test_conv_step_width4_vector_path(dtype, with_state, channels, batch):
    """W = 4, D % 8 == 0: the decode step regroups 8 channels' state in registers. On the
    interpreter (one processor) D = 1040 puts 2 (B = 3) or 8 (B = 9) sequences in a program,
    the last program partly empty."""
    x, weight, bias = conv_inputs(dtype, batch, 1, channels=channels)
    initial = torch.randn(batch, channels, 3, device=DEVICE, dtype=dtype) if with_state else None
    state = torch.empty(batch, channels, 3, device=DEVICE, dtype=dtype)
    y = launch_causal_conv1d(x, weight, bias, initial, state, None, None, "silu")
    y_ref, state_ref = reference.causal_conv1d(x, weight, bias, initial, None, "silu")
    assert relative_error(y, y_ref) < TOLERANCE[dtype]
    torch.testing.assert_close(state, state_ref)


@pytest.mark.parametrize(
    ("programs", "expected"),
    [(3072, 8), (2111, 4), (768, 2), (527, 1), (12, 1)],  # D = 12288: B = 256, 64, 1
)
def test_conv_step_sequences_per_program(programs, expected):
    """Sequences share a program only while two programs are left for each of 132 SMs."""
    assert step_sequences_per_program(programs, sms=132) == expected


def test_conv_step_width4_pool_in_place_mixed_dtypes():
    """bf16 x into an fp32 pool through indices (padding included), no bias, identity."""
    x, weight, _ = conv_inputs(torch.bfloat16, 3, 1, channels=16)
    pool = torch.randn(5, 16, 3, device=DEVICE)
    before = pool.clone()
    indices = torch.tensor([3, -1, 0], device=DEVICE, dtype=torch.int32)
    history = torch.where((indices >= 0)[:, None, None], before[indices.clamp(min=0)], 0)
    y_ref, state_ref = reference.causal_conv1d(x, weight, None, history, None, "identity")
    y = launch_causal_conv1d(x, weight, None, pool, pool, indices, None, "identity")
    assert relative_error(y, y_ref) < TOLERANCE[torch.bfloat16]
    torch.testing.assert_close(pool[[3, 0]], state_ref[[0, 2]])
    torch.testing.assert_close(pool[[1, 2, 4]], before[[1, 2, 4]])


@pytest.mark.parametrize("width", [2, 4])
@pytest.mark.parametrize("extra", [1, 2])  # S = W (transformers, Mamba) and S = W + 1
@pytest.mark.parametrize("channels", [10, 16])  # 16: the W = 4 vector path's D, not taken
def test_conv_step_longer_state_in_place(width, extra, channels):
    """A pool of S = W - 1 + extra kept inputs, through indices (padding included): the
    step reads the last W - 1, and writes the last S inputs back in the pool's layout."""
    x, weight, bias = conv_inputs(torch.float32, 3, 1, channels=channels, width=width)
    pool = torch.randn(5, channels, width - 1 + extra, device=DEVICE)
    before = pool.clone()
    indices = torch.tensor([3, -1, 0], device=DEVICE)
    history = torch.where((indices >= 0)[:, None, None], before[indices.clamp(min=0)], 0)
    y_ref, _ = reference.causal_conv1d(x, weight, bias, history[..., extra:], None, "silu")
    y = launch_causal_conv1d(x, weight, bias, pool, pool, indices, None, "silu")
    torch.testing.assert_close(y, y_ref)
    shifted = torch.cat([history[..., 1:], x.transpose(1, 2)], dim=-1)
    torch.testing.assert_close(pool[[3, 0]], shifted[[0, 2]])
    assert torch.equal(pool[[1, 2, 4]], before[[1, 2, 4]])
