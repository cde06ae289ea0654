"""Tiny random transformers hybrid models (head_dim 128, 3 linear-attention layers and one
full-attention layer, dense MLPs) and the reference that the integration must reproduce."""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator

import torch

LAYER_TYPES = ["linear_attention"] * 3 + ["full_attention"]
VOCAB = 128


KIMI_LINEAR = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
    num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=32, q_lora_rank=None,
    qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32, linear_head_dim=128,
    linear_num_heads=2, linear_conv_kernel_dim=4, layer_types=LAYER_TYPES,
    mlp_layer_types=["dense"] * 4, pad_token_id=0, bos_token_id=1, eos_token_id=2,
)  # fmt: skip
QWEN3_NEXT = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
    num_attention_heads=2, num_key_value_heads=1, head_dim=128, linear_key_head_dim=128,
    linear_value_head_dim=128, linear_num_key_heads=1, linear_num_value_heads=2,
    linear_conv_kernel_dim=4, num_experts=0, layer_types=LAYER_TYPES, pad_token_id=0,
    bos_token_id=1, eos_token_id=2,
)  # fmt: skip


QWEN3_5 = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
    num_attention_heads=2, num_key_value_heads=1, head_dim=32, linear_key_head_dim=32,
    linear_value_head_dim=32, linear_num_key_heads=1, linear_num_value_heads=2,
    linear_conv_kernel_dim=4, layer_types=["linear_attention", "full_attention"],
    pad_token_id=0, bos_token_id=1, eos_token_id=2,
)  # fmt: skip
QWEN3_5_MOE = QWEN3_5 | dict(
    moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=4,
    num_experts_per_tok=2,
)  # fmt: skip
OLMO_HYBRID = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
    num_attention_heads=2, num_key_value_heads=1, linear_key_head_dim=32,
    linear_value_head_dim=32, linear_num_key_heads=1, linear_num_value_heads=2,
    linear_conv_kernel_dim=4, layer_types=["linear_attention", "full_attention"],
    pad_token_id=0, bos_token_id=1, eos_token_id=2,
)  # fmt: skip

# GLM5-next ships as a vision-language model only; text-only input runs its text model
# (KDA with the safe gate, MLA with the sparse-attention indexer, hyper-connections).
GLM5_NEXT_TEXT = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
    num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, n_routed_experts=4,
    num_experts_per_tok=2, kv_lora_rank=32, q_lora_rank=32, qk_rope_head_dim=0,
    v_head_dim=32, qk_nope_head_dim=32, index_topk=16, index_kpool=4, index_head_dim=32,
    index_n_heads=2, linear_head_dim=32, linear_num_heads=2, linear_conv_kernel_dim=4,
    layer_types=["linear_attention", "full_attention"], mlp_layer_types=["dense"] * 2,
    hc_mult=2, pad_token_id=0, bos_token_id=1, eos_token_id=2,
)  # fmt: skip
GLM5_NEXT_VISION = dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2,
                        out_hidden_size=64)  # fmt: skip


def kimi_linear_model(**sizes: int) -> torch.nn.Module:
    """The tiny Kimi Linear (``KIMI_LINEAR``), with ``sizes`` replacing config entries."""
    from transformers import KimiLinearConfig, KimiLinearForCausalLM

    return _build(KimiLinearForCausalLM, KimiLinearConfig(**(KIMI_LINEAR | sizes)))


def qwen3_next_model(**sizes: int) -> torch.nn.Module:
    """The tiny Qwen3-Next (``QWEN3_NEXT``), with ``sizes`` replacing config entries."""
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    return _build(Qwen3NextForCausalLM, Qwen3NextConfig(**(QWEN3_NEXT | sizes)))


def qwen3_5_model(**sizes: int) -> torch.nn.Module:
    """The tiny Qwen3.5 text model (``QWEN3_5``), with ``sizes`` replacing config entries."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    return _build(Qwen3_5ForCausalLM, Qwen3_5TextConfig(**(QWEN3_5 | sizes)))


def qwen3_5_moe_model(**sizes: int) -> torch.nn.Module:
    """The tiny Qwen3.5-MoE text model (``QWEN3_5_MOE``)."""
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    return _build(Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig(**(QWEN3_5_MOE | sizes)))


def olmo_hybrid_model(**sizes: int) -> torch.nn.Module:
    """The tiny OLMo-Hybrid (``OLMO_HYBRID``)."""
    from transformers import OlmoHybridConfig, OlmoHybridForCausalLM

    return _build(OlmoHybridForCausalLM, OlmoHybridConfig(**(OLMO_HYBRID | sizes)))


def glm5_next_model(**sizes: int) -> torch.nn.Module:
    """The tiny GLM5-next (``GLM5_NEXT_TEXT`` and a one-block vision tower), with ``sizes``
    replacing text config entries."""
    from transformers import Glm5NextConfig, Glm5NextForConditionalGeneration

    config = Glm5NextConfig(text_config=GLM5_NEXT_TEXT | sizes, vision_config=GLM5_NEXT_VISION)
    return _build(Glm5NextForConditionalGeneration, config)


def _build(model_class: type, config: object) -> torch.nn.Module:
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = model_class(config).eval()
    # Random init leaves some projections at zero and the decay near 1; perturb every
    # parameter so each piece (conv, gates, norms) shows up in the logits.
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


BUILDERS = {
    "kimi_linear": kimi_linear_model,
    "qwen3_next": qwen3_next_model,
    "qwen3_5": qwen3_5_model,
    "qwen3_5_moe": qwen3_5_moe_model,
    "olmo_hybrid": olmo_hybrid_model,
    "glm5_next": glm5_next_model,
}
MODEL_FILES = {name: f"transformers.models.{name}.modeling_{name}" for name in BUILDERS}


@contextlib.contextmanager
def transformers_reference(model: str) -> Iterator[None]:
    """Run transformers' own PyTorch kernels (the unpatched model on a machine without
    FLA). transformers binds FLA's Triton kernels into its kernel wrappers whenever FLA is
    importable, and those cannot run on CPU; each wrapper keeps the PyTorch function it
    falls back to as ``__wrapped__``, which is what the unpatched model runs without FLA."""
    module = importlib.import_module(MODEL_FILES[model])
    wrappers = {
        name: fn for name, fn in vars(module).items()
        if callable(fn) and hasattr(fn, "__wrapped__") and fn.__module__ == module.__name__
    }  # fmt: skip
    try:
        for name, fn in wrappers.items():
            setattr(module, name, fn.__wrapped__)
        yield
    finally:
        for name, fn in wrappers.items():
            setattr(module, name, fn)


def min_prefill_length(name: str) -> int:
    """The shortest prompt an exported prefill of model ``name`` takes: 2 (``torch.export``
    specializes T = 1), or for GLM5-next one more than its sparse-attention indexer's key pool
    (its indexer branches on whether the prompt fills more than one pool; not a
    linear-attention bound)."""
    return GLM5_NEXT_TEXT["index_kpool"] + 1 if name == "glm5_next" else 2
