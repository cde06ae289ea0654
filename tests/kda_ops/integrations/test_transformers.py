"""transformers Kimi Linear and Qwen3-Next with ``kda_ops.integrations.enable()``: same
logits as the unpatched model, full-graph compile, generate, export of a decode step."""

from __future__ import annotations

import copy
import importlib

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

pytest.importorskip("transformers")

import kda_ops.integrations as integrations
from kda_ops.integrations import _transformers
from kda_ops.integrations._conventions import FUNCTION_ROLES, GATED_NORM_SUFFIX
from kda_ops.integrations.export import DecodeStep, PrefillStep, cache_states
from tests.kda_ops.integrations.models import (
    BUILDERS,
    MODEL_FILES,
    VOCAB,
    transformers_reference,
)

# The other models' end-to-end tests are in test_models.py (smaller configs).
MODELS = ("kimi_linear", "qwen3_next")
KDA_OPS = {"kda.chunk", "kda.recurrent", "kda.causal_conv1d", "kda.gated_rms_norm"}


@pytest.fixture(scope="module", params=MODELS)
def model(request):
    return request.param, BUILDERS[request.param]()


@pytest.fixture
def enabled(model):
    name, _ = model
    integrations.enable([name])
    yield
    integrations.disable()


class OpRecorder(TorchDispatchMode):
    """Records the namespaces.names of the ops that run (to prove ours are used)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.add(func._schema.name.replace("::", "."))
        return func(*args, **(kwargs or {}))


def _prompt(length: int, batch: int = 2) -> torch.Tensor:
    return torch.randint(3, VOCAB, (batch, length), generator=torch.Generator().manual_seed(length))


def _decode(model: torch.nn.Module, prompt: torch.Tensor, steps: int = 8):
    """Greedy decode with a DynamicCache: logits of the last prompt token and each step."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    logits = [model(prompt, cache=cache, use_cache=True).logits[:, -1]]
    for _ in range(steps):
        token = logits[-1].argmax(-1, keepdim=True)
        logits.append(model(token, cache=cache, use_cache=True).logits[:, -1])
    return torch.stack(logits, dim=1), cache


@pytest.mark.parametrize("length", [1, 63, 64, 65, 130])
@torch.no_grad()
def test_prefill_logits_match_unpatched(model, length):
    name, net = model
    prompt = _prompt(length)
    with transformers_reference(name):
        expected = net(prompt).logits
    integrations.enable([name])
    try:
        with OpRecorder() as recorder:
            actual = net(prompt).logits
    finally:
        integrations.disable()
    assert {"kda.chunk", "kda.causal_conv1d", "kda.gated_rms_norm"} <= recorder.ops
    torch.testing.assert_close(actual, expected)


@torch.no_grad()
def test_decode_with_cache_matches_unpatched(model):
    name, net = model
    prompt = _prompt(65)
    with transformers_reference(name):
        expected, expected_cache = _decode(net, prompt)
    integrations.enable([name])
    try:
        with OpRecorder() as recorder:
            actual, actual_cache = _decode(net, prompt)
    finally:
        integrations.disable()
    assert recorder.ops >= KDA_OPS
    torch.testing.assert_close(actual, expected)
    types = net.config.layer_types
    for got, want in zip(cache_states(actual_cache, types), cache_states(expected_cache, types)):
        torch.testing.assert_close(got, want)


@torch.no_grad()
def test_generate_matches_unpatched(model):
    name, net = model
    prompt = _prompt(20)
    settings = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    with transformers_reference(name):
        expected = net.generate(prompt, **settings)
    integrations.enable([name])
    try:
        actual = net.generate(prompt, **settings)
    finally:
        integrations.disable()
    assert actual.shape == (2, 26)
    torch.testing.assert_close(actual, expected)


