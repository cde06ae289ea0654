"""The post-grad pass manager: runs every kda pass, counts their matches, and gives Inductor
a ``uuid`` over the passes' sources so the FX graph cache stays on."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass

from lowering.inductor.base import KDAInductorPass, source_hash
from lowering.inductor.conv_update import ConvUpdatePass
from lowering.inductor.conv_update_roll import ConvUpdateRollPass
from lowering.inductor.conv_update_transformers import ConvUpdateTransformersPass
from lowering.inductor.conv_update_window import ConvUpdateWindowPass
from lowering.inductor.gated_rms_norm import GatedRMSNormPass
from lowering.inductor.recurrent_state import RecurrentStatePass
from lowering.inductor.triton_kernels import TritonKernelsPass


def default_passes() -> list[KDAInductorPass]:
    """The kda fusions, in the order they run."""
    return [
        RecurrentStatePass(),  # a written-back kda.recurrent -> kda.recurrent_ on its state
        # The conv decode step, every spelling (conv_patterns.window_update), per state:
        ConvUpdatePass(),  # a W - 1 state, window cat(state, x) (examples/hybrid_model.py)
        ConvUpdateWindowPass(),  # a W-column state shifted by cat(state[..., 1:], x)
        ConvUpdateTransformersPass(),  # transformers' torch_causal_conv1d_update (F.conv1d)
        ConvUpdateRollPass(),  # Mamba / causal-conv1d's roll, assign, weighted sum
        GatedRMSNormPass(),  # the gated RMSNorm, every spelling (norm_patterns)
        TritonKernelsPass(),  # last: the fused ops' CUDA kernels as Inductor kernel nodes
    ]


class KDAPassManager(CustomGraphPass):
    """Install as ``torch._inductor.config.post_grad_custom_post_pass``.

    ``counts`` holds, per pass name, the matches since construction or the last
    :meth:`reset_counts` (summed over every graph compiled in between).
    """

    def __init__(self, passes: Optional[Sequence[KDAInductorPass]] = None) -> None:
        self.passes = list(default_passes() if passes is None else passes)

    def __call__(self, graph: torch.fx.Graph) -> None:
        for fusion in self.passes:
            fusion(graph)
        graph.eliminate_dead_code()

    def uuid(self) -> str:
        """Changes whenever this file or any pass's source changes."""
        return source_hash(type(self), *(type(p) for p in self.passes)) + ",".join(
            p.uuid() for p in self.passes
        )

    @property
    def counts(self) -> dict[str, int]:
        return {p.name: p.matches for p in self.passes}

    def reset_counts(self) -> None:
        for fusion in self.passes:
            fusion.matches = 0
