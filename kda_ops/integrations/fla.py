"""flash-linear-attention (FLA, ``fla-core`` 0.6) call sites on ``torch.ops.kda``.

Swapped while enabled:

- ``fla.ops.kda.chunk_kda`` / ``fused_recurrent_kda`` → :func:`kda_ops.chunk_kda` /
  :func:`kda_ops.fused_recurrent_kda`, which take FLA's signatures whole,
- ``fla.ops.kda.fused_recurrent.fused_recurrent_kda_fwd`` (vLLM's decode call: a state
  pool addressed by ``ssm_state_indices``, speculative ``num_accepted_tokens``,
  ``inplace_final_state``) → :func:`fused_recurrent_kda_fwd` below,
- ``fla.ops.kda.gate.fused_kda_gate`` → :func:`kda_ops.kda_gate`;
  ``fla.ops.gated_delta_rule.gate.fused_gdn_gate`` → :func:`fused_gdn_gate` on the same op,
- ``fla.ops.gated_delta_rule.chunk_gated_delta_rule`` / ``fused_recurrent_gated_delta_rule``
  → ``kda::chunk`` / ``kda::recurrent`` with the scalar gate (``gk`` is the per-key KDA gate),
- ``fla.modules.FusedRMSNormGated.forward`` → ``kda::gated_rms_norm``,
- ``fla.modules.ShortConvolution.forward`` → ``kda::causal_conv1d`` with FLA's ``[N, D, W]``
  cache (newest input at ``W - 1``; our history is its last ``W - 1`` entries).

The functions are swapped in their defining FLA modules, the packages that re-export them,
and every other loaded module that holds the same object under the same name (code that did
``from fla.ops.kda import chunk_kda`` before ``enable()``). Options of FLA that kda_ops does
not implement (``cp_context``, ``gv``, gated-norm ``residual`` / ``prenorm``, varlen conv
final states) raise ``ValueError``; scheduling options that change nothing here
(``chunk_indices``) are accepted. Unlike FLA, no function writes into its inputs except
the state pools of :func:`fused_recurrent_kda_fwd` and ``ShortConvolution``'s single-token
decode, which update them in place as FLA's do.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any, Optional

import torch
from torch import Tensor

import kda_ops
from kda_ops import arguments, delta_rule_ops
from kda_ops.integrations._patch import Patch
from kda_ops.validation import INDEX_DTYPES, ArgumentChecker

GDN_CHUNK_SIZES = (16, 32, 64)


def fused_gdn_gate(
    g: Tensor,
    A_log: Tensor,
    dt_bias: Optional[Tensor] = None,
    output_dtype: torch.dtype = torch.float32,
) -> Tensor:
    """``fla.ops.gated_delta_rule.gate.fused_gdn_gate``: g ``[..., HV]`` → the log-decay
    ``-exp(A_log) · softplus(g + dt_bias)`` (``kda::gate`` with one channel per head)."""
    gate = kda_ops.kda_gate(g.unsqueeze(-1), A_log, dt_bias, output_dtype=output_dtype)
    return gate.squeeze(-1)


def fused_kda_gate(
    g: Tensor,
    A_log: Optional[Tensor] = None,
    dt_bias: Optional[Tensor] = None,
    lower_bound: Optional[float] = None,
    output_dtype: torch.dtype = torch.float32,
) -> Tensor:
    """``fla.ops.kda.gate.fused_kda_gate``: :func:`kda_ops.kda_gate` with FLA's float32
    default output."""
    return kda_ops.kda_gate(
        g=g, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound, output_dtype=output_dtype
    )


def chunk_gated_delta_rule(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    scale: Optional[float] = None,
    initial_state: Optional[Tensor] = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    state_v_first: bool = False,
    cu_seqlens: Optional[Tensor] = None,
    cu_seqlens_cpu: Optional[Tensor] = None,
    chunk_indices: Optional[Tensor] = None,
    cp_context: None = None,
    *,
    use_gate_in_kernel: bool = False,
    A_log: Optional[Tensor] = None,
    dt_bias: Optional[Tensor] = None,
    chunk_size: int = 64,
    transpose_state_layout: Optional[bool] = None,
) -> tuple[Tensor, Optional[Tensor]]:
    """``fla.ops.gated_delta_rule.chunk_gated_delta_rule`` on ``kda::chunk``: g ``[B, T, HV]``
    (raw with ``use_gate_in_kernel``, then ``A_log`` / ``dt_bias`` are ``[HV]``);
    ``chunk_indices`` is FLA's precomputed chunk list, not needed here."""
    check = ArgumentChecker("chunk_gated_delta_rule")
    arguments.chunk_size(
        check=check,
        size=chunk_size,
        return_intermediate_states=False,
        allowed=GDN_CHUNK_SIZES,
        family="Gated Delta Rule",
    )
    if use_gate_in_kernel and A_log is None:
        check.fail(ValueError, "`use_gate_in_kernel=True` needs `A_log` of shape (HV,)")
    return kda_ops.chunk_kda(
        q=q,
        k=k,
        v=v,
        g=g,
        beta=beta,
        scale=scale,
        initial_state=initial_state,
        output_final_state=output_final_state,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        use_gate_in_kernel=use_gate_in_kernel,
        use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
        allow_neg_eigval=allow_neg_eigval,
        state_v_first=state_v_first,
        cu_seqlens=cu_seqlens,
        cu_seqlens_cpu=cu_seqlens_cpu,
        cp_context=cp_context,
        A_log=A_log,
        dt_bias=dt_bias,
        transpose_state_layout=transpose_state_layout,
    )


