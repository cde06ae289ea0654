"""FLA call sites on torch.ops.kda: results against FLA's own PyTorch references (its
``naive`` modules and ``nn.Conv1d``), in-place cache semantics, swaps and restores.
Skipped where ``fla`` (fla-core) cannot be imported."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

fla_kda = pytest.importorskip("fla.ops.kda", reason="fla-core is not installed")

import fla.modules  # noqa: E402
import fla.ops.gated_delta_rule as fla_gdn  # noqa: E402
import fla.ops.kda.chunk  # noqa: E402
from fla.ops.gated_delta_rule.naive import naive_recurrent_gated_delta_rule  # noqa: E402
from fla.ops.kda.naive import naive_recurrent_kda  # noqa: E402

import kda_ops  # noqa: E402
import kda_ops.integrations as integrations  # noqa: E402
from kda_ops.integrations import fla as fla_integration  # noqa: E402


@pytest.fixture
def enabled():
    integrations.enable(["fla"])
    yield
    integrations.disable()


def _inputs(length: int = 37, heads: int = 2, head_k: int = 16, head_v: int = 8):
    q, k = F.normalize(torch.randn(2, 2, length, heads, head_k), dim=-1)
    v = torch.randn(2, length, heads, head_v)
    g = -torch.rand(2, length, heads, head_k) * 0.2
    beta = torch.rand(2, length, heads)
    state = torch.randn(2, heads, head_k, head_v)
    return q, k, v, g, beta, state


def test_swaps_every_binding_and_restores():
    chunk_kda = fla_kda.chunk_kda
    norm_forward = vars(fla.modules.FusedRMSNormGated)["forward"]
    integrations.enable(["fla"])
    try:
        assert fla_kda.chunk_kda is kda_ops.chunk_kda
        assert fla.ops.kda.chunk.chunk_kda is kda_ops.chunk_kda
        assert fla_gdn.chunk_gated_delta_rule is fla_integration.chunk_gated_delta_rule
        assert fla.modules.FusedRMSNormGated.forward is fla_integration.fused_rms_norm_gated_forward
    finally:
        integrations.disable()
    assert fla_kda.chunk_kda is chunk_kda
    assert fla.ops.kda.chunk.chunk_kda is chunk_kda
    assert vars(fla.modules.FusedRMSNormGated)["forward"] is norm_forward


@pytest.mark.parametrize("entry", ["chunk_kda", "fused_recurrent_kda"])
def test_kda_matches_fla_naive(enabled, entry):
    q, k, v, g, beta, state = _inputs()
    expected, expected_state = naive_recurrent_kda(q, k, v, g, beta, initial_state=state,
                                                   output_final_state=True)  # fmt: skip
    actual, actual_state = getattr(fla_kda, entry)(q, k, v, g, beta, initial_state=state,
                                                   output_final_state=True)  # fmt: skip
    torch.testing.assert_close(actual, expected)
    torch.testing.assert_close(actual_state, expected_state)


@pytest.mark.parametrize("entry", ["chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule"])
def test_gated_delta_rule_matches_fla_naive(enabled, entry):
    q, k, v, g, beta, state = _inputs()
    g = g[..., 0]
    expected, expected_state = naive_recurrent_gated_delta_rule(
        q, k, v, beta, g, initial_state=state, output_final_state=True
    )
    actual, actual_state = getattr(fla_gdn, entry)(q, k, v, g=g, beta=beta, initial_state=state,
                                                   output_final_state=True)  # fmt: skip
    torch.testing.assert_close(actual, expected)
    torch.testing.assert_close(actual_state, expected_state)


def test_kda_gate_lower_bound_without_a_log(enabled):
    g, dt_bias = torch.randn(3, 2, 4), torch.randn(8)
    actual = fla.ops.kda.gate.fused_kda_gate(g, None, dt_bias, lower_bound=-5.0)
    torch.testing.assert_close(actual, -5.0 * torch.sigmoid(g + dt_bias.view(2, 4)))


def test_fused_rms_norm_gated(enabled):
    norm = fla.modules.FusedRMSNormGated(16, eps=1e-5, activation="sigmoid")
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x, gate = torch.randn(2, 3, 16), torch.randn(2, 3, 16)
    expected = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * norm.weight
    torch.testing.assert_close(norm(x, gate), expected * torch.sigmoid(gate))
    with pytest.raises(ValueError, match="residual"):
        norm(x, gate, residual=x)


def _conv_reference(conv: torch.nn.Module, window: torch.Tensor) -> torch.Tensor:
    """nn.Conv1d's own forward over [history, x] (channels first), then SiLU."""
    out = torch.nn.Conv1d.forward(conv, window)[..., : window.shape[-1]]
    return F.silu(out)


