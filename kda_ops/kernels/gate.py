"""The KDA gate: elementwise log-decay from the raw gate, in fp32."""

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from kda_ops.kernels.fast_exp import fast_exp, fast_log, fast_sigmoid
from kda_ops.kernels.launches import KernelLaunch
from kda_ops.kernels.sizes import cdiv, next_power_of_2


@triton.jit
def gate_activation(x, rate, lower_bound, USE_LOWER_BOUND: tl.constexpr):
    """Log-decay from ``x = g_raw + dt_bias`` in fp32, ``rate = exp(A_log)``
    (``reference.kda_gate``): the safe gate ``lower_bound · sigmoid(rate · x)``, or
    ``-rate · softplus(x)`` with the overflow-free ``max(x, 0) + log(1 + exp(-|x|))``, the
    log's argument in (1, 2], where ``fast_log`` is accurate to ~2^-22."""
    if USE_LOWER_BOUND:
        # The chunk prepare kernel evaluates this on every gate element.
        log_decay = lower_bound * fast_sigmoid(rate * x)
    else:
        log_decay = -rate * (tl.maximum(x, 0.0) + fast_log(1.0 + fast_exp(-tl.abs(x))))
    return log_decay


@triton.jit
def gate_parameters(
    A_log,
    dt_bias,
    i_hv,
    offs_k,
    mask_k,
    K: tl.constexpr,
    SCALAR_GATE: tl.constexpr,
    USE_GATE: tl.constexpr,
    HAS_DT_BIAS: tl.constexpr,
):
    """Value head i_hv's gate parameters for :func:`gate_activation` (the chunk kernels'
    ``activate_gate``, the recurrent kernel): the rate e^{A_log} (fp32) and dt_bias (fp32
    ``[BK]``, a scalar for a scalar gate; 0 without). A program loads them once, before
    its first store: a load after a store the compiler cannot prove apart waits for its
    own round trip."""
    rate = 0.0
    bias = 0.0
    if USE_GATE:
        rate = tl.exp(tl.load(A_log + i_hv).to(tl.float32))
        if HAS_DT_BIAS:
            if SCALAR_GATE:
                bias = tl.load(dt_bias + i_hv).to(tl.float32)
            else:
                bias = tl.load(dt_bias + i_hv * K + offs_k, mask=mask_k, other=0.0).to(tl.float32)
    return rate, bias


@triton.jit
def kda_gate_kernel(
    g,
    A_log,
    dt_bias,
    lower_bound,
    n_rows,
    out,
    HV: tl.constexpr,
    K: tl.constexpr,
    BK: tl.constexpr,
    ROWS: tl.constexpr,
    HAS_DT_BIAS: tl.constexpr,
    USE_LOWER_BOUND: tl.constexpr,
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BK)
    mask = (rows < n_rows)[:, None] & (cols < K)[None, :]
    heads = rows % HV
    offsets = rows.to(tl.int64)[:, None] * K + cols[None, :]
    b_g = tl.load(g + offsets, mask=mask, other=0.0).to(tl.float32)
    if HAS_DT_BIAS:
        b_g += tl.load(dt_bias + heads[:, None] * K + cols[None, :], mask=mask, other=0.0)
    rate = tl.exp(tl.load(A_log + heads, mask=rows < n_rows, other=0.0).to(tl.float32))[:, None]
    tl.store(
        out + offsets,
        gate_activation(x=b_g, rate=rate, lower_bound=lower_bound, USE_LOWER_BOUND=USE_LOWER_BOUND),
        mask=mask,
    )


def gate_launch(
    g: Tensor, A_log: Tensor, dt_bias: Optional[Tensor], lower_bound: Optional[float]
) -> KernelLaunch:
    """The gate kernel's launch for g ``[..., HV, K]``, writing a new float32 log-decay of
    g's shape (``args["out"]``)."""
    g = g.contiguous()
    heads, channels = g.shape[-2], g.shape[-1]
    n_rows = g.numel() // channels if channels else 0
    block_k = next_power_of_2(channels)
    rows = max(1, min(128, 8192 // block_k))
    args = dict(
        g=g,
        A_log=A_log,
        dt_bias=dt_bias,
        lower_bound=0.0 if lower_bound is None else lower_bound,
        n_rows=n_rows,
        out=torch.empty_like(g, dtype=torch.float32),
        HV=heads,
        K=channels,
        BK=block_k,
        ROWS=rows,
        HAS_DT_BIAS=dt_bias is not None,
        USE_LOWER_BOUND=lower_bound is not None,
    )
    return KernelLaunch(kda_gate_kernel, (cdiv(n_rows, rows),), args, writes=("out",))


def launch_kda_gate(
    g: Tensor, A_log: Tensor, dt_bias: Optional[Tensor], lower_bound: Optional[float]
) -> Tensor:
    """g ``[..., HV, K]`` -> float32 log-decay of g's shape."""
    launch = gate_launch(g=g, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound)
    launch.run()
    return launch.args["out"]
