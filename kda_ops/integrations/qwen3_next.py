"""transformers ``qwen3_next`` (Gated DeltaNet) on ``torch.ops.kda``.

Swapped while enabled, in ``modeling_qwen3_next``:

- ``torch_chunk_gated_delta_rule`` → ``kda::chunk`` with the scalar gate ``g [B, T, HV]``
  (the model's log-decay), beta after sigmoid, q/k l2norm in the op, ``cu_seqlens`` passed on,
- ``torch_recurrent_gated_delta_rule`` → ``kda::recurrent``,
- ``causal_conv1d_fn`` / ``causal_conv1d_update`` → ``kda::causal_conv1d``,
- ``Qwen3NextRMSNormGated.forward`` → ``kda::gated_rms_norm`` (silu gate).
"""

from __future__ import annotations

import importlib

from kda_ops.integrations import _transformers
from kda_ops.integrations._patch import Patch

MODEL_FILE = "transformers.models.qwen3_next.modeling_qwen3_next"
GATED_NORM = "Qwen3NextRMSNormGated"

FUNCTIONS = {
    "torch_chunk_gated_delta_rule": _transformers.chunk_delta_rule,
    "torch_recurrent_gated_delta_rule": _transformers.recurrent_delta_rule,
    "causal_conv1d_fn": _transformers.causal_conv1d_fn,
    "causal_conv1d_update": _transformers.causal_conv1d_update,
}


def patches() -> list[Patch]:
    """The swaps for ``modeling_qwen3_next``; imports it."""
    module = importlib.import_module(MODEL_FILE)
    return _transformers.model_patches(module, FUNCTIONS, GATED_NORM)
