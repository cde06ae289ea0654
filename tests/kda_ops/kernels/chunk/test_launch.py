"""The chunked forward (``launch_chunk_kda``: the prepare kernel, then the recurrence)
against the token recurrence of the reference."""

import pytest
import torch

from kda_ops import reference
from kda_ops.kernels.chunk import launch
from kda_ops.kernels.chunk.launch import launch_chunk_kda
from tests.kda_ops.inputs import delta_rule_inputs, grouped
from tests.kda_ops.kernels.devices import DEVICE, DTYPES, TOLERANCE, relative_error

VARIANTS = {
    # name: (in-kernel gate, lower bound, scalar gate)
    "safe_gate": (True, -5.0, False),
    "softplus_gate": (True, None, False),
    "pregated": (False, None, False),
    "gdn": (True, None, True),
    "gdn_pregated": (False, None, True),
}


def run(variant, dtype=torch.float32, cu_seqlens=None, initial_state=True, gate_shift=0.0,
        chunk=None, **shape):  # fmt: skip
    """Kernel and float64 reference on the same random inputs (``gate_shift`` added to
    the raw gate; ``chunk``: ``launch_chunk_kda``'s)."""
    gate, lower_bound, scalar_gate = VARIANTS[variant]
    x = delta_rule_inputs(raw_gate=gate, unit_qk=not gate, scalar_gate=scalar_gate,
                          dtype=torch.float32, **shape)  # fmt: skip
    x.g = x.g + gate_shift
    low = {"q", "k", "v", "g", "beta"}
    for name, t in vars(x).items():
        setattr(x, name, t.to(DEVICE, dtype if name in low else torch.float32))
    args = (x.q, x.k, x.v, x.g, x.beta, x.A_log if gate else None, x.dt_bias if gate else None,
            x.initial_state if initial_state else None, cu_seqlens, 0.3,
            lower_bound if gate else None, gate, gate)  # fmt: skip
    expected = reference.delta_rule(reference.recurrent_delta_rule, *args)
    return launch_chunk_kda(*grouped(*args), chunk=chunk), expected


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("dtype", DTYPES)
def test_fixed_length(variant, dtype):
    (o, state), (o_ref, state_ref) = run(variant, dtype, batch=2, length=70, heads=1,
                                         value_heads=2, head_k=16, head_v=16)  # fmt: skip
    assert o.dtype == dtype and state.dtype == torch.float32
    assert relative_error(o, o_ref) < TOLERANCE[dtype]
    assert relative_error(state, state_ref) < TOLERANCE[dtype]


@pytest.mark.parametrize("bounds", [None, [0, 1, 70, 150]])
def test_tensor_core_paths_on_fp32_inputs(monkeypatch, bounds):
    """What 16-bit inputs compile to, run in the interpreter on fp32 inputs by giving
    their launch tensor-core precision ("tf32", which the interpreter computes in fp32):
    the prepare's fp16 inverse and w product (l2norm and the β sigmoid bound their
    operands) and the recurrence's unmasked full steps. Within fp16's unit roundoff of
    the float64 reference, fixed length and packed."""
    flags = launch.prepare_flags
    monkeypatch.setattr(launch, "prepare_flags",
                        lambda *args: {**flags(*args), "DOT_PRECISION": "tf32"})  # fmt: skip
    cu_seqlens = None if bounds is None else torch.tensor(bounds, device=DEVICE).int()
    shape = dict(batch=2, length=70) if bounds is None else dict(length=150, n_seqs=3)
    (o, state), (o_ref, state_ref) = run("safe_gate", cu_seqlens=cu_seqlens, heads=1,
                                         value_heads=2, head_k=32, head_v=16, **shape)  # fmt: skip
    assert relative_error(o, o_ref) < 2.0**-11
    assert relative_error(state, state_ref) < 2.0**-11


