"""Device functions with which the backward's kernels load a chunk's rows as the forward
saw them: q̂ and k̂ (l2-normalised whole, or by the whole rows' factors that kernel 1
stored, for kernels that see only some key columns), the cumulative log-decay G and β
after the sigmoid. Shared so that every kernel of the backward reads the same rows.
"""

import triton
import triton.language as tl

from kda_ops.kernels.chunk.device import beta_rows, unit_rows


@triton.jit
def load_unit_rows(
    x, tokens, rows_in, i_h, H: tl.constexpr, K: tl.constexpr, offs_k, USE_L2NORM: tl.constexpr
):
    """Rows of q or k ``[R, BK]`` fp32, l2-normalised with ``USE_L2NORM``; zero outside."""
    mask = rows_in[:, None] & (offs_k < K)[None, :]
    offsets = (tokens * H + i_h)[:, None] * K + offs_k[None, :]
    return unit_rows(tl.load(x + offsets, mask=mask, other=0.0), USE_L2NORM)


@triton.jit
def stored_norms(norm, tokens, rows_in, i_hv, HV: tl.constexpr, USE_L2NORM: tl.constexpr):
    """``[R]`` fp32 factors that l2-normalise whole rows of q or k, as
    ``chunk_bwd_prepare_kernel`` stored them (``[B, T, HV]``; ones without ``USE_L2NORM``),
    for kernels that load rows a block of columns at a time."""
    factors = tl.full([tokens.shape[0]], 1.0, dtype=tl.float32)
    if USE_L2NORM:
        factors = tl.load(norm + tokens * HV + i_hv, mask=rows_in, other=0.0)
    return factors


@triton.jit
def load_normed_rows(
    x,
    norm,
    tokens,
    rows_in,
    i_h,
    i_hv,
    H: tl.constexpr,
    HV: tl.constexpr,
    K: tl.constexpr,
    offs_k,
    USE_L2NORM: tl.constexpr,
):
    """Rows of q or k ``[R, BK]`` fp32 on the columns ``offs_k``, l2-normalised by their
    whole rows' factors as kernel 1 stored them (``stored_norms``); zero outside."""
    raw = load_unit_rows(
        x=x, tokens=tokens, rows_in=rows_in, i_h=i_h, H=H, K=K, offs_k=offs_k, USE_L2NORM=False
    )
    return (
        raw
        * stored_norms(
            norm=norm, tokens=tokens, rows_in=rows_in, i_hv=i_hv, HV=HV, USE_L2NORM=USE_L2NORM
        )[:, None]
    )


@triton.jit
def load_cum_rows(
    cum_g, tokens, rows_in, i_hv, HV: tl.constexpr, K: tl.constexpr, offs_k, cum_last
):
    """Cumulative log-decay rows ``[R, BK]``; rows past the sequence hold the chunk's last
    value (padding decays nothing, so every pair factor stays <= 1)."""
    mask = rows_in[:, None] & (offs_k < K)[None, :]
    rows = tl.load(
        cum_g + (tokens * HV + i_hv)[:, None] * K + offs_k[None, :], mask=mask, other=0.0
    )
    return tl.where(rows_in[:, None], rows, cum_last[None, :])


@triton.jit
def load_beta_rows(beta, tokens, rows_in, i_hv, HV: tl.constexpr, USE_BETA_SIGMOID: tl.constexpr):
    """β ``[R]`` fp32 (after the sigmoid with ``USE_BETA_SIGMOID``, the forward's
    ``beta_rows``), zero outside."""
    raw = tl.load(beta + tokens * HV + i_hv, mask=rows_in, other=0.0)
    return beta_rows(raw, rows_in, USE_BETA_SIGMOID)
