"""FLA entry points that kda_ops builds from its ops (no fla-core needed): vLLM's
``fused_recurrent_kda_fwd`` against the token recurrence, the gates against their formulas,
each with new buffers poisoned with NaN (as FLA's test suite does) so that a result read
from memory nobody wrote shows."""

import pytest
import torch
import torch.nn.functional as F

import kda_ops
from kda_ops.integrations import fla

HEADS, HEAD_K, HEAD_V = 2, 8, 4
SENTINEL = 1e30  # fills pool slots that must not be touched


@pytest.fixture(autouse=True)
def nan_poisoned_allocations(monkeypatch):
    """torch.empty / empty_like / Tensor.new_empty return NaN-filled float tensors."""
    empty, empty_like, new_empty = torch.empty, torch.empty_like, torch.Tensor.new_empty

    def poison(t):
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", lambda *a, **kw: poison(empty(*a, **kw)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **kw: poison(empty_like(*a, **kw)))
    monkeypatch.setattr(
        torch.Tensor, "new_empty", lambda s, *a, **kw: poison(new_empty(s, *a, **kw))
    )


def tokens(n_tokens: int):
    q, k = F.normalize(torch.randn(2, 1, n_tokens, HEADS, HEAD_K, dtype=torch.float64), dim=-1)
    v = torch.randn(1, n_tokens, HEADS, HEAD_V, dtype=torch.float64)
    g = -torch.rand(1, n_tokens, HEADS, HEAD_K, dtype=torch.float64)
    beta = torch.rand(1, n_tokens, HEADS, dtype=torch.float64)
    return q, k, v, g, beta


def pool(slots: int, used: torch.Tensor) -> torch.Tensor:
    states = torch.full((slots, HEADS, HEAD_K, HEAD_V), SENTINEL, dtype=torch.float64)
    states[used] = torch.randn(len(used), HEADS, HEAD_K, HEAD_V, dtype=torch.float64)
    return states


def step(x, state):
    """One sequence's tokens from ``state`` ``[HV, K, V]``: o and the state after each."""
    o, after = [], []
    for t in range(x[0].shape[1]):
        o_t, state = kda_ops.fused_recurrent_kda(*(y[:, t : t + 1] for y in x),
                                                 initial_state=state[None],
                                                 output_final_state=True)  # fmt: skip
        state = state[0]
        o.append(o_t)
        after.append(state)
    return torch.cat(o, 1), after


@pytest.mark.parametrize("state_v_first", [False, True])
def test_vllm_decode_one_token_a_sequence(state_v_first):
    n_seqs = 3
    slots = torch.tensor([4, 0, 2])
    states = pool(6, slots)
    x = tokens(n_seqs)
    expected = states.clone()
    o_ref = []
    for n in range(n_seqs):
        o_n, after = step([y[:, n : n + 1] for y in x], expected[slots[n]])
        o_ref.append(o_n)
        expected[slots[n]] = after[-1]
    given = states.transpose(-1, -2).contiguous() if state_v_first else states.clone()
    o, returned = fla.fused_recurrent_kda_fwd(
        *x, initial_state=given, inplace_final_state=True, state_v_first=state_v_first,
        cu_seqlens=torch.arange(n_seqs + 1), ssm_state_indices=slots.int(),
    )  # fmt: skip
    assert returned is given
    if state_v_first:
        given = given.transpose(-1, -2)
    torch.testing.assert_close(o, torch.cat(o_ref, 1))
    torch.testing.assert_close(given, expected, rtol=1e-12, atol=0)


