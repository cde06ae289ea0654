"""kda-ops: Kimi Delta Attention and Gated DeltaNet as first-class PyTorch ops.

Importing this package registers the ``torch.ops.kda`` ops (needed before
``torch.export.load`` of a program that uses them) and arranges for ``torch.onnx.export``
to find their ONNX translations (registered on the first export, ``lowering.onnx_registry``).
"""

from kda_ops import speculative  # registers kda::verify and kda::commit_
from kda_ops.conv import causal_conv1d, causal_conv1d_update, causal_conv1d_update_inplace
from kda_ops.delta_rule import (
    chunk_kda,
    chunk_offsets,
    fused_recurrent_kda,
    fused_recurrent_kda_inplace,
)
from kda_ops.gate import kda_gate
from kda_ops.gated_norm import gated_rms_norm
from kda_ops.plan import explain
from kda_ops.segmented import chunk_kda_segmented
from lowering import onnx_registry as _onnx_registry

_onnx_registry.install()

__version__ = "0.2.0"

__all__ = [
    "causal_conv1d",
    "causal_conv1d_update",
    "causal_conv1d_update_inplace",
    "chunk_kda",
    "chunk_kda_segmented",
    "chunk_offsets",
    "explain",
    "fused_recurrent_kda",
    "fused_recurrent_kda_inplace",
    "gated_rms_norm",
    "kda_gate",
    "speculative",
]
