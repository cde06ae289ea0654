"""The KDA forget gate: ``kda_gate`` and the ``kda::gate`` op (with ``kda::gate_backward``)."""

from typing import Optional

import torch
from torch import Tensor

from kda_ops import arguments, kernels, reference
from kda_ops.validation import ArgumentChecker


@torch.library.custom_op("kda::gate", mutates_args=())
def gate_op(
    g: Tensor, A_log: Tensor, dt_bias: Optional[Tensor], lower_bound: Optional[float]
) -> Tensor:
    return reference.kda_gate(g, A_log, dt_bias, lower_bound)


@gate_op.register_fake
def _(g, A_log, dt_bias, lower_bound):
    dtype = reference.compute_dtype(g, A_log, dt_bias)
    return g.new_empty(g.shape, dtype=dtype)


@torch.library.custom_op("kda::gate_backward", mutates_args=())
def gate_backward_op(
    g: Tensor,
    A_log: Tensor,
    dt_bias: Optional[Tensor],
    grad_out: Tensor,
    lower_bound: Optional[float],
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients for (g, A_log, dt_bias); an absent dt_bias gets an empty tensor."""

    def forward(g: Tensor, A_log: Tensor, dt_bias: Optional[Tensor]) -> Tensor:
        return reference.kda_gate(g, A_log, dt_bias, lower_bound)

    return reference.vjp(forward, (g, A_log, dt_bias), (grad_out,))


@gate_backward_op.register_fake
def _(g, A_log, dt_bias, grad_out, lower_bound):
    grad_dt_bias = g.new_empty(0) if dt_bias is None else dt_bias.new_empty(dt_bias.shape)
    return g.new_empty(g.shape), A_log.new_empty(A_log.shape), grad_dt_bias


def _setup_context(ctx, inputs, output) -> None:
    g, A_log, dt_bias, lower_bound = inputs
    ctx.save_for_backward(g, A_log, dt_bias)
    ctx.lower_bound = lower_bound


def _backward(ctx, grad_out: Tensor):
    g, A_log, dt_bias = ctx.saved_tensors
    grad_g, grad_A_log, grad_dt_bias = gate_backward_op(
        g, A_log, dt_bias, grad_out, ctx.lower_bound
    )
    return grad_g, grad_A_log, None if dt_bias is None else grad_dt_bias, None


gate_op.register_autograd(_backward, setup_context=_setup_context)

if kernels.AVAILABLE:
    from kda_ops.kernels.gate import launch_kda_gate

    @gate_op.register_kernel("cuda")
    def _(g, A_log, dt_bias, lower_bound):
        if reference.compute_dtype(g, A_log, dt_bias) == torch.float64:
            return reference.kda_gate(g, A_log, dt_bias, lower_bound)
        return launch_kda_gate(g, A_log, dt_bias, lower_bound)


def kda_gate(
    g: Tensor,
    A_log: Optional[Tensor] = None,
    dt_bias: Optional[Tensor] = None,
    lower_bound: Optional[float] = None,
    output_dtype: Optional[torch.dtype] = None,
) -> Tensor:
    """The KDA log-decay from the raw gate: ``fla.ops.kda.gate.fused_kda_gate``'s signature
    and math.

    Args:
        g: raw gate ``[..., HV, K]``; Gated DeltaNet's per-head gate is ``[..., HV, 1]``.
        A_log: HV values (``[HV]``, or any shape holding them, e.g. ``[1, 1, HV, 1]``);
            ``None`` with ``lower_bound`` means the rate 1: ``lower_bound * sigmoid(g +
            dt_bias)``.
        dt_bias: ``[HV * K]`` (or ``[HV, K]``) or ``None``.
        lower_bound: ``None`` for ``-exp(A_log) * softplus(g + dt_bias)``; a negative bound
            (Kimi K3: -5) for the safe gate ``lower_bound * sigmoid(exp(A_log) * (g +
            dt_bias))``.
        output_dtype: the result's dtype; ``None`` keeps the compute dtype.

    Returns:
        the log-decay of g's shape, computed in float32 (float64 for float64 inputs).
    """
    check = ArgumentChecker("kda_gate")
    g = check.tensor("g", g)
    if g.dim() < 2:
        check.fail(ValueError, f"`g` must be [..., HV, K], got shape {tuple(g.shape)}")
    heads, channels = g.shape[-2], g.shape[-1]
    if A_log is None:
        if lower_bound is None:
            check.fail(ValueError, "`A_log` is needed unless `lower_bound` is set")
        A_log = torch.zeros(heads, dtype=torch.float32, device=g.device)
    A_log = arguments.as_vector(check.tensor("A_log", A_log), heads)
    check.shape("A_log", check.tensor("A_log", A_log, dims=1), (heads,), "(HV,)")
    if dt_bias is not None:
        dt_bias = arguments.as_vector(check.tensor("dt_bias", dt_bias), heads * channels)
        check.shape(
            "dt_bias", check.tensor("dt_bias", dt_bias, dims=1), (heads * channels,), "(HV * K,)"
        )
    if lower_bound is not None and not lower_bound < 0:
        check.fail(ValueError, f"`lower_bound` must be negative, got {lower_bound}")
    check.same_device(g=g, A_log=A_log, dt_bias=dt_bias)
    out = gate_op(g, A_log, dt_bias, None if lower_bound is None else float(lower_bound))
    return out if output_dtype is None else out.to(output_dtype)