def _recurrent_gdn_gate(g: Optional[Tensor], gk: Optional[Tensor], v: Tensor) -> Tensor:
    """The log-decay of FLA's recurrent GDN: scalar g, per-key gk, or both (decays add)."""
    if g is None and gk is None:
        return v.new_zeros(v.shape[:3], dtype=torch.float32)
    if gk is None:
        return g
    return gk if g is None else gk + g.unsqueeze(-1)


def fused_recurrent_gated_delta_rule(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Optional[Tensor] = None,
    gk: Optional[Tensor] = None,
    gv: Optional[Tensor] = None,
    beta: Optional[Tensor] = None,
    scale: Optional[float] = None,
    initial_state: Optional[Tensor] = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    A_log: Optional[Tensor] = None,
    dt_bias: Optional[Tensor] = None,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    state_v_first: bool = False,
    cu_seqlens: Optional[Tensor] = None,
    *,
    transpose_state_layout: Optional[bool] = None,
) -> tuple[Tensor, Optional[Tensor]]:
    """``fla.ops.gated_delta_rule.fused_recurrent_gated_delta_rule`` on ``kda::recurrent``.
    beta ``None`` means 1 (plain delta rule)."""
    check = ArgumentChecker("fused_recurrent_gated_delta_rule")
    if gv is not None:
        check.fail(ValueError, "`gv` (a per-value gate) is not supported by kda_ops")
    if use_gate_in_kernel and gk is not None:
        check.fail(ValueError, "`use_gate_in_kernel` with `gk`")
    beta = v.new_ones(v.shape[:3]) if beta is None else beta
    return kda_ops.fused_recurrent_kda(
        q=q,
        k=k,
        v=v,
        g=_recurrent_gdn_gate(g, gk, v),
        beta=beta,
        A_log=A_log,
        dt_bias=dt_bias,
        scale=scale,
        initial_state=initial_state,
        output_final_state=output_final_state,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        use_gate_in_kernel=use_gate_in_kernel,
        use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
        allow_neg_eigval=allow_neg_eigval,
        state_v_first=state_v_first,
        cu_seqlens=cu_seqlens,
        transpose_state_layout=transpose_state_layout,
    )


