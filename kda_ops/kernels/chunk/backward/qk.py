"""Kernel 6 of the backward, ``chunk_bwd_qk_kernel`` (token-parallel), and its launch: dq,
dk from the per-value-head gradients of the l2-normalised rows, summing each head's
value-head group (grouped value heads share q and k), then the l2norm backward (a
whole-row product, hence not in the pairs kernel, which sees only some key columns).
"""

import triton
import triton.language as tl

from kda_ops.kernels.chunk.backward.rows import load_unit_rows
from kda_ops.kernels.chunk.device import inverse_norm
from kda_ops.kernels.chunk.planning import dot_block
from kda_ops.kernels.sizes import cdiv


@triton.jit
def _l2norm_backward(x, tokens, rows_in, i_h, H: tl.constexpr, K: tl.constexpr, offs_k, d_unit):
    """The gradient of raw rows of q or k ``[R, BK]`` from that of their l2-normalised
    rows: ``(d - x̂ (x̂ · d)) / sqrt(|x|² + eps)``."""
    raw = load_unit_rows(
        x=x, tokens=tokens, rows_in=rows_in, i_h=i_h, H=H, K=K, offs_k=offs_k, USE_L2NORM=False
    )
    inv_norm = inverse_norm(raw)
    unit = raw * inv_norm[:, None]
    return (d_unit - unit * tl.sum(unit * d_unit, axis=1)[:, None]) * inv_norm[:, None]


@triton.jit
def chunk_bwd_qk_kernel(
    x,
    d_unit,
    n_tokens,
    dx,
    H: tl.constexpr,
    HV: tl.constexpr,
    K: tl.constexpr,
    BK: tl.constexpr,
    BT: tl.constexpr,
    USE_L2NORM: tl.constexpr,
):
    """The gradient of q or k (``[B, T, H, K]``, its dtype) for BT tokens of head i_h from
    the per-value-head gradients of its l2-normalised rows (``[B, T, HV, K]`` fp32): the
    sum over the head's value-head group, then the l2norm backward. Apart from the pairs
    kernel because that one sees only some key columns, and the l2norm backward needs a
    whole row."""
    i_t, i_h = tl.program_id(0), tl.program_id(1)
    tokens = i_t.to(tl.int64) * BT + tl.arange(0, BT)
    rows_in = tokens < n_tokens
    offs_k = tl.arange(0, BK)
    mask = rows_in[:, None] & (offs_k < K)[None, :]
    d = tl.zeros([BT, BK], dtype=tl.float32)
    for i_g in range(0, HV // H):
        d += tl.load(
            d_unit + (tokens * HV + i_h * (HV // H) + i_g)[:, None] * K + offs_k[None, :],
            mask=mask,
            other=0.0,
        )
    if USE_L2NORM:
        d = _l2norm_backward(
            x=x, tokens=tokens, rows_in=rows_in, i_h=i_h, H=H, K=K, offs_k=offs_k, d_unit=d
        )
    tl.store(
        dx + (tokens * H + i_h)[:, None] * K + offs_k[None, :], d.to(dx.dtype.element_ty), mask=mask
    )


def launch_qk_backward(x, d_unit, dx, use_qk_l2norm: bool) -> None:
    """``chunk_bwd_qk_kernel`` over every token and head of x (q or k ``[B, T, H, K]``):
    writes its gradient ``dx`` from ``d_unit`` (``[B, T, HV, K]`` fp32)."""
    batch, length, heads, head_k = x.shape
    value_heads, block_k = d_unit.shape[2], dot_block(head_k)
    chunk_bwd_qk_kernel[(cdiv(batch * length, 32), heads)](
        x=x,
        d_unit=d_unit,
        n_tokens=batch * length,
        dx=dx,
        H=heads,
        HV=value_heads,
        K=head_k,
        BK=block_k,
        BT=32,
        USE_L2NORM=use_qk_l2norm,
        num_warps=4,
    )
