"""lowering/inductor/triton_kernels.py: kda ops on CUDA become Inductor's own Triton-kernel
nodes. On CPU, on graphs of fake CUDA tensors (the rewrite, no code generation); on the GPU,
compiled models whose generated code launches the kernels itself, against eager."""

from __future__ import annotations

import math
import operator

import pytest
import torch
from torch._dynamo.source import ConstantSource
from torch._higher_order_ops.auto_functionalize import auto_functionalized
from torch._inductor.virtualized import V
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.experimental.symbolic_shapes import ShapeEnv

import kda_ops
from kda_ops.kernels.chunk import FORWARD_CHUNK
from lowering.inductor.triton_kernels import TritonKernelsPass
from tests.lowering.compiled import compile_kda

KERNEL_NODE = torch.ops.higher_order.triton_kernel_wrapper_functional
GATED_RMS_NORM = torch.ops.kda.gated_rms_norm.default
CONV_UPDATE = torch.ops.kda.causal_conv1d_update_.default
RECURRENT = torch.ops.kda.recurrent.default
RECURRENT_INPLACE = torch.ops.kda.recurrent_.default


def _lowered(fn, *shapes_dtypes, device="cuda") -> tuple[torch.fx.GraphModule, int]:
    """``fn`` traced on fake tensors of ``(shape, dtype)`` on ``device``, then the pass."""
    mode = FakeTensorMode()
    with mode:
        args = [torch.empty(shape, dtype=dtype, device=device) for shape, dtype in shapes_dtypes]
        gm = make_fx(fn, tracing_mode="fake")(*args)
    with V.set_fake_mode(mode):
        count = TritonKernelsPass()(gm.graph)
    return gm, count


def _calls(gm: torch.fx.GraphModule, target) -> list[torch.fx.Node]:
    return list(gm.graph.find_nodes(op="call_function", target=target))


def _norm(x, gate, weight):
    return GATED_RMS_NORM(x, gate, weight, 1e-6, "silu") * 2


def _conv_step(x, conv_state, weight):
    y, new_state = auto_functionalized(
        CONV_UPDATE, x=x, conv_state=conv_state, weight=weight, bias=None,
        state_indices=None, activation="silu",
    )  # fmt: skip
    return y, new_state


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_gated_rms_norm_becomes_one_kernel_node_writing_a_new_output(dtype):
    gm, count = _lowered(_norm, ((4, 64), dtype), ((4, 64), dtype), ((64,), dtype))
    assert count == 1 and not _calls(gm, GATED_RMS_NORM)
    (node,) = _calls(gm, KERNEL_NODE)
    assert node.kwargs["tensors_to_clone"] == ["y"]
    assert node.kwargs["grid"] == [(1, 1, 1)]  # 4 rows of 64, 32 rows a program
    arguments = node.kwargs["kwargs"]
    assert [arguments[name].op for name in ("x", "gate", "weight")] == ["placeholder"] * 3
    assert arguments["D"] == 64 and arguments["SILU"] is True and arguments["eps"] == 1e-6
    (item,) = node.users
    assert item.target is operator.getitem and item.args[1] == "y"


@pytest.mark.parametrize("device, dtype", [("cpu", torch.float32), ("cuda", torch.float64)])
def test_gated_rms_norm_stays_the_op_off_the_kernels(device, dtype):
    shapes = ((4, 64), dtype), ((4, 64), dtype), ((64,), dtype)
    gm, count = _lowered(_norm, *shapes, device=device)
    assert count == 0 and len(_calls(gm, GATED_RMS_NORM)) == 1 and not _calls(gm, KERNEL_NODE)


def test_conv_step_writes_the_models_state_through_the_kernel_node():
    # D = 10: the generic step kernel (the W = 4 one needs D % 8 == 0 and the SM count).
    shapes = ((3, 1, 10), torch.bfloat16), ((3, 10, 4), torch.bfloat16), ((10, 4), torch.bfloat16)
    gm, count = _lowered(_conv_step, *shapes)
    assert count == 1 and not _calls(gm, auto_functionalized)
    (node,) = _calls(gm, KERNEL_NODE)
    arguments = node.kwargs["kwargs"]
    state = arguments["state_out"]
    # The model's own state (a graph input), read and written: re-inplacing writes it there.
    assert state.op == "placeholder" and arguments["state_in"] is state
    assert sorted(node.kwargs["tensors_to_clone"]) == ["state_out", "y"]
    assert (arguments["W"], arguments["S"]) == (4, 4)  # a W-column state, transformers'


