"""ONNX translation of the ``kda`` ops for ``torch.onnx.export(..., dynamo=True)``.

Four modes, each a ``custom_translation_table`` (:func:`translation_table`; user guide:
``docs/onnx.md``):

- ``"standard"`` (opset 27): ONNX's own ``LinearAttention`` and ``CausalConvWithState``
  after standard pre-processing nodes (:mod:`lowering.onnx_standard`). No packed sequences.
- ``"portable"`` (opset 18): the chunk prefill as matrix products over 32-token chunks
  in a ``Scan`` over steps of 8 chunks (:mod:`lowering.onnx_chunked`); the decode step
  (``kda.recurrent``) a ``Scan`` over tokens carrying the ``[B, HV, K, V]`` float32
  state; the conv a grouped ``Conv`` over the history concatenated with the input; gate
  and gated RMSNorm elementwise. Math in float32.
- ``"token"`` (opset 18): portable with every delta rule a token ``Scan`` (the form
  portable mode had before the chunked prefill; kept as a baseline).
- ``"plugin"``: one node per op in the ``kda`` domain (op type = the op's name, e.g.
  ``kda::recurrent``), with schemas registered in ``onnx.defs`` (so ONNX shape inference
  works) and the attributes TensorRT's ONNX parser uses to find a plugin
  (``plugin_namespace="kda"``, ``plugin_version="1"``). Absent optional inputs are
  materialized (zeros, or a ``use_gate=0`` flag for ``A_log``) because TensorRT plugins
  take no optional inputs; every float argument is an attribute; ``A_log`` / ``dt_bias``
  are float32. The conv is two nodes, ``causal_conv1d_output`` then
  ``causal_conv1d_state``, and the chunk prefill is two, ``chunk_prepare`` (its six
  intermediates are node outputs) then ``chunk_recurrence``: each node is one
  single-kernel plugin of ``lowering.tensorrt_plugins``.

Without a table, ``torch.onnx.export`` finds the standard translations from opset 27 on
and the portable ones below (:func:`register_default_translations`, which
:mod:`lowering.onnx_registry` runs on the first export after ``import kda_ops``).

Packed sequences (``cu_seqlens``) are translated in portable and token mode (the
delta-rule token scan reloads the state at each sequence's first token; the conv gathers
each tap's input from the sequence or its history). Standard and plugin mode reject them
with a ``ValueError``: neither the standard ops nor the plugins take ``cu_seqlens``.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Optional

import onnx
import onnxscript
import torch
from onnx.defs import OpSchema
from onnxscript import BOOL, FLOAT, INT64, graph, script
from onnxscript import opset18 as op

from kda_ops.kernels.chunk import FORWARD_CHUNK

MODES = ("standard", "portable", "token", "plugin")
# The opset a mode's nodes need; the exporter's registry keeps, per op, the translation of
# the highest opset not above the export's (so opset >= 27 exports in standard mode).
MODE_OPSETS = {"standard": 27, "portable": 18, "token": 18, "plugin": 18}
PLUGIN_DOMAIN = "kda"
PLUGIN_NAMESPACE = "kda"
PLUGIN_VERSION = "1"
L2NORM_EPS = 1e-6
INT64_MAX = 2**63 - 1

Value = onnxscript.ir.Value  # a tensor inside the graph being built


# ----------------------------------------------------------------------------- portable


@script()
def delta_rule_scan(
    state: FLOAT, q: FLOAT, k: FLOAT, v: FLOAT, g: FLOAT, beta: FLOAT
) -> tuple[FLOAT, FLOAT]:
    """Token recurrence. state ``[B, HV, K, V]``; q (already scaled), k, g ``[B, T, HV, K]``
    (g may be ``[B, T, HV, 1]``); v ``[B, T, HV, V]``; beta ``[B, T, HV]``; all float32.
    Returns (final state, o ``[B, T, HV, V]``)."""

    @graph()
    def step(
        s: FLOAT[...],
        q_t: FLOAT[...],
        k_t: FLOAT[...],
        v_t: FLOAT[...],
        g_t: FLOAT[...],
        beta_t: FLOAT[...],
    ):
        decayed = s * op.Unsqueeze(op.Exp(g_t), [-1])
        k_col = op.Unsqueeze(k_t, [-1])
        v_hat = op.ReduceSum(k_col * decayed, [-2], keepdims=0)
        error = op.Unsqueeze(beta_t, [-1]) * (v_t - v_hat)
        written = decayed + k_col * op.Unsqueeze(error, [-2])
        o_t = op.ReduceSum(op.Unsqueeze(q_t, [-1]) * written, [-2], keepdims=0)
        return written, o_t

    final, o = op.Scan(
        state,
        q,
        k,
        v,
        g,
        beta,
        body=step,
        num_scan_inputs=5,
        scan_input_axes=[1, 1, 1, 1, 1],
        scan_output_axes=[1],
    )
    return final, o


@script()
def packed_delta_rule_scan(
    bank: FLOAT,
    q: FLOAT,
    k: FLOAT,
    v: FLOAT,
    g: FLOAT,
    beta: FLOAT,
    seq_ids: INT64,
    starts: BOOL,
) -> tuple[FLOAT, FLOAT]:
    """Token recurrence over packed sequences (B = 1). bank ``[N, HV, K, V]``: each
    sequence's initial state, returned holding its final state; q, k, v, g, beta as in
    :func:`delta_rule_scan`; seq_ids ``[T]`` each token's sequence, starts ``[T]`` whether
    it opens one. A sequence's first token loads its state from the bank and every token
    writes its state back, so the bank ends with each sequence's last state (an empty
    sequence keeps its initial one). Returns (bank, o ``[1, T, HV, V]``). The step repeats
    :func:`delta_rule_scan`'s math inline: a Scan body cannot call a script function in the
    exported model (onnxruntime does not find it)."""

    @graph()
    def step(
        s: FLOAT[...],
        states: FLOAT[...],
        q_t: FLOAT[...],
        k_t: FLOAT[...],
        v_t: FLOAT[...],
        g_t: FLOAT[...],
        beta_t: FLOAT[...],
        seq_t: INT64,
        start_t: BOOL,
    ):
        slot = op.Unsqueeze(seq_t, [0])
        s = op.Where(start_t, op.Gather(states, slot, axis=0), s)
        decayed = s * op.Unsqueeze(op.Exp(g_t), [-1])
        k_col = op.Unsqueeze(k_t, [-1])
        v_hat = op.ReduceSum(k_col * decayed, [-2], keepdims=0)
        error = op.Unsqueeze(beta_t, [-1]) * (v_t - v_hat)
        written = decayed + k_col * op.Unsqueeze(error, [-2])
        o_t = op.ReduceSum(op.Unsqueeze(q_t, [-1]) * written, [-2], keepdims=0)
        states = op.ScatterND(states, op.Unsqueeze(slot, [0]), written)
        return written, states, o_t

    first = op.Gather(bank, op.Constant(value_ints=[0]), axis=0)  # replaced at token 0
    _, bank, o = op.Scan(
        first,
        bank,
        q,
        k,
        v,
        g,
        beta,
        seq_ids,
        starts,
        body=step,
        num_scan_inputs=7,
        scan_input_axes=[1, 1, 1, 1, 1, 0, 0],
        scan_output_axes=[1],
    )
    return bank, o


def _f32(x: Value) -> Value:
    return op.Cast(x, to=onnx.TensorProto.FLOAT)


def _reject_varlen(name: str, cu_seqlens: Optional[Value]) -> None:
    if cu_seqlens is not None:
        raise ValueError(
            f"kda.{name}: packed sequences (`cu_seqlens`) have no plugin-mode translation; "
            "export in portable mode, or a padded batch [B, T, ...]"
        )


def _token_sequences(cu_seqlens: Value, tokens_of: Value) -> tuple[Value, Value, Value]:
    """Per token of a packed ``[1, T, ...]`` input: (its sequence's index, the index of
    its sequence's first token, whether it is that first token); int64 / bool ``[T]``."""
    bounds = op.Cast(cu_seqlens, to=onnx.TensorProto.INT64)
    length = op.Shape(tokens_of, start=1, end=2)
    positions = op.Range(op.Constant(value_int=0), op.Squeeze(length), op.Constant(value_int=1))
    ends = op.Slice(bounds, [1], [INT64_MAX], [0])
    seq_ids = op.ReduceSum(
        op.Cast(
            op.LessOrEqual(op.Unsqueeze(ends, [0]), op.Unsqueeze(positions, [1])),
            to=onnx.TensorProto.INT64,
        ),
        [1],
        keepdims=0,
    )
    first = op.Gather(bounds, seq_ids, axis=0)
    return seq_ids, first, op.Equal(positions, first)


def _zeros(batch_of: Value, *dims: int) -> Value:
    """float32 zeros ``[batch_of.shape[0], *dims]``."""
    shape = op.Concat(
        op.Shape(batch_of, start=0, end=1), op.Constant(value_ints=list(dims)), axis=0
    )
    return op.Expand(op.Constant(value_float=0.0), shape)


def _l2norm(x: Value, scale: float = 1.0) -> Value:
    """``scale · x / sqrt(sum(x²) + 1e-6)`` over the last dim (FLA's eps placement); the
    scale multiplies the one-per-row norm, not the whole tensor."""
    squares = op.ReduceSumSquare(x, [-1], keepdims=1)
    norm = op.Sqrt(squares + op.Constant(value_float=L2NORM_EPS))
    if scale == 1.0:
        return x / norm
    return x * (op.Constant(value_float=scale) / norm)


def _softplus(x: Value) -> Value:
    """Overflow-free ``log(1 + exp(x)) = max(x, 0) + log(1 + exp(-|x|))``."""
    one = op.Constant(value_float=1.0)
    return op.Max(x, op.Constant(value_float=0.0)) + op.Log(one + op.Exp(op.Neg(op.Abs(x))))


def _log_decay(
    g: Value,
    A_log: Value,
    dt_bias: Optional[Value],
    lower_bound: Optional[float],
    heads: int,
    channels: int,
) -> Value:
    """The KDA gate on g ``[..., heads, channels]`` (float32), like ``reference.kda_gate``."""
    x = _f32(g)
    if dt_bias is not None:
        x = x + op.Reshape(_f32(dt_bias), op.Constant(value_ints=[heads, channels]))
    rate = op.Unsqueeze(op.Exp(_f32(A_log)), [-1])
    if lower_bound is None:
        return op.Neg(rate) * _softplus(x)
    return op.Constant(value_float=lower_bound) * op.Sigmoid(rate * x)


def _repeat_heads(x: Value, heads: int, group: int, channels: int) -> Value:
    """``[B, T, heads, channels]`` -> ``[B, T, heads * group, channels]``, each head
    repeated ``group`` times."""
    if group == 1:
        return x
    expanded = op.Expand(op.Unsqueeze(x, [3]), op.Constant(value_ints=[1, 1, 1, group, 1]))
    return op.Reshape(expanded, op.Constant(value_ints=[0, 0, heads * group, channels]))


def prepare_delta_rule(
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
) -> tuple[Value, Value, Value, Value, Value, Value]:
    """The in-kernel options applied, like ``reference.prepare_delta_rule_inputs``: float32
    q (scaled) and k ``[B, T, HV, K]``, v ``[B, T, HV, V]``, log-decay ``[B, T, HV, K]``
    (``[B, T, HV, 1]`` for Gated DeltaNet), beta ``[B, T, HV]`` and the initial state
    ``[N, HV, K, V]`` (zeros when none is given)."""
    qf, kf, beta_f = _f32(q), _f32(k), _f32(beta)
    if use_qk_l2norm:  # the scale folded into q's norm
        qf, kf = _l2norm(qf, scale), _l2norm(kf)
    heads, value_heads, head_k, head_v = q.shape[2], v.shape[2], q.shape[3], v.shape[3]
    gate_width = 1 if len(g.shape) == 3 else head_k
    if gate_width == 1:  # Gated DeltaNet: one decay per head
        g = op.Unsqueeze(g, [-1])
    if A_log is None:
        log_decay = _f32(g)
    else:
        log_decay = _log_decay(
            g=g,
            A_log=A_log,
            dt_bias=dt_bias,
            lower_bound=lower_bound,
            heads=value_heads,
            channels=gate_width,
        )
    if use_beta_sigmoid:
        beta_f = op.Sigmoid(beta_f)
    group = value_heads // heads
    qf = _repeat_heads(x=qf, heads=heads, group=group, channels=head_k)
    if not use_qk_l2norm:
        qf = qf * op.Constant(value_float=scale)
    kf = _repeat_heads(x=kf, heads=heads, group=group, channels=head_k)
    if cu_seqlens is None:
        batch_of = q
    else:  # one initial state per sequence
        batch_of = op.Slice(cu_seqlens, [1], [INT64_MAX], [0])
    state = (
        _zeros(batch_of, value_heads, head_k, head_v) if initial_state is None else initial_state
    )
    return qf, kf, _f32(v), log_decay, beta_f, _f32(state)


def portable_delta_rule(
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
    """``kda.chunk`` / ``kda.recurrent`` as a token ``Scan`` (same math, same results);
    packed sequences reset the state at each sequence's first token."""
    qf, kf, vf, log_decay, beta_f, state = prepare_delta_rule(
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
    if cu_seqlens is None:
        final, o = delta_rule_scan(state=state, q=qf, k=kf, v=vf, g=log_decay, beta=beta_f)
    else:
        seq_ids, _, starts = _token_sequences(cu_seqlens, q)
        final, o = packed_delta_rule_scan(
            bank=state, q=qf, k=kf, v=vf, g=log_decay, beta=beta_f, seq_ids=seq_ids, starts=starts
        )
    return op.Cast(o, to=v.dtype), final


def portable_causal_conv1d(
    x: Value,
    weight: Value,
    bias: Optional[Value],
    initial_state: Optional[Value],
    cu_seqlens: Optional[Value],
    activation: str,
) -> tuple[Value, Value]:
    """``kda.causal_conv1d``: grouped ``Conv`` over ``[history, x]`` along time."""
    if cu_seqlens is not None:
        return _packed_causal_conv1d(
            x=x,
            weight=weight,
            bias=bias,
            initial_state=initial_state,
            cu_seqlens=cu_seqlens,
            activation=activation,
        )
    channels, width = weight.shape[0], weight.shape[1]
    history = _zeros(x, channels, width - 1) if initial_state is None else _f32(initial_state)
    window = op.Concat(history, op.Transpose(_f32(x), perm=[0, 2, 1]), axis=2)  # [B, D, W-1+T]
    conv_inputs = [window, op.Unsqueeze(_f32(weight), [1])]
    if bias is not None:
        conv_inputs.append(_f32(bias))
    y = op.Conv(*conv_inputs, group=channels)
    if activation == "silu":
        y = y * op.Sigmoid(y)
    final = op.Slice(window, [-(width - 1)], [INT64_MAX], [2])
    state_dtype = x.dtype if initial_state is None else initial_state.dtype
    return op.Cast(op.Transpose(y, perm=[0, 2, 1]), to=x.dtype), op.Cast(final, to=state_dtype)


def _int64(value: int) -> Value:
    return op.Constant(value_int=value)


def _packed_inputs(
    xf: Value, history: Value, seq: Value, first: Value, position: Value, width: int
) -> Value:
    """The input at ``position`` (int64 ``[M]``) of sequence ``seq`` (first token
    ``first``): from the packed xf ``[T, D]`` inside the sequence, else from its history
    ``[N, W - 1, D]`` (entry ``W - 1 - k`` is k tokens before its start), else 0."""
    zero = _int64(0)
    from_x = op.Gather(xf, op.Max(position, zero), axis=0)
    entry = position - first + _int64(width - 1)
    in_range = op.Min(op.Max(entry, zero), _int64(width - 2))  # the Where below picks
    index = op.Concat(op.Unsqueeze(seq, [1]), op.Unsqueeze(in_range, [1]), axis=1)
    from_history = op.Where(
        op.Unsqueeze(op.GreaterOrEqual(entry, zero), [1]),
        op.GatherND(history, index),
        op.Constant(value_float=0.0),
    )
    return op.Where(op.Unsqueeze(op.GreaterOrEqual(position, first), [1]), from_x, from_history)


def _packed_causal_conv1d(
    x: Value,
    weight: Value,
    bias: Optional[Value],
    initial_state: Optional[Value],
    cu_seqlens: Value,
    activation: str,
) -> tuple[Value, Value]:
    """``kda.causal_conv1d`` over packed sequences (x ``[1, T, D]``): each tap gathers its
    input from the sequence or its history; the final states gather the last W - 1."""
    channels, width = weight.shape[0], weight.shape[1]
    ends = op.Cast(op.Slice(cu_seqlens, [1], [INT64_MAX], [0]), to=onnx.TensorProto.INT64)
    starts = op.Cast(op.Slice(cu_seqlens, [0], [-1], [0]), to=onnx.TensorProto.INT64)
    if initial_state is None:
        initial_state = op.CastLike(_zeros(ends, channels, width - 1), x)
    history = op.Transpose(_f32(initial_state), perm=[0, 2, 1])  # [N, W - 1, D]
    xf = op.Squeeze(_f32(x), [0])
    seq_ids, first, _ = _token_sequences(cu_seqlens, x)
    positions = op.Range(_int64(0), op.Squeeze(op.Shape(x, start=1, end=2)), _int64(1))
    weight_f = _f32(weight)
    y = op.Constant(value_float=0.0)
    for tap in range(width):
        inputs = _packed_inputs(
            xf=xf,
            history=history,
            seq=seq_ids,
            first=first,
            position=positions - _int64(width - 1 - tap),
            width=width,
        )
        y = y + inputs * op.Gather(weight_f, _int64(tap), axis=1)
    if bias is not None:
        y = y + _f32(bias)
    if activation == "silu":
        y = y * op.Sigmoid(y)
    sequences = op.Range(_int64(0), op.Squeeze(op.Shape(ends)), _int64(1))
    kept = [
        op.Unsqueeze(
            _packed_inputs(
                xf=xf,
                history=history,
                seq=sequences,
                first=starts,
                position=ends - _int64(width - 1 - j),
                width=width,
            ),
            [2],
        )
        for j in range(width - 1)
    ]
    final = op.Concat(*kept, axis=2)  # [N, D, W - 1]
    return op.Cast(op.Unsqueeze(y, [0]), to=x.dtype), op.CastLike(final, initial_state)


def portable_gated_rms_norm(
    x: Value, gate: Value, weight: Value, eps: float, activation: str
) -> Value:
    """``kda.gated_rms_norm``: ``rmsnorm(x) * weight * act(gate)`` in float32."""
    xf, gate_f = _f32(x), _f32(gate)
    mean_square = op.ReduceMean(xf * xf, [-1], keepdims=1)
    normed = xf / op.Sqrt(mean_square + op.Constant(value_float=eps))
    act = op.Sigmoid(gate_f) if activation == "sigmoid" else gate_f * op.Sigmoid(gate_f)
    return op.Cast(normed * _f32(weight) * act, to=x.dtype)


def portable_gate(
    g: Value, A_log: Value, dt_bias: Optional[Value], lower_bound: Optional[float]
) -> Value:
    """``kda.gate``: float32 log-decay of g's shape."""
    return _log_decay(
        g=g,
        A_log=A_log,
        dt_bias=dt_bias,
        lower_bound=lower_bound,
        heads=g.shape[-2],
        channels=g.shape[-1],
    )


# ----------------------------------------------------------------------------- plugin


def _copy_type(source: int, target: int) -> Callable[[object], None]:
    """Shape inference: output ``target`` gets input ``source``'s type and shape."""

    def infer(ctx: onnx.shape_inference.InferenceContext) -> None:
        ctx.set_output_type(target, ctx.get_input_type(source))

    return infer


def _float32_like(source: int, target: int) -> Callable[[object], None]:
    """Shape inference: output ``target`` is float32 with input ``source``'s shape."""

    def infer(ctx: onnx.shape_inference.InferenceContext) -> None:
        out = onnx.TypeProto()
        out.CopyFrom(ctx.get_input_type(source))
        out.tensor_type.elem_type = onnx.TensorProto.FLOAT
        ctx.set_output_type(target, out)

    return infer


def _derived(target: int, dims: list, elem_from: Optional[int] = None) -> Callable[[object], None]:
    """Shape inference: output ``target`` with ``dims``, each an int, ``None`` (unknown) or
    ``(input, axis)`` copied from an input; elem type of input ``elem_from`` (float32 if
    None)."""

    def infer(ctx: onnx.shape_inference.InferenceContext) -> None:
        out = onnx.TypeProto()
        out.tensor_type.elem_type = (
            onnx.TensorProto.FLOAT
            if elem_from is None
            else ctx.get_input_type(elem_from).tensor_type.elem_type
        )
        shape = out.tensor_type.shape
        for spec in dims:
            dim = shape.dim.add()
            if isinstance(spec, int):
                dim.dim_value = spec
            elif spec is not None:
                source = ctx.get_input_type(spec[0]).tensor_type.shape
                if len(source.dim) > spec[1]:
                    dim.CopyFrom(source.dim[spec[1]])
        ctx.set_output_type(target, out)

    return infer


PLUGIN_ATTRIBUTES = (
    ("plugin_namespace", OpSchema.AttrType.STRING),
    ("plugin_version", OpSchema.AttrType.STRING),
)
DELTA_RULE_ATTRIBUTES = [
    "scale",
    "lower_bound",
    "use_gate",
    "use_lower_bound",
    "use_qk_l2norm",
    "use_beta_sigmoid",
]
_PER_TOKEN_K = [(0, 0), (0, 1), (2, 2), (0, 3)]  # [B, T, HV, K]: HV from v, K from q
PLUGIN_OPS: dict[str, dict[str, object]] = {
    # name: inputs, outputs (name, type var), attributes, inference (rules per output)
    "recurrent": dict(
        inputs=["q", "k", "v", "g", "beta", "A_log", "dt_bias", "initial_state"],
        outputs=[("o", "T"), ("final_state", "S")],
        attributes=DELTA_RULE_ATTRIBUTES,
        rules=[_copy_type(2, 0), _copy_type(7, 1)],
    ),
    # The chunk prefill is a chain of two plugins (FlashKDA's two kernels); the chunk
    # count of the intermediates (B * ceil(T / FORWARD_CHUNK)) is left to TensorRT.
    "chunk_prepare": dict(
        inputs=["q", "k", "v", "g", "beta", "A_log", "dt_bias"],
        outputs=[
            ("chunk_decay", "S"),
            ("w", "T"),
            ("u", "T"),
            ("qg", "T"),
            ("kd", "T"),
            ("aqk", "T"),
        ],
        attributes=DELTA_RULE_ATTRIBUTES,
        rules=[
            _derived(0, [None, (2, 2), (0, 3)]),
            _derived(1, _PER_TOKEN_K, elem_from=0),
            _copy_type(2, 2),
            _derived(3, _PER_TOKEN_K, elem_from=0),
            _derived(4, _PER_TOKEN_K, elem_from=0),
            _derived(5, [None, (2, 2), FORWARD_CHUNK, FORWARD_CHUNK], elem_from=0),
        ],
    ),
    "chunk_recurrence": dict(
        inputs=["w", "u", "qg", "kd", "aqk", "chunk_decay", "initial_state"],
        outputs=[("o", "T"), ("final_state", "S")],
        attributes=[],
        rules=[_copy_type(1, 0), _copy_type(6, 1)],
    ),
    # The conv is a chain of two plugins (TensorRT plugins run one kernel each).
    "causal_conv1d_output": dict(
        inputs=["x", "weight", "bias", "state"],
        outputs=[("y", "T")],
        attributes=["silu"],
        rules=[_copy_type(0, 0)],
    ),
    "causal_conv1d_state": dict(
        inputs=["x", "state_in"],
        outputs=[("state_out", "T")],
        attributes=[],
        rules=[_copy_type(1, 0)],
    ),
    "gated_rms_norm": dict(
        inputs=["x", "gate", "weight"],
        outputs=[("y", "T")],
        attributes=["eps", "silu"],
        rules=[_copy_type(0, 0)],
    ),
    "gate": dict(
        inputs=["g", "A_log", "dt_bias"],
        outputs=[("log_decay", "S")],
        attributes=["lower_bound", "use_lower_bound"],
        rules=[_float32_like(0, 0)],
    ),
}
FLOAT_ATTRIBUTES = ("scale", "lower_bound", "eps")


def _schema(name: str, spec: dict[str, object]) -> OpSchema:
    parameters = [OpSchema.FormalParameter(n, "T") for n in spec["inputs"]]
    outputs = [OpSchema.FormalParameter(n, t) for n, t in spec["outputs"]]
    attributes = [
        OpSchema.Attribute(
            a, OpSchema.AttrType.FLOAT if a in FLOAT_ATTRIBUTES else OpSchema.AttrType.INT, a
        )
        for a in spec["attributes"]
    ] + [OpSchema.Attribute(a, kind, a) for a, kind in PLUGIN_ATTRIBUTES]
    floats = ["tensor(float16)", "tensor(bfloat16)", "tensor(float)"]
    schema = OpSchema(
        name=name,
        domain=PLUGIN_DOMAIN,
        since_version=1,
        doc=f"kda::{name} as one TensorRT plugin node",
        inputs=parameters,
        outputs=outputs,
        type_constraints=[("T", floats, "tensors"), ("S", ["tensor(float)"], "float32 state")],
        attributes=attributes,
    )
    rules = spec["rules"]

    def infer(ctx: onnx.shape_inference.InferenceContext) -> None:
        for rule in rules:
            rule(ctx)

    schema.set_type_and_shape_inference_function(infer)
    return schema


def register_plugin_schemas() -> None:
    """Register the ``kda`` domain schemas with ``onnx.defs`` (idempotent)."""
    for name, spec in PLUGIN_OPS.items():
        try:
            onnx.defs.get_schema(name, 1, PLUGIN_DOMAIN)
        except onnx.defs.SchemaError:
            onnx.defs.register_schema(_schema(name, spec))


def _plugin_node(name: str, inputs: list[Value], **attributes: object) -> Value:
    register_plugin_schemas()
    opset = onnxscript.values.Opset(PLUGIN_DOMAIN, 1)
    attributes = {k: int(v) if isinstance(v, bool) else v for k, v in attributes.items()}
    return getattr(opset, name)(
        *inputs, plugin_namespace=PLUGIN_NAMESPACE, plugin_version=PLUGIN_VERSION, **attributes
    )


def _or_zeros(value: Optional[Value], shape: list[int], like: Value) -> Value:
    """``value``, or zeros of ``shape`` (dim 0 from ``like``'s batch when shape[0] < 0)."""
    if value is not None:
        return value
    if shape[0] < 0:
        return op.CastLike(_zeros(like, *shape[1:]), like)
    return op.CastLike(op.Expand(op.Constant(value_float=0.0), op.Constant(value_ints=shape)), like)


def _plugin_delta_rule(name: str) -> Callable[..., tuple[Value, Value]]:
    def translate(
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
        _reject_varlen(name, cu_seqlens)
        value_heads, head_k, head_v = v.shape[2], q.shape[3], v.shape[3]
        gate_width = 1 if len(g.shape) == 3 else head_k
        inputs = [
            q,
            k,
            v,
            g,
            beta,
            _f32(_or_zeros(A_log, [value_heads], q)),
            _f32(_or_zeros(dt_bias, [value_heads * gate_width], q)),
            _f32(_or_zeros(initial_state, [-1, value_heads, head_k, head_v], q)),
        ]
        attributes = dict(
            scale=scale,
            lower_bound=lower_bound or 0.0,
            use_gate=A_log is not None,
            use_lower_bound=lower_bound is not None,
            use_qk_l2norm=use_qk_l2norm,
            use_beta_sigmoid=use_beta_sigmoid,
        )
        if name == "recurrent":
            return _plugin_node("recurrent", inputs, **attributes)
        decay, w, u, qg, kd, aqk = _plugin_node("chunk_prepare", inputs[:7], **attributes)
        return _plugin_node("chunk_recurrence", [w, u, qg, kd, aqk, decay, inputs[7]])

    return translate


def plugin_causal_conv1d(
    x: Value,
    weight: Value,
    bias: Optional[Value],
    initial_state: Optional[Value],
    cu_seqlens: Optional[Value],
    activation: str,
) -> tuple[Value, Value]:
    _reject_varlen("causal_conv1d", cu_seqlens)
    channels, width = weight.shape[0], weight.shape[1]
    state = _or_zeros(initial_state, [-1, channels, width - 1], x)
    inputs = [x, weight, _or_zeros(bias, [channels], x), state]
    y = _plugin_node("causal_conv1d_output", inputs, silu=activation == "silu")
    return y, _plugin_node("causal_conv1d_state", [x, state])


def plugin_gated_rms_norm(
    x: Value, gate: Value, weight: Value, eps: float, activation: str
) -> Value:
    return _plugin_node("gated_rms_norm", [x, gate, weight], eps=eps, silu=activation == "silu")


def plugin_gate(
    g: Value, A_log: Value, dt_bias: Optional[Value], lower_bound: Optional[float]
) -> Value:
    width = g.shape[-2] * g.shape[-1]
    inputs = [g, A_log, _or_zeros(dt_bias, [width], g)]
    return _plugin_node(
        "gate", inputs, lower_bound=lower_bound or 0.0, use_lower_bound=lower_bound is not None
    )


def translation_table(mode: str = "portable") -> dict[torch._ops.OpOverload, Callable]:
    """``custom_translation_table`` for every functional ``kda`` op in ``mode``:
    ``"standard"`` (opset 27: ``LinearAttention``, ``CausalConvWithState``;
    :mod:`lowering.onnx_standard`), ``"portable"`` (opset 18; the chunk prefill chunked,
    :mod:`lowering.onnx_chunked`, the token step a ``Scan``), ``"token"`` (opset 18, every
    delta rule a token ``Scan``) or ``"plugin"`` (TensorRT)."""
    import kda_ops  # noqa: F401  (registers torch.ops.kda)

    ops = torch.ops.kda
    if mode == "standard":
        from lowering import onnx_standard as standard

        standard.install_version_conversion()
        return {
            ops.chunk.default: standard.standard_delta_rule,
            ops.recurrent.default: standard.standard_delta_rule,
            ops.causal_conv1d.default: standard.standard_causal_conv1d,
            ops.gated_rms_norm.default: standard.standard_gated_rms_norm,
            ops.gate.default: portable_gate,
        }
    if mode in ("portable", "token"):
        from lowering import onnx_chunked

        chunk = onnx_chunked.chunked_delta_rule if mode == "portable" else portable_delta_rule
        return {
            ops.chunk.default: chunk,
            ops.recurrent.default: portable_delta_rule,
            ops.causal_conv1d.default: portable_causal_conv1d,
            ops.gated_rms_norm.default: portable_gated_rms_norm,
            ops.gate.default: portable_gate,
        }
    if mode == "plugin":
        register_plugin_schemas()
        return {
            ops.chunk.default: _plugin_delta_rule("chunk"),
            ops.recurrent.default: _plugin_delta_rule("recurrent"),
            ops.causal_conv1d.default: plugin_causal_conv1d,
            ops.gated_rms_norm.default: plugin_gated_rms_norm,
            ops.gate.default: plugin_gate,
        }
    raise ValueError(f"`mode` must be one of {MODES}, got {mode!r}")


def register_default_translations(mode: Optional[str] = None) -> None:
    """Make every later ``torch.onnx.export(..., dynamo=True)`` translate the ``kda`` ops
    without the caller naming :func:`translation_table` (transformers' ``OnnxExporter``,
    for one, passes a table of its own). A caller's ``custom_translation_table`` still
    wins: the exporter tries its entries first. With ``mode=None`` (what importing this
    module does) the export's opset picks the mode: ``"standard"`` from opset 27 on,
    ``"portable"`` below; a mode named here serves every opset. Calling again replaces the
    registration.

    The exporter builds its registry from ``torch.onnx``'s torchlib list on every export
    and keeps, per op, the entries of the highest ``opset_introduced`` not above the
    export's opset; the entries go into that list (an internal list of torch >= 2.11: a
    ``RuntimeError`` names what is missing if a torch release moves it).
    :mod:`lowering.onnx_registry` runs this on the first export after ``import kda_ops``."""
    try:
        from torch.onnx._internal.exporter import _registration
        from torch.onnx._internal.exporter._torchlib import _torchlib_registry
    except ImportError as error:
        raise RuntimeError(
            f"lowering.onnx: this torch ({torch.__version__}) has no exporter registry to "
            f"hold the kda translations ({error}); pass `custom_translation_table="
            "lowering.onnx.translation_table()` to torch.onnx.export instead"
        ) from error
    if mode is not None and mode not in MODES:
        raise ValueError(f"`mode` must be one of {MODES} or None, got {mode!r}")
    fields = {field.name for field in dataclasses.fields(_registration.OnnxDecompMeta)}
    if mode is None and "opset_introduced" not in fields:
        mode = "portable"  # a registry with no per-opset choice: the mode every runtime runs
    modes = ["portable", "standard"] if mode is None else [mode]
    tables = {m: translation_table(m) for m in modes}
    registry = _torchlib_registry._registry
    registry[:] = [meta for meta in registry if meta.fx_target not in tables[modes[0]]]
    # The exporter cannot infer an ONNX signature from onnxscript-IR annotations and says
    # so once per op; with no signature it dispatches every node of the op here, as meant.
    logger = logging.getLogger(_registration.__name__)
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        for m, table in tables.items():
            opset = {"opset_introduced": MODE_OPSETS[m]} if mode is None else {}
            for target, function in table.items():
                meta = _registration.OnnxDecompMeta(
                    function, target, signature=None, is_custom=True, **opset
                )
                registry.append(meta)
    finally:
        logger.setLevel(level)
    global _registered
    _registered = True


def export_onnx(
    program: torch.export.ExportedProgram,
    path: str,
    mode: str = "portable",
    input_names: Optional[list[str]] = None,
    output_names: Optional[list[str]] = None,
    opset_version: Optional[int] = None,
) -> onnx.ModelProto:
    """Translate an exported program (dynamic dims kept) to ONNX in ``mode``; save it at
    ``path`` and return the model proto. ``opset_version`` defaults to the mode's
    (:data:`MODE_OPSETS`); standard mode needs 27 or later."""
    if mode not in MODES:
        raise ValueError(f"`mode` must be one of {MODES}, got {mode!r}")
    opset = MODE_OPSETS[mode] if opset_version is None else opset_version
    if opset < MODE_OPSETS[mode]:
        raise ValueError(
            f"`opset_version` {opset} is below what {mode!r} mode needs ({MODE_OPSETS[mode]})"
        )
    onnx_program = torch.onnx.export(
        program,
        dynamo=True,
        custom_translation_table=translation_table(mode),
        input_names=input_names,
        output_names=output_names,
        verbose=False,
        opset_version=opset,
    )
    onnx_program.save(path)
    return onnx.load(path)


_registered = False


def ensure_default_translations() -> None:
    """:func:`register_default_translations` with the opset picking the mode, unless a
    registration was made already (what :mod:`lowering.onnx_registry` calls on the first
    export after ``import kda_ops``)."""
    if not _registered:
        register_default_translations()
