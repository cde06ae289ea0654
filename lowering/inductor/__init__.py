"""Inductor lowering of the kda ops: post-grad fusion passes and the ``kda`` compile backend.

- ``torch.compile(model, backend="kda")`` (registered through the ``torch_dynamo_backends``
  entry point), or ``torch.compile(model, backend=kda_backend)``.
- Stock inductor: ``torch.compile(model, options=inductor_options())``.

Each fusion's patterns come from one description parametrised by spelling
(``norm_patterns``, ``conv_patterns``), matched on the graph after exact canonical rewrites
(``canonical``) that make more spellings one graph. Passes (``pass_manager.default_passes``
says why each is there): the gated RMSNorm, every spelling (kda's example, transformers'
Qwen3-Next / Kimi Linear / GLM5-next modules, FLA's reference, hand-written forms) ->
``kda.gated_rms_norm`` (``gated_rms_norm``); the conv decode step, every spelling ->
in-place ``kda.causal_conv1d_update_`` on a ``W - 1`` state (``conv_update``), a
whole-window state (``conv_update_window``), Mamba's roll-and-assign (``conv_update_roll``),
and transformers' multi-token ``torch_causal_conv1d_update`` (``conv_update_transformers``);
written-back ``kda.recurrent`` -> in-place ``kda.recurrent_`` (``recurrent_state``). Set
``KDA_LOG_PASSES=1`` to log the match counts of every compiled
graph and, for each match, the formulation and the model source line.
"""

from lowering.inductor.backend import PASS_MANAGER, inductor_options, kda_backend
from lowering.inductor.base import KDAInductorPass, PatternPass, ReplacementPass
from lowering.inductor.conv_update import ConvUpdatePass
from lowering.inductor.conv_update_roll import ConvUpdateRollPass
from lowering.inductor.conv_update_transformers import ConvUpdateTransformersPass
from lowering.inductor.conv_update_window import ConvUpdateWindowPass
from lowering.inductor.gated_rms_norm import GatedRMSNormPass
from lowering.inductor.pass_manager import KDAPassManager, default_passes
from lowering.inductor.recurrent_state import RecurrentStatePass

__all__ = [
    "PASS_MANAGER",
    "ConvUpdatePass",
    "ConvUpdateRollPass",
    "ConvUpdateTransformersPass",
    "ConvUpdateWindowPass",
    "GatedRMSNormPass",
    "KDAInductorPass",
    "KDAPassManager",
    "PatternPass",
    "RecurrentStatePass",
    "ReplacementPass",
    "default_passes",
    "inductor_options",
    "kda_backend",
]
