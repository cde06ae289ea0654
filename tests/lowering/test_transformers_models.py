"""Unchanged tiny transformers Qwen3-Next, Kimi Linear and GLM5-next (its text model) models
(no ``kda_ops.integrations.enable()``) under ``torch.compile(backend="kda", fullgraph=True)``:
one decode token after an eager prefill, every conv update and every gated norm fused,
logits and cache as eager's. transformers' PyTorch kernels stand in for FLA's, which
cannot run on CPU (tests.kda_ops.integrations.models.transformers_reference)."""

import copy

import pytest
import torch

from tests.kda_ops.integrations.models import _build, transformers_reference
from tests.lowering.compiled import compile_kda
from tests.sweeps import sweep

transformers = pytest.importorskip("transformers")
LAYER_TYPES = ["linear_attention", "full_attention", "linear_attention"]
LINEAR_LAYERS = [i for i, kind in enumerate(LAYER_TYPES) if kind == "linear_attention"]
COMMON = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
              num_attention_heads=2, linear_conv_kernel_dim=4, layer_types=LAYER_TYPES,
              pad_token_id=0, bos_token_id=1, eos_token_id=2)  # fmt: skip


def qwen3_next() -> torch.nn.Module:
    config = transformers.Qwen3NextConfig(
        **COMMON, num_key_value_heads=1, head_dim=16, linear_key_head_dim=16,
        linear_value_head_dim=16, linear_num_key_heads=1, linear_num_value_heads=2,
        num_experts=0,
    )  # fmt: skip
    return _build(transformers.Qwen3NextForCausalLM, config)


def kimi_linear() -> torch.nn.Module:
    config = transformers.KimiLinearConfig(
        **COMMON, num_key_value_heads=2, kv_lora_rank=16, q_lora_rank=None,
        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, linear_head_dim=16,
        linear_num_heads=2, mlp_layer_types=["dense"] * 3,
    )  # fmt: skip
    return _build(transformers.KimiLinearForCausalLM, config)


def glm5_next() -> torch.nn.Module:
    """GLM5-next's text model (no causal-LM head of its own): KDA layers around a DSA
    (indexed, NoPE) attention layer, dense MLPs, two hyper-connection streams."""
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextModel

    config = transformers.Glm5NextTextConfig(
        **{**COMMON, "layer_types": ["linear_attention", "indexed_attention", "linear_attention"]},
        moe_intermediate_size=32, num_key_value_heads=2, kv_lora_rank=16, q_lora_rank=16,
        qk_rope_head_dim=0, qk_nope_head_dim=8, v_head_dim=16, linear_head_dim=16,
        linear_num_heads=2, mlp_layer_types=["dense"] * 3, index_head_dim=16, index_n_heads=2,
        index_topk=16, hc_mult=2,
    )  # fmt: skip
    return _build(Glm5NextTextModel, config)


MODELS = {"qwen3_next": qwen3_next, "kimi_linear": kimi_linear, "glm5_next": glm5_next}


def _output(result: object) -> torch.Tensor:
    """Logits, or the last hidden state of a model without a head."""
    logits = getattr(result, "logits", None)
    return result.last_hidden_state if logits is None else logits


@pytest.mark.parametrize("name", sweep(sorted(MODELS), keep=[("qwen3_next",)]))
def test_unchanged_model_decode_fuses_every_conv_update_and_gated_norm(name):
    model = MODELS[name]()
    ids = torch.randint(3, 64, (2, 6))
    with transformers_reference(name), torch.no_grad():
        cache = model(ids[:, :5], use_cache=True).past_key_values
        eager_cache = copy.deepcopy(cache)
        expected = _output(model(ids[:, 5:], past_key_values=eager_cache, use_cache=True))

        def decode(token, cache):
            return _output(model(token, past_key_values=cache, use_cache=True))

        logits, counts, _ = compile_kda(decode, ids[:, 5:], cache)
    layers = len(LINEAR_LAYERS)
    assert counts == {"conv_update_transformers": layers, "gated_rms_norm": layers}
    torch.testing.assert_close(logits, expected)
    for i in LINEAR_LAYERS:
        got, want = cache.layers[i], eager_cache.layers[i]
        torch.testing.assert_close(got.conv_states[0], want.conv_states[0])
        torch.testing.assert_close(got.recurrent_states[0], want.recurrent_states[0])
