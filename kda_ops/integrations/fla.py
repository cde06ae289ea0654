"""flash-linear-attention (FLA, ``fla-core`` 0.6) call sites on ``torch.ops.kda``.

Swapped while enabled:

- ``fla.ops.kda.chunk_kda`` / ``fused_recurrent_kda`` → :func:`chunk_kda` /
  :func:`fused_recurrent_kda` below (FLA's signatures; ``A_log`` / ``dt_bias`` may come as
  keywords; ``A_log=None`` with ``lower_bound`` is the gate ``lower_bound·sigmoid(g +
  dt_bias)``),
- ``fla.ops.kda.gate.fused_kda_gate`` → ``kda::gate`` (cast to ``output_dtype``),
- ``fla.ops.gated_delta_rule.chunk_gated_delta_rule`` / ``fused_recurrent_gated_delta_rule``
  → ``kda::chunk`` / ``kda::recurrent`` with the scalar gate (``gk`` is the per-key KDA gate),
- ``fla.modules.FusedRMSNormGated.forward`` → ``kda::gated_rms_norm``,
- ``fla.modules.ShortConvolution.forward`` → ``kda::causal_conv1d`` with FLA's ``[N, D, W]``
  cache (newest input at ``W - 1``; our history is its last ``W - 1`` entries).

The functions are swapped in their defining FLA modules, the packages that re-export them,
and every other loaded module that holds the same object under the same name (code that did
``from fla.ops.kda import chunk_kda`` before ``enable()``). Options of FLA that change the
math and that kda_ops does not implement (``allow_neg_eigval``, ``state_v_first``,
``cp_context``, ``return_intermediate_states``, ``gv``, gated-norm ``residual`` /
``prenorm``, varlen conv final states) raise ``ValueError``; ``chunk_kda``'s
``disable_recompute`` is passed on; other scheduling options (``cu_seqlens_cpu``,
``chunk_indices``, ``use_graph``, ...) are ignored. Unlike FLA, no function writes into
its inputs except ``ShortConvolution``'s single-token decode, which updates ``cache`` in
place as FLA's does.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any, Optional

import torch
from torch import Tensor

import kda_ops
from kda_ops.integrations._patch import Patch

UNSUPPORTED = ("allow_neg_eigval", "state_v_first", "transpose_state_layout",
               "return_intermediate_states", "cp_context", "ssm_state_indices",
               "num_accepted_tokens", "out", "gv")  # fmt: skip


def _reject(function: str, options: dict[str, Any]) -> None:
    for name in UNSUPPORTED:
        value = options.get(name)
        if value is not None and value is not False:
            raise ValueError(f"{function}: `{name}` is not supported by kda_ops")


def _gate_params(
    function: str, use_gate_in_kernel: bool, A_log: Optional[Tensor], lower_bound, heads: int,
    device: torch.device,
) -> Optional[Tensor]:  # fmt: skip
    """FLA lets ``A_log`` be None with a ``lower_bound`` (rate 1): exp(0) = 1 gives that."""
    if not use_gate_in_kernel or A_log is not None:
        return A_log
    if lower_bound is None:
        raise ValueError(f"{function}: `use_gate_in_kernel=True` needs `A_log` or `lower_bound`")
    return torch.zeros(heads, dtype=torch.float32, device=device)


def chunk_kda(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: Optional[float] = None,
    initial_state: Optional[Tensor] = None, output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False, use_gate_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False, safe_gate: bool = False,
    lower_bound: Optional[float] = None, cu_seqlens: Optional[Tensor] = None, **kwargs: Any,
) -> tuple[Tensor, Optional[Tensor]]:  # fmt: skip
    """``fla.ops.kda.chunk_kda`` on ``kda::chunk``: q, k ``[B, T, H, K]``; v ``[B, T, HV, V]``;
    g ``[B, T, HV, K]``; beta ``[B, T, HV]``; state ``[N, HV, K, V]`` float32."""
    _reject("chunk_kda", kwargs)
    A_log = _gate_params("chunk_kda", use_gate_in_kernel, kwargs.get("A_log"), lower_bound,
                         v.shape[2], v.device)  # fmt: skip
    return kda_ops.chunk_kda(
        q, k, v, g, beta, scale=scale, initial_state=initial_state,
        output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        use_gate_in_kernel=use_gate_in_kernel,
        use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, A_log=A_log,
        dt_bias=kwargs.get("dt_bias"), lower_bound=lower_bound, cu_seqlens=cu_seqlens,
        safe_gate=safe_gate and use_gate_in_kernel,
        disable_recompute=bool(kwargs.get("disable_recompute", False)),
    )  # fmt: skip


def fused_recurrent_kda(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, A_log: Optional[Tensor] = None,
    dt_bias: Optional[Tensor] = None, scale: Optional[float] = None,
    initial_state: Optional[Tensor] = None, output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False, use_gate_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False, lower_bound: Optional[float] = None,
    cu_seqlens: Optional[Tensor] = None, **kwargs: Any,
) -> tuple[Tensor, Optional[Tensor]]:  # fmt: skip
    """``fla.ops.kda.fused_recurrent_kda`` on ``kda::recurrent`` (same shapes as chunk_kda)."""
    _reject("fused_recurrent_kda", kwargs)
    A_log = _gate_params("fused_recurrent_kda", use_gate_in_kernel, A_log, lower_bound,
                         v.shape[2], v.device)  # fmt: skip
    return kda_ops.fused_recurrent_kda(
        q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, scale=scale, initial_state=initial_state,
        output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        use_gate_in_kernel=use_gate_in_kernel,
        use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, lower_bound=lower_bound,
        cu_seqlens=cu_seqlens,
    )  # fmt: skip


def fused_kda_gate(
    g: Tensor, A_log: Optional[Tensor] = None, dt_bias: Optional[Tensor] = None,
    lower_bound: Optional[float] = None, output_dtype: torch.dtype = torch.float32,
) -> Tensor:  # fmt: skip
    """``fla.ops.kda.gate.fused_kda_gate`` on ``kda::gate``: g ``[..., HV, K]`` → log-decay."""
    A_log = _gate_params("fused_kda_gate", True, A_log, lower_bound, g.shape[-2], g.device)
    return kda_ops.kda_gate(g, A_log, dt_bias, lower_bound).to(output_dtype)


def chunk_gated_delta_rule(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: Optional[float] = None,
    initial_state: Optional[Tensor] = None, output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False, use_beta_sigmoid_in_kernel: bool = False,
    cu_seqlens: Optional[Tensor] = None, **kwargs: Any,
) -> tuple[Tensor, Optional[Tensor]]:  # fmt: skip
    """``fla.ops.gated_delta_rule.chunk_gated_delta_rule`` on ``kda::chunk``: g ``[B, T, HV]``;
    with ``use_gate_in_kernel`` (keyword) g is raw and ``A_log`` / ``dt_bias`` are ``[HV]``."""
    _reject("chunk_gated_delta_rule", kwargs)
    return kda_ops.chunk_kda(
        q, k, v, g, beta, scale=scale, initial_state=initial_state,
        output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        use_gate_in_kernel=kwargs.get("use_gate_in_kernel", False),
        use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, A_log=kwargs.get("A_log"),
        dt_bias=kwargs.get("dt_bias"), cu_seqlens=cu_seqlens,
    )  # fmt: skip


def _recurrent_gdn_gate(g: Optional[Tensor], gk: Optional[Tensor], v: Tensor) -> Tensor:
    """The log-decay of FLA's recurrent GDN: scalar g, per-key gk, or both (decays add)."""
    if g is None and gk is None:
        return v.new_zeros(v.shape[:3], dtype=torch.float32)
    if gk is None:
        return g
    return gk if g is None else gk + g.unsqueeze(-1)


