"""Gated DeltaNet (one decay a head, ``g`` ``[B, T, HV]``) on the GPU: the forward in 16-
and 64-token chunks, in segments, packed, with strong decays, and the training step's
gradients, against the float64 reference; the forward against FLA's
``chunk_gated_delta_rule`` where fla-core is installed."""

import pytest
import torch

import kda_ops
from kda_ops.kernels.chunk.launch import launch_chunk_kda
from kda_ops.signature import DeltaRuleInputs, DeltaRuleOptions
from tests.kda_ops.kernels.devices import relative_error
from tests.kda_ops.test_gpu import (
    REFERENCE_GRAD_TOLERANCE,
    assert_at_least_as_accurate_as_fla,
    chunk_kda_grads,
    float64,
    needs_fla,
)

pytestmark = pytest.mark.gpu
IN_KERNEL = dict(use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True)
PACKED = [0, 1, 300, 1000, 2100, 4096]


def gdn_inputs(length, heads=2, value_heads=4, dim=128, pregated=False, decay=1.0):
    """bf16 q, k ``[1, T, H, D]``, v ``[1, T, HV, D]``, beta and g ``[1, T, HV]``: a raw
    gate with A_log / dt_bias ``[HV]`` for the in-kernel softplus gate, or with
    ``pregated`` the log-decay itself, about ``-decay`` a token."""

    def rand(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, device="cuda").to(dtype)

    x = dict(q=rand(1, length, heads, dim), k=rand(1, length, heads, dim),
             v=rand(1, length, value_heads, dim), beta=rand(1, length, value_heads))  # fmt: skip
    if pregated:
        g = -decay * torch.rand(1, length, value_heads, device="cuda") * 2.0
        x.update(g=g.to(torch.bfloat16), A_log=None, dt_bias=None)
        return x, dict(IN_KERNEL, use_gate_in_kernel=False)
    x.update(g=rand(1, length, value_heads), A_log=torch.rand(value_heads, device="cuda"),
             dt_bias=rand(value_heads, dtype=torch.float32))  # fmt: skip
    return x, dict(IN_KERNEL, use_gate_in_kernel=True)


def reference(x, options, state, cu_seqlens=None):
    tensors = {name: t for name, t in x.items() if t is not None}
    return kda_ops.chunk_kda(**float64(tensors), **options, initial_state=state.double(),
                             cu_seqlens=cu_seqlens, output_final_state=True)  # fmt: skip


def kernel(x, options, state, cu_seqlens=None, **choices):
    """``launch_chunk_kda`` with the forward's choices forced (``chunk``, ``segments``)."""
    inputs = DeltaRuleInputs(*(x[name] for name in DeltaRuleInputs._fields))
    softplus_gate = DeltaRuleOptions(128**-0.5, None, True, True)
    return launch_chunk_kda(inputs, state, cu_seqlens, softplus_gate, **choices)


@pytest.mark.parametrize("chunk", [16, 64])
@pytest.mark.parametrize("pregated", [False, True], ids=["softplus", "pregated"])
@pytest.mark.parametrize("varlen", [False, True], ids=["fixed", "varlen"])
def test_forward_against_float64_reference(chunk, pregated, varlen):
    x, options = gdn_inputs(PACKED[-1], pregated=pregated)
    cu_seqlens = None
    if varlen:
        cu_seqlens = torch.tensor(PACKED, device="cuda", dtype=torch.int32)
    state = torch.randn(len(PACKED) - 1 if varlen else 1, 4, 128, 128, device="cuda")
    o, final = kernel(x, options, state, cu_seqlens, chunk=chunk)
    o_ref, final_ref = reference(x, options, state, cu_seqlens)
    assert relative_error(o, o_ref) < 5e-3
    assert relative_error(final, final_ref) < 5e-3


@pytest.mark.parametrize("chunk", [16, 64])
def test_strong_decays_are_exact(chunk):
    """A log-decay of ~10 a token (e^160 over a 16-token block, e^640 over a chunk): the
    scalar gate's diagonal blocks are exact for any decay."""
    x, options = gdn_inputs(1000, pregated=True, decay=10.0)
    state = torch.randn(1, 4, 128, 128, device="cuda")
    o, final = kernel(x, options, state, chunk=chunk)
    o_ref, final_ref = reference(x, options, state)
    assert torch.isfinite(o).all() and torch.isfinite(final).all()
    assert relative_error(o, o_ref) < 5e-3
    assert relative_error(final, final_ref) < 5e-3


@pytest.mark.parametrize("chunk", [16, 64])
@pytest.mark.parametrize("segments", [2, 4])
def test_segments_against_float64_reference(chunk, segments):
    x, options = gdn_inputs(8192)
    state = torch.randn(1, 4, 128, 128, device="cuda")
    o, final = kernel(x, options, state, chunk=chunk, segments=segments)
    o_ref, final_ref = reference(x, options, state)
    assert relative_error(o, o_ref) < 5e-3
    assert relative_error(final, final_ref) < 5e-3


@needs_fla
@pytest.mark.parametrize("length", [8192, 32768])
def test_forward_against_fla(length):
    """The planned forward (Qwen3-Next's 16 q / k and 32 value heads) against FLA's, both
    measured against float64 on the first q / k head's value heads."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    x, options = gdn_inputs(length, heads=16, value_heads=32)
    state = torch.randn(1, 32, 128, 128, device="cuda")
    kwargs = dict(options, initial_state=state, output_final_state=True)
    ours = kda_ops.chunk_kda(**x, **kwargs)
    fla = chunk_gated_delta_rule(**x, **kwargs)
    part = {name: t[:, :, :1] if name in ("q", "k") else t[:, :, :2] if t.dim() >= 3 else t[:2]
            for name, t in x.items()}  # fmt: skip
    expected = reference(part, options, state[:, :2])
    assert_at_least_as_accurate_as_fla((ours[0][:, :, :2], ours[1][:, :2]),
                                       (fla[0][:, :, :2], fla[1][:, :2]), expected)  # fmt: skip


@pytest.mark.parametrize("pregated", [False, True], ids=["softplus", "pregated"])
@pytest.mark.parametrize("varlen", [False, True], ids=["fixed", "varlen"])
def test_training_gradients_against_float64_reference(pregated, varlen):
    x, options = gdn_inputs(1000, pregated=pregated)
    x = {name: t for name, t in x.items() if t is not None}
    cu_seqlens = None
    if varlen:
        cu_seqlens = torch.tensor([0, 1, 300, 1000], device="cuda", dtype=torch.int32)
    state = torch.randn(3 if varlen else 1, 4, 128, 128, device="cuda")
    grad_o = torch.randn_like(x["v"])
    grad_state = torch.randn_like(state)
    kwargs = dict(options, cu_seqlens=cu_seqlens, output_final_state=True)
    grads = chunk_kda_grads(kda_ops.chunk_kda, x, state, grad_o, grad_state, **kwargs)
    expected = chunk_kda_grads(kda_ops.chunk_kda, float64(x), state.double(), grad_o.double(),
                               grad_state.double(), **kwargs)  # fmt: skip
    errors = {name: relative_error(grads[name], expected[name]) for name in expected}
    assert all(errors[name] < REFERENCE_GRAD_TOLERANCE[name] for name in errors), errors