def _recurrent_inputs(dtype, heads=2, value_heads=4, dim=16):
    """q, k [B, 1, H, K], v [B, 1, HV, V], g [B, 1, HV, K], beta [B, 1, HV], state fp32."""
    return [((3, 1, heads, dim), dtype), ((3, 1, heads, dim), dtype),
            ((3, 1, value_heads, dim), dtype), ((3, 1, value_heads, dim), dtype),
            ((3, 1, value_heads), dtype), ((3, value_heads, dim, dim), torch.float32)]  # fmt: skip


def _recurrent(q, k, v, g, beta, state):
    return RECURRENT(q, k, v, g, beta, None, None, state, None, 0.25, None, True, True)


def _recurrent_inplace(q, k, v, g, beta, state):
    o, new_state = auto_functionalized(
        RECURRENT_INPLACE, q=q, k=k, v=v, g=g, beta=beta, A_log=None, dt_bias=None,
        state_pool=state, state_indices=None, cu_seqlens=None, scale=0.25, lower_bound=None,
        use_qk_l2norm=True, use_beta_sigmoid=True,
    )  # fmt: skip
    return o, new_state


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_recurrent_writes_a_new_float32_state(dtype):
    gm, count = _lowered(_recurrent, *_recurrent_inputs(dtype))
    assert count == 1 and not _calls(gm, RECURRENT)
    (node,) = _calls(gm, KERNEL_NODE)
    arguments = node.kwargs["kwargs"]
    assert arguments["state_in"].op == "placeholder"
    written = arguments["state_out"]
    assert written.op != "placeholder" and written.meta["val"].dtype == torch.float32
    assert written.meta["val"].shape == (3, 4, 16, 16)
    assert sorted(node.kwargs["tensors_to_clone"]) == ["o", "state_out"]
    assert node.kwargs["grid"] == [(12, 1, 1)]  # V = 16 in one block, 3 sequences x 4 heads


def test_recurrent_inplace_reads_and_writes_the_models_pool():
    gm, count = _lowered(_recurrent_inplace, *_recurrent_inputs(torch.bfloat16))
    assert count == 1 and not _calls(gm, auto_functionalized)
    (node,) = _calls(gm, KERNEL_NODE)
    arguments = node.kwargs["kwargs"]
    assert (
        arguments["state_out"].op == "placeholder"
        and arguments["state_in"] is arguments["state_out"]
    )


def test_recurrent_in_float64_stays_the_op():
    gm, count = _lowered(_recurrent, *_recurrent_inputs(torch.float64)[:5],
                         ((3, 4, 16, 16), torch.float64))  # fmt: skip
    assert count == 0 and len(_calls(gm, RECURRENT)) == 1


def test_gate_becomes_one_kernel_node_writing_float32():
    def gate(g, A_log, dt_bias):
        return torch.ops.kda.gate.default(g, A_log, dt_bias, -5.0)

    shapes = ((2, 3, 4, 16), torch.bfloat16), ((4,), torch.float32), ((64,), torch.float32)
    gm, count = _lowered(gate, *shapes)
    assert count == 1
    (node,) = _calls(gm, KERNEL_NODE)
    assert node.kwargs["tensors_to_clone"] == ["out"]
    assert node.kwargs["kwargs"]["out"].meta["val"].dtype == torch.float32


def test_conv_update_prefill_stays_the_op():
    shapes = ((3, 5, 10), torch.bfloat16), ((3, 10, 3), torch.bfloat16), ((10, 4), torch.bfloat16)
    gm, count = _lowered(_conv_step, *shapes)
    assert count == 0 and len(_calls(gm, auto_functionalized)) == 1


def _conv_prefill(x, weight, state):
    return torch.ops.kda.causal_conv1d.default(x, weight, None, state, None, "silu")


@pytest.mark.parametrize("length", [1, 5])
def test_conv_prefill_becomes_its_kernel_writing_the_final_state(length):
    shapes = (
        ((3, length, 10), torch.bfloat16),
        ((10, 4), torch.bfloat16),
        ((3, 10, 3), torch.float32),
    )
    gm, count = _lowered(_conv_prefill, *shapes)
    assert count == 1 and not _calls(gm, torch.ops.kda.causal_conv1d.default)
    (node,) = _calls(gm, KERNEL_NODE)  # the output kernel writes the final state too
    arguments = node.kwargs["kwargs"]
    assert sorted(node.kwargs["tensors_to_clone"]) == ["state_out", "y"]
    assert arguments["FINAL_STATE"] is True and arguments["state"].op == "placeholder"
    assert arguments["state_out"].meta["val"].dtype == torch.float32  # the state's dtype
    assert node.kwargs["grid"] == [(3, 1, 1)]  # 3 rows of one token and channel block


