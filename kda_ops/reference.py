"""The executable specification of every ``kda`` op, in plain PyTorch.

This module is the CPU kernel of every op, the autograd fallback until a fused backward
exists, and the oracle of every test. It favours clarity over speed: loops run over
sequences and chunks (never over channels), math runs in float32, or float64 when any
floating input is float64.

Layouts (FLA's): q, k ``[B, T, H, K]``; v ``[B, T, HV, V]`` with ``HV % H == 0``;
g ``[B, T, HV, K]`` (KDA) or ``[B, T, HV]`` (Gated DeltaNet); beta ``[B, T, HV]``;
state ``[N, HV, K, V]``. With ``cu_seqlens`` (int ``[N + 1]``) the batch is ``B == 1``
and holds ``N`` packed sequences.

Per token and head, with S of shape ``[K, V]`` and row vectors:

1. decay:   ``S = diag(exp(g_t)) S``
2. predict: ``v_hat = k_t S``
3. write:   ``S = S + k_tᵀ (beta_t (v_t - v_hat))``
4. read:    ``o_t = (scale q_t) S``
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

L2NORM_EPS = 1e-6
CHUNK_SIZE = 64
# The K3 safe gate's most negative lower bound: 16 tokens then decay by at most e^80, inside
# fp32 / bf16 range, which the kernels' dense 16-row diagonal blocks rely on.
SAFE_GATE_LOWER_BOUND = -5.0


def compute_dtype(*tensors: Tensor | None) -> torch.dtype:
    """float64 when any floating input is float64, else float32."""
    if any(t is not None and t.dtype == torch.float64 for t in tensors):
        return torch.float64
    return torch.float32


def l2norm(x: Tensor, eps: float = L2NORM_EPS) -> Tensor:
    """``x / sqrt(sum(x²) + eps)`` over the last dim (FLA's eps placement)."""
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


def kda_gate(
    g: Tensor,
    A_log: Tensor,
    dt_bias: Tensor | None = None,
    lower_bound: float | None = None,
) -> Tensor:
    """Log-decay from the raw gate.

    g: ``[..., HV, K]`` (Gated DeltaNet's scalar gate is ``K == 1``). A_log: ``[HV]``.
    dt_bias: ``[HV * K]``. Returns float32 (float64 for float64 inputs) of g's shape:
    ``-exp(A_log) * softplus(g + dt_bias)``, or with ``lower_bound`` (the K3 safe gate)
    ``lower_bound * sigmoid(exp(A_log) * (g + dt_bias))``.
    """
    dtype = compute_dtype(g, A_log, dt_bias)
    x = g.to(dtype)
    if dt_bias is not None:
        x = x + dt_bias.to(dtype).view(g.shape[-2:])
    rate = A_log.to(dtype).exp().unsqueeze(-1)
    if lower_bound is None:
        return -rate * F.softplus(x)
    return lower_bound * torch.sigmoid(rate * x)


def prepare_delta_rule_inputs(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    A_log: Tensor | None,
    dt_bias: Tensor | None,
    lower_bound: float | None,
    use_qk_l2norm: bool,
    use_beta_sigmoid: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Apply the in-kernel options and broadcast to value heads.

    Returns q, k ``[B, T, HV, K]``, v ``[B, T, HV, V]``, log-decay ``[B, T, HV, K]`` and
    beta ``[B, T, HV]``, all in the compute dtype. Value head ``hv`` reads q/k head
    ``hv // (HV // H)``.
    """
    dtype = compute_dtype(q, k, v, g, beta, A_log, dt_bias)
    q, k, v, beta = q.to(dtype), k.to(dtype), v.to(dtype), beta.to(dtype)
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    if g.dim() == 3:  # Gated DeltaNet: one decay per head, shared by all K channels
        g = g.unsqueeze(-1)
    g = g.to(dtype) if A_log is None else kda_gate(g, A_log, dt_bias, lower_bound)
    if use_beta_sigmoid:
        beta = torch.sigmoid(beta)
    group = v.shape[2] // q.shape[2]
    q = q.repeat_interleave(group, dim=2)
    k = k.repeat_interleave(group, dim=2)
    return q, k, v, g.expand_as(k), beta


Scan = Callable[..., tuple[Tensor, tuple[Tensor, ...]]]
"""A sequential loop with the signature of ``torch._higher_order_ops.scan.scan``:
``scan(step, state, xs) -> (final_state, stacked_outputs)``; ``xs`` is a list of tensors
whose dim 0 runs over the tokens, ``step(state, x) -> (state, outputs)``
with ``outputs`` a tuple of tensors."""


def python_scan(
    step: Callable[[Tensor, list[Tensor]], tuple[Tensor, tuple[Tensor, ...]]],
    state: Tensor,
    xs: list[Tensor],
) -> tuple[Tensor, tuple[Tensor, ...]]:
    """The eager :data:`Scan`: a Python loop (autograd and float64 run through it)."""
    outputs = []
    for i in range(xs[0].shape[0]):
        state, out = step(state, [x[i] for x in xs])
        outputs.append(out)
    return state, tuple(torch.stack(parts) for parts in zip(*outputs))


def recurrent_delta_rule(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    scale: float,
    state: Tensor,
    scan: Scan = python_scan,
) -> tuple[Tensor, Tensor]:
    """Token-by-token recurrence on prepared inputs of one batch; ``scan`` runs the loop
    over tokens.

    q, k, g ``[B, T, HV, K]``; v ``[B, T, HV, V]``; beta ``[B, T, HV]``; state
    ``[B, HV, K, V]``. Returns o ``[B, T, HV, V]`` and the final state.
    """
    if q.shape[1] == 0:
        return torch.zeros_like(v), state

    def step(state: Tensor, token: list[Tensor]) -> tuple[Tensor, tuple[Tensor, ...]]:
        q_t, k_t, v_t, g_t, beta_t = token
        state = state * g_t.exp().unsqueeze(-1)
        v_hat = torch.einsum("bhk,bhkv->bhv", k_t, state)
        error = beta_t.unsqueeze(-1) * (v_t - v_hat)
        state = state + torch.einsum("bhk,bhv->bhkv", k_t, error)
        return state, (torch.einsum("bhk,bhkv->bhv", q_t * scale, state),)

    state, (o,) = scan(step, state, [x.transpose(0, 1) for x in (q, k, v, g, beta)])
    return o.transpose(0, 1), state


def chunk_delta_rule(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    scale: float,
    state: Tensor,
    chunk_size: int = CHUNK_SIZE,
) -> tuple[Tensor, Tensor]:
    """Chunkwise (UT/WY) form of :func:`recurrent_delta_rule`, same arguments and result
    (the algorithm is described in :func:`_chunk_delta_rule`)."""
    o, state, _ = _chunk_delta_rule(q, k, v, g, beta, scale, state, chunk_size, False)
    return o, state


def chunk_delta_rule_with_states(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    scale: float,
    state: Tensor,
    chunk_size: int = CHUNK_SIZE,
) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`chunk_delta_rule` plus the state at the start of every chunk.

    Returns o, the final state and chunk states ``[B, NT, HV, K, V]`` with
    ``NT = ceil(T / chunk_size)``: ``[:, c]`` is the state before token ``c * chunk_size``
    (``[:, 0]`` is the initial state), what a prefix cache stores at chunk boundaries.
    """
    o, state, starts = _chunk_delta_rule(q, k, v, g, beta, scale, state, chunk_size, True)
    if not starts:
        return o, state, state.new_empty(state.shape[0], 0, *state.shape[1:])
    return o, state, torch.stack(starts, dim=1)


def _chunk_delta_rule(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    scale: float,
    state: Tensor,
    chunk_size: int,
    keep_chunk_states: bool,
) -> tuple[Tensor, Tensor, list[Tensor]]:
    """Chunkwise (UT/WY) recurrence; returns o, the final state and, with
    ``keep_chunk_states``, the list of the states at each chunk start (else empty).

    Inside a chunk of C tokens with in-chunk cumulative log-decay G (so Γ = exp(G)) the
    rank-1 updates collapse to ``u = T (diag(β) V - diag(β) (K ⊙ Γ) S)`` with
    ``T = (I + tril(diag(β) (K ⊙ Γ)(K / Γ)ᵀ, -1))⁻¹``, a unit lower-triangular solve.
    Then ``O = (Q ⊙ Γ) S + tril((Q ⊙ Γ)(K / Γ)ᵀ) u`` and
    ``S ← diag(Γ_C) S + (K ⊙ Γ_C / Γ)ᵀ u``. Pairwise factors are formed as
    ``exp(G_i - G_j)`` over causal pairs only, so no ratio of decays overflows.
    """
    length = q.shape[1]
    if length == 0:
        return torch.zeros_like(v), state, []
    pad = -length % chunk_size
    # Padding tokens have k = v = beta = 0 and no decay: they leave the state untouched.
    q, k, v, g, beta = (F.pad(x, (0, 0) * (x.dim() - 2) + (0, pad)) for x in (q, k, v, g, beta))
    # [B, HV, chunks, C, ...]
    q, k, v, g = (x.unflatten(1, (-1, chunk_size)).permute(0, 3, 1, 2, 4) for x in (q, k, v, g))
    beta = beta.unflatten(1, (-1, chunk_size)).permute(0, 3, 1, 2)
    q = q * scale
    cum_g = g.cumsum(-2)

    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).tril()
    strictly_causal = causal.tril(-1)
    # decay_pairs[..., i, j, :] = exp(G_i - G_j) for j <= i, else 0.
    pair_log_decay = cum_g.unsqueeze(-2) - cum_g.unsqueeze(-3)
    decay_pairs = torch.where(causal[..., None], pair_log_decay, -torch.inf).exp()
    kk = torch.einsum("...ik,...jk,...ijk->...ij", k, k, decay_pairs)
    qk = torch.einsum("...ik,...jk,...ijk->...ij", q, k, decay_pairs)
    eye = torch.eye(chunk_size, dtype=q.dtype, device=q.device)
    solve_lhs = eye + beta.unsqueeze(-1) * kk * strictly_causal
    u_base = torch.linalg.solve_triangular(
        solve_lhs, beta.unsqueeze(-1) * v, upper=False, unitriangular=True
    )
    w = torch.linalg.solve_triangular(
        solve_lhs, beta.unsqueeze(-1) * k * cum_g.exp(), upper=False, unitriangular=True
    )
    qk = qk * causal
    k_to_end = k * (cum_g[..., -1:, :] - cum_g).exp()

    outputs, starts = [], []
    for c in range(q.shape[2]):
        if keep_chunk_states:
            starts.append(state)
        u = u_base[:, :, c] - w[:, :, c] @ state
        outputs.append((q[:, :, c] * cum_g[:, :, c].exp()) @ state + qk[:, :, c] @ u)
        state = cum_g[:, :, c, -1].exp().unsqueeze(-1) * state + k_to_end[:, :, c].mT @ u
    o = torch.stack(outputs, dim=2).flatten(2, 3).transpose(1, 2)
    return o[:, :length], state, starts


DeltaRuleForm = Callable[..., tuple[Tensor, ...]]
"""A form ``(q, k, v, g, beta, scale, state) -> (o, final_state, *per_chunk)`` on prepared
inputs; extra outputs are per-chunk tensors ``[B, NT, ...]``."""


def delta_rule(
    form: DeltaRuleForm,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    A_log: Tensor | None,
    dt_bias: Tensor | None,
    initial_state: Tensor | None,
    cu_seqlens: Tensor | None,
    scale: float,
    lower_bound: float | None,
    use_qk_l2norm: bool,
    use_beta_sigmoid: bool,
) -> tuple[Tensor, ...]:
    """KDA / Gated DeltaNet on raw inputs with ``form`` = chunk or recurrent.

    Returns o ``[B, T, HV, V]`` in v's dtype and the final state ``[N, HV, K, V]`` in the
    compute dtype, then any extra per-chunk outputs of ``form`` (e.g. the chunk states of
    :func:`chunk_delta_rule_with_states`, ``[B, NT, ...]``); with ``cu_seqlens`` these are
    ``[1, sum_n NT_n, ...]``, sequence by sequence in order (sequence n from row
    ``chunk_offsets(cu_seqlens)[n]``).
    """
    q, k, v_c, g, beta = prepare_delta_rule_inputs(
        q, k, v, g, beta, A_log, dt_bias, lower_bound, use_qk_l2norm, use_beta_sigmoid
    )
    n_seqs = q.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
    state_shape = (n_seqs, v.shape[2], q.shape[3], v.shape[3])
    if initial_state is None:
        state = q.new_zeros(state_shape)
    else:
        state = initial_state.to(q.dtype, copy=True)
    if cu_seqlens is None:
        o, *states = form(q, k, v_c, g, beta, scale, state)
        return o.to(v.dtype).contiguous(), *states
    results = []
    bounds = cu_seqlens.tolist()
    for n, (start, end) in enumerate(itertools.pairwise(bounds)):
        seq = (x[:, start:end] for x in (q, k, v_c, g, beta))
        results.append(form(*seq, scale, state[n : n + 1]))
    outputs, finals, *per_chunk = zip(*results)
    o = torch.cat(outputs, dim=1).to(v.dtype).contiguous()
    return o, torch.cat(finals), *(torch.cat(parts, dim=1) for parts in per_chunk)


def chunk_offsets(cu_seqlens: Tensor, chunk_size: int = CHUNK_SIZE) -> Tensor:
    """int32 ``[N + 1]``: where each packed sequence's chunks start when the chunks of all
    sequences are numbered in order (sequence n has ``ceil(len_n / chunk_size)`` chunks,
    rows ``[out[n], out[n + 1])``; ``out[N]`` is the total). On cu_seqlens' device, no
    host sync."""
    per_seq = (cu_seqlens[1:] - cu_seqlens[:-1] + chunk_size - 1) // chunk_size
    return torch.cat([per_seq.new_zeros(1), per_seq.cumsum(0)]).to(torch.int32)


def longest_first(cu_seqlens: Tensor) -> Tensor:
    """int64 ``[N]``: the packed sequences' numbers, longest first (equal lengths in
    order). The head-parallel scans take their sequences in this order: a GPU starts a
    grid's programs in order, and a long sequence's scan started last would run on alone
    after the short ones are done. On cu_seqlens' device, no host sync; argsort's own
    dtype, which the kernels read as it is (a cast would be one more launch a scan)."""
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    return torch.argsort(lengths, descending=True, stable=True)


def chunk_state_rows(
    batch: int, length: int, n_seqs: int | None, chunk_size: int = CHUNK_SIZE
) -> int:
    """Rows of the chunk-state buffer: ``B * ceil(T / C)`` for fixed length; with packed
    sequences (``n_seqs`` given, B == 1) the upper bound ``T // C + N``, which needs no
    sequence lengths (``sum_n ceil(len_n / C) <= T // C + N``). Works on SymInts."""
    if n_seqs is None:
        return batch * ((length + chunk_size - 1) // chunk_size)
    return length // chunk_size + n_seqs


def gated_rms_norm(x: Tensor, gate: Tensor, weight: Tensor, eps: float, activation: str) -> Tensor:
    """``rmsnorm(x) * weight * act(gate)`` over the last dim, in fp32, cast to x's dtype.

    x, gate ``[..., D]``; weight ``[D]``; activation ``"sigmoid"`` or ``"silu"``.
    """
    dtype = compute_dtype(x, gate, weight)
    xf = x.to(dtype)
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    gate_fn = torch.sigmoid if activation == "sigmoid" else F.silu
    return (normed * weight.to(dtype) * gate_fn(gate.to(dtype))).to(x.dtype)


def causal_conv1d(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    initial_state: Tensor | None,
    cu_seqlens: Tensor | None,
    activation: str | None,
) -> tuple[Tensor, Tensor]:
    """Depthwise causal conv over time, then the activation.

    x ``[B, T, D]``; weight ``[D, W]`` (tap ``W - 1`` multiplies the current token); bias
    ``[D]``; state ``[N, D, W - 1]``, the last ``W - 1`` inputs of each sequence (zeros
    before the start). Returns y ``[B, T, D]`` in x's dtype and the final state in the
    initial state's dtype (x's when none is given).
    """
    dtype = compute_dtype(x, weight, bias, initial_state)
    state_dtype = x.dtype if initial_state is None else initial_state.dtype
    width = weight.shape[1]
    n_seqs = x.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
    if initial_state is None:
        initial_state = x.new_zeros(n_seqs, x.shape[2], width - 1, dtype=dtype)
    history = initial_state.to(dtype).transpose(1, 2)  # [N, W - 1, D]
    xf = x.to(dtype)
    if cu_seqlens is None:
        windows = [torch.cat([history, xf], dim=1)]
    else:
        bounds = cu_seqlens.tolist()
        windows = [
            torch.cat([history[n], xf[0, s:e]]).unsqueeze(0)
            for n, (s, e) in enumerate(itertools.pairwise(bounds))
        ]
    outputs = [_depthwise_conv(w, weight.to(dtype)) for w in windows]
    y = outputs[0] if cu_seqlens is None else torch.cat(outputs, dim=1)
    if bias is not None:
        y = y + bias.to(dtype)
    if activation in ("silu", "swish"):
        y = F.silu(y)
    final = torch.cat([w[:, w.shape[1] - (width - 1) :] for w in windows]).transpose(1, 2)
    return y.to(x.dtype).contiguous(), final.to(state_dtype).contiguous()


def _depthwise_conv(window: Tensor, weight: Tensor) -> Tensor:
    """window ``[B, W - 1 + T, D]`` (history then inputs) -> ``[B, T, D]``."""
    width = weight.shape[1]
    length = window.shape[1] - (width - 1)
    return sum(window[:, tap : tap + length] * weight[:, tap] for tap in range(width))


def _autograd_reenabled() -> torch._C._ForceDispatchKeyGuard:
    """Undo the dispatcher's exclusion of the autograd keys, which is in force inside every
    op kernel (the kernel runs below autograd), so the kernel can differentiate."""
    exclude = torch._C._dispatch_tls_local_exclude_set()
    for key in ("AutogradFunctionality", "AutogradOther", "AutogradNestedTensor"):
        exclude = exclude.remove(getattr(torch._C.DispatchKey, key))
    return torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), exclude)


def vjp(
    fn: Callable[..., Tensor | tuple[Tensor, ...]],
    primals: tuple[Tensor | None, ...],
    cotangents: tuple[Tensor, ...],
) -> tuple[Tensor, ...]:
    """Vector-Jacobian product of ``fn`` by recomputing it under autograd.

    ``primals`` are fn's differentiable arguments (``None`` where an optional one is
    absent); ``cotangents`` match fn's outputs. Returns one gradient per primal; an absent
    primal gets an empty tensor, so the result is a tuple of tensors (what a custom op can
    return). Meant to be called from an op's kernel.
    """
    with _autograd_reenabled(), torch.enable_grad():
        leaves = tuple(None if p is None else p.detach().requires_grad_() for p in primals)
        outputs = fn(*leaves)
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        present = [leaf for leaf in leaves if leaf is not None]
        grads = torch.autograd.grad(outputs, present, cotangents, allow_unused=True)
    # Contiguous, and never a view: an op's outputs may not alias its inputs or each other.
    grads = iter(
        torch.zeros_like(leaf) if g is None else g.clone() if g._is_view() else g.contiguous()
        for leaf, g in zip(present, grads)
    )
    return tuple(present[0].new_empty(0) if p is None else next(grads) for p in primals)