@torch.no_grad()
def test_compile_fullgraph_prefill_and_decode(model, enabled):
    """fullgraph=True raises on any graph break; aot_eager runs the fake kernels and
    functionalization (the conv state's in-place update) like Inductor does."""
    from transformers import DynamicCache

    _, net = model
    torch._dynamo.reset()
    compiled = torch.compile(net, fullgraph=True, backend="aot_eager")
    prompt = _prompt(65)
    torch.testing.assert_close(compiled(prompt).logits, net(prompt).logits, rtol=0, atol=0)

    cache = DynamicCache(config=net.config)
    token = net(prompt, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)
    cache_copy = copy.deepcopy(cache)
    expected = net(token, cache=cache, use_cache=True).logits
    actual = compiled(token, cache=cache_copy, use_cache=True).logits
    torch.testing.assert_close(actual, expected, rtol=0, atol=0)
    for got, want in zip(cache_states(cache_copy, net.config.layer_types),
                         cache_states(cache, net.config.layer_types)):  # fmt: skip
        torch.testing.assert_close(got, want, rtol=0, atol=0)


@torch.no_grad()
def test_export_decode_step_with_states_as_io(model, enabled):
    from transformers import DynamicCache

    _, net = model
    prompt = _prompt(65)
    cache = DynamicCache(config=net.config)
    token = net(prompt, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)
    types = net.config.layer_types
    states = [tuple(t.clone() for t in s) for s in cache_states(cache, types)]
    kv_length = torch.export.Dim("kv_length", min=2, max=4096)
    dynamic = {
        "input_ids": None,
        "states": [({2: kv_length},) * 2 if t == "full_attention" else (None, None) for t in types],
    }
    program = torch.export.export(DecodeStep(net), (token, states), dynamic_shapes=dynamic)

    kinds = {spec.kind for spec in program.graph_signature.output_specs}
    assert kinds == {torch.export.graph_signature.OutputKind.USER_OUTPUT}, kinds
    targets = {str(n.target) for n in program.graph.nodes if n.op == "call_function"}
    assert {"kda.recurrent.default", "kda.causal_conv1d.default"} <= targets

    logits, new_states = program.module()(token, states)
    expected = net(token, cache=cache, use_cache=True).logits
    torch.testing.assert_close(logits, expected)
    for got, want in zip(new_states, cache_states(cache, types)):
        torch.testing.assert_close(got, want)


@pytest.mark.slow
@torch.no_grad()
def test_export_prefill_step_with_left_padding(model, enabled):
    """PrefillStep exported with dynamic batch and length (T = 3 < the conv width runs:
    no branch on T) gives the unpatched model's logits and cache states."""
    from transformers import DynamicCache

    name, net = model
    batch = torch.export.Dim("batch", min=1, max=64)
    length = torch.export.Dim("length", min=2, max=4096)
    prompt = _prompt(9, batch=3)
    dims = {0: batch, 1: length}
    dynamic = {"input_ids": dims, "attention_mask": dims}
    args = (prompt, torch.ones_like(prompt))
    program = torch.export.export(PrefillStep(net), args, dynamic_shapes=dynamic)
    targets = {str(n.target) for n in program.graph.nodes if n.op == "call_function"}
    assert targets >= {"kda.chunk.default", "kda.causal_conv1d.default"}
    for size, tokens in [(2, 3), (1, 20)]:
        prompt = _prompt(tokens, batch=size)
        mask = torch.ones_like(prompt)
        mask[0, :1] = 0
        logits, states = program.module()(prompt, mask)
        integrations.disable()
        with transformers_reference(name):
            cache = DynamicCache(config=net.config)
            expected = net(prompt, attention_mask=mask, cache=cache, use_cache=True).logits
        integrations.enable([name])
        torch.testing.assert_close(logits, expected)
        for got, want in zip(states, cache_states(cache, net.config.layer_types)):
            torch.testing.assert_close(got, want)


