"""transformers' Qwen3.5, Qwen3.5-MoE, OLMo-Hybrid and GLM5-next with ``enable()`` (found by the
functions their files hold, not by name): the unpatched model's logits, cache and tokens,
full-graph compile of prefill and decode, and the exported prefill (with and without a
left-padding mask) and decode steps with every state as graph I/O, dynamic batch and length.
Kimi Linear and Qwen3-Next have the same checks in test_transformers.py; the AOTInductor
packages of both steps are in test_aoti.py. Compile and export cases are marked ``slow``
(seconds each on 2 CPU cores; they run in CI all the same)."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")

import kda_ops.integrations as integrations
from kda_ops.integrations.export import DecodeStep, PrefillStep, cache_states, layer_types
from tests.kda_ops.integrations.models import (
    BUILDERS,
    VOCAB,
    min_prefill_length,
    transformers_reference,
)

MODELS = ("qwen3_5", "qwen3_5_moe", "olmo_hybrid", "glm5_next")
DELTA_RULES = {
    "gdn": ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule"),
    "kda": ("chunk_kimi_delta_attention", "recurrent_kimi_delta_attention"),
}
# Every swapped function that a prefill / a decode step runs shows up as its op.
PREFILL_OPS = {"kda.chunk.default", "kda.causal_conv1d.default", "kda.gated_rms_norm.default"}
DECODE_OPS = {"kda.recurrent.default", "kda.causal_conv1d.default", "kda.gated_rms_norm.default"}


@pytest.fixture(scope="module", params=MODELS)
def model(request):
    return request.param, BUILDERS[request.param]()


@pytest.fixture
def enabled(model):
    integrations.enable([model[0]])
    yield
    integrations.disable()


def _prompt(length: int, batch: int = 2) -> torch.Tensor:
    return torch.randint(3, VOCAB, (batch, length), generator=torch.Generator().manual_seed(length))


def _left_padding(prompt: torch.Tensor, pads: list[int]) -> torch.Tensor:
    mask = torch.ones_like(prompt)
    for row, pad in enumerate(pads):
        mask[row, :pad] = 0
    return mask


def _prefill(net, prompt, mask=None):
    from transformers import DynamicCache

    cache = DynamicCache(config=net.config)
    logits = net(prompt, attention_mask=mask, cache=cache, use_cache=True).logits
    return logits, cache


def _unpatched(name, run):
    """``run()`` on transformers' own PyTorch functions."""
    integrations.disable()
    with transformers_reference(name):
        return run()


def _targets(program) -> set[str]:
    return {str(n.target) for n in program.graph.nodes if n.op == "call_function"}


def _assert_states_close(actual, expected, **tolerance) -> None:
    assert len(actual) == len(expected)
    for got, want in zip(actual, expected):
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, **tolerance)


@torch.no_grad()
def test_found_by_functions_and_logits_match_unpatched(model):
    """enable() with no target swaps the model's file (it holds the delta rules); prefill
    with a left-padded batch, then decode steps, give the unpatched logits and states."""
    name, net = model
    prompt = _prompt(37, batch=3)
    mask = _left_padding(prompt, [0, 5, 1])

    def run():
        logits, cache = _prefill(net, prompt, mask)
        steps, full_mask = [logits], mask
        for _ in range(3):
            token = steps[-1][:, -1:].argmax(-1)
            full_mask = torch.cat([full_mask, torch.ones_like(token)], dim=1)
            steps.append(net(token, cache=cache, use_cache=True, attention_mask=full_mask).logits)
        return steps, cache_states(cache, layer_types(net))

    expected, expected_states = _unpatched(name, run)
    integrations.enable()
    try:
        assert name in integrations.enabled()
        swapped = {s.attribute for s in integrations.patched() if s.target == name}
        delta_rules = DELTA_RULES["kda" if name == "glm5_next" else "gdn"]
        assert {*delta_rules, "causal_conv1d_fn", "causal_conv1d_update"} <= swapped
        assert any(a.endswith("RMSNormGated.forward") for a in swapped), swapped
        actual, actual_states = run()
    finally:
        integrations.disable()
    for got, want in zip(actual, expected):
        torch.testing.assert_close(got, want)
    _assert_states_close(actual_states, expected_states)


@torch.no_grad()
def test_generate_matches_unpatched(model):
    name, net = model
    prompt = _prompt(12)
    settings = dict(max_new_tokens=5, do_sample=False, pad_token_id=0)
    expected = _unpatched(name, lambda: net.generate(prompt, **settings))
    integrations.enable([name])
    try:
        actual = net.generate(prompt, **settings)
    finally:
        integrations.disable()
    assert actual.shape == (2, 17)
    torch.testing.assert_close(actual, expected)


@pytest.mark.slow
@torch.no_grad()
def test_compile_fullgraph_prefill_and_decode(model, enabled):
    """fullgraph=True raises on any graph break; aot_eager runs the fake kernels and
    functionalization (the conv state's in-place update) as Inductor does."""
    from transformers import DynamicCache

    _, net = model
    torch._dynamo.reset()
    compiled = torch.compile(net, fullgraph=True, backend="aot_eager")
    prompt = _prompt(19)
    torch.testing.assert_close(compiled(prompt).logits, net(prompt).logits, rtol=0, atol=0)

    cache = DynamicCache(config=net.config)
    token = net(prompt, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)
    cache_copy = copy.deepcopy(cache)
    expected = net(token, cache=cache, use_cache=True).logits
    actual = compiled(token, cache=cache_copy, use_cache=True).logits
    torch.testing.assert_close(actual, expected, rtol=0, atol=0)
    types = layer_types(net)
    _assert_states_close(
        cache_states(cache_copy, types), cache_states(cache, types), rtol=0, atol=0
    )