@pytest.mark.parametrize("variant", ["softplus_gate", "pregated"])
def test_large_decays_inside_a_block(variant):
    """Decays of ~10 per token, far past what one dense dot per 16-row block can hold
    (e^160 over a block): the dyadic diagonal path stays finite and exact."""
    shift = 10.0 if variant == "softplus_gate" else -10.0  # pregated g is the log-decay
    (o, state), (o_ref, state_ref) = run(variant, gate_shift=shift, length=70, heads=1,
                                         value_heads=2, head_k=16, head_v=16)  # fmt: skip
    assert o.isfinite().all() and state.isfinite().all()
    assert relative_error(o, o_ref) < TOLERANCE[torch.float32]
    assert relative_error(state, state_ref) < TOLERANCE[torch.float32]


@pytest.mark.parametrize("variant", ["gdn", "gdn_pregated"])
def test_scalar_gate_large_decays_in_one_pass(monkeypatch, variant):
    """A scalar gate's diagonal blocks are exact for any decay: decays of ~10 per token
    (e^160 over a block) in one "all" launch of the prepare kernel, finite and exact."""
    passes = []
    kernel = launch.PrepareStep.launches

    def recorded(step, *args):
        launches = kernel(step, *args)
        passes.extend(launched.args["CHUNKS"] for launched in launches)
        return launches

    monkeypatch.setattr(launch.PrepareStep, "launches", recorded)
    shift = 10.0 if variant == "gdn" else -10.0  # pregated g is the log-decay
    (o, state), (o_ref, state_ref) = run(variant, gate_shift=shift, length=70, heads=1,
                                         value_heads=2, head_k=16, head_v=16)  # fmt: skip
    assert passes == ["all"]
    assert o.isfinite().all() and state.isfinite().all()
    assert relative_error(o, o_ref) < TOLERANCE[torch.float32]
    assert relative_error(state, state_ref) < TOLERANCE[torch.float32]


@pytest.mark.parametrize("variant", ["safe_gate", "softplus_gate", "gdn_pregated"])
@pytest.mark.parametrize("bounds", [None, [0, 1, 70, 150]])
def test_64_token_chunks(variant, bounds):
    """The forward in 64-token prepare chunks and recurrence steps (``chunk=64``, which
    ``forward_chunk`` picks for long scans): a partial last chunk, fixed length and
    packed."""
    cu_seqlens = None if bounds is None else torch.tensor(bounds, device=DEVICE).int()
    shape = dict(batch=2, length=70) if bounds is None else dict(length=150, n_seqs=3)
    (o, state), (o_ref, state_ref) = run(variant, cu_seqlens=cu_seqlens, chunk=64, heads=1,
                                         value_heads=2, head_k=16, head_v=16, **shape)  # fmt: skip
    assert relative_error(o, o_ref) < TOLERANCE[torch.float32]
    assert relative_error(state, state_ref) < TOLERANCE[torch.float32]


def test_chunk_must_be_16_or_64():
    with pytest.raises(ValueError, match="chunk must be 16 or 64"):
        run("gdn", chunk=32, length=20, head_k=16)


def test_dense_and_dyadic_chunks_in_one_call():
    """Without the safe gate every chunk takes the dense diagonal dots first (the first
    launch); one with a block decaying past e^80 is redone by the dyadic split (the
    second), its overflowed dense outputs overwritten.
    Decays of ~10 per token in the second chunk only (the dense dots would overflow
    there) and ordinary ones around it."""
    shift = torch.zeros(150, 1, 1)
    shift[64:128] = 10.0
    (o, state), (o_ref, state_ref) = run("softplus_gate", gate_shift=shift, length=150,
                                         heads=1, value_heads=2, head_k=16, head_v=16)  # fmt: skip
    assert o.isfinite().all() and state.isfinite().all()
    assert relative_error(o, o_ref) < TOLERANCE[torch.float32]
    assert relative_error(state, state_ref) < TOLERANCE[torch.float32]


