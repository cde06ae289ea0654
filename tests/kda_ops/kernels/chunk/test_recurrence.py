"""The recurrence kernel's launches (``recurrence.py``)."""

import itertools

import pytest
import torch

from kda_ops import reference
from kda_ops.kernels.chunk import planning, recurrence
from kda_ops.kernels.chunk.backward.launch import launch_chunk_kda_training
from kda_ops.kernels.chunk.launch import launch_chunk_kda
from tests.kda_ops.inputs import delta_rule_inputs, grouped
from tests.kda_ops.kernels.devices import DEVICE
from tests.sweeps import sweep


@pytest.mark.parametrize("cu_seqlens", sweep([None, [0, 100, 300]], keep=[([0, 100, 300],)]))
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
    o_one, final_one = launch_chunk_kda(*grouped(*args), chunk_states=states_one, segments=1)
    split = [(0, 2, 32), (2, 3 * n_seqs - 2, 16)]
    monkeypatch.setattr(planning, "scan_launches", lambda *_: split)
    o_two, final_two = launch_chunk_kda(*grouped(*args), chunk_states=states_two, segments=1)
    torch.testing.assert_close(o_two, o_one)
    torch.testing.assert_close(final_two, final_one)
    used = reference.chunk_state_rows(batch, 300, None) if cu_seqlens is None else 6
    torch.testing.assert_close(states_two[:used], states_one[:used])


def test_longest_first():
    cu_seqlens = torch.tensor([0, 3, 10, 10, 15], dtype=torch.int32)
    assert reference.longest_first(cu_seqlens).tolist() == [1, 3, 0, 2]


def test_packed_sequences_taken_longest_first():
    """The scan takes packed sequences out of their order (longest first): each keeps its
    own outputs, initial state and final state, as when run alone."""
    bounds = [0, 40, 200, 230]
    x = delta_rule_inputs(raw_gate=True, dtype=torch.float32, length=230, heads=1,
                          value_heads=2, head_k=16, head_v=32)  # fmt: skip
    *tensors, _ = (t.to(DEVICE) for t in x.tensors())
    initial = torch.randn(3, 2, 16, 32, device=DEVICE)
    options = (0.3, -5.0, True, True)
    cu_seqlens = torch.tensor(bounds, device=DEVICE).int()
    assert reference.longest_first(cu_seqlens).tolist() == [1, 0, 2]
    o, final = launch_chunk_kda(*grouped(*tensors, initial, cu_seqlens, *options))
    for n, (start, end) in enumerate(itertools.pairwise(bounds)):
        alone = [t[:, start:end] if t.dim() > 1 else t for t in tensors]
        o_alone, final_alone = launch_chunk_kda(*grouped(*alone, initial[n : n + 1], None,
                                                          *options))  # fmt: skip
        torch.testing.assert_close(o[:, start:end], o_alone)
        torch.testing.assert_close(final[n : n + 1], final_alone)


SPLIT_CASES = {
    # name: (cu_seqlens, shape, window steps); partial last steps unless said
    "fixed": (None, dict(batch=2, length=200), 0),
    "whole_steps": (None, dict(batch=1, length=192), 0),  # no partial step
    # empty sequences; one of 16 tokens, one step and no partial one
    "varlen": ([0, 0, 40, 56, 170, 200], dict(length=200), 0),
    "windows": ([0, 0, 40, 56, 170, 200], dict(length=200), 3),  # partial in later windows
}


@pytest.mark.parametrize("case", sweep(SPLIT_CASES, keep=[("whole_steps",), ("windows",)]))
def test_unmasked_full_steps_give_the_masked_loop_results(monkeypatch, case):
    """The recurrence's full steps in a loop without row masks, then the partial last step
    (what 16-bit inputs compile to in the inference forward, ``unmasked_full_steps``),
    give the one masked loop's outputs, final state and chunk states bit for bit (fp32
    inputs, which take the masked loop, forced to the split), in the inference forward's
    16-token steps and in the training forward's 64-token ones."""
    cu_seqlens, shape, window_steps = SPLIT_CASES[case]
    x = delta_rule_inputs(raw_gate=True, dtype=torch.float32, heads=1, value_heads=2,
                          head_k=16, head_v=32, **shape)  # fmt: skip
    tensors = [t.to(DEVICE) for t in x.tensors()]
    if cu_seqlens is not None:
        cu_seqlens = torch.tensor(cu_seqlens, device=DEVICE, dtype=torch.int32)
        tensors[-1] = tensors[-1][:1].expand(cu_seqlens.numel() - 1, -1, -1, -1).contiguous()
    n_seqs = None if cu_seqlens is None else cu_seqlens.numel() - 1
    rows = reference.chunk_state_rows(x.q.shape[0], x.q.shape[1], n_seqs)
    used = rows if cu_seqlens is None else int(reference.chunk_offsets(cu_seqlens, 64)[-1])
    args = grouped(*tensors, cu_seqlens, 0.3, -5.0, True, True)
    results = []
    for split in (False, True):
        monkeypatch.setattr(recurrence, "unmasked_full_steps", lambda *_, split=split: split)
        states = torch.zeros(rows, 2, 16, 32, device=DEVICE)
        o, final = launch_chunk_kda(*args, chunk_states=states, segments=1,
                                    window_steps=window_steps)  # fmt: skip
        training_o, training_final, saved = launch_chunk_kda_training(*args)
        results.append(
            (o, final, states[:used], training_o, training_final, saved.chunk_states[:used])
        )  # rows past the last chunk: untouched
    for masked, split in zip(*results):
        assert torch.equal(split, masked)
