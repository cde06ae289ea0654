"""Replacements for the kernel functions of transformers' hybrid linear-attention models.

transformers (>= 5.24) writes the same four functions into every KDA / Gated DeltaNet model
file (``kimi_linear``, ``glm5_next``, ``qwen3_next``, ``qwen3_5``, ``qwen3_5_moe``,
``olmo_hybrid``, ...; its modular files copy them): a chunked and a recurrent delta rule
(FLA's ``chunk_kda`` / ``fused_recurrent_kda`` / ``chunk_gated_delta_rule`` /
``fused_recurrent_gated_delta_rule`` when FLA is installed, Python loops over T otherwise),
``causal_conv1d_fn`` / ``causal_conv1d_update`` and a gated RMSNorm module. The functions
below keep those call signatures and route to ``torch.ops.kda``.

Caller conventions (read from transformers 5.24):

- delta rule: q, k ``[B, T, H, K]``, v ``[B, T, HV, V]``, g the log-decay already computed
  by the model (``[B, T, HV, K]`` for KDA, ``[B, T, HV]`` for GDN, float32), beta after
  sigmoid, ``use_qk_l2norm_in_kernel=True``, default scale; the state ``[B, HV, K, V]`` comes
  from the cache and the final state goes back to it (float32).
- conv: channels first, x ``[B, D, T]``, weight ``[D, W]``; the cache's conv state is
  ``[B, D, S]`` (S = W, newest input last) and the decode update rewrites it in place as
  ``cat(state, x)[..., -S:]``. Our op's history is the last ``W - 1`` inputs, so it reads
  ``state[..., -(W - 1):]``.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor

import kda_ops
from kda_ops.integrations._patch import Patch


def chunk_delta_rule(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    g: Tensor,
    beta: Tensor,
    chunk_size: int = 64,
    initial_state: Optional[Tensor] = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: Optional[Tensor] = None,
    **kwargs: Any,
) -> tuple[Tensor, Optional[Tensor]]:
    """transformers' ``chunk_kimi_delta_attention`` / ``torch_chunk_gated_delta_rule`` on
    ``kda::chunk``.

    Shapes: q, k ``[B, T, H, K]``; v ``[B, T, HV, V]``; g log-decay ``[B, T, HV, K]`` (KDA)
    or ``[B, T, HV]`` (GDN); beta ``[B, T, HV]`` after sigmoid; initial_state
    ``[N, HV, K, V]`` in any float dtype (the cache's; ``chunk_kda`` computes it in float32,
    where transformers' reference casts it to v's dtype). ``chunk_size`` is accepted for
    signature compatibility (the result does not depend on it); other keyword arguments
    (the model's attention kwargs) are ignored, as transformers' own kernel wrapper does.

    Returns o ``[B, T, HV, V]`` in v's dtype and the float32 final state or ``None``.
    """
    return kda_ops.chunk_kda(
        query, key, value, g, beta, initial_state=initial_state,
        output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        cu_seqlens=cu_seqlens,
    )  # fmt: skip


def recurrent_delta_rule(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    g: Tensor,
    beta: Tensor,
    initial_state: Optional[Tensor] = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: Optional[Tensor] = None,
    **kwargs: Any,
) -> tuple[Tensor, Optional[Tensor]]:
    """transformers' ``recurrent_kimi_delta_attention`` / ``torch_recurrent_gated_delta_rule``
    on ``kda::recurrent``; same shapes and results as :func:`chunk_delta_rule`."""
    return kda_ops.fused_recurrent_kda(
        query, key, value, g, beta, initial_state=initial_state,
        output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        cu_seqlens=cu_seqlens,
    )  # fmt: skip


def _reject_seq_idx(function: str, kwargs: dict[str, Any]) -> None:
    if kwargs.get("seq_idx") is not None:
        raise ValueError(
            f"{function}: `seq_idx` (packed sequences) is not supported by kda_ops' conv "
            "integration; pass unpacked batches"
        )


def causal_conv1d_fn(
    hidden_states: Tensor,
    weight: Tensor,
    bias: Optional[Tensor] = None,
    activation: Optional[str] = None,
    **kwargs: Any,
) -> Tensor:
    """transformers' ``causal_conv1d_fn`` (prefill, zero history) on ``kda::causal_conv1d``.

    hidden_states ``[B, D, T]`` (channels first); weight ``[D, W]``; bias ``[D]``;
    activation ``None`` or ``"silu"`` / ``"swish"``. Returns ``[B, D, T]`` in the input dtype.
    """
    _reject_seq_idx("causal_conv1d_fn", kwargs)
    y, _ = kda_ops.causal_conv1d(hidden_states.transpose(1, 2), weight, bias, None, activation)
    return y.transpose(1, 2)


def causal_conv1d_update(
    hidden_states: Tensor,
    conv_state: Tensor,
    weight: Tensor,
    bias: Optional[Tensor] = None,
    activation: Optional[str] = None,
) -> Tensor:
    """transformers' ``causal_conv1d_update`` (decode) on ``kda::causal_conv1d``.

    hidden_states ``[B, D, T]``; conv_state ``[B, D, S]`` with ``S >= W - 1``, newest input
    last, rewritten in place to ``cat(conv_state, hidden_states)[..., -S:]`` exactly as
    transformers does. Returns ``[B, D, T]`` in the input dtype.
    """
    if not isinstance(conv_state, Tensor) or conv_state.dim() != 3:
        raise TypeError("causal_conv1d_update: `conv_state` must be a 3-D tensor [B, D, S]")
    width, kept = weight.shape[-1], conv_state.shape[-1]
    if kept < width - 1:
        raise ValueError(
            f"causal_conv1d_update: `conv_state` keeps {kept} inputs but a width-{width} "
            f"conv needs the last {width - 1}"
        )
    history = conv_state[..., kept - (width - 1) :]
    y, _ = kda_ops.causal_conv1d_update(
        hidden_states.transpose(1, 2), history, weight, bias, activation
    )
    window = torch.cat([conv_state, hidden_states.to(conv_state.dtype)], dim=-1)
    conv_state.copy_(window[..., -kept:])
    return y.transpose(1, 2)


def gated_rms_norm_forward(module: torch.nn.Module, hidden_states: Tensor, gate: Tensor) -> Tensor:
    """``forward`` of transformers' ``*RMSNormGated`` modules on ``kda::gated_rms_norm``:
    ``rmsnorm(x) · weight · act(gate)`` over the last dim with the module's
    ``variance_epsilon`` and ``activation`` (sigmoid for Kimi / GLM, silu for Qwen3-Next).
    x, gate ``[..., D]``."""
    return kda_ops.gated_rms_norm(
        hidden_states, gate, module.weight, module.variance_epsilon, module.activation
    )


def gated_norm_patch(cls: type) -> Patch:
    """The swap of a gated RMSNorm class's ``forward`` (so models built before ``enable()``
    switch too)."""

    def forward(self: torch.nn.Module, hidden_states: Tensor, gate: Optional[Tensor] = None):
        return gated_rms_norm_forward(self, hidden_states, gate)

    forward.__doc__ = gated_rms_norm_forward.__doc__
    forward.__qualname__ = forward.__name__ = "gated_rms_norm_forward"
    return Patch(cls, "forward", forward)
