"""Gated RMSNorm, gate and causal-conv kernels against the reference."""

import pytest
import torch

from kda_ops import reference
from kda_ops.conv import causal_conv1d_backward_reference
from kda_ops.gated_norm import gated_rms_norm_backward_reference
from kda_ops.kernels.conv.backward import launch_causal_conv1d_backward
from kda_ops.kernels.conv.forward import launch_causal_conv1d
from kda_ops.kernels.conv.step import step_sequences_per_program
from kda_ops.kernels.gate import launch_kda_gate
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


def conv_inputs(dtype, batch, length, channels=10, width=4):
    x = torch.randn(batch, length, channels, device=DEVICE, dtype=dtype)
    weight = torch.randn(channels, width, device=DEVICE)
    return x, weight, torch.randn(channels, device=DEVICE)


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
