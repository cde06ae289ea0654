"""``fast_exp``: e^x for decay factors in two instructions (``ex2.approx.ftz``: a multiply
and MUFU.EX2) instead of ``tl.exp``'s five (a range check and two rescaling multiplies
around MUFU.EX2 keep its subnormal results). Results below 2^-126 flush to zero, which is
what decay products that small contribute to the sums they enter. The chunk prepare
kernel is instruction-bound and exponentials are a sizeable share of its instructions, so
three instructions saved per exponential count there. ``fast_log``, ``fast_reciprocal``
and ``fast_sigmoid`` likewise.

Triton's interpreter has no libdevice: interpreted kernels keep ``tl.exp`` / ``tl.log``."""

import os

import triton
import triton.language as tl

INTERPRETED = tl.constexpr(os.environ.get("TRITON_INTERPRET") == "1")


@triton.jit
def fast_exp(x):
    """e^x of an fp32 tensor, subnormal results flushed to zero."""
    if INTERPRETED:
        result = tl.exp(x)
    else:
        result = tl.extra.cuda.libdevice.fast_expf(x)
    return result


@triton.jit
def fast_reciprocal(x):
    """1 / x of an fp32 tensor to ~2 ulp (MUFU.RCP and a multiply; no IEEE division)."""
    if INTERPRETED:
        result = 1.0 / x
    else:
        result = tl.extra.cuda.libdevice.fast_dividef(1.0, x)
    return result


@triton.jit
def fast_log(x):
    """ln x of an fp32 tensor from MUFU.LG2 (``lg2.approx.ftz``, absolute error ~2^-22 in
    [0.5, 2]) and a multiply; libdevice's ``logf`` spends many more instructions on full
    range and accuracy, a noticeable share of the chunk prepare kernel with the softplus
    gate."""
    if INTERPRETED:
        result = tl.log(x)
    else:
        result = tl.extra.cuda.libdevice.fast_logf(x)
    return result


@triton.jit
def fast_sigmoid(x):
    """1 / (1 + e^-x) of an fp32 tensor from ``fast_exp`` and ``fast_reciprocal``."""
    return fast_reciprocal(1.0 + fast_exp(-x))
