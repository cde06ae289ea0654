"""The causal conv1d launcher (``launch_causal_conv1d``: the prefill kernels, and the
decode step for one token) against the reference."""

import pytest
import torch

from kda_ops import reference
from kda_ops.kernels.conv.forward import launch_causal_conv1d
from tests.kda_ops.kernels.conv.inputs import conv_inputs
from tests.kda_ops.kernels.devices import DEVICE, DTYPES, TOLERANCE, relative_error


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("length", [1, 2, 3, 65, 70])
@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("width", [2, 4])
def test_causal_conv1d(dtype, length, with_state, width):
    x, weight, bias = conv_inputs(dtype, 2, length, width=width)
    initial = torch.randn(2, 10, width - 1, device=DEVICE, dtype=dtype) if with_state else None
    state = torch.empty(2, 10, width - 1, device=DEVICE, dtype=dtype)
    y = launch_causal_conv1d(x, weight, bias, initial, state, None, None, "silu")
    y_ref, state_ref = reference.causal_conv1d(x, weight, bias, initial, None, "silu")
    assert relative_error(y, y_ref) < TOLERANCE[dtype]
    torch.testing.assert_close(state, state_ref)


def test_causal_conv1d_varlen():
    x, weight, _ = conv_inputs(torch.float32, 1, 41)
    cu_seqlens = torch.tensor([0, 2, 3, 40, 41], device=DEVICE)
    initial = torch.randn(4, 10, 3, device=DEVICE)
    state = torch.empty_like(initial)
    y = launch_causal_conv1d(x, weight, None, initial, state, None, cu_seqlens, "identity")
    y_ref, state_ref = reference.causal_conv1d(x, weight, None, initial, cu_seqlens, "identity")
    torch.testing.assert_close(y, y_ref)
    torch.testing.assert_close(state, state_ref)


@pytest.mark.parametrize("length", [1, 2])
def test_causal_conv1d_pool_in_place(length):
    x, weight, bias = conv_inputs(torch.float32, 3, length)
    pool = torch.randn(6, 10, 3, device=DEVICE)
    before = pool.clone()
    indices = torch.tensor([4, -1, 1], device=DEVICE)
    history = torch.where((indices >= 0)[:, None, None], before[indices.clamp(min=0)], 0)
    y_ref, state_ref = reference.causal_conv1d(x, weight, bias, history, None, "silu")
    y = launch_causal_conv1d(x, weight, bias, pool, pool, indices, None, "silu")
    torch.testing.assert_close(y, y_ref)
    torch.testing.assert_close(pool[[4, 1]], state_ref[[0, 2]])
    assert torch.equal(pool[[0, 2, 3, 5]], before[[0, 2, 3, 5]])


def test_causal_conv1d_varlen_pool_heads():
    """Packed sequences from a pool: three start in the first 64-token tile (one of one
    token), one starts at its last row so that its first W - 1 outputs, which read the
    state, cross into the next tile, and one has padding (-1) for a slot."""
    x, weight, bias = conv_inputs(torch.float32, 1, 140)
    cu_seqlens = torch.tensor([0, 62, 63, 66, 129, 140], device=DEVICE)
    pool = torch.randn(6, 10, 3, device=DEVICE)
    before = pool.clone()
    indices = torch.tensor([3, -1, 0, 5, 1], device=DEVICE)
    history = torch.where((indices >= 0)[:, None, None], before[indices.clamp(min=0)], 0)
    y_ref, state_ref = reference.causal_conv1d(x, weight, bias, history, cu_seqlens, "silu")
    y = launch_causal_conv1d(x, weight, bias, pool, pool, indices, cu_seqlens, "silu")
    torch.testing.assert_close(y, y_ref)
    torch.testing.assert_close(pool[[3, 0, 5, 1]], state_ref[[0, 2, 3, 4]])
    torch.testing.assert_close(pool[[2, 4]], before[[2, 4]])


@pytest.mark.parametrize("length", [1, 5])
@pytest.mark.parametrize("in_place", [False, True])
def test_causal_conv1d_strided_state(length, in_place):
    """A state view (FLA's ``cache[..., 1:]``, transformers' longer conv_state) is read and,
    in place, written as its values, not as a dense tensor at the same address."""
    x, weight, bias = conv_inputs(torch.float32, 2, length, channels=16)
    cache = torch.randn(2, 16, 4, device=DEVICE)
    view = cache[..., 1:]
    before = cache.clone()
    y_ref, state_ref = reference.causal_conv1d(x, weight, bias, view.clone(), None, "silu")
    state = view if in_place else torch.empty(2, 16, 3, device=DEVICE)
    y = launch_causal_conv1d(x, weight, bias, view, state, None, None, "silu")
    torch.testing.assert_close(y, y_ref)
    torch.testing.assert_close(state, state_ref)
    torch.testing.assert_close(cache[..., 0], before[..., 0])
