"""The hybrid example model in eager mode: decode agrees with prefill, the in-place and
functional decodes agree, bad input is rejected."""

import pytest
import torch

from examples.hybrid_model import AttentionState, HybridConfig, KDAState
from tests.examples.cases import (
    BATCH,
    CONFIG,
    assert_caches_close,
    clone_cache,
    tiny_model,
    token_ids,
)


def test_cache_layout_follows_the_config():
    cache = tiny_model().new_cache(BATCH)
    kinds = [type(state) for state in cache]
    assert kinds == [KDAState, KDAState, KDAState, AttentionState]
    kda, attention = cache[0], cache[3]
    channels = CONFIG.num_heads * CONFIG.head_dim
    assert kda.conv_q.shape == (BATCH, channels, CONFIG.conv_size - 1)
    assert kda.recurrent.shape == (BATCH, CONFIG.num_heads, CONFIG.head_dim, CONFIG.head_dim)
    assert kda.recurrent.dtype == torch.float32
    assert attention.key.shape == (BATCH, CONFIG.num_heads, CONFIG.max_seq_len, CONFIG.head_dim)
    assert attention.length.dtype == torch.int64


def test_decoding_continues_the_prompt_exactly():
    model, ids = tiny_model(), token_ids(11)
    full, _ = model.prefill(ids, model.new_cache(BATCH))
    _, cache = model.prefill(ids[:, :8], model.new_cache(BATCH))
    for t in range(8, 11):
        logits, cache = model.decode(ids[:, t : t + 1], cache)
        torch.testing.assert_close(logits[:, 0], full[:, t])
    assert cache[3].length.tolist() == [11] * BATCH


def test_inplace_decode_matches_functional_decode_and_leaves_input_alone():
    model, ids = tiny_model(), token_ids(7)
    _, cache = model.prefill(ids[:, :6], model.new_cache(BATCH))
    untouched = clone_cache(cache)
    logits, new_cache = model.decode(ids[:, 6:], cache)
    assert_caches_close(cache, untouched, rtol=0, atol=0)
    inplace_logits = model.decode_(ids[:, 6:], cache)
    torch.testing.assert_close(inplace_logits, logits)
    assert_caches_close(cache, new_cache)


def test_silu_gate_and_safe_gate_configs_run():
    config = HybridConfig(gate_activation="silu", lower_bound=-5.0, num_layers=1)
    model, ids = tiny_model(config), token_ids(5, config)
    logits, cache = model.prefill(ids, model.new_cache(BATCH))
    assert logits.shape == (BATCH, 5, config.vocab_size) and torch.isfinite(logits).all()
    assert len(cache) == 1


def test_bad_input_raises():
    model = tiny_model()
    cache = model.new_cache(BATCH)
    with pytest.raises(TypeError, match="input_ids"):
        model.prefill(torch.zeros(BATCH, 3), cache)
    with pytest.raises(ValueError, match=r"\[B, 1\]"):
        model.decode(token_ids(2), cache)
    with pytest.raises(ValueError, match="layer states"):
        model.prefill(token_ids(3), cache[:2])


@pytest.mark.parametrize(
    "field, value", [("num_heads", 0), ("conv_size", 1), ("gate_activation", "tanh")]
)
def test_config_rejects_bad_values(field, value):
    with pytest.raises(ValueError, match=field):
        HybridConfig(**{field: value})


def test_kimi_linear_dims():
    config = HybridConfig.kimi_linear_48b(num_layers=4)
    assert (config.hidden_size, config.num_heads, config.head_dim) == (2304, 32, 128)
    assert config.kda_layer_count == 3
