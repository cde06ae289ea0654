"""The chunked backward (``launch_chunk_kda_backward``) against autograd through the float64
reference."""

import pytest
import torch

from kda_ops import reference
from kda_ops.delta_rule_ops import saved_like
from kda_ops.kernels.chunk.backward.launch import (
    launch_chunk_kda_backward,
    launch_chunk_kda_training,
)
from kda_ops.kernels.chunk.backward.saved import ROWS
from kda_ops.kernels.chunk.launch import launch_chunk_kda
from tests.kda_ops.inputs import delta_rule_inputs, grouped
from tests.kda_ops.kernels.devices import DEVICE, DTYPES, relative_error
from tests.sweeps import sweep

VARIANTS = {
    # name: (in-kernel gate, lower bound, scalar gate)
    "safe_gate": (True, -5.0, False),
    "softplus_gate": (True, None, False),
    "pregated": (False, None, False),
    "gdn": (True, None, True),
}
NAMES = ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "initial_state")
# Relative error of every gradient against float64 (low-precision inputs: GPU only).
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 1e-2}


def kernel_inputs(variant, dtype=torch.float32, cu_seqlens=None, initial_state=True,
                  heads=1, value_heads=2, gate_shift=0.0, **shape):  # fmt: skip
    """Random primals (``NAMES``' order), cu_seqlens, the op's config, cotangents of o and
    of the final state (by default one q/k head and two value heads, a group the
    launcher sums; ``gate_shift`` is added to the raw gate)."""
    gate, lower_bound, scalar_gate = VARIANTS[variant]
    x = delta_rule_inputs(raw_gate=gate, unit_qk=not gate, scalar_gate=scalar_gate,
                          dtype=torch.float32, heads=heads, value_heads=value_heads,
                          **shape)  # fmt: skip
    low = {"q", "k", "v", "g", "beta"}
    inputs = {n: t.to(DEVICE, dtype if n in low else torch.float32) for n, t in vars(x).items()}
    inputs["g"] = inputs["g"] + gate_shift
    if not gate:
        inputs["A_log"] = inputs["dt_bias"] = None
    if not initial_state:
        inputs["initial_state"] = None
    if cu_seqlens is not None:
        cu_seqlens = torch.tensor(cu_seqlens, device=DEVICE, dtype=torch.int32)
    config = (0.3, lower_bound if gate else None, gate, gate)
    grad_o = torch.randn_like(inputs["v"])
    grad_state = torch.randn_like(x.initial_state, device=DEVICE)
    return tuple(inputs[n] for n in NAMES), cu_seqlens, config, grad_o, grad_state


def check_gradients(variant, dtype=torch.float32, **options):
    """Kernel gradients of ``kernel_inputs(variant, dtype, **options)`` vs
    ``reference.vjp`` in float64."""
    primals, cu_seqlens, config, grad_o, grad_state = kernel_inputs(variant, dtype, **options)
    got = launch_chunk_kda_backward(*grouped(*primals, cu_seqlens, grad_o, grad_state, *config))
    assert_matches_float64(got, primals, cu_seqlens, config, grad_o, grad_state, dtype)


def assert_matches_float64(got, primals, cu_seqlens, config, grad_o, grad_state, dtype):
    """``got`` (the backward launch's gradients) against ``reference.vjp`` in float64."""

    def forward(*p):
        return reference.delta_rule(reference.chunk_delta_rule, *p, cu_seqlens, *config)

    double = tuple(None if p is None else p.double() for p in primals)
    expected = reference.vjp(forward, double, (grad_o.double(), grad_state.double()))
    floors = {name: 0.0 for name in NAMES}
    if dtype == torch.float32:
        # What fp32 arithmetic itself achieves: with large decays dA_log and d dt_bias are
        # sums over tokens that cancel to a small fraction of their terms, where the
        # reference run in fp32 is already off by ~1e-2 (CPU, softplus gate + 10).
        in_fp32 = reference.vjp(forward, primals, (grad_o, grad_state))
        floors = {n: 0.0 if a is None else relative_error(a, b)
                  for n, a, b in zip(NAMES, in_fp32, expected)}  # fmt: skip
    for name, primal, grad, grad_ref in zip(NAMES, primals, got, expected):
        if primal is None:
            assert grad.numel() == 0, name
            continue
        assert grad.shape == primal.shape and grad.dtype == primal.dtype, name
        assert grad.isfinite().all(), name
        # Some gradients are exactly zero (a lone token's decay multiplies a zero state):
        # there, rounding noise is judged against the tolerance in absolute terms. A
        # blocked fp32 kernel may err up to 10x the fp32 reference's own error.
        tolerance = max(TOLERANCE[dtype], 10 * floors[name])
        error = relative_error(grad, grad_ref)
        assert error < tolerance or (grad.double() - grad_ref).abs().max() < tolerance, name


