"""Standard mode of :mod:`lowering.onnx`: the ``kda`` ops as ONNX's own opset-27 operators.

- ``kda.chunk`` / ``kda.recurrent``: the pre-processing as standard elementwise nodes (FLA's
  l2norm ``x / sqrt(sum(x²) + 1e-6)``, the gate in either form, the beta sigmoid, the query
  heads repeated for grouped value heads) and one ``LinearAttention`` node with
  ``update_rule="gated_delta"``. The op's recurrence (decay first, predict from the decayed
  state, write the error, read after writing; decay in log space) is ours. Its inputs are
  packed ``[B, T, heads * D]``; its state ``[B, kv_num_heads, dk, dv]`` is our key-first
  ``[N, HV, K, V]`` with ``kv_num_heads = q_num_heads = HV``: our grouped value heads
  (several value heads reading one q/k head) are the op's plain multi-head case once q and
  k are repeated to HV heads (the op's own GQA is the other way round: several query heads
  sharing one key/value head and its state). The decay is ``[B, T, HV * K]`` per key (KDA)
  or ``[B, T, HV]`` per head (Gated DeltaNet). V-first states are transposed by the public
  functions around the op, so the graph carries those transposes outside the node.
- ``kda.causal_conv1d`` (prefill and the functional decode update): one
  ``CausalConvWithState`` on the channels-first ``[B, D, T]`` input, weight ``[D, 1, W]``,
  state ``[B, D, W - 1]`` (ours exactly; callers keeping ``W`` columns, as transformers'
  caches do, slice before and concatenate after, outside the node).
- ``kda.gated_rms_norm``: ``RMSNormalization`` (opset 23) times the gate's activation.
- ``kda.gate``: elementwise, as in portable mode.

Packed sequences (``cu_seqlens``) have no counterpart (neither op takes sequence offsets):
a ``ValueError`` names the argument.

The exporter builds every graph at opset 18 and then upgrades it to the requested opset,
with onnxscript's converter up to opset 25 and past that with ONNX's C++ converter, which
has no adapter for the two opset-27 ops and gives up (leaving an opset-18 model that holds
them). :func:`install_version_conversion` makes the exporter's upgrade of a graph holding
nodes newer than onnxscript's converter take the rest of the graph to 25 with onnxscript's
converter and then relabel it: from 25 to 27 no operator the exporter emits changed its
meaning (26 and 27 add BitCast, CumProd and the two ops, and give Range more types).
"""

from __future__ import annotations

import importlib
from typing import Optional

import onnx
import onnxscript.version_converter
from onnxscript import ir
from onnxscript import opset18 as op
from onnxscript.values import Opset

from lowering import onnx as kda_onnx

STANDARD_OPSET = 27  # LinearAttention and CausalConvWithState
op27 = Opset("", STANDARD_OPSET)
op23 = Opset("", 23)  # RMSNormalization

Value = kda_onnx.Value


def _default_domain_nodes(model: ir.Model) -> list[ir.Node]:
    return [
        node
        for node in ir.traversal.RecursiveGraphIterator(model.graph)
        if node.domain in ("", "ai.onnx")
    ]


def install_version_conversion() -> None:
    """Wrap the exporter's opset upgrade (``onnxscript._framework_apis``'s
    ``convert_version``) as the module docstring says; idempotent."""
    from torch.onnx._internal import _lazy_import

    # The framework-API module itself (torch holds it behind a lazy proxy, which forwards
    # attribute reads, __name__ included, to the module).
    apis = importlib.import_module(_lazy_import.onnxscript_apis.__name__)
    original = apis.convert_version
    if getattr(original, "kda_standard", False):
        return
    supported = onnxscript.version_converter._version_converter.SUPPORTED_MAX_ONNX_OPSET

    def convert_version(model: ir.Model, target_version: int) -> ir.Model:
        nodes = _default_domain_nodes(model)
        newest = max((node.version or 0 for node in nodes), default=0)
        if newest <= supported or target_version < newest:
            return original(model, target_version)
        # onnxscript's converter refuses nodes newer than its target: hide their version
        # (no adapter exists for these ops, so the converter leaves them as they are).
        newer = [(node, node.version) for node in nodes if (node.version or 0) > supported]
        for node, _ in newer:
            node.version = None
        original(model, supported)
        for node, version in newer:
            node.version = version
        model.opset_imports[""] = target_version
        return model

    convert_version.kda_standard = True
    apis.convert_version = convert_version