def test_vllm_speculative_decode():
    """Sequence n starts from slot indices[n, accepted[n] - 1] and writes the state after
    token t to slot indices[n, t]; a negative slot is padding."""
    indices = torch.tensor([[0, 1, 2], [3, 4, -1]])
    accepted = torch.tensor([2, 1])
    lengths = [3, 2]
    cu_seqlens = torch.tensor([0, 3, 5])
    states = pool(6, torch.arange(5))
    x = tokens(5)
    expected = states.clone()
    o_ref = []
    for n, length in enumerate(lengths):
        start = int(cu_seqlens[n])
        o_n, after = step([y[:, start : start + length] for y in x],
                          states[indices[n, accepted[n] - 1]])  # fmt: skip
        o_ref.append(o_n)
        for t, state in enumerate(after):
            if indices[n, t] >= 0:
                expected[indices[n, t]] = state
    o, _ = fla.fused_recurrent_kda_fwd(
        *x, initial_state=states, inplace_final_state=True, cu_seqlens=cu_seqlens,
        ssm_state_indices=indices, num_accepted_tokens=accepted,
    )  # fmt: skip
    torch.testing.assert_close(o, torch.cat(o_ref, 1))
    torch.testing.assert_close(states, expected, rtol=1e-12, atol=0)


def test_vllm_decode_states_per_token():
    indices = torch.tensor([[1], [0]])
    states = pool(2, torch.arange(2))
    x = tokens(2)
    o, per_token = fla.fused_recurrent_kda_fwd(
        *x, initial_state=states, inplace_final_state=False, cu_seqlens=torch.tensor([0, 1, 2]),
        ssm_state_indices=indices,
    )  # fmt: skip
    for n in range(2):
        o_n, after = step([y[:, n : n + 1] for y in x], states[indices[n, 0]])
        torch.testing.assert_close(o[:, n : n + 1], o_n)
        torch.testing.assert_close(per_token[n].double(), after[0], rtol=1e-6, atol=1e-6)


def test_vllm_decode_without_indices_overwrites_the_initial_state():
    x = tokens(4)
    state = torch.randn(1, HEADS, HEAD_K, HEAD_V, dtype=torch.float64)
    o_ref, final_ref = kda_ops.fused_recurrent_kda(*x, initial_state=state,
                                                   output_final_state=True)  # fmt: skip
    out = torch.empty_like(x[2])
    o, final = fla.fused_recurrent_kda_fwd(*x, initial_state=state, out=out)
    assert o is out and final is state
    torch.testing.assert_close(o, o_ref)
    torch.testing.assert_close(state, final_ref)
    with pytest.raises(ValueError, match="`inplace_final_state=True` needs `initial_state`"):
        fla.fused_recurrent_kda_fwd(*x)


def test_gdn_gate():
    g = torch.randn(2, 5, HEADS, dtype=torch.float64, requires_grad=True)
    A_log = torch.randn(HEADS, dtype=torch.float64)
    dt_bias = torch.randn(HEADS, dtype=torch.float64)
    out = fla.fused_gdn_gate(g, A_log, dt_bias, output_dtype=torch.float64)
    torch.testing.assert_close(out, -A_log.exp() * F.softplus(g + dt_bias))
    assert fla.fused_gdn_gate(g, A_log).dtype == torch.float32


def test_kda_gate_in_flas_shapes():
    g = torch.randn(2, 3, HEADS, HEAD_K, dtype=torch.float64, requires_grad=True)
    A_log = torch.randn(1, 1, HEADS, 1, dtype=torch.float64, requires_grad=True)
    out = fla.fused_kda_gate(g, A_log, lower_bound=-5.0, output_dtype=torch.float64)
    expected = -5.0 * torch.sigmoid(A_log.exp() * g)
    torch.testing.assert_close(out, expected)
    (grad,) = torch.autograd.grad(out.sum(), A_log)
    (expected_grad,) = torch.autograd.grad(expected.sum(), A_log)
    torch.testing.assert_close(grad, expected_grad)
    without = fla.fused_kda_gate(g, None, lower_bound=-5.0, output_dtype=torch.float64)
    torch.testing.assert_close(without, -5.0 * torch.sigmoid(g))
    with pytest.raises(ValueError, match="`A_log` is needed unless `lower_bound`"):
        fla.fused_kda_gate(g)
