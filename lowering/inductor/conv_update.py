"""The decode conv update on a ``W - 1`` state (kda's own, ``examples/hybrid_model.py``)
-> in-place ``kda::causal_conv1d_update_`` through ``auto_functionalized``.

Matches, for x ``[B, D]`` (or ``[B, D, 1]``), conv_state ``[B, D, W - 1]``, weight
``[D, W]``, optional bias ``[D]`` (float32 / bfloat16 / float16, all one dtype), every
spelling of :func:`~lowering.inductor.conv_patterns.window_update` with the ``tail``
shift, e.g.::

    window = torch.cat([conv_state, x.unsqueeze(-1)], dim=-1)
    y = F.silu((window.float() * weight.float()).sum(-1)).to(x.dtype)
    new_state = window[..., 1:]

The new state need not be written back (the functional decode returns it). When the
model writes it back (``conv_state.copy_(new_state)``, which functionalization turns into
``copy_(conv_state, aten.copy(conv_state, new_state))`` because the slice's strides differ
from the state's), the pass also drops that intermediate ``aten.copy``, so Inductor's
re-inplacing pass turns the ``auto_functionalized`` node into the in-place op on the state
itself: no window tensor, no state copy. Without the write-back it clones the (small) state.
"""

from __future__ import annotations

from lowering.inductor.conv_patterns import ConvWindowPass


class ConvUpdatePass(ConvWindowPass):
    """The ``W - 1``-state decode step, every spelling (see module doc)."""

    name = "conv_update"
    formulation = "W - 1 state conv update"
    shift = "tail"
    write_back = False