def test_conv_prefill_with_a_longer_state_stays_the_op():
    shapes = ((3, 5, 10), torch.bfloat16), ((10, 4), torch.bfloat16), ((3, 10, 4), torch.bfloat16)
    _, count = _lowered(_conv_prefill, *shapes)
    assert count == 0


@pytest.fixture
def hopper_sizes(monkeypatch):
    """An H200's SM count and shared memory for the chunk planning of fake CUDA tensors."""
    from kda_ops.kernels.chunk import planning, segments
    from kda_ops.kernels.sizes import HOPPER

    monkeypatch.setattr(planning, "device_sizes", lambda device: HOPPER)
    monkeypatch.setattr(segments, "processors", lambda device: HOPPER.processors)


def _chunk_inputs(length, dtype=torch.bfloat16, batch=2, heads=2, dim=32):
    return [((batch, length, heads, dim), dtype)] * 4 + [((batch, length, heads), dtype),
            ((heads,), torch.float32), ((heads * dim,), torch.float32),
            ((batch, heads, dim, dim), torch.float32)]  # fmt: skip


def _chunk_with(lower_bound):
    def chunk(q, k, v, g, beta, A_log, dt_bias, state):
        return torch.ops.kda.chunk.default(q, k, v, g, beta, A_log, dt_bias, state, None, 0.25,
                                           lower_bound, True, True)  # fmt: skip

    return chunk


@pytest.mark.parametrize("lower_bound, prepare_passes", [(-5.0, 1), (None, 2)])
def test_chunk_becomes_prepare_then_recurrence(hopper_sizes, lower_bound, prepare_passes):
    gm, count = _lowered(_chunk_with(lower_bound), *_chunk_inputs(100))
    assert count == 1 and not _calls(gm, torch.ops.kda.chunk.default)
    *prepares, recurrence = _calls(gm, KERNEL_NODE)
    assert len(prepares) == prepare_passes
    # Each launch reads what the one before wrote: the nodes' outputs, not new buffers.
    written = {user.args[1]: user for user in prepares[-1].users}
    for name in ("w", "u", "qg", "kd", "aqk", "chunk_decay"):
        assert recurrence.kwargs["kwargs"][name] is written[name]
    if prepare_passes == 2:
        flags = {user.args[1]: user for user in prepares[0].users}["unbounded"]
        assert prepares[1].kwargs["kwargs"]["unbounded"] is flags
    # 2 sequences x 7 chunks of 16 tokens, 2 heads
    assert prepares[0].kwargs["grid"] == [(2 * math.ceil(100 / FORWARD_CHUNK), 2, 1)]
    assert recurrence.kwargs["kwargs"]["initial_state"].op == "placeholder"
    assert sorted(recurrence.kwargs["tensors_to_clone"]) == ["final_state", "o"]


def test_chunk_of_a_symbolic_batch_and_length_plans_without_guards(hopper_sizes):
    shape_env = ShapeEnv()
    mode = FakeTensorMode(shape_env=shape_env)
    batch, length = (
        shape_env.create_symintnode(shape_env.create_symbol(hint, ConstantSource(name)), hint=hint)
        for name, hint in (("batch", 3), ("length", 100))
    )
    with mode:
        args = [torch.empty(batch, length, *shape[2:], dtype=dtype, device="cuda") if i < 5
                else torch.empty(shape, dtype=dtype, device="cuda")
                for i, (shape, dtype) in enumerate(_chunk_inputs(1))]  # fmt: skip
        args[-1] = torch.empty(batch, 2, 32, 32, device="cuda")
        gm = make_fx(_chunk_with(-5.0), tracing_mode="fake")(*args)
    guards = len(shape_env.guards)
    with V.set_fake_mode(mode):
        count = TritonKernelsPass()(gm.graph)
    assert count == 1 and len(shape_env.guards) == guards  # planned without a new guard
    prepare, recurrence = _calls(gm, KERNEL_NODE)
    assert not isinstance(prepare.kwargs["grid"][0][0], int)  # chunks of the traced shapes
    assert recurrence.kwargs["kwargs"]["BV"] == 32  # the choice of a batch filling the SMs


