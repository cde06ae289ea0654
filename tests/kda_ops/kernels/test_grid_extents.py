"""Grids stay launchable for batches of many sequences: a CUDA grid's second and third
extents stop at 65535, and 2048 packed sequences at 32 value heads make 65536
sequence-heads, as a decode or prefill batch of 65536 rows makes 65536 conv rows. Planned
on the meta device (shapes only, nothing runs)."""

import pytest
import torch

from kda_ops.kernels.chunk.backward import state
from kda_ops.kernels.chunk.backward.layout import plan_layout
from kda_ops.kernels.chunk.launch import chunk_plan
from kda_ops.kernels.conv import backward as conv_backward
from kda_ops.kernels.conv.forward import prefill_plan
from kda_ops.kernels.conv.step import step_launch
from kda_ops.kernels.recurrent import recurrent_launch
from tests.kda_ops.inputs import grouped

GRID_LIMIT = 65535  # CUDA's gridDim.y and gridDim.z
SEQUENCES, VALUE_HEADS, DIM = 2048, 32, 16
OPTIONS = (DIM**-0.5, -5.0, True, True)  # scale, safe gate, l2norm and beta sigmoid
CONV_ROWS, CHANNELS = GRID_LIMIT + 1, 64


@pytest.fixture
def packed():
    """Inputs of 2048 two-token sequences at 32 heads (meta tensors) and their offsets."""
    length = 2 * SEQUENCES
    q, k, v, g = (torch.empty(1, length, VALUE_HEADS, DIM, device="meta") for _ in range(4))
    beta = torch.empty(1, length, VALUE_HEADS, device="meta")
    gate = (torch.empty(VALUE_HEADS, device="meta"), torch.empty(VALUE_HEADS * DIM, device="meta"))
    cu_seqlens = torch.arange(0, length + 1, 2, device="meta", dtype=torch.int32)
    return (q, k, v, g, beta, *gate), cu_seqlens


def assert_launchable(grid):
    assert all(extent <= GRID_LIMIT for extent in grid[1:]), grid


def test_chunk_forward(packed):
    inputs, cu_seqlens = packed
    plan = chunk_plan(*grouped(*inputs, None, cu_seqlens, *OPTIONS))
    for launch in plan.launches:
        assert_launchable(launch.grid)


def test_recurrent(packed):
    inputs, cu_seqlens = packed
    states = torch.empty(SEQUENCES, VALUE_HEADS, DIM, DIM, device="meta")
    launch = recurrent_launch(*grouped(*inputs, states, states, None, cu_seqlens, *OPTIONS))
    assert_launchable(launch.grid)


class RecordedKernel:
    """Stands in for a Triton kernel: records the grids it is launched with."""

    def __init__(self):
        self.grids = []

    def __getitem__(self, grid):
        self.grids.append(grid)
        return lambda *args, **kwargs: None


def test_backward_state_scan(packed, monkeypatch):
    inputs, cu_seqlens = packed
    q, v = inputs[0], inputs[2]
    kernel = RecordedKernel()
    monkeypatch.setattr(state, "chunk_bwd_state_kernel", kernel)
    layout = plan_layout(*grouped(*inputs, cu_seqlens, *OPTIONS))
    tiles = torch.empty(layout.n_chunks, VALUE_HEADS, 64, 64, device="meta")
    states = torch.empty(SEQUENCES, VALUE_HEADS, DIM, DIM, device="meta")
    chunk_states = torch.empty(layout.n_chunks, VALUE_HEADS, DIM, DIM, device="meta")
    state.launch_state_scan(q, q, q, q, tiles, q, v, states, cu_seqlens, q.shape[1], layout,
                            torch.empty_like(v), chunk_states, states)  # fmt: skip
    assert kernel.grids
    for grid in kernel.grids:
        assert_launchable(grid)


@pytest.mark.parametrize("width", [4, 3])  # the 16-byte-vector step kernel, the generic one
@pytest.mark.parametrize("symbolic_batch", [False, True])
def test_conv_step(width, symbolic_batch, monkeypatch):
    """A decode step of 65536 sequences; with a batch only known at run time (a graph
    traced for any batch) a program takes one sequence."""
    if symbolic_batch:
        monkeypatch.setattr("kda_ops.kernels.conv.step.step_sequences_per_program",
                            lambda programs, sms: 1)  # fmt: skip
    x = torch.empty(CONV_ROWS, 1, CHANNELS, device="meta")
    states = torch.empty(CONV_ROWS, CHANNELS, width - 1, device="meta")
    launch = step_launch(x, torch.empty(CHANNELS, width, device="meta"), None, states, states,
                         None, "silu")  # fmt: skip
    assert_launchable(launch.grid)


def conv_rows(width=4, length=2):
    """x, weight and state of a prefill of 65536 rows (meta tensors)."""
    return (torch.empty(CONV_ROWS, length, CHANNELS, device="meta"),
            torch.empty(CHANNELS, width, device="meta"),
            torch.empty(CONV_ROWS, CHANNELS, width - 1, device="meta"))  # fmt: skip


def test_conv_prefill():
    x, weight, states = conv_rows()
    plan = prefill_plan(x, weight, None, states, torch.empty_like(states), None, None, "silu")
    for launch in plan.launches:
        assert_launchable(launch.grid)


def test_conv_backward(monkeypatch):
    kernels = {name: RecordedKernel() for name in
               ("conv_grad_z_kernel", "conv_grad_x_kernel", "conv_grad_state_kernel")}  # fmt: skip
    for name, kernel in kernels.items():
        monkeypatch.setattr(conv_backward, name, kernel)
    x, weight, states = conv_rows()
    conv_backward.launch_causal_conv1d_backward(x, weight, None, states, None,
                                                torch.empty_like(x), states, "silu")  # fmt: skip
    for kernel in kernels.values():
        assert kernel.grids
        for grid in kernel.grids:
            assert_launchable(grid)
