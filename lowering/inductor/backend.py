"""``torch.compile(model, backend="kda")``: Inductor with the kda post-grad passes, and the
options that add the same passes to the stock ``inductor`` backend."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional

import torch
from torch._inductor import list_mode_options
from torch._inductor.compile_fx import compile_fx

from lowering.inductor.pass_manager import KDAPassManager

PASS_MANAGER = KDAPassManager()
"""The pass manager every kda compile uses; read ``PASS_MANAGER.counts`` for match counts."""

PASS_OPTION = "post_grad_custom_post_pass"


def inductor_options() -> dict[str, Any]:
    """Inductor options that install the kda passes on the stock backend:
    ``torch.compile(model, options=inductor_options())``; merge with other options (for CUDA
    graphs, ``{"triton.cudagraphs": True, **inductor_options()}``)."""
    return {PASS_OPTION: PASS_MANAGER}


def kda_backend(
    gm: torch.fx.GraphModule,
    example_inputs: list[Any],
    mode: Optional[str] = None,
    options: Optional[dict[str, Any]] = None,
) -> Callable[..., Any]:
    """The ``kda`` dynamo backend: Inductor (``mode`` and ``options`` as for
    ``torch.compile``) with :data:`PASS_MANAGER` as the post-grad custom pass."""
    options = dict(options or {})
    if PASS_OPTION in options:
        raise ValueError(
            f"backend 'kda' installs its own {PASS_OPTION!r}; drop it from `options` "
            "or use the inductor backend with lowering.inductor.inductor_options()"
        )
    patches = list_mode_options(mode) if mode and mode != "default" else {}
    patches.update({key.replace("-", "_"): value for key, value in options.items()})
    patches.update(inductor_options())
    return compile_fx(gm, example_inputs, config_patches=patches)
