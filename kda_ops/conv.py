"""Depthwise causal short convolution: ``causal_conv1d``, ``causal_conv1d_update`` and the
``kda::causal_conv1d`` (functional) / ``kda::causal_conv1d_update_`` (in-place) ops.

Layouts: x ``[B, T, D]`` (channels last, as FLA); weight ``[D, W]`` with tap ``W - 1`` on
the current token; bias ``[D]``; conv state ``[N, D, W - 1]``: the last ``W - 1`` inputs.
"""

from typing import Optional

import torch
from torch import Tensor

from kda_ops import kernels, reference
from kda_ops.validation import ArgumentChecker

ACTIVATIONS = {None: "identity", "identity": "identity", "silu": "silu", "swish": "silu"}


@torch.library.custom_op("kda::causal_conv1d", mutates_args=())
def causal_conv1d_op(
    x: Tensor,
    weight: Tensor,
    bias: Optional[Tensor],
    initial_state: Optional[Tensor],
    cu_seqlens: Optional[Tensor],
    activation: str,
) -> tuple[Tensor, Tensor]:
    return reference.causal_conv1d(x, weight, bias, initial_state, cu_seqlens, activation)


@causal_conv1d_op.register_fake
def _(x, weight, bias, initial_state, cu_seqlens, activation):
    n_seqs = x.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
    state_dtype = x.dtype if initial_state is None else initial_state.dtype
    state = x.new_empty(n_seqs, x.shape[2], weight.shape[1] - 1, dtype=state_dtype)
    return x.new_empty(x.shape), state