def _export_prefill(net, name: str, with_mask: bool):
    batch = torch.export.Dim("batch", min=1, max=64)
    length = torch.export.Dim("length", min=min_prefill_length(name), max=4096)
    prompt = _prompt(9, batch=3)
    mask = _left_padding(prompt, [0, 4, 2]) if with_mask else None
    dynamic = {"input_ids": {0: batch, 1: length},
               "attention_mask": {0: batch, 1: length} if with_mask else None}  # fmt: skip
    return torch.export.export(PrefillStep(net), (prompt, mask), dynamic_shapes=dynamic)


def _export_decode(net, states, with_mask: bool):
    batch = torch.export.Dim("batch", min=1, max=64)
    kv_length = torch.export.Dim("kv_length", min=2, max=4096)
    dynamic = {
        "input_ids": {0: batch},
        "states": [({0: batch, 2: kv_length},) * 2 if t != "linear_attention" else ({0: batch},) * 2
                   for t in layer_types(net)],
        "attention_mask": {0: batch, 1: kv_length + 1} if with_mask else None,
    }  # fmt: skip
    size = states[0][0].shape[0]
    token = torch.full((size, 1), 5)
    mask = torch.ones(size, _kv_length(states) + 1, dtype=torch.long) if with_mask else None
    return torch.export.export(DecodeStep(net), (token, states, mask), dynamic_shapes=dynamic)


def _kv_length(states) -> int:
    return states[-1][0].shape[2]  # every tiny config ends with its full-attention layer


@pytest.mark.slow
@pytest.mark.parametrize("with_mask", [False, True], ids=["no_mask", "left_padding"])
@torch.no_grad()
def test_export_prefill_dynamic_batch_and_length(model, enabled, with_mask):
    """The program traced at B = 3, T = 9 runs B = 2, T = 3 (shorter than the conv width:
    PrefillStep's zero conv states leave no branch on T; GLM5-next: T = 5) and B = 1,
    T = 21. Without a mask for Qwen3.5 only: the same code path with one input less."""
    name, net = model
    if not with_mask and name != "qwen3_5":
        pytest.skip("the unmasked prefill export is checked on qwen3_5 (same path)")
    program = _export_prefill(net, name, with_mask)
    assert _targets(program) >= PREFILL_OPS
    kinds = {spec.kind for spec in program.graph_signature.output_specs}
    assert kinds == {torch.export.graph_signature.OutputKind.USER_OUTPUT}, kinds
    for batch, length in [(2, max(3, min_prefill_length(name))), (1, 21)]:
        prompt = _prompt(length, batch=batch)
        mask = _left_padding(prompt, [1] * batch) if with_mask else None
        logits, states = program.module()(prompt, mask)
        expected, cache = _unpatched(name, lambda p=prompt, m=mask: _prefill(net, p, m))
        integrations.enable([name])
        torch.testing.assert_close(logits, expected)
        _assert_states_close(states, cache_states(cache, layer_types(net)))


@pytest.mark.slow
@pytest.mark.parametrize("with_mask", [False, True], ids=["no_mask", "left_padding"])
@torch.no_grad()
def test_export_decode_step_dynamic_batch_and_kv_length(model, enabled, with_mask):
    """A decode step traced at B = 3 after 6 tokens runs at B = 2 after 5 and B = 1 after
    17; with the mask of a left-padded prompt, the same as the model eagerly (padded keys
    stay masked). Without a mask for Qwen3.5 only."""
    name, net = model
    if not with_mask and name != "qwen3_5":
        pytest.skip("the unmasked decode export is checked on qwen3_5 (same path)")
    prefill = PrefillStep(net)
    _, states = prefill(_prompt(6, batch=3))
    program = _export_decode(net, states, with_mask)
    assert _targets(program) >= DECODE_OPS
    for batch, length in [(2, 5), (1, 17)]:
        prompt = _prompt(length, batch=batch)
        mask = _left_padding(prompt, [2] * batch) if with_mask else None
        _, states = prefill(prompt, mask)
        token = torch.full((batch, 1), 7)
        step_mask = None if mask is None else torch.cat([mask, torch.ones_like(token)], dim=1)
        logits, new_states = program.module()(token, states, step_mask)
        eager_logits, eager_states = DecodeStep(net)(token, states, step_mask)
        torch.testing.assert_close(logits, eager_logits)
        _assert_states_close(new_states, eager_states)
        assert _kv_length(new_states) == length + 1  # the KV cache grew by the token
        # The mask reaches the attention: without it, padded keys count (GLM5-next's sparse
        # indexed attention selects its keys without the padding mask, eagerly too).
        if with_mask and name != "glm5_next":
            unmasked_logits, _ = DecodeStep(net)(token, states)
            assert not torch.allclose(unmasked_logits, eager_logits)


def test_prefill_step_checks_its_arguments(model):
    _, net = model
    with pytest.raises(ValueError, match="`input_ids` must be"):
        PrefillStep(net)(torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match="`attention_mask`"):
        PrefillStep(net)(_prompt(5), torch.ones(2, 4, dtype=torch.long))