@pytest.mark.parametrize(
    ("variant", "shape"),
    [
        pytest.param("safe_gate", dict(batch=2, length=130), marks=pytest.mark.exhaustive),
        ("softplus_gate", dict(length=70)),
        pytest.param("pregated", dict(length=70), marks=pytest.mark.exhaustive),
        ("gdn", dict(length=70)),
    ],
    ids=lambda p: p if isinstance(p, str) else f"T{p['length']}",
)
@pytest.mark.parametrize("dtype", DTYPES)
def test_variants(variant, shape, dtype):
    check_gradients(variant, dtype, head_k=16, head_v=16, **shape)


@pytest.mark.parametrize("variant", sweep(["safe_gate", "pregated"], keep=[("pregated",)]))
def test_ungrouped_heads(variant):
    """HV == H: the kernel finishes dq and dk itself (l2norm backward included)."""
    check_gradients(variant, value_heads=1, batch=2, length=70, head_k=16, head_v=16)


def test_several_groups():
    """H = 2 q/k heads, each shared by two of HV = 4 value heads."""
    check_gradients("gdn", heads=2, value_heads=4, length=20, head_k=16, head_v=16)


@pytest.mark.parametrize("length", sweep([1, 20], keep=[(1,)]))
def test_short_without_initial_state(length):
    check_gradients("gdn", initial_state=False, length=length, head_k=16, head_v=16)
    check_gradients("safe_gate", initial_state=False, length=length, head_k=16, head_v=16)


def test_varlen_and_padded_head_dims():
    """A 1-token sequence, partial last chunks and an unused row of the chunk grid; K and
    V that are not powers of two."""
    check_gradients("safe_gate", cu_seqlens=[0, 1, 70, 150], length=150, n_seqs=3,
                    head_k=8, head_v=24)  # fmt: skip


def test_varlen_dyadic_diagonal():
    """Packed sequences through the dyadic (any gate) diagonal-block path."""
    check_gradients("softplus_gate", cu_seqlens=[0, 40, 100], length=100, n_seqs=2,
                    head_k=8, head_v=24)  # fmt: skip


def test_several_value_blocks():
    """V = 40: two value blocks of 32 (the second partly masked) in the scan's grid and in
    the WY kernel's pass over V; K = 40 likewise in its pass over K (padded to 64)."""
    check_gradients("safe_gate", length=70, head_k=40, head_v=40)


def test_wide_head_dims():
    """K = 192, V = 256: 256-wide tiles with masked key columns, the WY kernel at its
    narrower value step past 128 key columns (``wy_launch``)."""
    check_gradients("safe_gate", value_heads=1, length=20, head_k=192, head_v=256)


@pytest.mark.parametrize("variant", ["safe_gate", "softplus_gate"])
@pytest.mark.parametrize("gate_shift", [-30.0, 30.0])
def test_extreme_gates(variant, gate_shift):
    """Saturated gates: no decay at all, or (softplus at +30) the state forgotten at every
    token, where every decay factor underflows."""
    check_gradients(variant, gate_shift=gate_shift, length=40, head_k=16, head_v=16)


@pytest.mark.parametrize("variant", ["softplus_gate", "pregated"])
def test_large_decays_inside_a_block(variant):
    """Decays of ~10 per token (e^160 over a 16-row block), where neighbouring pairs still
    count (e^-10) but no reference row can hold a whole block: the dyadic diagonal path
    stays finite and exact."""
    shift = 10.0 if variant == "softplus_gate" else -10.0  # pregated g is the log-decay
    check_gradients(variant, gate_shift=shift, length=70, head_k=16, head_v=16)


@pytest.mark.parametrize("variant", sweep(["softplus_gate", "pregated"], keep=[("pregated",)]))
def test_dense_and_dyadic_chunks_in_one_call(variant):
    """Without the safe gate the pairs kernel runs twice: the chunks whose blocks decay
    within e^75 take the dense diagonal blocks, the ones the prepare kernel flags the
    dyadic split. Decays of ~10 a token in the second of three chunks only."""
    shift = torch.zeros(150, 1, 1, device=DEVICE)
    shift[64:128] = 10.0 if variant == "softplus_gate" else -10.0
    check_gradients(variant, gate_shift=shift, length=150, head_k=16, head_v=16)


