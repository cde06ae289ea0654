"""lowering/inductor/gated_rms_norm.py on transformers' own gated-norm modules
(Qwen3-Next's, Kimi Linear's, GLM5-next's), each gate activation, the weight in fp32 or
x's dtype, eps the module's attribute."""

import pytest
import torch

from tests.lowering.compiled import assert_close, compile_kda

qwen3_next = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
kimi_linear = pytest.importorskip("transformers.models.kimi_linear.modeling_kimi_linear")
MODULES = {"qwen3_next": qwen3_next.Qwen3NextRMSNormGated,
           "kimi_linear": kimi_linear.KimiLinearRMSNormGated}  # fmt: skip
try:
    from transformers.models.glm5_next import modeling_glm5_next

    MODULES["glm5_next"] = modeling_glm5_next.Glm5NextTextRMSNormGated
except ImportError:
    pass

DIM = 16


def norms(module_class: type, dtype: torch.dtype) -> list[torch.nn.Module]:
    """Four modules: (silu, sigmoid) x (weight in x's dtype, weight in fp32), each its eps."""
    found = []
    for i, (activation, weight_dtype) in enumerate(
        [("silu", dtype), ("sigmoid", dtype), ("silu", torch.float32), ("sigmoid", torch.float32)]
    ):
        norm = module_class(DIM, eps=10.0 ** -(i + 3))
        norm.activation = activation
        with torch.no_grad():
            norm.weight.copy_(torch.randn(DIM))
        found.append(norm.to(weight_dtype))
    return found


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("model", sorted(MODULES))
def test_transformers_gated_norm_fuses_every_variant(model, dtype):
    modules = norms(MODULES[model], dtype)
    xs = [torch.randn(3, 5, DIM, dtype=dtype) for _ in modules]
    gates = [torch.randn(3, 5, DIM, dtype=dtype) for _ in modules]

    def fn(xs, gates):
        return [norm(x, gate) for norm, x, gate in zip(modules, xs, gates)]

    with torch.no_grad():  # inference: a training graph saves the norm's intermediates
        expected = fn(xs, gates)
        out, counts, code = compile_kda(fn, xs, gates)
    assert counts == {"gated_rms_norm": len(modules)}
    assert code.count("kda.gated_rms_norm.default(") == len(modules)
    for got, want in zip(out, expected):
        assert got.dtype == dtype
        assert_close(got, want, dtype)


def test_norm_without_gate_stays_untouched():
    norm = kimi_linear.KimiLinearRMSNorm(DIM, eps=1e-5)
    with torch.no_grad():
        _, counts, _ = compile_kda(lambda x: torch.sigmoid(norm(x)), torch.randn(4, DIM))
    assert counts == {}
