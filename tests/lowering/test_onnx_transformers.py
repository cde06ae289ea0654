"""transformers 5.24's own ``OnnxExporter`` at opset 27 on tiny Qwen3-Next and Kimi Linear
with ``kda_ops.integrations.enable()``: the graphs hold ``LinearAttention`` and
``CausalConvWithState`` (and no token ``Scan``), and onnxruntime gives the unpatched
model's logits and cache, for a prefill that continues a cache (states in and out) and
for a decode step. (Qwen3.5 has no integration target here yet.)"""

import copy

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("onnxruntime")

import kda_ops.integrations as integrations
from tests.kda_ops.integrations.models import BUILDERS, VOCAB, transformers_reference

STANDARD_OPS = {"LinearAttention", "CausalConvWithState"}


def _tokens(batch: int, length: int, seed: int) -> torch.Tensor:
    return torch.randint(3, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", sorted(BUILDERS))
@torch.no_grad()
def test_onnx_exporter_gives_standard_ops_and_pytorch_results(name):
    from transformers.exporters.exporter_onnx import OnnxConfig, OnnxExporter

    model = BUILDERS[name]()
    integrations.enable([name])
    try:
        cache = model(input_ids=_tokens(2, 5, 0), use_cache=True).cache
        for length in (9, 1):  # a prefill continuing the cache, then one decode step
            inputs = {"input_ids": _tokens(2, length, length), "cache": cache,
                      "use_cache": True}  # fmt: skip
            exported = OnnxExporter().export(
                model, copy.deepcopy(inputs), config=OnnxConfig(dynamic=False, opset_version=27)
            )
            op_types = {node.op_type for node in exported.program.graph.all_nodes()}
            assert op_types >= STANDARD_OPS and "Scan" not in op_types, op_types
            assert exported.program.opset_imports[""] == 27
            got = exported(**copy.deepcopy(inputs))
            with transformers_reference(name):
                want = model(**copy.deepcopy(inputs))
            torch.testing.assert_close(torch.as_tensor(got["logits"]), want.logits)
            for layer, want_layer in zip(got["cache"].layers, want.cache.layers):
                for field in ("conv_states", "recurrent_states"):
                    if hasattr(want_layer, field):
                        torch.testing.assert_close(torch.as_tensor(getattr(layer, field)[0]),
                                                   getattr(want_layer, field)[0])  # fmt: skip
            cache = want.cache
    finally:
        integrations.disable()