@pytest.mark.parametrize(
    ("variant", "head_v"),
    sweep(["safe_gate", "softplus_gate", "gdn"], [16, 24], keep=[("softplus_gate", 16)]),
)
def test_training_forward_keeps_what_the_backward_needs(variant, head_v):
    """``launch_chunk_kda_training`` gives ``launch_chunk_kda``'s o and final state, and the
    backward from what it keeps equals the backward that prepares for itself (same
    kernels on the same inputs: bit for bit); packed sequences. With K == V the backward
    also reuses the kept qg and kd as scratch."""
    primals, cu_seqlens, config, grad_o, grad_state = kernel_inputs(
        variant, cu_seqlens=[0, 50, 150], length=150, n_seqs=2, head_k=16, head_v=head_v
    )
    o, final_state, saved = launch_chunk_kda_training(*grouped(*primals, cu_seqlens, *config))
    expected_o, expected_state = launch_chunk_kda(*grouped(*primals, cu_seqlens, *config))
    assert relative_error(o, expected_o) < 1e-6
    assert relative_error(final_state, expected_state) < 1e-6
    got = launch_chunk_kda_backward(*grouped(*primals, cu_seqlens, grad_o, grad_state, *config),
                                    saved=saved)  # fmt: skip
    expected = launch_chunk_kda_backward(
        *grouped(*primals, cu_seqlens, grad_o, grad_state, *config)
    )
    for name, grad, grad_expected in zip(NAMES, got, expected):
        assert torch.equal(grad, grad_expected), name


@pytest.mark.parametrize("variant", ["softplus_gate", "gdn"])
@pytest.mark.parametrize("keep_rows", [False, True])
@pytest.mark.parametrize("cu_seqlens", [None, [0, 50, 150]], ids=["fixed", "varlen"])
def test_training_op_fake_matches_what_the_launch_keeps(cu_seqlens, keep_rows, variant):
    """kda::chunk_train's fake kernel (``saved_like``) describes the kept tensors exactly:
    shape and dtype of each, in order (what torch.compile traces against); the scalar
    gate's G one a row."""
    primals, cu, config, _, _ = kernel_inputs(
        variant, cu_seqlens=cu_seqlens, length=150, n_seqs=2 if cu_seqlens else None,
        head_k=16, head_v=24,
    )  # fmt: skip
    _, _, saved = launch_chunk_kda_training(*grouped(*primals, cu, *config), keep_rows=keep_rows)
    scalar_gate = variant == "gdn"
    expected = saved_like(primals[0], primals[2], cu, keep_rows, scalar_gate=scalar_gate)
    assert len(saved) == len(expected)
    for got, like in zip(saved, expected):
        assert (got.shape, got.dtype) == (like.shape, like.dtype)


@pytest.mark.parametrize(
    ("variant", "head_v"),
    sweep(
        ["safe_gate", "softplus_gate", "pregated", "gdn"],
        [16, 24, 80],  # K == V, K != V, V over several column blocks
        keep=[("safe_gate", 80), ("gdn", 24)],
    ),
)
def test_rebuilt_rows_match_the_solved_ones(variant, head_v):
    """Kept without G, w, u, qg, kd, the backward rebuilds them from the inputs and T (G by
    one 64-row cumsum, ``w = T β K̂Γ``, ``u = T β V`` as whole products). G is summed in
    another order than kernel 1's, so its gradients are judged against float64 (as the
    other tests'), not bit for bit against the kept rows'; packed sequences, K == V,
    K != V, and V over several of the rebuild's column blocks (``REBUILD_COLUMNS``; K's
    later blocks then lie wholly past K). That backward only reads what was kept, so a second
    one gives the same bits."""
    check_rebuilt_rows(variant, head_k=16, head_v=head_v)


@pytest.mark.parametrize("variant", ["softplus_gate", "gdn"])
def test_rebuilt_rows_with_padded_key_columns(variant):
    """K = 60 in a 64-wide rebuild block: the padding columns carry no gate (the scalar
    gate's G, one a row, is read off a column inside K)."""
    check_rebuilt_rows(variant, head_k=60, head_v=24)


def check_rebuilt_rows(variant, head_k, head_v):
    """``test_rebuilt_rows_match_the_solved_ones`` for one shape."""
    primals, cu_seqlens, config, grad_o, grad_state = kernel_inputs(
        variant, cu_seqlens=[0, 50, 150], length=150, n_seqs=2, head_k=head_k, head_v=head_v
    )
    _, _, saved = launch_chunk_kda_training(*grouped(*primals, cu_seqlens, *config))
    _, _, kept = launch_chunk_kda_training(*grouped(*primals, cu_seqlens, *config), keep_rows=False)
    assert len(kept) == len(saved) - len(ROWS)
    kept_before = [t.clone() for t in kept]
    got = launch_chunk_kda_backward(*grouped(*primals, cu_seqlens, grad_o, grad_state, *config),
                                    saved=kept)  # fmt: skip
    # Bit patterns: T's and Aqk's tiles above the diagonal are never written.
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8))
               for a, b in zip(kept, kept_before))  # fmt: skip
    again = launch_chunk_kda_backward(*grouped(*primals, cu_seqlens, grad_o, grad_state, *config),
                                      saved=kept)  # fmt: skip
    for name, grad, grad_again in zip(NAMES, got, again):
        assert torch.equal(grad, grad_again), name
    assert_matches_float64(got, primals, cu_seqlens, config, grad_o, grad_state, torch.float32)
