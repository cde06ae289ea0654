"""The dS scan's launches (``state.py``)."""

import pytest
import torch

from kda_ops.kernels.chunk import planning
from kda_ops.kernels.chunk.backward.launch import launch_chunk_kda_backward
from tests.kda_ops.inputs import grouped
from tests.kda_ops.kernels.chunk.backward.test_launch import kernel_inputs
from tests.sweeps import sweep


@pytest.mark.parametrize("cu_seqlens", sweep([None, [0, 100, 300]], keep=[([0, 100, 300],)]))
def test_state_scan_split_across_launches(monkeypatch, cu_seqlens):
    """Sequence-heads split over two launches at different value columns (as
    ``scan_launches`` splits them past one wave) give one launch's gradients."""
    batch = 1 if cu_seqlens else 2
    primals, cu, config, grad_o, grad_state = kernel_inputs(
        "safe_gate", cu_seqlens=cu_seqlens, batch=batch, length=300, value_heads=3,
        head_k=16, head_v=32,
    )  # fmt: skip
    n_seqs = batch if cu_seqlens is None else len(cu_seqlens) - 1
    primals = (*primals[:-1], primals[-1][:1].expand(n_seqs, -1, -1, -1).contiguous())
    grad_state = grad_state[:1].expand(n_seqs, -1, -1, -1).contiguous()
    one = launch_chunk_kda_backward(*grouped(*primals, cu, grad_o, grad_state, *config))
    split = [(0, 2, 32), (2, 3 * n_seqs - 2, 16)]
    monkeypatch.setattr(planning, "scan_launches", lambda *_: split)
    two = launch_chunk_kda_backward(*grouped(*primals, cu, grad_o, grad_state, *config))
    for got, expected in zip(two, one):
        torch.testing.assert_close(got, expected)