def fused_recurrent_kda_fwd(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    A_log: Optional[Tensor] = None,
    dt_bias: Optional[Tensor] = None,
    initial_state: Optional[Tensor] = None,
    scale: Optional[float] = None,
    output_final_state: bool = False,
    inplace_final_state: bool = True,
    state_v_first: bool = False,
    cu_seqlens: Optional[Tensor] = None,
    ssm_state_indices: Optional[Tensor] = None,
    num_accepted_tokens: Optional[Tensor] = None,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    lower_bound: Optional[float] = None,
    out: Optional[Tensor] = None,
) -> tuple[Tensor, Optional[Tensor]]:
    """``fla.ops.kda.fused_recurrent.fused_recurrent_kda_fwd``, vLLM's decode call.

    Without ``ssm_state_indices`` it is :func:`kda_ops.fused_recurrent_kda` (with
    ``inplace_final_state`` the final states overwrite ``initial_state``). With them,
    ``initial_state`` is a pool ``[P, HV, K, V]`` (``[P, HV, V, K]`` V-first):

    - ``[N]`` indices: sequence n starts from slot ``indices[n]`` and its final state goes
      back there (``inplace_final_state``; kda_ops' in-place pool op, no copies);
    - ``[N, S]`` indices (speculative decoding): sequence n starts from slot
      ``indices[n, num_accepted_tokens[n] - 1]`` (``indices[n, 0]`` without it) and its
      state after token t goes to slot ``indices[n, t]``.

    Without ``inplace_final_state`` the state after every token goes to row ``token`` of
    a new ``[T_total, HV, K, V]`` tensor instead (FLA's layout). A negative index is
    padding: its sequence starts from zero and writes nothing (FLA leaves it undefined).
    Returns ``(o, states)``: o in v's dtype (copied into ``out`` when given) and the
    pool, the per-token states, the final states or ``None``.
    """
    check = ArgumentChecker("fused_recurrent_kda_fwd")
    options = dict(
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        use_gate_in_kernel=use_gate_in_kernel,
        use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
        allow_neg_eigval=allow_neg_eigval,
        lower_bound=lower_bound,
        cu_seqlens=cu_seqlens,
        scale=scale,
        A_log=A_log,
        dt_bias=dt_bias,
    )
    if inplace_final_state and initial_state is None:
        check.fail(ValueError, "`inplace_final_state=True` needs `initial_state` (the pool)")
    if ssm_state_indices is None:
        o, final = kda_ops.fused_recurrent_kda(
            q=q,
            k=k,
            v=v,
            g=g,
            beta=beta,
            initial_state=initial_state,
            state_v_first=state_v_first,
            output_final_state=output_final_state or inplace_final_state,
            **options,
        )
        if inplace_final_state:
            initial_state.copy_(final)
            final = initial_state
        return _into(out, o), final
    indices = check.tensor("ssm_state_indices", ssm_state_indices, dims=(1, 2), dtypes=INDEX_DTYPES)
    if initial_state is None:
        check.fail(ValueError, "`ssm_state_indices` needs `initial_state` (the pool)")
    if indices.dim() == 1 and num_accepted_tokens is None and inplace_final_state:
        o = kda_ops.fused_recurrent_kda_inplace(
            q=q,
            k=k,
            v=v,
            g=g,
            beta=beta,
            state_pool=initial_state,
            state_indices=indices,
            state_v_first=state_v_first,
            **options,
        )
        return _into(out, o), initial_state
    o, states = _per_token_slots(
        check=check,
        q=q,
        k=k,
        v=v,
        g=g,
        beta=beta,
        pool=initial_state,
        indices=indices,
        num_accepted_tokens=num_accepted_tokens,
        inplace=inplace_final_state,
        state_v_first=state_v_first,
        options=options,
    )
    return _into(out, o), states


def _into(out: Optional[Tensor], o: Tensor) -> Tensor:
    if out is None:
        return o
    out.copy_(o)
    return out


