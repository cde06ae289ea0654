"""transformers ``kimi_linear`` (and ``glm5_next``, which ships the same KDA functions) on
``torch.ops.kda``.

Swapped while enabled, per model file (``modeling_kimi_linear`` / ``modeling_glm5_next``):

- ``chunk_kimi_delta_attention`` → ``kda::chunk`` (g is the model's log-decay, beta after
  sigmoid, q/k l2norm in the op),
- ``recurrent_kimi_delta_attention`` → ``kda::recurrent``,
- ``causal_conv1d_fn`` / ``causal_conv1d_update`` → ``kda::causal_conv1d`` (channels-first
  layout and the cache's ``[B, D, W]`` conv state translated),
- ``KimiLinearRMSNormGated.forward`` / ``Glm5NextTextRMSNormGated.forward`` →
  ``kda::gated_rms_norm`` (sigmoid gate).
"""

from __future__ import annotations

import importlib

from kda_ops.integrations import _transformers
from kda_ops.integrations._patch import Patch

# target -> (model file, its gated RMSNorm class)
MODEL_FILES = {
    "kimi_linear": (
        "transformers.models.kimi_linear.modeling_kimi_linear",
        "KimiLinearRMSNormGated",
    ),
    "glm5_next": ("transformers.models.glm5_next.modeling_glm5_next", "Glm5NextTextRMSNormGated"),
}

FUNCTIONS = {
    "chunk_kimi_delta_attention": _transformers.chunk_delta_rule,
    "recurrent_kimi_delta_attention": _transformers.recurrent_delta_rule,
    "causal_conv1d_fn": _transformers.causal_conv1d_fn,
    "causal_conv1d_update": _transformers.causal_conv1d_update,
}


def patches(model: str) -> list[Patch]:
    """The swaps for ``model`` (``"kimi_linear"`` or ``"glm5_next"``); imports its file."""
    module_name, gated_norm = MODEL_FILES[model]
    module = importlib.import_module(module_name)
    return _transformers.model_patches(module, FUNCTIONS, gated_norm)
