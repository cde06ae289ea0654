"""The decode conv update on a whole-window state -> in-place ``kda::causal_conv1d_update_``.

Matches, for x ``[B, D]`` (or ``[B, D, 1]``), conv_state ``[B, D, W]`` (the window itself:
the last W inputs), weight ``[D, W]`` (or ``[D, 1, W]`` for ``F.conv1d``), optional bias
``[D]`` (float32 / bfloat16 / float16, all one dtype), every spelling of
:func:`~lowering.inductor.conv_patterns.window_update` with the ``cat`` shift, e.g.::

    window = torch.cat([conv_state[..., 1:], x.unsqueeze(-1)], -1)
    y = F.silu((window * weight).sum(-1) + bias)     # or without bias / without SiLU
    conv_state.copy_(window)

    window = torch.cat([conv_state[:, :, 1:], u], 2)  # u [B, D, 1]
    y = F.silu((window * w).sum(-1, keepdim=True))   # or einsum, or F.conv1d(window, ...)

The op advances the W-column state in place in its own layout (it keeps the last S >= W - 1
inputs), so the state is neither converted nor copied. A match needs the write-back.
"""

from __future__ import annotations

from lowering.inductor.conv_patterns import ConvWindowPass


class ConvUpdateWindowPass(ConvWindowPass):
    """The whole-window formulation, every spelling (see module doc)."""

    name = "conv_update_window"
    formulation = "whole-window conv update"
    shift = "cat"