def _per_token_slots(
    check: ArgumentChecker,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    pool: Tensor,
    indices: Tensor,
    num_accepted_tokens: Optional[Tensor],
    inplace: bool,
    state_v_first: bool,
    options: dict[str, Any],
) -> tuple[Tensor, Tensor]:
    """FLA's continuous-batching decode with a state kept after every token: one
    single-token recurrent step per position (``indices.shape[1]`` of them, or T for
    ``[N]`` indices), the states carried between steps."""
    cu_seqlens = options.pop("cu_seqlens")
    n_seqs = q.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
    if indices.shape[0] != n_seqs:
        check.fail(ValueError, f"`ssm_state_indices` must have {n_seqs} rows, one a sequence")
    steps = indices.shape[1] if indices.dim() == 2 else q.shape[1]
    indices = indices.long().view(n_seqs, -1)
    if cu_seqlens is None:
        starts = torch.arange(n_seqs, device=q.device) * q.shape[1]
        lengths = torch.full((n_seqs,), q.shape[1], device=q.device)
    else:
        starts, lengths = cu_seqlens[:-1].long(), (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    first = torch.zeros(n_seqs, dtype=torch.long, device=q.device)
    if num_accepted_tokens is not None:
        first = num_accepted_tokens.long() - 1
    start_slots = indices.gather(1, first.clamp(min=0).view(-1, 1)).squeeze(1)
    pool_k_first = arguments.key_first(pool, state_v_first)
    state = delta_rule_ops.gather_pool_states(pool_k_first, start_slots)
    state = state.to(arguments.state_dtype(q))
    flat = [x.flatten(0, 1) for x in (q, k, v, g, beta)]
    o = torch.zeros_like(flat[2])
    per_token = None
    if not inplace:
        shape = (flat[0].shape[0], *pool_k_first.shape[1:])
        per_token = torch.zeros(shape, dtype=state.dtype, device=q.device)
    for t in range(steps):
        live = t < lengths
        rows = (starts + t).clamp(max=flat[0].shape[0] - 1)
        q_t, k_t, v_t, g_t, beta_t = (x[rows].unsqueeze(1) for x in flat)
        o_t, after = kda_ops.fused_recurrent_kda(
            q=q_t,
            k=k_t,
            v=v_t,
            g=g_t,
            beta=beta_t,
            initial_state=state,
            output_final_state=True,
            **options,
        )
        state = torch.where(live.view(-1, 1, 1, 1), after, state)
        o[rows[live]] = o_t[live, 0]
        if inplace:
            targets = torch.where(live, indices[:, min(t, indices.shape[1] - 1)], -1)
            delta_rule_ops.scatter_pool_states(pool_k_first, targets, state)
        else:
            per_token[rows[live]] = state[live]
    o = o.view_as(v)
    return o, pool if inplace else arguments.caller_layout(per_token, state_v_first)


def fused_rms_norm_gated_forward(
    self: torch.nn.Module,
    x: Tensor,
    g: Tensor,
    residual: Optional[Tensor] = None,
    prenorm: bool = False,
    residual_in_fp32: bool = False,
) -> Tensor:
    """``FusedRMSNormGated.forward``: ``rmsnorm(x)·weight·act(g)`` over the last dim."""
    if residual is not None or prenorm:
        raise ValueError("FusedRMSNormGated: `residual` / `prenorm` are not supported by kda_ops")
    weight = self.weight if self.weight is not None else x.new_ones(x.shape[-1])
    return kda_ops.gated_rms_norm(
        x=x, gate=g, weight=weight, eps=self.eps, activation=self.activation
    )


def _short_conv_step(
    module: torch.nn.Module, x: Tensor, cache: Optional[Tensor], weight: Tensor
) -> tuple[Tensor, Tensor]:
    """One token per sequence (x ``[N, 1, D]``): FLA updates ``cache [N, D, W]`` in place."""
    if cache is None:
        cache = x.new_zeros(x.shape[0], x.shape[2], weight.shape[1])
    y, _ = kda_ops.causal_conv1d(
        x=x,
        weight=weight,
        bias=module.bias,
        initial_state=cache[..., 1:],
        activation=module.activation,
    )
    cache.copy_(torch.cat([cache[..., 1:], x.transpose(1, 2).to(cache.dtype)], dim=-1))
    return y, cache


def short_convolution_forward(
    self: torch.nn.Module,
    x: Tensor,
    residual: Optional[Tensor] = None,
    mask: Optional[Tensor] = None,
    cache: Optional[Tensor] = None,
    output_final_state: bool = False,
    cu_seqlens: Optional[Tensor] = None,
    **kwargs: Any,
) -> tuple[Tensor, Optional[Tensor]]:
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
        y, cache = _short_conv_step(module=self, x=x, cache=cache, weight=weight)
        final = cache
    else:
        if output_final_state and cu_seqlens is not None:
            raise ValueError("ShortConvolution: varlen final states are not supported by kda_ops")
        history = None if cache is None else cache[..., 1:]
        y, _ = kda_ops.causal_conv1d(
            x=x,
            weight=weight,
            bias=self.bias,
            initial_state=history,
            activation=self.activation,
            cu_seqlens=cu_seqlens,
        )
        final = None
        if output_final_state:
            prior = x.new_zeros(batch, x.shape[2], weight.shape[1]) if cache is None else cache
            window = torch.cat([prior, x.transpose(1, 2).to(prior.dtype)], dim=-1)
            final = window[..., -weight.shape[1] :].contiguous()
    if residual is not None:
        y = y + residual
    return y, final if output_final_state else None


FUNCTIONS = {
    ("fla.ops.kda", "chunk_kda"): kda_ops.chunk_kda,
    ("fla.ops.kda", "fused_recurrent_kda"): kda_ops.fused_recurrent_kda,
    ("fla.ops.kda.fused_recurrent", "fused_recurrent_kda_fwd"): fused_recurrent_kda_fwd,
    ("fla.ops.kda.gate", "fused_kda_gate"): fused_kda_gate,
    ("fla.ops.gated_delta_rule.gate", "fused_gdn_gate"): fused_gdn_gate,
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
