"""Inductor lowering of the kda ops: post-grad fusion passes and the ``kda`` compile backend.

- ``torch.compile(model, backend="kda")`` (registered through the ``torch_dynamo_backends``
  entry point), or ``torch.compile(model, backend=kda_backend)``.
- Stock inductor: ``torch.compile(model, options=inductor_options())``.

Passes (one module each): ``gated_rms_norm`` (plain-op gated RMSNorm -> ``kda.gated_rms_norm``),
``conv_update`` (plain-op conv decode step -> in-place ``kda.causal_conv1d_update_``),
``recurrent_state`` (written-back ``kda.recurrent`` -> in-place ``kda.recurrent_``).
Set ``KDA_LOG_PASSES=1`` to log the match counts of every compiled graph.
"""

from lowering.inductor.backend import PASS_MANAGER, inductor_options, kda_backend
from lowering.inductor.base import KDAInductorPass, PatternPass
from lowering.inductor.conv_update import ConvUpdatePass
from lowering.inductor.gated_rms_norm import GatedRMSNormPass
from lowering.inductor.pass_manager import KDAPassManager, default_passes
from lowering.inductor.recurrent_state import RecurrentStatePass

__all__ = [
    "PASS_MANAGER",
    "ConvUpdatePass",
    "GatedRMSNormPass",
    "KDAInductorPass",
    "KDAPassManager",
    "PatternPass",
    "RecurrentStatePass",
    "default_passes",
    "inductor_options",
    "kda_backend",
]
