"""chunk_kda(..., return_intermediate_states=True): the state at the start of every chunk
(what a prefix cache stores), fixed length and packed sequences, and its argument checks."""

import pytest
import torch

import kda_ops
from tests.kda_ops.inputs import delta_rule_inputs

CHUNK = 64
IN_KERNEL = dict(use_gate_in_kernel=True, use_qk_l2norm_in_kernel=True,
                 use_beta_sigmoid_in_kernel=True, lower_bound=-5.0)  # fmt: skip


def kwargs_of(x, **extra):
    """chunk_kda keyword arguments for inputs x, gate computed in the kernel."""
    return dict(q=x.q, k=x.k, v=x.v, g=x.g, beta=x.beta, A_log=x.A_log, dt_bias=x.dt_bias,
                **IN_KERNEL, **extra)  # fmt: skip


def prefix(kwargs, start, stop):
    """The arguments restricted to tokens [start, stop) of every sequence of the batch."""
    sliced = {n: t[:, start:stop] for n, t in kwargs.items() if n in ("q", "k", "v", "g", "beta")}
    return {**kwargs, **sliced}


@pytest.mark.parametrize("scalar_gate", [False, True], ids=["kda", "gdn"])
def test_fixed_length_states_are_prefix_final_states(scalar_gate):
    x = delta_rule_inputs(batch=2, length=150, raw_gate=True, scalar_gate=scalar_gate)
    kwargs = kwargs_of(x, initial_state=x.initial_state)
    o, final, h = kda_ops.chunk_kda(**kwargs, output_final_state=True,
                                    return_intermediate_states=True)  # fmt: skip
    o_plain, final_plain = kda_ops.chunk_kda(**kwargs, output_final_state=True)

    assert h.shape == (2, 3, 2, 8, 4) and h.dtype == torch.float64
    assert torch.equal(o, o_plain) and torch.equal(final, final_plain)
    assert torch.equal(h[:, 0], x.initial_state)
    for c in (1, 2):
        _, expected = kda_ops.chunk_kda(**prefix(kwargs, 0, CHUNK * c), output_final_state=True)
        torch.testing.assert_close(h[:, c], expected)


def test_varlen_rows_follow_chunk_offsets():
    cu_seqlens = torch.tensor([0, 1, 130, 194, 200], dtype=torch.int32)
    x = delta_rule_inputs(length=200, n_seqs=4, raw_gate=True)
    kwargs = kwargs_of(x, initial_state=x.initial_state)
    o, final, h = kda_ops.chunk_kda(**kwargs, cu_seqlens=cu_seqlens, output_final_state=True,
                                    return_intermediate_states=True)  # fmt: skip
    offsets = kda_ops.chunk_offsets(cu_seqlens)

    assert offsets.tolist() == [0, 1, 4, 5, 6] and offsets.dtype == torch.int32
    assert h.shape == (1, 200 // CHUNK + 4, 2, 8, 4)
    bounds = cu_seqlens.tolist()
    for n in range(4):
        single = prefix(kwargs, bounds[n], bounds[n + 1])
        single["initial_state"] = x.initial_state[n : n + 1]
        _, _, h_single = kda_ops.chunk_kda(**single, return_intermediate_states=True)
        torch.testing.assert_close(h[0, offsets[n] : offsets[n + 1]], h_single[0])
    assert torch.equal(h[0, offsets[-1] :], torch.zeros_like(h[0, offsets[-1] :]))
    o_plain, final_plain = kda_ops.chunk_kda(**kwargs, cu_seqlens=cu_seqlens,
                                             output_final_state=True)  # fmt: skip
    assert torch.equal(o, o_plain) and torch.equal(final, final_plain)


def test_without_initial_state_or_final_state():
    x = delta_rule_inputs(length=70, raw_gate=True)
    _, final, h = kda_ops.chunk_kda(**kwargs_of(x), return_intermediate_states=True)
    assert final is None
    assert torch.equal(h[:, 0], torch.zeros_like(h[:, 0]))
    assert h.shape == (1, 2, 2, 8, 4)


def test_inference_only():
    x = delta_rule_inputs(length=20, raw_gate=True, requires_grad=True)
    with pytest.raises(ValueError, match="chunk_kda: `return_intermediate_states=True` is "
                                         "inference only"):  # fmt: skip
        kda_ops.chunk_kda(**kwargs_of(x), return_intermediate_states=True)
    with torch.no_grad():
        _, _, h = kda_ops.chunk_kda(**kwargs_of(x), return_intermediate_states=True)
    with torch.inference_mode():
        _, _, h_inference = kda_ops.chunk_kda(**kwargs_of(x), return_intermediate_states=True)
    assert torch.equal(h, h_inference) and not h.requires_grad


@pytest.mark.parametrize("flag", [1, None, "yes"])
def test_flag_must_be_bool(flag):
    x = delta_rule_inputs(length=5)
    with pytest.raises(TypeError, match="`return_intermediate_states` must be a bool"):
        kda_ops.chunk_kda(x.q, x.k, x.v, x.g, x.beta, return_intermediate_states=flag)


@pytest.mark.parametrize("flag", [1, None, "yes"])
def test_disable_recompute_must_be_bool(flag):
    x = delta_rule_inputs(length=5)
    with pytest.raises(TypeError, match="chunk_kda: `disable_recompute` must be a bool"):
        kda_ops.chunk_kda(x.q, x.k, x.v, x.g, x.beta, disable_recompute=flag)


def test_disable_recompute_is_not_for_inference_states():
    x = delta_rule_inputs(length=5)
    message = "chunk_kda: `return_intermediate_states=True` is inference only and `disable_"
    with pytest.raises(ValueError, match=message):
        kda_ops.chunk_kda(x.q, x.k, x.v, x.g, x.beta, return_intermediate_states=True,
                          disable_recompute=True)  # fmt: skip


def test_chunk_offsets_checks_its_argument():
    with pytest.raises(TypeError, match="chunk_offsets: `cu_seqlens` must have dtype"):
        kda_ops.chunk_offsets(torch.tensor([0.0, 3.0]))
    with pytest.raises(ValueError, match="chunk_offsets: `cu_seqlens` must be 1-D"):
        kda_ops.chunk_offsets(torch.zeros(2, 2, dtype=torch.int32))


def test_compiles_with_dynamic_length():
    compiled = torch.compile(kda_ops.chunk_kda, fullgraph=True, dynamic=True)
    for length in (70, 130):
        x = delta_rule_inputs(length=length, raw_gate=True)
        kwargs = kwargs_of(x, initial_state=x.initial_state, output_final_state=True,
                          return_intermediate_states=True)  # fmt: skip
        for got, expected in zip(compiled(**kwargs), kda_ops.chunk_kda(**kwargs)):
            torch.testing.assert_close(got, expected)