def causal_conv1d_backward_reference(
    x: Tensor,
    weight: Tensor,
    bias: Optional[Tensor],
    initial_state: Optional[Tensor],
    cu_seqlens: Optional[Tensor],
    grad_y: Tensor,
    grad_final_state: Tensor,
    activation: str,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Gradients for (x, weight, bias, initial_state); absent optionals get empty tensors."""

    def forward(x: Tensor, weight: Tensor, bias: Optional[Tensor], state: Optional[Tensor]):
        return reference.causal_conv1d(x, weight, bias, state, cu_seqlens, activation)

    primals = (x, weight, bias, initial_state)
    return reference.vjp(forward, primals, (grad_y, grad_final_state))


causal_conv1d_backward_op = torch.library.custom_op("kda::causal_conv1d_backward", mutates_args=())(
    causal_conv1d_backward_reference
)


@causal_conv1d_backward_op.register_fake
def _(x, weight, bias, initial_state, cu_seqlens, grad_y, grad_final_state, activation):
    primals = (x, weight, bias, initial_state)
    return tuple(x.new_empty(0) if p is None else p.new_empty(p.shape) for p in primals)


def _setup_context(ctx, inputs, output) -> None:
    *tensors, ctx.activation = inputs
    ctx.save_for_backward(*tensors)


def _backward(ctx, grad_y: Tensor, grad_final_state: Tensor):
    saved = ctx.saved_tensors
    grads = causal_conv1d_backward_op(*saved, grad_y, grad_final_state, ctx.activation)
    return *(None if p is None else grad for p, grad in zip(saved, grads)), None, None


causal_conv1d_op.register_autograd(_backward, setup_context=_setup_context)


def causal_conv1d_update_inplace_reference(
    x: Tensor,
    conv_state: Tensor,
    weight: Tensor,
    bias: Optional[Tensor],
    state_indices: Optional[Tensor],
    activation: str,
) -> Tensor:
    """Advances slots of the pool ``conv_state`` ``[P, D, S]`` by x ``[N, T, D]``.

    A slot keeps the last ``S >= W - 1`` inputs: ``W - 1`` in kda's layout, ``W`` in
    transformers' and Mamba's (whose oldest entry the conv never reads); the update writes
    the last S inputs of (slot, x). Sequence n uses slot ``state_indices[n]`` (slot n
    without indices); a negative index marks padding: zero history, nothing written back.
    """
    kept = conv_state.shape[-1]
    if state_indices is None:
        history = conv_state
    else:
        valid = state_indices >= 0
        history = torch.where(valid[:, None, None], conv_state[state_indices.clamp(min=0)], 0)
    window = history[..., kept - (weight.shape[1] - 1) :]
    y, final = reference.causal_conv1d(x, weight, bias, window, None, activation)
    if kept != weight.shape[1] - 1:
        inputs = torch.cat([history, x.transpose(1, 2).to(history.dtype)], dim=-1)
        final = inputs[..., inputs.shape[-1] - kept :]
    if state_indices is None:
        conv_state.copy_(final)
    else:
        conv_state[state_indices[valid]] = final[valid]
    return y


causal_conv1d_update_inplace_op = torch.library.custom_op(
    "kda::causal_conv1d_update_", mutates_args=("conv_state",)
)(causal_conv1d_update_inplace_reference)


@causal_conv1d_update_inplace_op.register_fake
def _(x, conv_state, weight, bias, state_indices, activation):
    return x.new_empty(x.shape)


if kernels.AVAILABLE:
    from kda_ops.kernels.conv.backward import launch_causal_conv1d_backward
    from kda_ops.kernels.conv.forward import launch_causal_conv1d

    def _uses_reference(*tensors: Optional[Tensor]) -> bool:
        """The kernels compute in fp32; fp64 is the oracle's."""
        return reference.compute_dtype(*tensors) == torch.float64

    @causal_conv1d_op.register_kernel("cuda")
    def _(x, weight, bias, initial_state, cu_seqlens, activation):
        if _uses_reference(x, weight, bias, initial_state):
            return reference.causal_conv1d(x, weight, bias, initial_state, cu_seqlens, activation)
        n_seqs = x.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
        state_dtype = x.dtype if initial_state is None else initial_state.dtype
        state = x.new_empty(n_seqs, x.shape[2], weight.shape[1] - 1, dtype=state_dtype)
        y = launch_causal_conv1d(
            x, weight, bias, initial_state, state, None, cu_seqlens, activation
        )
        return y, state

    @causal_conv1d_backward_op.register_kernel("cuda")
    def _(x, weight, bias, initial_state, cu_seqlens, grad_y, grad_final_state, activation):
        args = (x, weight, bias, initial_state, cu_seqlens, grad_y, grad_final_state, activation)
        if _uses_reference(x, weight, bias, initial_state):
            return causal_conv1d_backward_reference(*args)
        return launch_causal_conv1d_backward(*args)

    @causal_conv1d_update_inplace_op.register_kernel("cuda")
    def _(x, conv_state, weight, bias, state_indices, activation):
        # The prefill kernels keep W - 1 inputs; the decode step kernel any S >= W - 1.
        longer_state_prefill = conv_state.shape[-1] != weight.shape[1] - 1 and x.shape[1] != 1
        if _uses_reference(x, conv_state, weight, bias) or longer_state_prefill:
            return causal_conv1d_update_inplace_reference(
                x, conv_state, weight, bias, state_indices, activation
            )
        return launch_causal_conv1d(
            x, weight, bias, conv_state, conv_state, state_indices, None, activation
        )


def _check_conv(
    function: str,
    x: object,
    weight: object,
    bias: object,
    activation: Optional[str],
) -> tuple[ArgumentChecker, str]:
    check = ArgumentChecker(function)
    x = check.tensor("x", x, dims=3)
    weight = check.tensor("weight", weight, dims=2)
    check.shape("weight", weight, (x.shape[2], weight.shape[1]), "(D, W)")
    if weight.shape[1] < 2:
        check.fail(ValueError, f"kernel width W must be >= 2, got {weight.shape[1]}")
    if bias is not None:
        check.shape("bias", check.tensor("bias", bias, dims=1), (x.shape[2],), "(D,)")
    if activation not in ACTIVATIONS:
        names = ", ".join(repr(a) for a in ACTIVATIONS)
        check.fail(ValueError, f"`activation` must be one of {names}, got {activation!r}")
    return check, ACTIVATIONS[activation]


def _state_layout(x: Tensor, weight: Tensor) -> tuple[int, int]:
    return x.shape[2], weight.shape[1] - 1


def causal_conv1d(
    x: Tensor,
    weight: Tensor,
    bias: Optional[Tensor] = None,
    initial_state: Optional[Tensor] = None,
    activation: Optional[str] = "silu",
    cu_seqlens: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor]:
    """Depthwise causal conv over T, then SiLU (prefill and training).

    Args:
        x: ``[B, T, D]``; with ``cu_seqlens`` ``B == 1`` holding packed sequences.
        weight: ``[D, W]``; bias: ``[D]``.
        initial_state: ``[N, D, W - 1]``, the inputs before each sequence (zeros if None).
        activation: ``"silu"`` (or ``"swish"``), or ``None`` / ``"identity"``.
        cu_seqlens: int32/int64 ``[N + 1]`` offsets.

    Returns:
        y ``[B, T, D]`` in x's dtype, and the final conv state ``[N, D, W - 1]`` (the last
        ``W - 1`` inputs of each sequence) in the initial state's dtype, else x's.
    """
    check, act = _check_conv("causal_conv1d", x, weight, bias, activation)
    n_seqs = x.shape[0]
    if cu_seqlens is not None:
        n_seqs = check.cu_seqlens(cu_seqlens, x.shape[0], x.shape[1]).shape[0] - 1
    if initial_state is not None:
        state = check.tensor("initial_state", initial_state, dims=3)
        check.shape("initial_state", state, (n_seqs, *_state_layout(x, weight)), "(N, D, W - 1)")
    check.same_device(
        x=x, weight=weight, bias=bias, initial_state=initial_state, cu_seqlens=cu_seqlens
    )
    return causal_conv1d_op(x, weight, bias, initial_state, cu_seqlens, act)


def _as_tokens(check: ArgumentChecker, x: object) -> tuple[Tensor, bool]:
    """Decode input ``[N, D]`` (one token) or ``[N, T, D]`` as ``[N, T, D]``."""
    x = check.tensor("x", x, dims=(2, 3))
    return (x.unsqueeze(1), True) if x.dim() == 2 else (x, False)


def causal_conv1d_update(
    x: Tensor,
    conv_state: Tensor,
    weight: Tensor,
    bias: Optional[Tensor] = None,
    activation: Optional[str] = "silu",
) -> tuple[Tensor, Tensor]:
    """One decode step (or T draft tokens) of :func:`causal_conv1d`, functional.

    Args:
        x: ``[N, D]`` or ``[N, T, D]``.
        conv_state: ``[N, D, W - 1]``.

    Returns:
        y of x's shape and dtype, and the new conv state (a new tensor, conv_state's dtype).
    """
    check = ArgumentChecker("causal_conv1d_update")
    tokens, single = _as_tokens(check, x)
    check, act = _check_conv("causal_conv1d_update", tokens, weight, bias, activation)
    state = check.tensor("conv_state", conv_state, dims=3)
    check.shape("conv_state", state, (tokens.shape[0], *_state_layout(tokens, weight)),
                "(N, D, W - 1)")  # fmt: skip
    check.same_device(x=tokens, conv_state=conv_state, weight=weight, bias=bias)
    y, new_state = causal_conv1d_op(tokens, weight, bias, conv_state, None, act)
    return (y.squeeze(1) if single else y), new_state


def causal_conv1d_update_inplace(
    x: Tensor,
    conv_state: Tensor,
    weight: Tensor,
    bias: Optional[Tensor] = None,
    activation: Optional[str] = "silu",
    state_indices: Optional[Tensor] = None,
) -> Tensor:
    """:func:`causal_conv1d_update` that advances slots of a conv-state pool in place.

    Args:
        x: ``[N, D]`` or ``[N, T, D]``.
        conv_state: pool ``[P, D, S]``, updated in place: each slot keeps the last
            ``S >= W - 1`` inputs (``W - 1`` as :func:`causal_conv1d_update`; transformers'
            and Mamba's caches keep ``W``, and are read and written in their layout).
        state_indices: int32/int64 ``[N]``: sequence n uses slot ``state_indices[n]``; a
            negative index marks padding (zero history, nothing written). Without it,
            ``P == N``.

    Returns:
        y of x's shape and dtype. Not differentiable.
    """
    function = "causal_conv1d_update_inplace"
    tokens, single = _as_tokens(ArgumentChecker(function), x)
    check, act = _check_conv(function, tokens, weight, bias, activation)
    state = check.tensor("conv_state", conv_state, dims=3)
    pool_size = state.shape[0]
    if state_indices is None:
        pool_size = tokens.shape[0]
    else:
        check.state_indices(state_indices, tokens.shape[0])
    channels, kept = _state_layout(tokens, weight)
    check.shape("conv_state", state, (pool_size, channels, max(kept, state.shape[2])),
                "(P, D, S), S >= W - 1")  # fmt: skip
    check.same_device(
        x=tokens, conv_state=conv_state, weight=weight, bias=bias, state_indices=state_indices
    )
    y = causal_conv1d_update_inplace_op(tokens, conv_state, weight, bias, state_indices, act)
    return y.squeeze(1) if single else y
