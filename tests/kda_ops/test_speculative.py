"""Speculative decoding: verify leaves the pool alone; commit (per-position states or replay)
of every accepted length 0..T equals running the accepted tokens one by one."""

import pytest
import torch
from torch.library import opcheck

import kda_ops
from kda_ops import speculative
from tests.kda_ops.inputs import delta_rule_inputs

DRAFT = 3
POOL_SLOTS = 7
INDICES = [4, -1, 0, 2]  # slot -1: padding
GATE_OPTIONS = {
    "precomputed": {},
    "in_kernel": dict(
        use_qk_l2norm_in_kernel=True,
        use_gate_in_kernel=True,
        use_beta_sigmoid_in_kernel=True,
        lower_bound=-5.0,
    ),
}


def _drafts(options: str, scalar_gate: bool = False):
    x = delta_rule_inputs(batch=len(INDICES), length=DRAFT, heads=2, value_heads=4,
                          raw_gate=options == "in_kernel", scalar_gate=scalar_gate)  # fmt: skip
    kwargs = dict(GATE_OPTIONS[options])
    if options == "in_kernel":
        kwargs.update(A_log=x.A_log, dt_bias=x.dt_bias)
    pool = torch.randn(POOL_SLOTS, 4, 8, 4, dtype=torch.float64)
    return (x.q, x.k, x.v, x.g, x.beta), kwargs, pool, torch.tensor(INDICES)


def _expected_pool(tokens, kwargs, pool, indices, accepted):
    """Sequence n's accepted tokens run one at a time through the in-place recurrence."""
    expected = pool.clone()
    for n, slot in enumerate(indices.tolist()):
        for t in range(int(accepted[n])):
            step = tuple(x[n : n + 1, t : t + 1] for x in tokens)
            kda_ops.fused_recurrent_kda_inplace(*step, expected, torch.tensor([slot]), **kwargs)
    return expected


@pytest.mark.parametrize("options", list(GATE_OPTIONS))
@pytest.mark.parametrize("scalar_gate", [False, True])
@pytest.mark.parametrize("flavour", ["states", "replay"])
def test_commit_every_accepted_length(options, scalar_gate, flavour):
    tokens, kwargs, pool, indices = _drafts(options, scalar_gate)
    before = pool.clone()
    o, states = speculative.verify(*tokens, pool, indices, **kwargs)
    assert torch.equal(pool, before), "verify wrote the pool"
    start = torch.where((indices >= 0)[:, None, None, None], before[indices.clamp(min=0)], 0)
    o_ref, _ = kda_ops.fused_recurrent_kda(*tokens, initial_state=start, **kwargs)
    torch.testing.assert_close(o, o_ref)
    for shift in range(DRAFT + 1):  # every sequence sees every accepted length 0..T
        accepted = (torch.arange(len(INDICES)) + shift) % (DRAFT + 1)
        committed = before.clone()
        if flavour == "states":
            speculative.commit(committed, states, accepted, indices)
        else:
            speculative.commit_by_replay(*tokens, committed, accepted, indices, **kwargs)
        expected = _expected_pool(tokens, kwargs, before, indices, accepted)
        torch.testing.assert_close(committed, expected)
        untouched = [s for s in range(POOL_SLOTS) if s not in INDICES]
        assert torch.equal(committed[untouched], before[untouched])
        unaccepted = [s for s, a in zip(INDICES, accepted.tolist()) if s >= 0 and a == 0]
        assert torch.equal(committed[unaccepted], before[unaccepted])


def test_commit_without_indices_uses_slot_n():
    tokens, kwargs, _, _ = _drafts("precomputed")
    pool = torch.randn(len(INDICES), 4, 8, 4, dtype=torch.float64)
    _, states = speculative.verify(*tokens, pool, **kwargs)
    accepted = torch.tensor([3, 0, 1, 2])
    expected = _expected_pool(tokens, kwargs, pool, torch.arange(len(INDICES)), accepted)
    speculative.commit(pool, states, accepted)
    torch.testing.assert_close(pool, expected)


@pytest.mark.parametrize("indices", [None, torch.tensor(INDICES)])
def test_opcheck_verify_and_commit(indices):
    tokens, _, pool, _ = _drafts("in_kernel")
    x_gate = delta_rule_inputs(value_heads=4, raw_gate=True)
    pool = pool if indices is not None else pool[: len(INDICES)].clone()
    args = (*tokens, x_gate.A_log, x_gate.dt_bias, pool, indices, 0.5, -5.0, True, True)
    opcheck(torch.ops.kda.verify.default, args)
    _, states = torch.ops.kda.verify(*args)
    accepted = torch.tensor([1, 3, 0, 2])
    opcheck(torch.ops.kda.commit_.default, (pool.clone(), indices, states, accepted))


def test_commit_rejects_bad_arguments():
    tokens, _, pool, indices = _drafts("precomputed")
    _, states = speculative.verify(*tokens, pool, indices)
    with pytest.raises(TypeError, match="commit: `accepted_lengths` must have dtype"):
        speculative.commit(pool, states, torch.zeros(4), indices)
    with pytest.raises(ValueError, match="commit: `accepted_lengths` must have shape"):
        speculative.commit(pool, states, torch.zeros(3, dtype=torch.int64), indices)
    with pytest.raises(ValueError, match="commit: `state_pool` must have shape"):
        speculative.commit(pool[:, :2], states, torch.zeros(4, dtype=torch.int64), indices)
    with pytest.raises(ValueError, match="verify: `state_indices` must have shape"):
        speculative.verify(*tokens, pool, indices[:2])