def test_chunk_in_segments_stays_the_op(hopper_sizes):
    # One long sequence of few heads: the op runs the recurrence in segments.
    gm, count = _lowered(_chunk_with(-5.0), *_chunk_inputs(16384, batch=1))
    assert count == 0 and len(_calls(gm, torch.ops.kda.chunk.default)) == 1


# GPU: whole compiles, generated code launching the kernels.


@pytest.mark.gpu
@pytest.mark.parametrize("channels", [64, 10])  # the W = 4 vector kernel, the generic one
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_compiled_transformers_block_launches_the_kernels_in_place(dtype, channels):
    """Qwen3-Next's gated norm module and transformers' conv update, as the model runs them."""
    modeling = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
    conv_update = getattr(modeling.causal_conv1d_update, "__wrapped__",
                          modeling.causal_conv1d_update)  # fmt: skip
    device, batch, width = "cuda", 5, 4
    norm = modeling.Qwen3NextRMSNormGated(64, eps=1e-6).to(device, dtype)
    x, gate = (torch.randn(batch, 64, device=device, dtype=dtype) for _ in range(2))
    u = torch.randn(batch, channels, 1, device=device, dtype=dtype)
    conv_state = torch.randn(batch, channels, width, device=device, dtype=dtype)
    conv_weight = torch.randn(channels, width, device=device, dtype=dtype)

    def block(x, gate, u, conv_state, conv_weight):
        return norm(x, gate), conv_update(u, conv_state, conv_weight, None, "silu")

    expected_state = conv_state.clone()
    with torch.no_grad():
        expected = block(x, gate, u, expected_state, conv_weight)
        address = conv_state.data_ptr()
        out, counts, code = compile_kda(block, x, gate, u, conv_state, conv_weight)
    assert counts == {"gated_rms_norm": 1, "conv_update_transformers": 1,
                      "triton_kernels": 2}  # fmt: skip
    assert "torch.ops.kda" not in code  # no op call: the kernels are launched directly
    assert "gated_rms_norm_kernel" in code and "conv_step" in code
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    for got, want in zip(out, expected):
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    assert conv_state.data_ptr() == address
    torch.testing.assert_close(conv_state, expected_state, rtol=0, atol=0)


@pytest.mark.gpu
def test_hybrid_inplace_decode_launches_every_kernel_itself():
    from tests.examples.cases import BATCH, assert_caches_close, clone_cache, tiny_model, token_ids

    model, ids = tiny_model(device="cuda"), token_ids(7, device="cuda")
    _, cache = model.prefill(ids[:, :6], model.new_cache(BATCH))
    expected_cache = clone_cache(cache)
    expected = model.decode_(ids[:, 6:], expected_cache)
    addresses = [t.data_ptr() for state in cache for t in state]
    logits, counts, code = compile_kda(model.decode_, ids[:, 6:], cache)
    layers = model.config.kda_layer_count
    # Per KDA layer: the recurrence, three conv steps and the gated norm.
    assert counts["triton_kernels"] == 5 * layers
    assert "torch.ops.kda" not in code
    torch.testing.assert_close(logits, expected)
    assert_caches_close(cache, expected_cache)
    assert [t.data_ptr() for state in cache for t in state] == addresses


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_compiled_gate_and_recurrence_launch_the_kernels(dtype):
    """A decode step as a model calls the public functions: the gate, then the recurrence."""
    batch, heads, dim = 3, 4, 32
    q, k, v, g = (torch.randn(batch, 1, heads, dim, device="cuda", dtype=dtype) for _ in range(4))
    beta = torch.rand(batch, 1, heads, device="cuda", dtype=dtype)
    A_log = torch.rand(heads, device="cuda")
    state = torch.randn(batch, heads, dim, dim, device="cuda")

    def step(q, k, v, g, beta, A_log, state):
        decay = kda_ops.kda_gate(g, A_log, lower_bound=-5.0)
        return kda_ops.fused_recurrent_kda(
            q, k, v, decay, beta, initial_state=state, output_final_state=True,
            use_qk_l2norm_in_kernel=True,
        )  # fmt: skip

    expected = step(q, k, v, g, beta, A_log, state)
    out, counts, code = compile_kda(step, q, k, v, g, beta, A_log, state)
    assert counts == {"triton_kernels": 2} and "torch.ops.kda" not in code
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    for got, want in zip(out, expected):
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)
