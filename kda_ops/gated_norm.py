"""Gated RMSNorm: ``gated_rms_norm`` and the ``kda::gated_rms_norm`` op."""

import torch
from torch import Tensor

from kda_ops import kernels, reference
from kda_ops.validation import ArgumentChecker

ACTIVATIONS = ("sigmoid", "silu")


@torch.library.custom_op("kda::gated_rms_norm", mutates_args=())
def gated_rms_norm_op(
    x: Tensor, gate: Tensor, weight: Tensor, eps: float, activation: str
) -> Tensor:
    return reference.gated_rms_norm(x, gate, weight, eps, activation)


@gated_rms_norm_op.register_fake
def _(x, gate, weight, eps, activation):
    torch._check(gate.shape == x.shape)
    return x.new_empty(x.shape)


def gated_rms_norm_backward_reference(
    x: Tensor, gate: Tensor, weight: Tensor, grad_out: Tensor, eps: float, activation: str
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients for (x, gate, weight), by autograd through the reference."""

    def forward(x: Tensor, gate: Tensor, weight: Tensor) -> Tensor:
        return reference.gated_rms_norm(x, gate, weight, eps, activation)

    return reference.vjp(forward, (x, gate, weight), (grad_out,))


gated_rms_norm_backward_op = torch.library.custom_op(
    "kda::gated_rms_norm_backward", mutates_args=()
)(gated_rms_norm_backward_reference)


@gated_rms_norm_backward_op.register_fake
def _(x, gate, weight, grad_out, eps, activation):
    return x.new_empty(x.shape), gate.new_empty(gate.shape), weight.new_empty(weight.shape)


def _setup_context(ctx, inputs, output) -> None:
    x, gate, weight, ctx.eps, ctx.activation = inputs
    ctx.save_for_backward(x, gate, weight)


def _backward(ctx, grad_out: Tensor):
    grads = gated_rms_norm_backward_op(*ctx.saved_tensors, grad_out, ctx.eps, ctx.activation)
    return *grads, None, None


gated_rms_norm_op.register_autograd(_backward, setup_context=_setup_context)

if kernels.AVAILABLE:
    from kda_ops.kernels.gated_norm import launch_gated_rms_norm, launch_gated_rms_norm_backward

    @gated_rms_norm_op.register_kernel("cuda")
    def _(x, gate, weight, eps, activation):
        if x.dtype == torch.float64:  # the kernels compute in fp32; fp64 is the oracle's
            return reference.gated_rms_norm(x, gate, weight, eps, activation)
        return launch_gated_rms_norm(x, gate, weight, eps, activation)

    @gated_rms_norm_backward_op.register_kernel("cuda")
    def _(x, gate, weight, grad_out, eps, activation):
        args = (x, gate, weight, grad_out, eps, activation)
        if x.dtype == torch.float64:  # the kernels compute in fp32; fp64 is the oracle's
            return gated_rms_norm_backward_reference(*args)
        return launch_gated_rms_norm_backward(*args)


def gated_rms_norm(
    x: Tensor, gate: Tensor, weight: Tensor, eps: float = 1e-5, activation: str = "sigmoid"
) -> Tensor:
    """``rmsnorm(x) * weight * act(gate)`` over the last dim (FLA's ``FusedRMSNormGated``).

    Args:
        x: ``[..., D]`` float16 / bfloat16 / float32 / float64 (D is the head dim when
            used per head).
        gate: ``[..., D]``, like x.
        weight: ``[D]``.
        eps: added to the mean square.
        activation: ``"sigmoid"`` (Kimi) or ``"silu"`` (Qwen3-Next; ``"swish"`` too).

    Returns:
        ``[..., D]`` in x's dtype, computed in float32 (float64 for float64 inputs).
    """
    check = ArgumentChecker("gated_rms_norm")
    x = check.tensor("x", x)
    if x.dim() < 1:
        check.fail(ValueError, "`x` must have at least one dim")
    check.shape("gate", check.tensor("gate", gate), x.shape, "like `x`")
    check.shape("weight", check.tensor("weight", weight, dims=1), x.shape[-1:], "(D,)")
    activation = "silu" if activation == "swish" else activation
    if activation not in ACTIVATIONS:
        check.fail(ValueError, f"`activation` must be one of {ACTIVATIONS}, got {activation!r}")
    check.same_device(x=x, gate=gate, weight=weight)
    return gated_rms_norm_op(x, gate, weight, float(eps), activation)
