"""The chunked delta rule of portable mode (:mod:`lowering.onnx`, opset 18): ``kda.chunk``
as matrix products over 32-token chunks, in a ``Scan`` over steps of 8 chunks whose body
does all of a step's work.

It mirrors ``reference.chunk_delta_rule`` (the UT/WY form of DESIGN.md §2). Per chunk of
C tokens with in-chunk cumulative log-decay G and Γ = exp(G):

- ``Aqk = tril((Q ⊙ Γ)(K / Γ)ᵀ)`` and ``Akk = tril((K ⊙ Γ)(K / Γ)ᵀ, -1)``: the pairwise
  factors are ``exp(G_i - G_j)`` per channel, never a ratio of decays;
- ``T = (I + diag(β) Akk)⁻¹`` (unit lower triangular), ``U = T diag(β) V``,
  ``W = T diag(β) (K ⊙ Γ)``: β scales the ``[C, C]`` matrices' rows and columns, not the
  ``[C, D]`` ones;
- across chunks ``S ← diag(Γ_C) S + K̃ᵀ (U - W S)``, ``K̃ = K ⊙ Γ_C / Γ``: two products
  per chunk, ``[W; Q ⊙ Γ] S`` (the rows stacked once a step, so ``(Q ⊙ Γ) S₀`` needs no
  copy of the chunk-start states S₀) and the update; then, for every chunk of the step at
  once, ``O = (Q ⊙ Γ) S₀ + Aqk U'``. (Forming ``M = diag(Γ_C) - K̃ᵀ W`` and ``E = K̃ᵀ U``
  for all chunks, so that the serial step is one product, costs two products more.)

Why steps: onnxruntime runs each node over its whole tensor, so a graph batched over the
whole sequence streams ``[chunks, heads, C, C]`` tensors (2 MiB at T = 2048) through
memory some 60 times, at about a quarter of the speed it runs the same node on a step's
256 KiB, which stays in the CPU's cache. A step (:data:`STEP_TOKENS` tokens) gathers its
tokens head-major from the inputs, applies the in-kernel options (l2norm, gate, beta's
sigmoid), does every within-chunk product for its chunks at once, unrolls the serial part
over them and writes its outputs; the ``Scan`` carries the state from step to step.
32-token chunks cost half the within-chunk products of 64-token ones per token for twice
the serial steps, the cheaper trade here (measured: ``docs/onnx.md``).

Per-channel decay (KDA) with the safe gate and a lower bound of -5 or above (K3's) takes
16-token chunks (:data:`BLOCK`) factored at the chunk's start: ``exp(G_i - G_j) = Γ_i /
Γ_j``, ``Γ`` within ``[exp(-80), 1]``, ``1 / Γ`` within ``[1, exp(80)]``, inside float32
for ``|k|`` up to some 6e3 (FlashKDA's 16-token rule); a pair that is not causal has a
factor of at most ``exp(75)`` and is masked after the product. ``Q ⊙ Γ`` and ``K ⊙ Γ``
are the rows of one product with ``(K / Γ)ᵀ`` that gives ``Aqk`` and ``Akk``, and serve
the state's products; the update takes ``K / Γ`` too, with the chunk's decay after it:
``S ← Γ_C ⊙ (S + (K / Γ)ᵀ U')``. Three ``[C, K]`` factors a chunk (against about ten for
32-token chunks of two 16-token blocks with a factor between them, which cost more than
the serial steps they save: measured, ``docs/onnx.md``). Without a bound, for any
log-decay ``g <= 0`` (what both gate forms produce), by recursive halving of the chunk: a
block's causal pairs are those within each half (recursion) and those from its second
half to its first, whose factor splits at ``r``, the last token of the first half:
``exp(G_i - G_j) = exp(G_i - G_r) · exp(G_r - G_j)`` with ``j <= r < i``, both factors at
most 1, one matrix product per block; a one-token block is ``x_i · k_i``. Neither forms a
``[C, C, K]`` tensor (the reference's ``exp(G_i - G_j)`` over all causal pairs costs C
times the inputs' size). A scalar decay per head (Gated DeltaNet) takes the ``[C, C]``
matrix ``exp(G_i - G_j + m)``, m = -inf where the pair is not causal (strictly, for
``Akk``).

The triangular inverse is recursive: ``(I + L)⁻¹`` of a 16×16 block is the nilpotent
product ``(I - L)(I + L²)(I + L⁴)(I + L⁸)`` (``L¹⁶ = 0``); two halves combine as
``[[T₁, 0], [-T₂ L₂₁ T₁, T₂]]``.

Shaped for onnxruntime's CPU kernels (each choice measured): inside a step the tensors
are ``[B HV, n, C, D]``, reached by Reshapes only (the tokens are gathered head-major, so
no Transpose moves the layout; a 5-D Transpose that onnxruntime's transpose optimizer
merged with those feeding products transposed moved the innermost axis, ten times
slower); products read their transposed operands through a Transpose that onnxruntime
folds into them; scalar constants are rank-matched (a rank-0 operand against a tensor
whose last dim is 1 is broadcast one element at a time); the per-step token indices are
computed once, before the ``Scan``, which slices them without a copy and writes each
step's outputs straight into the stacked result.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable
from typing import Optional

import numpy as np
import onnx
import onnxscript
from onnxscript import ir
from onnxscript import opset18 as op

from lowering import onnx as kda_onnx

CHUNK = 32  # tokens per chunk: the UT transform's size
STEP_TOKENS = 256  # tokens per Scan step: a step's [B HV, n, C, C] tensors stay in cache
BLOCK = 16  # the triangular inverse's blocks inverted by the nilpotent product
# The safe gate's decay per token is above its lower bound, so a chunk of BLOCK tokens
# factored at its start has factors within exp(±BLOCK * 5) = exp(±80), inside float32
# (exp(88.7)) with room for |k| up to some 6e3: such chunks need no split of their factors.
FACTORED_BLOCK_LOWER_BOUND = -5.0
ELEMENTWISE_HALF = 2  # halves up to this size pair up by broadcast products, not MatMul
_scan_ids = itertools.count()  # a prefix for each Scan body's value names

Value = kda_onnx.Value


def _const(array: np.ndarray) -> Value:
    return op.Constant(value=onnx.numpy_helper.from_array(array))


def _scalar(value: float) -> Value:
    """A float32 ``[1, 1, 1, 1]``: onnxruntime broadcasts a rank-0 operand against a
    tensor whose last dim is 1 one element at a time (some 9 µs for 1024 of them), a
    rank-matched one at full speed."""
    return _const(np.full((1, 1, 1, 1), value, dtype=np.float32))


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


def _pairwise_decayed(
    q: Value, k: Value, cum: Value, head_k: int, chunk: int
) -> tuple[Value, Value]:
    """``(Aqk, Akk)`` before masking, ``[N, n, C, C]``: ``sum_c x_i[c] k_j[c] exp(G_i[c] -
    G_j[c])`` for x = q and x = k over causal pairs ``j <= i`` (0 elsewhere). q, k, cum
    ``[N, n, C, K]``.

    Recursive halving: a block's pairs are those within its two halves (recursion) and
    those from its second half to its first, which split every factor at ``r``, the last
    token of the first half: ``x_i exp(G_i - G_r)`` times ``k_j exp(G_r - G_j)``, each
    factor at most 1 for a log-decay ``g <= 0``, one matrix product per block. A
    one-token block is the plain product ``x_i · k_i``. For any log-decay ``g <= 0``; with
    a known lower bound :func:`_bounded_decayed` takes fewer nodes."""
    rows = op.Concat(op.Unsqueeze(q, [2]), op.Unsqueeze(k, [2]), axis=2)  # [N, n, 2, C, K]
    # [N, n, 2, C, 1, 1]: the diagonal, exp(0) = 1.
    blocks = op.Unsqueeze(op.ReduceSum(rows * op.Unsqueeze(k, [2]), [-1], keepdims=0), [-1, -2])
    half = 1
    while half < chunk:
        count = chunk // (2 * half)
        split = op.Constant(value_ints=[0, 0, count, 2, half, head_k])
        cum_b, k_b = op.Reshape(cum, split), op.Reshape(k, split)  # [N, n, m, 2, h, K]
        rows_b = op.Reshape(rows, op.Constant(value_ints=[0, 0, 2, count, 2, half, head_k]))
        ref = op.Slice(cum_b, [0, half - 1], [1, half], [3, 4])  # [N, n, m, 1, 1, K]
        to_ref = op.Exp(op.Slice(cum_b, [1], [2], [3]) - ref)  # [N, n, m, 1, h, K], <= 1
        from_ref = op.Exp(ref - op.Slice(cum_b, [0], [1], [3]))  # [N, n, m, 1, h, K], <= 1
        second = op.Slice(rows_b, [1], [2], [4]) * op.Unsqueeze(to_ref, [2])
        first = op.Unsqueeze(op.Slice(k_b, [0], [1], [3]) * from_ref, [2])
        if half <= ELEMENTWISE_HALF:  # tiny products: cheaper as a broadcast sum
            corner = op.ReduceSum(
                op.Unsqueeze(second, [-2]) * op.Unsqueeze(first, [-3]), [-1], keepdims=0
            )
        else:
            corner = op.MatMul(second, op.Transpose(first, perm=[0, 1, 2, 3, 4, 6, 5]))
        # [N, n, 2, m, 1, h, h] each: assemble [[top, 0], [corner, bottom]].
        paired = op.Reshape(blocks, op.Constant(value_ints=[0, 0, 2, count, 2, half, half]))
        top = op.Slice(paired, [0], [1], [4])
        bottom = op.Slice(paired, [1], [2], [4])
        zeros = op.Expand(op.Constant(value_float=0.0), op.Shape(top))
        blocks = op.Concat(
            op.Concat(top, zeros, axis=-1), op.Concat(corner, bottom, axis=-1), axis=-2
        )
        half *= 2
    full = op.Reshape(blocks, op.Constant(value_ints=[0, 0, 2, chunk, chunk]))
    aqk = op.Squeeze(op.Slice(full, [0], [1], [2]), [2])
    akk = op.Squeeze(op.Slice(full, [1], [2], [2]), [2])
    return aqk, akk


def _bounded_decayed(
    q: Value, k: Value, cum: Value, chunk: int
) -> tuple[Value, Value, Value, Value, Value]:
    """The decayed products of a log-decay bounded below by
    :data:`FACTORED_BLOCK_LOWER_BOUND`, in chunks of ``chunk`` <= :data:`BLOCK` tokens: q,
    k, cum ``[N, n, C, K]``. Returns ``Aqk`` and ``Akk`` masked (causal; strictly for
    ``Akk``) ``[N, n, C, C]``, ``K / Γ``, ``Q ⊙ Γ`` and ``K ⊙ Γ`` ``[N, n, C, K]``.

    Every factor is taken at the chunk's start: ``exp(G_i - G_j) = Γ_i / Γ_j``, with
    ``Γ = exp(G)`` within ``[exp(-80), 1]`` and ``1 / Γ`` within ``[1, exp(80)]`` (16
    tokens of at least -5 each), inside float32 (exp(88.7)) for ``|k|`` up to some 6e3;
    a pair that is not causal (j > i) has a factor of at most ``exp(75)`` (FlashKDA's
    16-token rule) and is masked after the product. ``Q ⊙ Γ`` and ``K ⊙ Γ``, the rows of
    ``Aqk`` and ``Akk``, serve the state's products too, and ``K / Γ``, their columns, the
    state's update (:func:`_across_chunks` with ``decay_after``), so no ``[C, K]`` factor
    is formed twice."""
    gamma = op.Exp(cum)
    q_decayed, k_decayed = q * gamma, k * gamma
    k_grown = k / gamma
    causal = np.tril(np.ones((chunk, chunk), dtype=np.float32))
    masks = np.stack([causal, np.tril(causal, -1)])  # [2, C, C]
    aqk, akk = _query_key_products(
        q_rows=q_decayed, k_rows=k_decayed, columns=k_grown, weights=_const(masks), chunk=chunk
    )
    return aqk, akk, k_grown, q_decayed, k_decayed


def _query_key_products(
    q_rows: Value, k_rows: Value, columns: Value, weights: Value, chunk: int
) -> tuple[Value, Value]:
    """``(Aqk, Akk)`` ``[N, n, C, C]``: ``q_rows columnsᵀ`` and ``k_rows columnsᵀ`` (rows
    and columns ``[N, n, C, K]``) times ``weights`` ``[.., 2, C, C]`` (Aqk's, then Akk's),
    in one product with q's and k's rows stacked (onnxruntime's batched MatMul costs about
    as much per matrix as per multiply-add at these sizes), the columns through a Transpose
    that onnxruntime folds into it (transB)."""
    rows = op.Concat(q_rows, k_rows, axis=2)  # [N, n, 2 C, K]
    both = op.MatMul(rows, op.Transpose(columns, perm=[0, 1, 3, 2]))
    both = op.Reshape(both, op.Constant(value_ints=[0, 0, 2, chunk, chunk])) * weights
    aqk, akk = (op.Squeeze(x, [2]) for x in op.Split(both, num_outputs=2, axis=2))
    return aqk, akk


def _recorder() -> object:
    """The graph recorder that ``op.*`` calls write to (the exporter's, while it translates
    an op): a step's body is recorded by another of its kind, and the Scan node, whose
    output count its schema leaves open, is added to its node list directly."""
    recorder = onnxscript.evaluator.default()
    if not (hasattr(recorder, "nodes") and hasattr(recorder, "opset")):
        raise RuntimeError(
            "lowering.onnx_chunked: the chunked delta rule is built inside torch.onnx's "
            f"exporter (its graph recorder), not under {type(recorder).__name__}"
        )
    return recorder


def _scan(
    carried: Value, scanned: list[Value], step: Callable[..., tuple[Value, ...]]
) -> list[Value]:
    """``Scan`` over axis 0 of ``scanned`` carrying ``carried`` (float32): the body is
    ``step(carried, *slices)`` -> (new carried, *per-step outputs), recorded into a graph
    of its own (it reads the enclosing graph's values as outer-scope names). Returns
    (final carried, each per-step output stacked on a new axis 0)."""
    outer = _recorder()
    value = type(carried)  # the exporter's value class, with Python operators
    prefix = f"chunk_steps{next(_scan_ids)}_"

    def body_input(name: str, like: Value) -> Value:
        shape = None if like.shape is None else ir.Shape(list(like.shape)[1:])
        return value(outer.opset, name=f"{prefix}{name}", shape=shape, type=like.type)

    state = value(
        outer.opset,
        name=f"{prefix}state",
        shape=carried.shape,
        type=ir.TensorType(ir.DataType.FLOAT),
    )
    slices = [body_input(f"scanned{i}", x) for i, x in enumerate(scanned)]
    recorder = type(outer)(outer.opset, {})  # constants of its own: none shared with outer
    with onnxscript.evaluator.default_as(recorder):
        results = step(state, *slices)
    # Names of their own: the exporter names the enclosing graph's values only, and a
    # name the body shares with them breaks the model's single assignment.
    for number, node in enumerate(recorder.nodes):
        node.name = f"{prefix}node{number}"
        for index, output in enumerate(node.outputs):
            output.name = f"{prefix}{number}_{index}"
    body = ir.Graph([state, *slices], list(results), nodes=recorder.nodes, name="chunk_steps")
    outputs = [value(outer.opset) for _ in results]
    attributes = [ir.AttrGraph("body", body), ir.AttrInt64("num_scan_inputs", len(scanned))]
    outer.nodes.append(ir.Node("", "Scan", [carried, *scanned], attributes, outputs=outputs))
    return outputs


@dataclasses.dataclass(frozen=True)
class _Tokens:
    """What a step needs to gather and prepare its tokens, built once before the Scan.

    ``sources`` are q, k, v, g, beta viewed ``[B, T h, D]`` (``[B, T h]`` for one value a
    head), h their head count: a ``Gather`` along axis 1 of indices ``t h + head`` ``[HV,
    S]`` reads a step's tokens head-major, ``[B, HV, S, D]``, with no Transpose; q and k
    read head ``h // group`` for value head h, so grouped value heads cost no repeat.
    ``rate`` and ``bias`` are the gate's parameters expanded to a step's ``[1, HV, S,
    Kg]``, so that the gate's first two nodes take operands of one shape (onnxruntime
    broadcasts at about half the speed)."""

    sources: tuple[Value, Value, Value, Value, Value]
    rate: Optional[Value]
    bias: Optional[Value]
    gate_width: int


def _gate_parameters(
    A_log: Optional[Value],
    dt_bias: Optional[Value],
    value_heads: int,
    gate_width: int,
    lower_bound: Optional[float],
) -> tuple[Optional[Value], Optional[Value]]:
    """``(rate, bias)`` ``[1, HV, S, Kg]`` of the gate ``lower_bound · σ(rate g + bias)``
    (bias = rate dt_bias) or ``-rate softplus(g + bias)`` (bias = dt_bias), rate =
    exp(A_log); None where there is no gate or no dt_bias."""
    if A_log is None:
        return None, None
    grid = op.Constant(value_ints=[1, value_heads, STEP_TOKENS, gate_width])
    rate = op.Reshape(op.Exp(kda_onnx._f32(A_log)), op.Constant(value_ints=[value_heads, 1, 1]))
    bias = None
    if dt_bias is not None:
        bias = op.Reshape(
            kda_onnx._f32(dt_bias), op.Constant(value_ints=[value_heads, 1, gate_width])
        )
        if lower_bound is not None:
            bias = rate * bias
        bias = op.Expand(bias, grid)
    return op.Expand(rate, grid), bias


def _l2norm(x: Value, scale: float) -> Value:
    """``scale · x / sqrt(sum(x²) + 1e-6)`` over the last dim of x ``[B, HV, S, D]``
    (FLA's eps placement, as :func:`lowering.onnx._l2norm`), with rank-matched constants
    and the sum of squares as ``ReduceSum(x ⊙ x)`` (faster in onnxruntime than
    ``ReduceSumSquare``)."""
    squares = op.ReduceSum(x * x, [-1], keepdims=1)
    return x * (_scalar(scale) / op.Sqrt(squares + _scalar(kda_onnx.L2NORM_EPS)))


def _step_tokens(
    plan: _Tokens,
    index_qk: Value,
    index_v: Value,
    valid: Value,
    A_log: Optional[Value],
    scale: float,
    lower_bound: Optional[float],
    use_qk_l2norm: bool,
    use_beta_sigmoid: bool,
    chunk: int,
) -> tuple[Value, Value, Value, Value, Value]:
    """A step's tokens gathered head-major (``index_*`` ``[HV, S]``: rows of
    ``plan.sources``) with the in-kernel options applied, as
    :func:`lowering.onnx.prepare_delta_rule` does, laid out ``[N, n, C, D]`` (N = B HV, a
    Reshape): float32 q (scaled), k, v, the log-decay (D = K, or 1 for a decay per head)
    and beta (D = 1). ``valid`` ``[1, 1, S, 1]`` (1, or 0 past the sequence's end) zeroes
    beta and the log-decay of the tokens the last step repeats past T, which leaves them
    inert: no Pad, as only the last step has such tokens."""
    q, k, v, g, beta = plan.sources
    qf = kda_onnx._f32(op.Gather(q, index_qk, axis=1))  # [B, HV, S, K]
    kf = kda_onnx._f32(op.Gather(k, index_qk, axis=1))
    if use_qk_l2norm:  # the scale folded into q's norm
        qf, kf = _l2norm(qf, scale), _l2norm(kf, 1.0)
    else:
        qf = qf * _scalar(scale)
    log_decay = kda_onnx._f32(op.Gather(g, index_v, axis=1))  # [B, HV, S, K] or [B, HV, S]
    if plan.gate_width == 1:
        log_decay = op.Unsqueeze(log_decay, [-1])
    if A_log is None:
        log_decay = log_decay * valid
    elif lower_bound is not None:
        x = log_decay * plan.rate
        x = x if plan.bias is None else x + plan.bias
        log_decay = op.Sigmoid(x) * (_scalar(lower_bound) * valid)
    else:
        x = log_decay if plan.bias is None else log_decay + plan.bias
        log_decay = kda_onnx._softplus(x) * (op.Neg(plan.rate) * valid)
    beta_f = kda_onnx._f32(op.Gather(beta, index_v, axis=1))  # [B, HV, S]
    if use_beta_sigmoid:
        beta_f = op.Sigmoid(beta_f)
    beta_f = op.Unsqueeze(beta_f, [-1]) * valid
    vf = kda_onnx._f32(op.Gather(v, index_v, axis=1))
    head_k = q.shape[-1]
    widths = [head_k, head_k, v.shape[-1], plan.gate_width, 1]
    chunked = [
        op.Reshape(x, op.Constant(value_ints=[-1, STEP_TOKENS // chunk, chunk, width]))
        for x, width in zip([qf, kf, vf, log_decay, beta_f], widths)
    ]
    chunked[3].shape = ir.Shape([None, None, None, plan.gate_width])  # read by _within_chunks
    return tuple(chunked)


def _within_chunks(
    q: Value,
    k: Value,
    v: Value,
    log_decay: Value,
    beta: Value,
    head_k: int,
    safe_gate: bool,
    chunk: int,
) -> tuple[Value, Value, Value, Value, Value, Value]:
    """Everything that does not depend on the state, for every chunk of a step at once:
    q, k ``[N, n, C, K]`` (N = B HV), v ``[N, n, C, V]``, log_decay ``[N, n, C, Kg]`` (Kg = 1
    for a decay per head), beta ``[N, n, C, 1]``. Returns (Aqk ``[N, n, C, C]``, W ``[N, n,
    C, K]``, U ``[N, n, C, V]``, Q ⊙ Γ ``[N, n, C, K]``, the keys of the state's update
    ``[N, n, C, K]``, the chunk's total decay ``[N, n, Kg, 1]``): the keys are ``K̃ = K ⊙
    Γ_C / Γ``, or with ``safe_gate`` and a decay per channel ``K / Γ``, which
    :func:`_across_chunks` decays after the update (``decay_after``)."""
    per_head = log_decay.shape is not None and log_decay.shape[-1] == 1
    cum = op.CumSum(log_decay, op.Constant(value_int=2))
    last = op.Slice(cum, [chunk - 1], [chunk], [2])  # [N, n, 1, Kg]
    if safe_gate and not per_head:
        aqk, akk, keys, q_decayed, k_decayed = _bounded_decayed(q=q, k=k, cum=cum, chunk=chunk)
    else:
        if per_head:
            # [N, n, 2, C, C]: exp(G_i - G_j) over causal pairs (strictly causal for Akk),
            # 0 elsewhere: -inf added where the pair is none, so no overflow and no mask.
            pair = op.Unsqueeze(cum - op.Transpose(cum, perm=[0, 1, 3, 2]), [2])
            causal = np.tril(np.ones((chunk, chunk), dtype=bool))
            none = np.where(np.stack([causal, np.tril(causal, -1)]), 0.0, -np.inf)
            decays = op.Exp(pair + _const(none.astype(np.float32)))
            aqk, akk = _query_key_products(
                q_rows=q, k_rows=k, columns=k, weights=decays, chunk=chunk
            )
        else:
            aqk, akk = _pairwise_decayed(q=q, k=k, cum=cum, head_k=head_k, chunk=chunk)
            akk = akk * _const(np.tril(np.ones((chunk, chunk), dtype=np.float32), -1))
        keys = k * op.Exp(last - cum)
        gamma = op.Exp(cum)  # Γ <= 1: one that underflows stands for a product that does
        q_decayed, k_decayed = q * gamma, k * gamma
    # β enters through the [C, C] matrices, not the [C, D] ones: diag(β) Akk, T diag(β).
    inverse = _unit_lower_inverse(akk * beta, chunk)
    inverse = inverse * op.Reshape(beta, op.Constant(value_ints=[0, 0, 1, chunk]))
    u = op.MatMul(inverse, v)
    w = op.MatMul(inverse, k_decayed)
    decay = op.Reshape(op.Exp(last), op.Constant(value_ints=[0, 0, -1, 1]))
    return aqk, w, u, q_decayed, keys, decay


def _chunk_parts(x: Value, count: int) -> list[Value]:
    """``[N, n, ...]`` -> n = count tensors ``[N, 1, ...]``."""
    if count == 1:
        return [x]
    return list(op.Split(x, axis=1, num_outputs=count))


def _across_chunks(
    state: Value,
    aqk: Value,
    w: Value,
    u: Value,
    q_decayed: Value,
    keys: Value,
    decay: Value,
    count: int,
    decay_after: bool,
) -> tuple[Value, Value]:
    """The serial part over a step's ``count`` chunks, unrolled: per chunk ``[W; Q ⊙ Γ] S``
    in one product (the rows stacked once for the step, so the output's ``(Q ⊙ Γ) S₀``
    needs no copy of the chunk-start states), ``U' = U - W S``, ``S ← Γ_C ⊙ S + K̃ᵀ U'``
    (with ``decay_after``, keys = ``K / Γ``: ``S ← Γ_C ⊙ (S + (K / Γ)ᵀ U')``, the decay
    per key row after the update); then for all chunks at once ``O = (Q ⊙ Γ) S₀ + Aqk
    U'``. state ``[N, 1, K, V]``, the rest as :func:`_within_chunks` returns them.
    Returns (the state after the step, O ``[N, n, C, V]``)."""
    rows = op.Concat(w, q_decayed, axis=2)  # [N, n, 2 C, K]
    reads, new_values = [], []
    parts = (_chunk_parts(x, count) for x in (rows, u, keys, decay))
    for r_c, u_c, k_c, d_c in zip(*parts):
        from_state, read = op.Split(op.MatMul(r_c, state), num_outputs=2, axis=2)
        new = u_c - from_state
        # keysᵀ through a Transpose that onnxruntime folds into the product (transA).
        update = op.MatMul(op.Transpose(k_c, perm=[0, 1, 3, 2]), new)
        state = d_c * (state + update) if decay_after else d_c * state + update
        reads.append(read)
        new_values.append(new)
    if count > 1:
        reads, new_values = op.Concat(*reads, axis=1), op.Concat(*new_values, axis=1)
    else:
        reads, new_values = reads[0], new_values[0]
    return state, reads + op.MatMul(aqk, new_values)


def chunked_delta_rule(
    q: Value,
    k: Value,
    v: Value,
    g: Value,
    beta: Value,
    A_log: Optional[Value],
    dt_bias: Optional[Value],
    initial_state: Optional[Value],
    cu_seqlens: Optional[Value],
    scale: float,
    lower_bound: Optional[float],
    use_qk_l2norm: bool,
    use_beta_sigmoid: bool,
) -> tuple[Value, Value]:
    """``kda.chunk`` in steps of :data:`STEP_TOKENS` tokens, chunks of :data:`CHUNK` tokens
    (:data:`BLOCK` for a decay per channel under the safe gate's bound) (portable mode). A
    one-token call (T = 1 known at export) and packed sequences (``cu_seqlens``) take the token
    ``Scan`` (:func:`lowering.onnx.portable_delta_rule`)."""
    if cu_seqlens is not None or q.shape[1] == 1:
        return kda_onnx.portable_delta_rule(
            q=q,
            k=k,
            v=v,
            g=g,
            beta=beta,
            A_log=A_log,
            dt_bias=dt_bias,
            initial_state=initial_state,
            cu_seqlens=cu_seqlens,
            scale=scale,
            lower_bound=lower_bound,
            use_qk_l2norm=use_qk_l2norm,
            use_beta_sigmoid=use_beta_sigmoid,
        )
    heads, value_heads, head_k, head_v = q.shape[2], v.shape[2], q.shape[3], v.shape[3]
    group, gate_width = value_heads // heads, 1 if len(g.shape) == 3 else head_k
    safe_gate = (
        A_log is not None and lower_bound is not None and lower_bound >= FACTORED_BLOCK_LOWER_BOUND
    )
    tokens = STEP_TOKENS
    # Per-channel decays under the safe gate's bound take chunks of BLOCK tokens, factored
    # at the chunk's start (_bounded_decayed); the others CHUNK.
    bounded = safe_gate and gate_width > 1
    chunk = BLOCK if bounded else CHUNK
    if initial_state is None:
        state = kda_onnx._zeros(q, value_heads, head_k, head_v)
    else:
        state = kda_onnx._f32(initial_state)
    batch, length = op.Shape(q, start=0, end=1), op.Shape(q, start=1, end=2)

    def flat(x: Value) -> Value:  # [B, T, h, D] -> [B, T h, D]; [B, T, h] -> [B, T h]
        width = [x.shape[3]] if len(x.shape) == 4 else []
        flattened = op.Reshape(x, op.Constant(value_ints=[0, -1, *width]))
        flattened.shape = ir.Shape([None, None, *width])  # read by _step_tokens
        return flattened

    rate, bias = _gate_parameters(
        A_log=A_log,
        dt_bias=dt_bias,
        value_heads=value_heads,
        gate_width=gate_width,
        lower_bound=lower_bound,
    )
    plan = _Tokens(
        sources=(flat(q), flat(k), flat(v), flat(g), flat(beta)),
        rate=rate,
        bias=bias,
        gate_width=gate_width,
    )
    # Every step's token indices [steps, HV, S] and validity [steps, 1, 1, S, 1], once: the
    # Scan slices them. Past T a step repeats the last token, made inert there.
    steps = op.Div(length + op.Constant(value_ints=[tokens - 1]), op.Constant(value_ints=[tokens]))
    wanted = op.Range(
        op.Constant(value_int=0),
        op.Squeeze(steps * op.Constant(value_ints=[tokens])),
        op.Constant(value_int=1),
    )
    at = op.Reshape(
        op.Min(wanted, length - op.Constant(value_ints=[1])),
        op.Constant(value_ints=[-1, 1, tokens]),
    )
    value_head = _const(np.arange(value_heads, dtype=np.int64).reshape(1, -1, 1))
    index_v = at * op.Constant(value_int=value_heads) + value_head
    index_qk = index_v
    if group > 1:  # value head h reads q / k head h // group
        head = _const((np.arange(value_heads, dtype=np.int64) // group).reshape(1, -1, 1))
        index_qk = at * op.Constant(value_int=heads) + head
    valid = op.Reshape(
        op.Cast(op.Less(wanted, length), to=onnx.TensorProto.FLOAT),
        op.Constant(value_ints=[-1, 1, 1, tokens, 1]),
    )

    def step(state: Value, index_qk: Value, index_v: Value, valid: Value) -> tuple[Value, Value]:
        q_c, k_c, v_c, log_decay, beta_c = _step_tokens(
            plan=plan,
            index_qk=index_qk,
            index_v=index_v,
            valid=valid,
            A_log=A_log,
            scale=scale,
            lower_bound=lower_bound,
            use_qk_l2norm=use_qk_l2norm,
            use_beta_sigmoid=use_beta_sigmoid,
            chunk=chunk,
        )
        aqk, w, u, q_decayed, keys, decay = _within_chunks(
            q=q_c,
            k=k_c,
            v=v_c,
            log_decay=log_decay,
            beta=beta_c,
            head_k=head_k,
            safe_gate=safe_gate,
            chunk=chunk,
        )
        state, o = _across_chunks(
            state=state,
            aqk=aqk,
            w=w,
            u=u,
            q_decayed=q_decayed,
            keys=keys,
            decay=decay,
            count=tokens // chunk,
            decay_after=bounded,
        )
        # [N, n, C, V] -> [B, HV, S, V]: a Reshape, no copy.
        return state, op.Reshape(o, op.Constant(value_ints=[-1, value_heads, tokens, head_v]))

    carried = op.Reshape(state, op.Constant(value_ints=[-1, 1, head_k, head_v]))
    final, o = _scan(carried, [index_qk, index_v, valid], step)
    # [steps, B, HV, S, V] -> [B, T, HV, V]: one Gather of rows ((t // S · B + b) HV + h) S
    # + t % S, which also drops the tokens past T.
    t = op.Range(op.Constant(value_int=0), op.Squeeze(length), op.Constant(value_int=1))
    b = op.Range(op.Constant(value_int=0), op.Squeeze(batch), op.Constant(value_int=1))
    per_token = op.Constant(value_ints=[1, -1, 1])
    step_tokens = op.Constant(value_int=tokens)
    row = op.Reshape(op.Div(t, step_tokens), per_token) * op.Squeeze(batch)
    row = row + op.Reshape(b, op.Constant(value_ints=[-1, 1, 1]))  # [B, T, 1]
    row = row * op.Constant(value_int=value_heads) + op.Reshape(
        value_head, op.Constant(value_ints=[1, 1, -1])
    )
    row = row * step_tokens + op.Reshape(op.Mod(t, step_tokens), per_token)  # [B, T, HV]
    o = op.Gather(op.Reshape(o, op.Constant(value_ints=[-1, head_v])), row, axis=0)
    final = op.Reshape(final, op.Constant(value_ints=[-1, value_heads, head_k, head_v]))
    if v.dtype == onnx.TensorProto.FLOAT:  # a Cast to its own type still copies
        return o, final
    return op.Cast(o, to=v.dtype), final