@torch.no_grad()
def test_short_convolution_prefill_and_decode_cache(enabled):
    conv = fla.modules.ShortConvolution(8, kernel_size=4, bias=True, activation="silu")
    conv.weight.normal_()
    conv.bias.normal_()
    cache = torch.randn(2, 8, 4)
    x = torch.randn(2, 5, 8)
    y, final = conv(x, cache=cache.clone(), output_final_state=True)
    window = torch.cat([cache[..., 1:], x.transpose(1, 2)], dim=-1)  # FLA ignores slot 0
    torch.testing.assert_close(y, _conv_reference(conv, window)[..., 3:].transpose(1, 2))
    torch.testing.assert_close(final, window[..., -4:])

    token = torch.randn(2, 1, 8)
    step_y, step_cache = conv(token, cache=final, output_final_state=True)
    assert step_cache is final  # updated in place, like FLA's decode kernel
    window = torch.cat([window, token.transpose(1, 2)], dim=-1)
    torch.testing.assert_close(step_y[:, 0], _conv_reference(conv, window)[..., -1])
    torch.testing.assert_close(final, window[..., -4:])


@pytest.mark.gpu
@pytest.mark.parametrize("channels", [24, 12], ids=["vector_step", "generic_step"])
@torch.no_grad()
def test_short_convolution_cuda_kernels_match_cpu(enabled, channels):
    """The CUDA kernels behind ShortConvolution against the same calls on CPU (the
    reference path, checked above against nn.Conv1d). The cache FLA hands over is a
    strided view (``cache[..., 1:]``); 24 channels take the 16-byte-vector decode step,
    12 the generic one."""
    conv = fla.modules.ShortConvolution(channels, kernel_size=4, bias=True, activation="silu")
    conv.weight.normal_()
    conv.bias.normal_()
    cache = torch.randn(2, channels, 4)
    x = torch.randn(2, 5, channels)
    token = torch.randn(2, 1, channels)
    results = {}
    for device in ("cpu", "cuda"):
        module = conv.to(device)
        y, final = module(x.to(device), cache=cache.to(device), output_final_state=True)
        step_y, step_cache = module(token.to(device), cache=final, output_final_state=True)
        results[device] = [t.cpu() for t in (y, step_y, step_cache)]
    for got, expected in zip(results["cuda"], results["cpu"]):
        torch.testing.assert_close(got, expected)


def test_unsupported_options_raise(enabled):
    q, k, v, g, beta, _ = _inputs()
    with pytest.raises(ValueError, match="cp_context"):
        fla_kda.chunk_kda(q, k, v, g, beta, cp_context=object())
    with pytest.raises(ValueError, match="`gv`"):
        fla_gdn.fused_recurrent_gated_delta_rule(q, k, v, g=g[..., 0], gv=v, beta=beta)
    with pytest.raises(ValueError, match="A_log"):
        fla_kda.chunk_kda(q, k, v, g, beta, use_gate_in_kernel=True)


def test_compile_fullgraph_through_fla_names(enabled):
    q, k, v, g, beta, state = _inputs(length=9)

    def step(q, k, v, g, beta, state):
        return fla_kda.fused_recurrent_kda(q, k, v, g, beta, initial_state=state,
                                           output_final_state=True)  # fmt: skip

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    for got, want in zip(compiled(q, k, v, g, beta, state), step(q, k, v, g, beta, state)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