def fused_recurrent_gated_delta_rule(
    q: Tensor, k: Tensor, v: Tensor, g: Optional[Tensor] = None, gk: Optional[Tensor] = None,
    gv: Optional[Tensor] = None, beta: Optional[Tensor] = None, scale: Optional[float] = None,
    initial_state: Optional[Tensor] = None, output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False, use_gate_in_kernel: bool = False,
    A_log: Optional[Tensor] = None, dt_bias: Optional[Tensor] = None,
    use_beta_sigmoid_in_kernel: bool = False, cu_seqlens: Optional[Tensor] = None,
    **kwargs: Any,
) -> tuple[Tensor, Optional[Tensor]]:  # fmt: skip
    """``fla.ops.gated_delta_rule.fused_recurrent_gated_delta_rule`` on ``kda::recurrent``.
    beta ``None`` means 1 (plain delta rule)."""
    _reject("fused_recurrent_gated_delta_rule", {**kwargs, "gv": gv})
    if use_gate_in_kernel and gk is not None:
        raise ValueError("fused_recurrent_gated_delta_rule: `use_gate_in_kernel` with `gk`")
    beta = v.new_ones(v.shape[:3]) if beta is None else beta
    return kda_ops.fused_recurrent_kda(
        q, k, v, _recurrent_gdn_gate(g, gk, v), beta, A_log=A_log, dt_bias=dt_bias, scale=scale,
        initial_state=initial_state, output_final_state=output_final_state,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_gate_in_kernel=use_gate_in_kernel,
        use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, cu_seqlens=cu_seqlens,
    )  # fmt: skip


