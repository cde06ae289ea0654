"""``FlatStateStep`` (the C++ runner's fixed-shape convention) run eagerly: a prefill and
greedy decode steps through fixed-size KV buffers give the model's own logits with a
``DynamicCache``; its arguments and the buffer length are checked. The compiled packages in
the C++ runner are in test_aoti.py (slow)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

import kda_ops.integrations as integrations
from kda_ops.integrations.export import FlatStateStep, flat_state_specs, layer_types
from tests.kda_ops.integrations.models import BUILDERS, VOCAB
from tests.kda_ops.integrations.test_aoti import SIZES

MAX_LENGTH = 24


# GLM5-next's sparse indexer selects keys without the padding mask: refused (test below).
FLAT_MODELS = [name for name in SIZES if name != "glm5_next"]


@pytest.fixture(scope="module", params=FLAT_MODELS)
def model(request):
    name = request.param
    net = BUILDERS[name](**SIZES[name])
    integrations.enable([name])
    yield net
    integrations.disable()


def _zero_states(net, batch: int) -> list[torch.Tensor]:
    return [torch.zeros(batch, *shape, dtype=dtype) for dtype, shape in
            flat_state_specs(net, MAX_LENGTH)]  # fmt: skip


def test_specs_list_each_layers_states_then_the_length(model):
    specs = flat_state_specs(model, MAX_LENGTH)
    types = layer_types(model)
    assert len(specs) == 2 * len(types) + 1
    assert specs[-1] == (torch.int64, [])
    for index, layer_type in enumerate(types):
        if layer_type == "full_attention":
            for _, shape in specs[2 * index : 2 * index + 2]:
                assert shape[1] == MAX_LENGTH  # [heads, max_length, d]


@torch.no_grad()
def test_flat_steps_give_the_models_greedy_logits(model):
    from transformers import DynamicCache

    prompt = torch.randint(3, VOCAB, (3, 9), generator=torch.Generator().manual_seed(4))
    cache = DynamicCache(config=model.config)
    expected = [model(prompt, cache=cache, use_cache=True).logits[:, -1]]
    prefill = FlatStateStep(model, "prefill", MAX_LENGTH)
    decode = FlatStateStep(model, "decode", MAX_LENGTH)
    logits, *states = prefill(prompt, *_zero_states(model, 3))
    actual = [logits[:, -1]]
    assert states[-1].tolist() == [9, 9, 9]
    for _ in range(6):
        token = expected[-1].argmax(-1, keepdim=True)
        expected.append(model(token, cache=cache, use_cache=True).logits[:, -1])
        logits, *states = decode(token, *states)
        actual.append(logits[:, -1])
    torch.testing.assert_close(torch.stack(actual), torch.stack(expected))
    assert states[-1].tolist() == [15, 15, 15]
    # The buffers hold the cache's keys and values at their positions, zeros after them.
    for index, layer_type in enumerate(layer_types(model)):
        if layer_type == "full_attention":
            keys = states[2 * index]
            torch.testing.assert_close(keys[:, :, :15], cache.layers[index].keys)
            assert not keys[:, :, 15:].any()


def test_flat_steps_check_their_arguments(model):
    with pytest.raises(ValueError, match="`step` must be"):
        FlatStateStep(model, "verify", MAX_LENGTH)
    with pytest.raises(ValueError, match="`max_length` must be"):
        FlatStateStep(model, "decode", 1)
    states = _zero_states(model, 2)
    prefill = FlatStateStep(model, "prefill", MAX_LENGTH)
    with pytest.raises(ValueError, match=r"expected \d+ states"):
        prefill(torch.ones(2, 4, dtype=torch.long), *states[:-1])
    with pytest.raises(ValueError, match="more than `max_length`"):
        prefill(torch.ones(2, MAX_LENGTH + 1, dtype=torch.long), *states)
    decode = FlatStateStep(model, "decode", MAX_LENGTH)
    with pytest.raises(ValueError, match="one token per sequence"):
        decode(torch.ones(2, 2, dtype=torch.long), *states)
    states[-1] = torch.full_like(states[-1], MAX_LENGTH)
    with pytest.raises(ValueError, match="holds `max_length` 24 tokens"):
        decode(torch.ones(2, 1, dtype=torch.long), *states)


def test_a_model_selecting_keys_without_the_mask_is_refused():
    net = BUILDERS["glm5_next"](**SIZES["glm5_next"])
    for step in ("prefill", "decode"):
        with pytest.raises(ValueError, match="selects its keys without the padding mask"):
            FlatStateStep(net, step, MAX_LENGTH)
