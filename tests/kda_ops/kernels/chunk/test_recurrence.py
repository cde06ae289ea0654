"""The recurrence kernel's launches (``recurrence.py``)."""

import pytest
import torch

from kda_ops import reference
from kda_ops.kernels.chunk import recurrence
from kda_ops.kernels.chunk.launch import launch_chunk_kda
from tests.kda_ops.inputs import delta_rule_inputs
from tests.kda_ops.kernels.devices import DEVICE


@pytest.mark.parametrize("cu_seqlens", [None, [0, 100, 300]])
def test_recurrence_split_across_launches(monkeypatch, cu_seqlens):
    """Sequence-heads split over two launches at different value columns (as
    ``scan_launches`` splits them past one wave) give one launch's outputs and states."""
    batch = 1 if cu_seqlens else 2
    x = delta_rule_inputs(raw_gate=True, dtype=torch.float32, batch=batch, length=300, heads=1,
                          value_heads=3, head_k=16, head_v=32)  # fmt: skip
    n_seqs = batch if cu_seqlens is None else len(cu_seqlens) - 1
    tensors = [t.to(DEVICE) for t in x.tensors()]
    tensors[-1] = tensors[-1][:1].expand(n_seqs, -1, -1, -1).contiguous()
    seqlens = None if cu_seqlens is None else torch.tensor(cu_seqlens, device=DEVICE).int()
    args = (*tensors, seqlens, 0.3, -5.0, True, True)
    rows = reference.chunk_state_rows(batch, 300, None if cu_seqlens is None else n_seqs)
    states_one = torch.empty(rows, 3, 16, 32, device=DEVICE)
    states_two = torch.empty_like(states_one)
    o_one, final_one = launch_chunk_kda(*args, chunk_states=states_one, segments=1)
    split = [(0, 2, 32), (2, 3 * n_seqs - 2, 16)]
    monkeypatch.setattr(recurrence, "scan_launches", lambda *_: split)
    o_two, final_two = launch_chunk_kda(*args, chunk_states=states_two, segments=1)
    torch.testing.assert_close(o_two, o_one)
    torch.testing.assert_close(final_two, final_one)
    used = reference.chunk_state_rows(batch, 300, None) if cu_seqlens is None else 6
    torch.testing.assert_close(states_two[:used], states_one[:used])