@torch.no_grad()
def test_transformers_onnx_exporter_converts_the_patched_model(model, enabled):
    """transformers' own OnnxExporter passes its own translation table; the kda ops'
    translations are found anyway, and onnxruntime gives the unpatched model's logits."""
    pytest.importorskip("onnxruntime")
    from transformers.exporters.exporter_onnx import OnnxConfig, OnnxExporter

    name, net = model
    inputs = {"input_ids": _prompt(9)}
    exported = OnnxExporter().export(net, dict(inputs), config=OnnxConfig(dynamic=False))
    targets = {node.domain + node.op_type for node in exported.program.graph.all_nodes()}
    assert not any("kda" in target for target in targets)  # portable: standard ops only
    with transformers_reference(name):
        expected = net(**inputs).logits
    torch.testing.assert_close(torch.as_tensor(exported(**inputs)["logits"]), expected)


def _kernel_functions(target: str) -> tuple[object, list[str], str]:
    """The model file, the names of its functions kda_ops swaps and its gated norm class."""
    module = importlib.import_module(MODEL_FILES[target])
    names = [n for role in FUNCTION_ROLES for n in role.attribute_names if hasattr(module, n)]
    norm = next(n for n in vars(module) if n.endswith(GATED_NORM_SUFFIX))
    return module, names, norm


@pytest.mark.parametrize("target", ["kimi_linear", "glm5_next", "qwen3_next"])
def test_enable_is_idempotent_and_disable_restores(target):
    module, names, norm = _kernel_functions(target)
    before = {name: getattr(module, name) for name in names}
    norm_forward = vars(getattr(module, norm))["forward"]
    assert integrations.enable([target]) == (target,)
    assert integrations.enable([target]) == (target,)
    try:
        for name in names:
            assert getattr(module, name) is not before[name]
            assert getattr(module, name).__module__ == _transformers.__name__
        assert vars(getattr(module, norm))["forward"] is not norm_forward
    finally:
        integrations.disable()
        integrations.disable()
    assert integrations.enabled() == ()
    assert {name: getattr(module, name) for name in names} == before
    assert vars(getattr(module, norm))["forward"] is norm_forward


@pytest.mark.parametrize("target", ["kimi_linear", "glm5_next", "qwen3_next"])
@torch.no_grad()
def test_conv_update_keeps_transformers_state_layout(target):
    """The decode conv rewrites the cache's [B, D, W] state in place exactly like
    transformers' own function, and returns the same outputs."""
    module, _, _ = _kernel_functions(target)
    reference = module.causal_conv1d_update.__wrapped__
    x, weight, bias = torch.randn(3, 8, 1), torch.randn(8, 4), torch.randn(8)
    state = torch.randn(3, 8, 4)
    expected_state, actual_state = state.clone(), state.clone()
    expected = reference(x, expected_state, weight, bias, "silu")
    actual = _transformers.causal_conv1d_update(x, actual_state, weight, bias, "silu")
    torch.testing.assert_close(actual, expected)
    torch.testing.assert_close(actual_state, expected_state, rtol=0, atol=0)


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="unknown integration target"):
        integrations.enable(["no_such_model"])
    with pytest.raises(ValueError, match="defines none of the delta-rule functions"):
        integrations.enable(["mamba"])
    with pytest.raises(TypeError, match="iterable of target names"):
        integrations.enable("kimi_linear")
    x, weight = torch.randn(2, 8, 5), torch.randn(8, 4)
    with pytest.raises(ValueError, match="seq_idx"):
        _transformers.causal_conv1d_fn(x, weight, seq_idx=torch.zeros(2, 5, dtype=torch.int32))
    with pytest.raises(ValueError, match="keeps 2 inputs"):
        _transformers.causal_conv1d_update(x[..., :1], torch.zeros(2, 8, 2), weight)
    with pytest.raises(ValueError, match="activation"):
        _transformers.causal_conv1d_fn(x, weight, activation="gelu")
