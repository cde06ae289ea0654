"""The chunked delta rule of portable mode (:mod:`lowering.onnx`, opset 18): ``kda.chunk``
as matrix products over 64-token chunks, a ``Scan`` over chunks carrying the state.

It mirrors ``reference.chunk_delta_rule`` (the UT/WY form of DESIGN.md §2). Per chunk of
C = 64 tokens with in-chunk cumulative log-decay G:

- ``Aqk = tril((Q ⊙ Γ)(K / Γ)ᵀ)`` and ``Akk = tril(diag(β) (K ⊙ Γ)(K / Γ)ᵀ, -1)``: the
  pairwise factors are ``exp(G_i - G_j)`` per channel, never a ratio of decays.
- ``T = (I + Akk)⁻¹`` (unit lower triangular), ``U = T diag(β) V``,
  ``W = T diag(β) (K ⊙ Γ)``;
- across chunks ``S ← diag(Γ_C) S + (K ⊙ Γ_C / Γ)ᵀ (U - W S)``: the serial ``Scan``
  takes two ``[C, K] × [K, V]``-sized products per chunk, ``U' = U - W S`` and the update,
  and returns each chunk's starting state S₀ and ``U'``; then, for every chunk at once,
  ``O = (Q ⊙ Γ) S₀ + Aqk U'``. (Forming ``M = diag(Γ_C) - K̃ᵀ W`` and ``E = K̃ᵀ U`` for
  all chunks, so that the step is one product, costs two products more.)

Everything but the ``Scan`` is batched over (chunks, batch, heads), in that order: the
``Scan`` slices its inputs along their first axis (onnxruntime transposes a scan input
whose scan axis is another one). For T = 2048, H = 4, D = 64 the matrix products are
~0.2 G multiply-adds.

Per-channel decay (KDA) with the safe gate and a lower bound of -5 or above (K3's): the
pairwise factors of every pair of 16-token blocks (b, c) at once, row block b factored at
its first token ``r_b``, column block c at its last token ``e_c``: ``exp(G_i - G_j) =
exp(G_i - G_r_b) · exp(G_r_b - G_e_c) · exp(G_e_c - G_j)``. Off the diagonal (c < b) all
three factors are at most 1, so one that underflows stands for a product that does; on
it (c = b) the bound keeps the middle factor within ``exp(75)`` and the outer ones above
``exp(-75)``, inside float32 (FlashKDA's 16-token rule). The middle factor scales the
keys (``[.., b, C, K]``, four times their size), and one batched product gives ``Aqk``,
another ``diag(β) Akk``. Without a bound, for any log-decay ``g <= 0``
(what both gate forms produce), by recursive halving of the chunk: a block's causal pairs
are those within each half (recursion) and those from its second half to its first,
whose factor splits at ``r``, the last token of the first half: ``exp(G_i - G_j) =
exp(G_i - G_r) · exp(G_r - G_j)`` with ``j <= r < i``, both factors at most 1, one matrix
product per block; a one-token block is ``x_i · k_i``. Neither forms a ``[C, C, K]``
tensor (the reference's ``exp(G_i - G_j)`` over all causal pairs costs 64 times the
inputs' size). A scalar decay per head (Gated DeltaNet) takes the ``[C, C]`` matrix
``exp(G_i - G_j + m)``, m = -inf where the pair is not causal (strictly, for ``Akk``).

The triangular inverse is recursive: ``(I + L)⁻¹`` of a 16×16 block is the nilpotent
product ``(I - L)(I + L²)(I + L⁴)(I + L⁸)`` (``L¹⁶ = 0``); two halves combine as
``[[T₁, 0], [-T₂ L₂₁ T₁, T₂]]``.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import onnx
from onnxscript import FLOAT, graph, script
from onnxscript import opset18 as op

from lowering import onnx as kda_onnx

CHUNK = 64  # tokens per chunk, as reference.CHUNK_SIZE
BLOCK = 16  # the triangular inverse's blocks inverted by the nilpotent product
# The safe gate's decay per token is above its lower bound, so a block of BLOCK tokens
# factored at its first token has factors within exp(±(BLOCK - 1) * 5) = exp(±75), inside
# float32 (exp(88.7)) with room for |k| up to 1e5: such blocks are one product each.
FACTORED_BLOCK_LOWER_BOUND = -5.0
ELEMENTWISE_HALF = 2  # halves up to this size pair up by broadcast products, not MatMul

Value = kda_onnx.Value


@script()
def chunk_scan(
    state: FLOAT, w: FLOAT, u: FLOAT, keys: FLOAT, decay: FLOAT
) -> tuple[FLOAT, FLOAT, FLOAT]:
    """The serial part, per chunk: ``U' = U_c - W_c S``, ``S ← Γ_c ⊙ S + K̃_cᵀ U'``.
    state ``[B, HV, K, V]``; scanned over their first axis (NC): w ``[NC, B, HV, C, K]``,
    u ``[NC, B, HV, C, V]``, keys K̃ ``[NC, B, HV, C, K]``, decay Γ_c (the chunk's
    total decay) ``[NC, B, HV, Kg, 1]``. Returns (final state, the state at each chunk's
    start ``[NC, B, HV, K, V]``, ``U'`` ``[NC, B, HV, C, V]``)."""

    @graph()
    def step(s: FLOAT[...], w_c: FLOAT[...], u_c: FLOAT[...], k_c: FLOAT[...], d_c: FLOAT[...]):
        new_values = u_c - op.MatMul(w_c, s)
        # K̃ᵀ through a Transpose that onnxruntime folds into the product (transA).
        update = op.MatMul(op.Transpose(k_c, perm=[0, 1, 3, 2]), new_values)
        return d_c * s + update, op.Identity(s), new_values

    final, starts, new_values = op.Scan(state, w, u, keys, decay, body=step, num_scan_inputs=4)
    return final, starts, new_values


def _const(array: np.ndarray) -> Value:
    return op.Constant(value=onnx.numpy_helper.from_array(array))


def _unit_lower_inverse(lower: Value, n: int) -> Value:
    """``(I + L)⁻¹`` for strictly lower-triangular ``L`` ``[..., n, n]`` (n a power of two)."""
    if n <= BLOCK:
        result = _const(np.eye(n, dtype=np.float32)) - lower
        power, reach = lower, 2
        while reach < n:
            power = op.MatMul(power, power)
            result = result + op.MatMul(result, power)
            reach *= 2
        return result
    h = n // 2
    halves = op.Concat(
        op.Unsqueeze(op.Slice(lower, [0, 0], [h, h], [-2, -1]), [-3]),
        op.Unsqueeze(op.Slice(lower, [h, h], [n, n], [-2, -1]), [-3]),
        axis=-3,
    )
    inverses = _unit_lower_inverse(halves, h)
    top = op.Squeeze(op.Slice(inverses, [0], [1], [-3]), [-3])
    bottom = op.Squeeze(op.Slice(inverses, [1], [2], [-3]), [-3])
    corner = op.Neg(op.MatMul(op.MatMul(bottom, op.Slice(lower, [h, 0], [n, h], [-2, -1])), top))
    zeros = op.Expand(op.Constant(value_float=0.0), op.Shape(top))
    return op.Concat(op.Concat(top, zeros, axis=-1), op.Concat(corner, bottom, axis=-1), axis=-2)


def _by_chunks(x: Value, padding: Value, heads: int, trailing: list[int]) -> Value:
    """``[B, T, heads, *trailing]`` -> ``[NC, B, HV, C, *trailing]`` with T zero-padded to
    ``NC * C`` (a padding token has k = v = beta = 0 and no decay: it leaves the state as
    it is, and its output is cut)."""
    rank = 3 + len(trailing)
    pads = op.Concat(
        op.Constant(value_ints=[0] * (rank + 1)), padding,
        op.Constant(value_ints=[0] * (rank - 2)), axis=0,
    )  # fmt: skip
    padded = op.Pad(x, pads)
    shaped = op.Reshape(padded, op.Constant(value_ints=[0, -1, CHUNK, heads, *trailing]))
    perm = [1, 0, 3, 2, *range(4, rank + 1)]
    return op.Transpose(shaped, perm=perm)


def _transposed(x: Value) -> Value:
    """``[NC, B, HV, R, D]`` -> ``[NC, B, HV, D, R]``. Through 3-D: onnxruntime's graph
    optimizer merges a 5-D Transpose with the chunk layout's into one that moves the
    innermost axis, which it runs about ten times slower."""
    rows, cols = op.Shape(x, start=3, end=4), op.Shape(x, start=4, end=5)
    flat = op.Reshape(x, op.Concat(op.Constant(value_ints=[-1]), rows, cols, axis=0))
    batch = op.Shape(x, start=0, end=3)
    return op.Reshape(op.Transpose(flat, perm=[0, 2, 1]), op.Concat(batch, cols, rows, axis=0))


def _pairwise_decayed(q: Value, k: Value, cum: Value, head_k: int) -> tuple[Value, Value]:
    """``(Aqk, Akk)`` before masking, ``[NC, B, HV, C, C]``: ``sum_c x_i[c] k_j[c]
    exp(G_i[c] - G_j[c])`` for x = q and x = k over causal pairs ``j <= i`` (0 elsewhere).
    q, k, cum ``[NC, B, HV, C, K]``.

    Recursive halving: a block's pairs are those within its two halves (recursion) and
    those from its second half to its first, which split every factor at ``r``, the last
    token of the first half: ``x_i exp(G_i - G_r)`` times ``k_j exp(G_r - G_j)``, each
    factor at most 1 for a log-decay ``g <= 0``, one matrix product per block. A
    one-token block is the plain product ``x_i · k_i``. For any log-decay ``g <= 0``; with
    a known lower bound :func:`_blockwise_decayed` takes fewer nodes."""
    rows = op.Concat(op.Unsqueeze(q, [3]), op.Unsqueeze(k, [3]), axis=3)  # [.., 2, C, K]
    # [.., 2, C, 1, 1]: the diagonal, exp(0) = 1.
    blocks = op.Unsqueeze(op.ReduceSum(rows * op.Unsqueeze(k, [3]), [-1], keepdims=0), [-1, -2])
    half = 1
    while half < CHUNK:
        count = CHUNK // (2 * half)
        split = op.Constant(value_ints=[0, 0, 0, count, 2, half, head_k])
        cum_b, k_b = op.Reshape(cum, split), op.Reshape(k, split)  # [.., m, 2, h, K]
        rows_b = op.Reshape(rows, op.Constant(value_ints=[0, 0, 0, 2, count, 2, half, head_k]))
        ref = op.Slice(cum_b, [0, half - 1], [1, half], [4, 5])  # [.., m, 1, 1, K]
        to_ref = op.Exp(op.Slice(cum_b, [1], [2], [4]) - ref)  # [.., m, 1, h, K], <= 1
        from_ref = op.Exp(ref - op.Slice(cum_b, [0], [1], [4]))  # [.., m, 1, h, K], <= 1
        second = op.Slice(rows_b, [1], [2], [5]) * op.Unsqueeze(to_ref, [3])
        first = op.Unsqueeze(op.Slice(k_b, [0], [1], [4]) * from_ref, [3])
        if half <= ELEMENTWISE_HALF:  # tiny products: cheaper as a broadcast sum
            corner = op.ReduceSum(
                op.Unsqueeze(second, [-2]) * op.Unsqueeze(first, [-3]), [-1], keepdims=0
            )
        else:
            corner = op.MatMul(second, op.Transpose(first, perm=[0, 1, 2, 3, 4, 5, 7, 6]))
        # [.., 2, m, 1, h, h] each: assemble [[top, 0], [corner, bottom]].
        paired = op.Reshape(blocks, op.Constant(value_ints=[0, 0, 0, 2, count, 2, half, half]))
        top = op.Slice(paired, [0], [1], [5])
        bottom = op.Slice(paired, [1], [2], [5])
        zeros = op.Expand(op.Constant(value_float=0.0), op.Shape(top))
        blocks = op.Concat(
            op.Concat(top, zeros, axis=-1), op.Concat(corner, bottom, axis=-1), axis=-2
        )
        half *= 2
    full = op.Reshape(blocks, op.Constant(value_ints=[0, 0, 0, 2, CHUNK, CHUNK]))
    aqk = op.Squeeze(op.Slice(full, [0], [1], [3]), [3])
    akk = op.Squeeze(op.Slice(full, [1], [2], [3]), [3])
    return aqk, akk


def _blockwise_decayed(
    q: Value, k: Value, beta_k: Value, cum: Value, head_k: int
) -> tuple[Value, Value]:
    """``(Aqk, β Akk)`` masked (causal, and strictly causal for ``Akk``), ``[NC, B, HV,
    C, C]``, for a log-decay bounded below by :data:`FACTORED_BLOCK_LOWER_BOUND`: every
    pair of the chunk's 16-token blocks at once. q, k, ``beta_k`` (β ⊙
    k), cum ``[NC, B, HV, C, K]``.

    Row block b is factored at its first token ``r_b``, column block c at its last token
    ``e_c``: ``exp(G_i - G_j) = exp(G_i - G_r_b) · exp(G_r_b - G_e_c) · exp(G_e_c - G_j)``.
    For c < b all three factors are at most 1, so a factor that underflows stands for a
    product that does too; for c = b the middle one is at most ``exp(-(BLOCK - 1) *
    bound)`` = ``exp(75)`` and the outer ones at least ``exp(-75)`` (FlashKDA's 16-token
    rule); for c > b (no causal pair) the middle factor is ``exp(-inf) = 0``. The middle
    factor scales the keys, ``[.., b, C, K]`` (four times the keys' size); one batched
    product of q's rows with them gives ``Aqk``, one of β ⊙ k's rows ``β Akk``."""
    blocks = CHUNK // BLOCK
    by_block = op.Constant(value_ints=[0, 0, 0, blocks, BLOCK, head_k])
    cum_b = op.Reshape(cum, by_block)  # [.., NB, L, K]
    first = op.Slice(cum_b, [0], [1], [4])  # [.., NB, 1, K]
    last = op.Slice(cum_b, [BLOCK - 1], [BLOCK], [4])
    to_first = op.Exp(cum_b - first)  # <= 1
    keys_b = op.Reshape(k, by_block) * op.Exp(last - cum_b)  # [.., NB, L, K], <= 1
    # [.., NB(b), NB(c), 1, K]: exp(G_r_b - G_e_c), 0 where c > b.
    above = np.triu(np.full((blocks, blocks), -np.inf, dtype=np.float32), 1)
    middle = op.Exp(
        op.Unsqueeze(first, [4]) - op.Unsqueeze(last, [3]) + _const(above[:, :, None, None])
    )
    keys = op.Reshape(
        middle * op.Unsqueeze(keys_b, [3]), op.Constant(value_ints=[0, 0, 0, blocks, CHUNK, head_k])
    )  # [.., NB(b), C, K]
    causal = np.tril(np.ones((CHUNK, CHUNK), dtype=np.float32))
    square = op.Constant(value_ints=[0, 0, 0, CHUNK, CHUNK])
    results = []
    for rows, mask in ((q, causal), (beta_k, np.tril(causal, -1))):  # Akk without diagonal
        rows_b = op.Reshape(rows, by_block) * to_first
        # A Transpose of its own for each product, so that onnxruntime folds each in (transB).
        product = op.MatMul(rows_b, op.Transpose(keys, perm=[0, 1, 2, 3, 5, 4]))
        results.append(op.Reshape(product, square) * _const(mask))
    return results[0], results[1]


def chunked_delta_rule(
    q: Value, k: Value, v: Value, g: Value, beta: Value, A_log: Optional[Value],
    dt_bias: Optional[Value], initial_state: Optional[Value], cu_seqlens: Optional[Value],
    scale: float, lower_bound: Optional[float], use_qk_l2norm: bool, use_beta_sigmoid: bool,
) -> tuple[Value, Value]:  # fmt: skip
    """``kda.chunk`` in 64-token chunks (portable mode). A one-token call (T = 1 known at
    export) and packed sequences (``cu_seqlens``) take the token ``Scan``
    (:func:`lowering.onnx.portable_delta_rule`)."""
    if cu_seqlens is not None or q.shape[1] == 1:
        return kda_onnx.portable_delta_rule(
            q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, scale, lower_bound,
            use_qk_l2norm, use_beta_sigmoid,
        )  # fmt: skip
    qf, kf, vf, log_decay, beta_f, state = kda_onnx.prepare_delta_rule(
        q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, scale, lower_bound,
        use_qk_l2norm, use_beta_sigmoid,
    )  # fmt: skip
    value_heads, head_k, head_v = v.shape[2], q.shape[3], v.shape[3]
    per_head = len(g.shape) == 3
    length = op.Shape(q, start=1, end=2)
    chunk = op.Constant(value_ints=[CHUNK])
    padding = op.Mod(chunk - op.Mod(length, chunk), chunk)
    q_c = _by_chunks(qf, padding, value_heads, [head_k])  # [NC, B, HV, C, K]
    k_c = _by_chunks(kf, padding, value_heads, [head_k])
    v_c = _by_chunks(vf, padding, value_heads, [head_v])
    gate_width = 1 if per_head else head_k
    g_c = _by_chunks(log_decay, padding, value_heads, [gate_width])
    beta_c = op.Unsqueeze(_by_chunks(beta_f, padding, value_heads, []), [-1])  # [NC, B, HV, C, 1]
    cum = op.CumSum(g_c, op.Constant(value_int=3))
    last = op.Slice(cum, [CHUNK - 1], [CHUNK], [3])  # [NC, B, HV, 1, Kg]
    strict = _const(np.tril(np.ones((CHUNK, CHUNK), dtype=np.float32), -1))
    lower = None
    beta_k = beta_c * k_c
    if per_head:
        # [.., 2, C, C]: exp(G_i - G_j) over causal pairs (strictly causal for Akk), 0
        # elsewhere: -inf added where the pair is none, so no overflow and no mask after.
        pair = op.Unsqueeze(cum - op.Transpose(cum, perm=[0, 1, 2, 4, 3]), [3])
        causal = np.tril(np.ones((CHUNK, CHUNK), dtype=bool))
        none = np.where(np.stack([causal, np.tril(causal, -1)]), 0.0, -np.inf)
        decays = op.Exp(pair + _const(none.astype(np.float32)))
        # One product for both: a Transpose feeding two MatMuls runs on its own.
        rows = op.Concat(op.Unsqueeze(q_c, [3]), op.Unsqueeze(beta_k, [3]), axis=3)
        both = op.MatMul(rows, op.Unsqueeze(_transposed(k_c), [3])) * decays
        aqk, lower = (op.Squeeze(x, [3]) for x in op.Split(both, num_outputs=2, axis=3))
    elif (
        A_log is not None
        and lower_bound is not None
        and (lower_bound >= FACTORED_BLOCK_LOWER_BOUND)
    ):
        aqk, lower = _blockwise_decayed(q_c, k_c, beta_k, cum, head_k)
    else:
        aqk, akk = _pairwise_decayed(q_c, k_c, cum, head_k)
    if lower is None:
        lower = beta_c * akk * strict
    inverse = _unit_lower_inverse(lower, CHUNK)
    gamma = op.Exp(cum)
    u_base = op.MatMul(inverse, beta_c * v_c)  # [NC, B, HV, C, V]
    w = op.MatMul(inverse, beta_k * gamma)  # [NC, B, HV, C, K]
    # Across chunks S ← diag(Γ_C) S + (K ⊙ Γ_C / Γ)ᵀ (U - W S): in the Scan, two products
    # per chunk (forming M = diag(Γ_C) - K̃ᵀ W and E = K̃ᵀ U for all chunks would take
    # two more, of the same size, outside it).
    keys = k_c * op.Exp(last - cum)
    decay = op.Transpose(op.Exp(last), perm=[0, 1, 2, 4, 3])  # [.., Kg, 1]
    final, starts, new_values = chunk_scan(state, w, u_base, keys, decay)
    # O = (Q ⊙ Γ) S + Aqk (U - W S), for all chunks at once.
    o = op.MatMul(q_c * gamma, starts) + op.MatMul(aqk, new_values)
    o = op.Reshape(op.Transpose(o, perm=[1, 0, 3, 2, 4]),
                   op.Constant(value_ints=[0, -1, value_heads, head_v]))  # fmt: skip
    o = op.Slice(o, op.Constant(value_ints=[0]), length, op.Constant(value_ints=[1]))
    if v.dtype == onnx.TensorProto.FLOAT:  # a Cast to its own type still copies
        return o, final
    return op.Cast(o, to=v.dtype), final