@pytest.mark.parametrize(
    "bounds",
    [
        [0, 1, 70, 150],
        # empty sequences (a server's idle slots) before, between and after others: each
        # keeps its initial state as its final state
        [0, 0, 40, 40, 40, 110, 110],
    ],
)
def test_varlen_gva_and_padded_head_dims(bounds):
    cu_seqlens = torch.tensor(bounds, device=DEVICE, dtype=torch.int32)
    (o, state), (o_ref, state_ref) = run(
        "safe_gate", cu_seqlens=cu_seqlens, length=bounds[-1], n_seqs=len(bounds) - 1,
        heads=1, value_heads=2, head_k=8, head_v=24,
    )  # fmt: skip
    torch.testing.assert_close(o, o_ref.float())
    torch.testing.assert_close(state, state_ref)


def test_wide_head_dims():
    """K = 192, V = 256: 256-wide tiles with masked key columns, launched on the GPU with
    fewer pipeline stages and more warps than up to 128 (``scan_stages``)."""
    (o, state), (o_ref, state_ref) = run("safe_gate", length=20, heads=1, value_heads=1,
                                         head_k=192, head_v=256)  # fmt: skip
    assert relative_error(o, o_ref) < TOLERANCE[torch.float32]
    assert relative_error(state, state_ref) < TOLERANCE[torch.float32]


def test_without_initial_state():
    (o, state), (o_ref, state_ref) = run("gdn", initial_state=False, length=20, head_k=16)
    torch.testing.assert_close(o, o_ref.float())
    torch.testing.assert_close(state, state_ref)


@pytest.mark.parametrize(
    ("variant", "cu_seqlens", "shape"),
    [
        pytest.param("safe_gate", None, dict(batch=2, length=130), marks=pytest.mark.exhaustive),
        # A 1-token sequence, partial last chunks, and one unused row of the upper bound.
        ("safe_gate", [0, 1, 65, 150], dict(length=150, n_seqs=3)),
        pytest.param("gdn", [0, 64, 100], dict(length=100, n_seqs=2), marks=pytest.mark.exhaustive),
    ],
    ids=["fixed", "varlen", "gdn_varlen"],
)
def test_chunk_states(variant, cu_seqlens, shape):
    """STORE_CHUNK_STATES writes the state entering every chunk at its global row and
    leaves the rest of the buffer alone; outputs are those of the plain launch."""
    if cu_seqlens is not None:
        cu_seqlens = torch.tensor(cu_seqlens, device=DEVICE, dtype=torch.int32)
    gate, lower_bound, scalar_gate = VARIANTS[variant]
    x = delta_rule_inputs(raw_gate=gate, unit_qk=not gate, scalar_gate=scalar_gate,
                          dtype=torch.float32, heads=1, value_heads=2, head_k=8, head_v=24,
                          **shape)  # fmt: skip
    args = (*(t.to(DEVICE) for t in x.tensors()), cu_seqlens, 0.3, lower_bound, gate, gate)
    _, _, expected = reference.delta_rule(reference.chunk_delta_rule_with_states, *args)
    expected = expected.flatten(0, 1)  # [rows used, HV, K, V]
    n_seqs = None if cu_seqlens is None else cu_seqlens.shape[0] - 1
    rows = reference.chunk_state_rows(x.q.shape[0], x.q.shape[1], n_seqs)
    chunk_states = torch.full((rows, *expected.shape[1:]), float("nan"), device=DEVICE)

    o, state = launch_chunk_kda(*grouped(*args), chunk_states=chunk_states)
    o_plain, state_plain = launch_chunk_kda(*grouped(*args))

    used = expected.shape[0]
    assert used == (rows if cu_seqlens is None else rows - 1)
    torch.testing.assert_close(chunk_states[:used], expected)
    assert chunk_states[used:].isnan().all()
    assert torch.equal(o, o_plain) and torch.equal(state, state_plain)
    # The backward's re-run: states only, no output products.
    states_only = torch.full_like(chunk_states, float("nan"))
    no_output, state_only = launch_chunk_kda(*grouped(*args), chunk_states=states_only,
                                             output=False)  # fmt: skip
    assert no_output is None and torch.equal(state_only, state)
    assert torch.equal(states_only[:used], chunk_states[:used])
