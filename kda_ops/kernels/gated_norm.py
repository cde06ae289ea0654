"""Gated RMSNorm: ``rmsnorm(x) * weight * act(gate)`` over rows, one pass in fp32."""

import torch
import triton
import triton.language as tl
from torch import Tensor

# Elements per program and warps, measured on an H200 (benchmarks/ops.py).
ROW_BLOCK_ELEMENTS = 2048
NUM_WARPS = 4


@triton.jit
def gated_rms_norm_kernel(
    x, gate, weight, eps, n_rows, y,
    D: tl.constexpr, BD: tl.constexpr, ROWS: tl.constexpr, SILU: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BD)
    mask = (rows < n_rows)[:, None] & (cols < D)[None, :]
    offsets = rows.to(tl.int64)[:, None] * D + cols[None, :]
    b_x = tl.load(x + offsets, mask=mask, other=0.0).to(tl.float32)
    b_gate = tl.load(gate + offsets, mask=mask, other=0.0).to(tl.float32)
    b_w = tl.load(weight + cols, mask=cols < D, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(b_x * b_x, axis=1) / D + eps)
    activated = b_gate * tl.sigmoid(b_gate) if SILU else tl.sigmoid(b_gate)
    b_y = b_x * rstd[:, None] * b_w[None, :] * activated
    tl.store(y + offsets, b_y.to(y.dtype.element_ty), mask=mask)


def launch_gated_rms_norm(
    x: Tensor, gate: Tensor, weight: Tensor, eps: float, activation: str
) -> Tensor:
    """x, gate ``[..., D]``; weight ``[D]`` -> y of x's shape and dtype."""
    x, gate = x.contiguous(), gate.contiguous()
    y = torch.empty_like(x)
    width = x.shape[-1]
    n_rows = x.numel() // width if width else 0
    block_d = triton.next_power_of_2(width)
    rows = max(1, ROW_BLOCK_ELEMENTS // block_d)
    gated_rms_norm_kernel[(triton.cdiv(n_rows, rows),)](
        x, gate, weight, eps, n_rows, y,
        D=width, BD=block_d, ROWS=rows, SILU=activation == "silu", num_warps=NUM_WARPS,
    )  # fmt: skip
    return y
