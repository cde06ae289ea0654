"""The Mamba / causal-conv1d reference decode update (``causal_conv1d_update_ref``,
Mamba's ``step``) -> in-place ``kda::causal_conv1d_update_``.

Matches, for x ``[B, D]`` (or ``[B, D, 1]``), conv_state ``[B, D, W]``, weight ``[D, W]``
(or ``[D, 1, W]``), optional bias ``[D]`` (float32 / bfloat16 / float16, all one dtype),
every spelling of :func:`~lowering.inductor.conv_patterns.window_update` with the ``roll``
shift, e.g.::

    conv_state.copy_(torch.roll(conv_state, shifts=-1, dims=-1))
    conv_state[:, :, -1] = x                            # or [:, :, -1:] = x for [B, D, 1]
    y = torch.sum(conv_state * weight, dim=-1) + bias   # or without bias, keepdim, einsum...
    y = F.silu(y)                                       # or no activation

which functionalization writes as a roll (an index by ``(i + 1) % W``), a select_scatter
(slice_scatter) of x into its last column, and the weighted sum of that. The op advances
the W-column state in place in its layout: no rolled copy, no scatter.
"""

from __future__ import annotations

from lowering.inductor.conv_patterns import ConvWindowPass


class ConvUpdateRollPass(ConvWindowPass):
    """The roll-and-assign formulation, every spelling (see module doc)."""

    name = "conv_update_roll"
    formulation = "Mamba roll-and-assign conv update"
    shift = "roll"