def fused_rms_norm_gated_forward(
    self: torch.nn.Module, x: Tensor, g: Tensor, residual: Optional[Tensor] = None,
    prenorm: bool = False, residual_in_fp32: bool = False,
) -> Tensor:  # fmt: skip
    """``FusedRMSNormGated.forward``: ``rmsnorm(x)·weight·act(g)`` over the last dim."""
    if residual is not None or prenorm:
        raise ValueError("FusedRMSNormGated: `residual` / `prenorm` are not supported by kda_ops")
    weight = self.weight if self.weight is not None else x.new_ones(x.shape[-1])
    return kda_ops.gated_rms_norm(x, g, weight, self.eps, self.activation)


def _short_conv_step(module: torch.nn.Module, x: Tensor, cache: Optional[Tensor],
                     weight: Tensor) -> tuple[Tensor, Tensor]:  # fmt: skip
    """One token per sequence (x ``[N, 1, D]``): FLA updates ``cache [N, D, W]`` in place."""
    if cache is None:
        cache = x.new_zeros(x.shape[0], x.shape[2], weight.shape[1])
    y, _ = kda_ops.causal_conv1d(x, weight, module.bias, cache[..., 1:], module.activation)
    cache.copy_(torch.cat([cache[..., 1:], x.transpose(1, 2).to(cache.dtype)], dim=-1))
    return y, cache


def short_convolution_forward(
    self: torch.nn.Module, x: Tensor, residual: Optional[Tensor] = None,
    mask: Optional[Tensor] = None, cache: Optional[Tensor] = None,
    output_final_state: bool = False, cu_seqlens: Optional[Tensor] = None, **kwargs: Any,
) -> tuple[Tensor, Optional[Tensor]]:  # fmt: skip
    """``ShortConvolution.forward``: x ``[B, T, D]`` → ``(y [B, T, D], cache [N, D, W] or
    None)``; FLA's semantics for mask (zeroes padded inputs), residual (added after the
    activation) and cache (initial and final states hold the last W inputs)."""
    if mask is not None:
        if cu_seqlens is not None:
            raise ValueError("ShortConvolution: `mask` and `cu_seqlens` cannot both be given")
        x = x * mask.unsqueeze(-1)
    weight = self.weight.squeeze(1)
    batch, length = x.shape[:2]
    if not torch.is_grad_enabled() and cu_seqlens is None and length == 1:
        y, cache = _short_conv_step(self, x, cache, weight)
        final = cache
    else:
        if output_final_state and cu_seqlens is not None:
            raise ValueError("ShortConvolution: varlen final states are not supported by kda_ops")
        history = None if cache is None else cache[..., 1:]
        y, _ = kda_ops.causal_conv1d(x, weight, self.bias, history, self.activation, cu_seqlens)
        final = None
        if output_final_state:
            prior = x.new_zeros(batch, x.shape[2], weight.shape[1]) if cache is None else cache
            window = torch.cat([prior, x.transpose(1, 2).to(prior.dtype)], dim=-1)
            final = window[..., -weight.shape[1] :].contiguous()
    if residual is not None:
        y = y + residual
    return y, final if output_final_state else None


FUNCTIONS = {
    ("fla.ops.kda", "chunk_kda"): chunk_kda,
    ("fla.ops.kda", "fused_recurrent_kda"): fused_recurrent_kda,
    ("fla.ops.kda.gate", "fused_kda_gate"): fused_kda_gate,
    ("fla.ops.gated_delta_rule", "chunk_gated_delta_rule"): chunk_gated_delta_rule,
    ("fla.ops.gated_delta_rule", "fused_recurrent_gated_delta_rule"): (
        fused_recurrent_gated_delta_rule
    ),
}
FORWARDS = {
    "FusedRMSNormGated": fused_rms_norm_gated_forward,
    "ShortConvolution": short_convolution_forward,
}


def _everywhere(original: object, name: str, replacement: object) -> list[Patch]:
    """A swap in every loaded module that holds ``original`` as ``name``."""
    return [
        Patch(module, name, replacement)
        for module in list(sys.modules.values())
        if module is not None and vars(module).get(name) is original
    ]


def patches() -> list[Patch]:
    """The swaps for FLA; imports ``fla.ops.kda``, ``fla.ops.gated_delta_rule``,
    ``fla.modules``."""
    swaps = []
    for (module_name, name), replacement in FUNCTIONS.items():
        original = getattr(importlib.import_module(module_name), name)
        swaps += _everywhere(original, name, replacement)
    modules = importlib.import_module("fla.modules")
    for class_name, forward in FORWARDS.items():
        swaps.append(Patch(getattr(modules, class_name), "forward", forward))
    return swaps
