"""The recurrence run in segments (``segments.py``) against one scan per sequence."""

import pytest
import torch

from kda_ops import reference
from kda_ops.kernels.chunk.launch import launch_chunk_kda
from kda_ops.kernels.chunk.segments import segment_count
from tests.kda_ops.inputs import delta_rule_inputs, grouped
from tests.kda_ops.kernels.devices import DEVICE
from tests.sweeps import sweep


@pytest.mark.parametrize(
    ("segments", "initial_state"), sweep([2, 4], [True, False], keep=[(4, True)])
)
def test_segmented_recurrence(segments, initial_state):
    """The recurrence run in segments (each segment's map, composed, then rerun from its
    exact incoming state) gives the outputs, final and chunk states of one scan."""
    x = delta_rule_inputs(raw_gate=True, dtype=torch.float32, batch=2, length=256, heads=1,
                          value_heads=2, head_k=16, head_v=24)  # fmt: skip
    tensors = [t.to(DEVICE) for t in x.tensors()]
    if not initial_state:
        tensors[-1] = None
    args = (*tensors, None, 0.3, -5.0, True, True)
    rows = reference.chunk_state_rows(2, 256, None)
    states_plain = torch.empty(rows, 2, 16, 24, device=DEVICE)
    states_segmented = torch.empty_like(states_plain)
    o_plain, final_plain = launch_chunk_kda(*grouped(*args), chunk_states=states_plain, segments=1)
    o, final = launch_chunk_kda(*grouped(*args), chunk_states=states_segmented,
                                segments=segments)  # fmt: skip
    torch.testing.assert_close(o, o_plain)
    torch.testing.assert_close(final, final_plain)
    torch.testing.assert_close(states_segmented, states_plain)


@pytest.mark.parametrize(
    ("batch", "length", "value_heads", "expected"),
    [
        (1, 131072, 16, 8),  # 16 heads fill 64 SMs even split to 32 columns: segments pay
        (1, 16384, 16, 2),  # segments of at least 8192 tokens
        (1, 8192, 16, 1),
        (1, 131072, 64, 1),  # 64 heads x 4 column blocks already fill 132 SMs
        (2, 131072, 32, 1),
        (1, 32768, 32, 1),  # 128 programs of 32 columns nearly fill 132 SMs
        (1, 32768, 8, 4),  # 32 programs: a quarter of the SMs
    ],
)
def test_segment_count(batch, length, value_heads, expected):
    """Segments only where split value columns leave at least half the SMs idle, on an
    H100's or H200's 132 SMs."""
    assert segment_count(batch, length, value_heads, 128, 132) == expected
