"""lowering/inductor/gated_rms_norm.py on FLA's PyTorch reference of the gated RMSNorm
(``fla.modules.norm.layernorm_gated.rms_norm_ref``, norm before gate)."""

import pytest
import torch

from tests.lowering.compiled import assert_close, compile_kda

layernorm_gated = pytest.importorskip("fla.modules.norm.layernorm_gated")

DIM = 16


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fla_reference_gated_norm_fuses(dtype):
    """Weight in x's dtype and in fp32, two eps."""
    weights = [torch.randn(DIM, dtype=dtype), torch.randn(DIM)]
    xs = [torch.randn(3, 5, DIM, dtype=dtype) for _ in weights]
    gates = [torch.randn(3, 5, DIM, dtype=dtype) for _ in weights]

    def fn(xs, gates, weights):
        return [
            layernorm_gated.rms_norm_ref(x, w, None, z=z, eps=eps)
            for x, z, w, eps in zip(xs, gates, weights, (1e-6, 1e-3))
        ]

    expected = fn(xs, gates, weights)
    out, counts, code = compile_kda(fn, xs, gates, weights)
    assert counts == {"gated_rms_norm": len(weights)}
    assert code.count("kda.gated_rms_norm.default(") == len(weights)
    for got, want in zip(out, expected):
        assert_close(got, want, dtype)