def reject_varlen(name: str, cu_seqlens: Optional[Value]) -> None:
    """``ValueError`` when ``cu_seqlens`` is given: the standard ops take padded batches."""
    if cu_seqlens is not None:
        raise ValueError(
            f"kda.{name}: packed sequences (`cu_seqlens`) have no standard ONNX counterpart "
            "(LinearAttention and CausalConvWithState take padded batches [B, T, ...]); "
            "export in portable mode (opset < 27, or mode='portable') or with a padded batch"
        )


def _pack(x: Value) -> Value:
    """``[B, T, H, D]`` -> ``[B, T, H * D]``."""
    return op.Reshape(x, op.Constant(value_ints=[0, 0, -1]))


def standard_delta_rule(
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
    """``kda.chunk`` / ``kda.recurrent`` as pre-processing plus one ``LinearAttention``.

    q, k ``[B, T, H, K]``; v ``[B, T, HV, V]``; g ``[B, T, HV, K]`` or ``[B, T, HV]``;
    beta ``[B, T, HV]``; initial_state ``[B, HV, K, V]``. Returns o ``[B, T, HV, V]`` in
    v's dtype and the final state float32 ``[B, HV, K, V]``; math in float32."""
    reject_varlen("chunk / kda.recurrent", cu_seqlens)
    heads, value_heads, head_k, head_v = q.shape[2], v.shape[2], q.shape[3], v.shape[3]
    qf, kf, beta_f = kda_onnx._f32(q), kda_onnx._f32(k), kda_onnx._f32(beta)
    if use_qk_l2norm:
        qf, kf = kda_onnx._l2norm(qf), kda_onnx._l2norm(kf)
    group = value_heads // heads
    qf = kda_onnx._repeat_heads(x=qf, heads=heads, group=group, channels=head_k)
    kf = kda_onnx._repeat_heads(x=kf, heads=heads, group=group, channels=head_k)
    per_head = len(g.shape) == 3  # Gated DeltaNet: one decay per head
    if A_log is None:
        decay = kda_onnx._f32(g)
    else:
        gate = op.Unsqueeze(g, [-1]) if per_head else g
        decay = kda_onnx._log_decay(
            g=gate,
            A_log=A_log,
            dt_bias=dt_bias,
            lower_bound=lower_bound,
            heads=value_heads,
            channels=1 if per_head else head_k,
        )
        if per_head:
            decay = op.Squeeze(decay, [-1])
    if use_beta_sigmoid:
        beta_f = op.Sigmoid(beta_f)
    state = None if initial_state is None else kda_onnx._f32(initial_state)
    o, final = op27.LinearAttention(
        _pack(qf),
        _pack(kf),
        _pack(kda_onnx._f32(v)),
        state,
        decay if per_head else _pack(decay),
        beta_f,
        q_num_heads=value_heads,
        kv_num_heads=value_heads,
        scale=float(scale),
        update_rule="gated_delta",
        _outputs=2,
    )
    o = op.Reshape(o, op.Constant(value_ints=[0, 0, value_heads, head_v]))
    return op.Cast(o, to=v.dtype), final


def standard_causal_conv1d(
    x: Value,
    weight: Value,
    bias: Optional[Value],
    initial_state: Optional[Value],
    cu_seqlens: Optional[Value],
    activation: str,
) -> tuple[Value, Value]:
    """``kda.causal_conv1d`` as one ``CausalConvWithState``: x ``[B, T, D]``, weight
    ``[D, W]``, bias ``[D]``, state ``[B, D, W - 1]``; y in x's dtype, the final state in
    the initial state's dtype (x's when none); math in float32."""
    reject_varlen("causal_conv1d", cu_seqlens)
    f32 = kda_onnx._f32
    y, final = op27.CausalConvWithState(
        op.Transpose(f32(x), perm=[0, 2, 1]),
        op.Unsqueeze(f32(weight), [1]),
        None if bias is None else f32(bias),
        None if initial_state is None else f32(initial_state),
        activation="silu" if activation == "silu" else "none",
        _outputs=2,
    )
    state_dtype = x.dtype if initial_state is None else initial_state.dtype
    return op.Cast(op.Transpose(y, perm=[0, 2, 1]), to=x.dtype), op.Cast(final, to=state_dtype)


def standard_gated_rms_norm(
    x: Value, gate: Value, weight: Value, eps: float, activation: str
) -> Value:
    """``kda.gated_rms_norm``: ``RMSNormalization(x) * act(gate)`` in float32."""
    xf, gate_f = kda_onnx._f32(x), kda_onnx._f32(gate)
    normed = op23.RMSNormalization(
        xf, kda_onnx._f32(weight), axis=-1, epsilon=float(eps), stash_type=onnx.TensorProto.FLOAT
    )
    act = op.Sigmoid(gate_f) if activation == "sigmoid" else gate_f * op.Sigmoid(gate_f)
    return op.Cast(normed * act, to=x.dtype)
