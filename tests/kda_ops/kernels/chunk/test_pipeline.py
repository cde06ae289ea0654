"""The forward in time windows (``pipeline.py``) against the one-pass forward, and the
windows' planning."""

import pytest
import torch

from kda_ops import reference
from kda_ops.kernels.chunk import launch
from kda_ops.kernels.chunk.launch import launch_chunk_kda
from kda_ops.kernels.chunk.planning import (
    MIN_WINDOW_TOKENS,
    PIPELINE_WINDOWS,
    WINDOW_PREPARE_REGISTERS,
    WINDOW_RECURRENCE_REGISTERS,
    pipeline_window_steps,
)
from kda_ops.kernels.launches import KernelLaunch
from tests.kda_ops.inputs import delta_rule_inputs, grouped
from tests.kda_ops.kernels.devices import DEVICE
from tests.sweeps import sweep

VARIANTS = {
    # name: (in-kernel gate, lower bound, scalar gate)
    "safe_gate": (True, -5.0, False),
    "softplus_gate": (True, None, False),  # two prepare launches a window
    "gdn": (True, None, True),
}
CASES = {
    "fixed": (None, dict(batch=2, length=200)),  # a last window past T
    # empty sequences, one inside one window, others across two and three
    "varlen": ([0, 0, 40, 40, 170, 200], dict(length=200, n_seqs=5)),
}


def arguments(variant, cu_seqlens, initial_state=True, **shape):
    gate, lower_bound, scalar_gate = VARIANTS[variant]
    x = delta_rule_inputs(raw_gate=gate, scalar_gate=scalar_gate, dtype=torch.float32,
                          heads=1, value_heads=2, head_k=16, head_v=24, **shape)  # fmt: skip
    tensors = [t.to(DEVICE) for t in x.tensors()]
    if not initial_state:
        tensors[-1] = None
    if cu_seqlens is not None:
        cu_seqlens = torch.tensor(cu_seqlens, device=DEVICE, dtype=torch.int32)
    return grouped(*tensors, cu_seqlens, 0.3, lower_bound, True, True)


@pytest.mark.parametrize(
    ("variant", "case", "window_steps"),
    sweep(VARIANTS, CASES, [3, 8], keep=[("softplus_gate", "varlen", 3), ("gdn", "fixed", 8)]),
)
def test_windows_give_the_one_pass_results(variant, case, window_steps):
    """Outputs, final state and chunk states of windows of 48 and 128 tokens equal the
    one pass's bit for bit: every chunk is prepared alike, and each window's recurrence
    takes the fp32 state where the one before left it (chunk states too, where a window
    starts inside a 64-token chunk)."""
    cu_seqlens, shape = CASES[case]
    inputs, initial_state, cu, options = arguments(variant, cu_seqlens, **shape)
    n_seqs = None if cu is None else cu.shape[0] - 1
    rows = reference.chunk_state_rows(inputs.q.shape[0], inputs.q.shape[1], n_seqs)
    states = torch.zeros(rows, 2, 16, 24, device=DEVICE)
    windowed_states = torch.zeros_like(states)
    o, final = launch_chunk_kda(inputs, initial_state, cu, options, states, window_steps=0)
    windowed_o, windowed_final = launch_chunk_kda(inputs, initial_state, cu, options,
                                                  windowed_states,
                                                  window_steps=window_steps)  # fmt: skip
    assert torch.equal(windowed_o, o)
    assert torch.equal(windowed_final, final)
    assert torch.equal(windowed_states, states)


def test_windows_cap_the_registers_of_16_bit_launches(monkeypatch):
    """With the launches of 16-bit inputs (fp32 ones given "tf32" precision, which the
    interpreter computes in fp32), the windows compile the prepare (but its dyadic launch)
    and the recurrence to ``window_registers``' caps, and still give the one pass's
    results bit for bit; the one pass leaves every launch uncapped."""
    flags = launch.prepare_flags
    monkeypatch.setattr(launch, "prepare_flags",
                        lambda *args: {**flags(*args), "DOT_PRECISION": "tf32"})  # fmt: skip
    launched = []
    run = KernelLaunch.run

    def record(self):
        launched.append((self.kernel.fn.__name__, self.args.get("CHUNKS"),
                         self.args.get("maxnreg")))  # fmt: skip
        run(self)

    monkeypatch.setattr(KernelLaunch, "run", record)
    inputs, initial_state, cu, options = arguments("softplus_gate", None, batch=2, length=200)
    o, final = launch_chunk_kda(inputs, initial_state, cu, options, window_steps=0)
    assert {registers for *_, registers in launched} == {None}
    launched.clear()
    windowed_o, windowed_final = launch_chunk_kda(inputs, initial_state, cu, options,
                                                  window_steps=4)  # fmt: skip
    assert torch.equal(windowed_o, o) and torch.equal(windowed_final, final)
    assert set(launched) == {
        ("chunk_prepare_kernel", "bounded", WINDOW_PREPARE_REGISTERS),
        ("chunk_prepare_kernel", "unbounded", None),
        ("chunk_recurrence_kernel", None, WINDOW_RECURRENCE_REGISTERS),
    }


def test_windows_without_initial_state_or_output():
    """The first window starts from zeros; the states-only scan (the backward's re-run)
    windows too."""
    cu_seqlens, shape = CASES["varlen"]
    inputs, _, cu, options = arguments("safe_gate", cu_seqlens, initial_state=False, **shape)
    _, final = launch_chunk_kda(inputs, None, cu, options, output=False, window_steps=0)
    none, windowed = launch_chunk_kda(inputs, None, cu, options, output=False, window_steps=4)
    assert none is None and torch.equal(windowed, final)


def test_window_planning():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    shortest = PIPELINE_WINDOWS * MIN_WINDOW_TOKENS
    assert pipeline_window_steps(8192, False, cpu) == 0  # the interpreter: one pass
    assert pipeline_window_steps(8192, True, cuda) == 0  # packed sequences: one pass
    assert pipeline_window_steps(shortest - 1, False, cuda) == 0
    assert pipeline_window_steps(8192, False, cuda) == 8192 // PIPELINE_WINDOWS // 16
    # Rounded up: PIPELINE_WINDOWS windows cover the sequence.
    steps = pipeline_window_steps(shortest + 16, False, cuda)
    assert steps * 16 * PIPELINE_WINDOWS >= shortest + 16 > (steps - 1) * 16 * PIPELINE_WINDOWS
