"""Gated RMSNorm: ``rmsnorm(x) * weight * act(gate)`` over rows, one pass in fp32, and its
backward, one pass too (the weight's gradient as per-program partial sums)."""

import torch
import triton
import triton.language as tl
from torch import Tensor

from kda_ops.kernels.launches import KernelLaunch
from kda_ops.kernels.sizes import cdiv, next_power_of_2

# Elements per program and warps, picked by timing the kernels (benchmarks/ops.py).
ROW_BLOCK_ELEMENTS = 2048
NUM_WARPS = 4


@triton.jit
def _load_rows(x, gate, weight, eps, n_rows, D: tl.constexpr, BD: tl.constexpr, ROWS: tl.constexpr):
    """This program's rows: (offsets, mask, x, gate, weight, rstd), fp32 values."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BD)
    mask = (rows < n_rows)[:, None] & (cols < D)[None, :]
    offsets = rows.to(tl.int64)[:, None] * D + cols[None, :]
    b_x = tl.load(x + offsets, mask=mask, other=0.0).to(tl.float32)
    b_gate = tl.load(gate + offsets, mask=mask, other=0.0).to(tl.float32)
    b_w = tl.load(weight + cols, mask=cols < D, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(b_x * b_x, axis=1) / D + eps)
    return offsets, mask, b_x, b_gate, b_w, rstd


@triton.jit
def gated_rms_norm_kernel(
    x,
    gate,
    weight,
    eps,
    n_rows,
    y,
    D: tl.constexpr,
    BD: tl.constexpr,
    ROWS: tl.constexpr,
    SILU: tl.constexpr,
):
    offsets, mask, b_x, b_gate, b_w, rstd = _load_rows(
        x=x, gate=gate, weight=weight, eps=eps, n_rows=n_rows, D=D, BD=BD, ROWS=ROWS
    )
    activated = b_gate * tl.sigmoid(b_gate) if SILU else tl.sigmoid(b_gate)
    b_y = b_x * rstd[:, None] * b_w[None, :] * activated
    tl.store(y + offsets, b_y.to(y.dtype.element_ty), mask=mask)


@triton.jit
def gated_rms_norm_backward_kernel(
    x,
    gate,
    weight,
    grad_y,
    eps,
    n_rows,
    dx,
    dgate,
    dweight_parts,
    D: tl.constexpr,
    BD: tl.constexpr,
    ROWS: tl.constexpr,
    SILU: tl.constexpr,
):
    """With x̂ = x · rstd and u = dy · w · act(gate) (the gradient of x̂):
    ``dx = rstd (u - x̂ mean(u x̂))``, ``dgate = dy x̂ w act'(gate)``, and this program's
    rows' share of ``dweight = Σ_rows dy x̂ act(gate)`` at row ``program_id`` of
    ``dweight_parts`` ``[programs, D]`` fp32."""
    offsets, mask, b_x, b_gate, b_w, rstd = _load_rows(
        x=x, gate=gate, weight=weight, eps=eps, n_rows=n_rows, D=D, BD=BD, ROWS=ROWS
    )
    b_dy = tl.load(grad_y + offsets, mask=mask, other=0.0).to(tl.float32)
    x_hat = b_x * rstd[:, None]
    sig = tl.sigmoid(b_gate)
    if SILU:  # act = g σ(g), act' = σ(g) (1 + g (1 - σ(g)))
        activated = b_gate * sig
        slope = sig * (1.0 + b_gate * (1.0 - sig))
    else:
        activated = sig
        slope = sig * (1.0 - sig)
    d_hat = b_dy * b_w[None, :] * activated
    b_dx = rstd[:, None] * (d_hat - x_hat * (tl.sum(d_hat * x_hat, axis=1) / D)[:, None])
    tl.store(dx + offsets, b_dx.to(dx.dtype.element_ty), mask=mask)
    b_dgate = b_dy * x_hat * b_w[None, :] * slope
    tl.store(dgate + offsets, b_dgate.to(dgate.dtype.element_ty), mask=mask)
    cols = tl.arange(0, BD)
    tl.store(
        dweight_parts + tl.program_id(0) * D + cols,
        tl.sum(b_dy * x_hat * activated, axis=0),
        mask=cols < D,
    )


def _row_blocks(x: Tensor) -> dict[str, int]:
    """Rows, padded width and rows per program of ``x [..., D]`` for both kernels."""
    width = x.shape[-1]
    block_d = next_power_of_2(width)
    return dict(
        n_rows=x.numel() // width if width else 0,
        D=width,
        BD=block_d,
        ROWS=max(1, ROW_BLOCK_ELEMENTS // block_d),
    )


def gated_rms_norm_launch(
    x: Tensor, gate: Tensor, weight: Tensor, eps: float, activation: str
) -> KernelLaunch:
    """The forward kernel's launch for x, gate ``[..., D]``, weight ``[D]``, writing a new
    y (``args["y"]``, x's shape and dtype)."""
    x, gate, weight = x.contiguous(), gate.contiguous(), weight.contiguous()
    shape = _row_blocks(x)
    grid = (cdiv(shape["n_rows"], shape["ROWS"]),)
    args = dict(
        x=x,
        gate=gate,
        weight=weight,
        eps=eps,
        y=torch.empty_like(x),
        **shape,
        SILU=activation == "silu",
        num_warps=NUM_WARPS,
    )
    return KernelLaunch(gated_rms_norm_kernel, grid, args, writes=("y",))


def launch_gated_rms_norm(
    x: Tensor, gate: Tensor, weight: Tensor, eps: float, activation: str
) -> Tensor:
    """x, gate ``[..., D]``; weight ``[D]`` -> y of x's shape and dtype."""
    launch = gated_rms_norm_launch(x=x, gate=gate, weight=weight, eps=eps, activation=activation)
    launch.run()
    return launch.args["y"]


def launch_gated_rms_norm_backward(
    x: Tensor, gate: Tensor, weight: Tensor, grad_y: Tensor, eps: float, activation: str
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of ``launch_gated_rms_norm`` for (x, gate, weight) given grad_y (x's
    shape), each in its input's dtype; the weight's summed in fp32 from per-program
    shares ``[programs, D]``."""
    x, gate, grad_y = x.contiguous(), gate.contiguous(), grad_y.contiguous()
    dx, dgate = torch.empty_like(x), torch.empty_like(gate)
    shape = _row_blocks(x)
    n_rows = shape.pop("n_rows")
    programs = cdiv(n_rows, shape["ROWS"])
    dweight_parts = torch.empty(programs, shape["D"], device=x.device, dtype=torch.float32)
    gated_rms_norm_backward_kernel[(programs,)](
        x=x,
        gate=gate,
        weight=weight,
        grad_y=grad_y,
        eps=eps,
        n_rows=n_rows,
        dx=dx,
        dgate=dgate,
        dweight_parts=dweight_parts,
        **shape,
        SILU=activation == "silu",
        num_warps=NUM_WARPS,
    )
    return dx, dgate, dweight_parts.sum(0).to(weight.dtype)
