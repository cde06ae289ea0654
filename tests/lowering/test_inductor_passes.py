"""The kda Inductor passes on small traced graphs (no code generation): what they match,
what they leave alone, and that rewritten graphs compute the same values."""

import importlib.metadata

import pytest
import torch
from torch._inductor.pattern_matcher import fwd_only
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

import lowering.inductor as inductor
from examples.hybrid_model import conv_update_torch, gated_rms_norm_torch, rms_norm_torch

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _targets(gm: torch.fx.GraphModule) -> set:
    return {node.target for node in gm.graph.nodes if node.op == "call_function"}


def _trace(fn, args) -> torch.fx.GraphModule:
    """An inference graph like Inductor's post-grad one: decomposed, with every node's
    ``meta["val"]`` from one fake mode."""
    gm = fwd_only(fn, args)
    mode = FakeTensorMode()
    FakeTensorProp(gm, mode).propagate(*(mode.from_tensor(a) for a in args))
    return gm


def _run_pass(fusion: inductor.KDAInductorPass, fn, args) -> tuple[torch.fx.GraphModule, int]:
    gm = _trace(fn, args)
    count = fusion(gm.graph)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return gm, count


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", ["sigmoid", "silu"])
@pytest.mark.parametrize("eps", [1e-5, 3e-3])
def test_gated_rms_norm_pass_fuses_every_dtype_activation_and_eps(dtype, activation, eps):
    x, gate = torch.randn(3, 5, 32, dtype=dtype), torch.randn(3, 5, 32, dtype=dtype)
    weight = torch.randn(32, dtype=dtype)

    def fn(x, gate, weight):
        return gated_rms_norm_torch(x, gate, weight, eps, activation)

    gm, count = _run_pass(inductor.GatedRMSNormPass(), fn, (x, gate, weight))
    assert count == 1
    (fused,) = gm.graph.find_nodes(op="call_function", target=torch.ops.kda.gated_rms_norm.default)
    assert fused.args[3:] == (eps, activation)
    assert torch.ops.aten.rsqrt.default not in _targets(gm)
    torch.testing.assert_close(gm(x, gate, weight), fn(x, gate, weight))


def test_gated_rms_norm_pass_leaves_plain_rms_norm_unchanged():
    x, weight = torch.randn(4, 32), torch.randn(32)

    def fn(x, weight):
        return torch.sigmoid(rms_norm_torch(x, weight, 1e-6))  # a gate-free norm, then sigmoid

    gm = _trace(fn, (x, weight))
    before = gm.code
    assert inductor.KDAPassManager()(gm.graph) is None
    gm.recompile()
    assert gm.code == before


@pytest.mark.parametrize("dtype", DTYPES)
def test_conv_update_pass_uses_the_inplace_op_and_matches(dtype):
    x, state = torch.randn(3, 24, dtype=dtype), torch.randn(3, 24, 3, dtype=dtype)
    weight = torch.randn(24, 4, dtype=dtype)
    gm, count = _run_pass(inductor.ConvUpdatePass(), conv_update_torch, (x, state, weight))
    assert count == 1
    assert torch.ops.aten.cat.default not in _targets(gm)
    (fused,) = gm.graph.find_nodes(
        op="call_function", target=torch.ops.higher_order.auto_functionalized
    )
    assert fused.args[0] is torch.ops.kda.causal_conv1d_update_.default
    state_before = state.clone()
    for got, expected in zip(gm(x, state, weight), conv_update_torch(x, state, weight)):
        torch.testing.assert_close(got, expected)
    assert torch.equal(state, state_before)  # auto_functionalized leaves the input alone


def test_conv_update_pass_ignores_a_conv_without_silu():
    def fn(x, state, weight):
        window = torch.cat([state, x.unsqueeze(-1)], dim=-1)
        return (window * weight).sum(-1), window[..., 1:]

    args = (torch.randn(2, 8), torch.randn(2, 8, 3), torch.randn(8, 4))
    assert _run_pass(inductor.ConvUpdatePass(), fn, args)[1] == 0


def test_uuid_is_stable_and_covers_every_pass():
    first, second = inductor.KDAPassManager(), inductor.KDAPassManager()
    assert first.uuid() == second.uuid()
    only_norm = inductor.KDAPassManager([inductor.GatedRMSNormPass()])
    assert only_norm.uuid() != first.uuid()


def test_counts_accumulate_and_reset():
    manager = inductor.KDAPassManager()
    x, gate, weight = torch.randn(2, 8), torch.randn(2, 8), torch.randn(8)
    for _ in range(2):
        manager(_trace(lambda *a: gated_rms_norm_torch(*a, 1e-6), (x, gate, weight)).graph)
    assert manager.counts == {**dict.fromkeys(manager.counts, 0), "gated_rms_norm": 2}
    manager.reset_counts()
    assert set(manager.counts.values()) == {0}


def test_match_counts_are_logged_when_asked(monkeypatch, caplog):
    monkeypatch.setenv("KDA_LOG_PASSES", "1")
    x, gate, weight = torch.randn(2, 8), torch.randn(2, 8), torch.randn(8)
    graph = _trace(lambda *a: gated_rms_norm_torch(*a, 1e-6), (x, gate, weight)).graph
    with caplog.at_level("WARNING", logger="lowering.inductor"):
        inductor.GatedRMSNormPass()(graph)
    assert "kda pass gated_rms_norm: 1 match(es)" in caplog.text


def test_backend_is_registered_as_entry_point():
    points = importlib.metadata.entry_points(group="torch_dynamo_backends")
    assert {p.name: p.value for p in points}.get("kda") == "lowering.inductor:kda_backend"
    assert "kda" in torch._dynamo.list_backends()


def test_backend_rejects_a_second_custom_pass():
    gm = torch.fx.symbolic_trace(torch.nn.ReLU())
    with pytest.raises(ValueError, match="post_grad_custom_post_pass"):
        inductor.kda_backend(gm, [torch.randn(2)], options={"post_grad_custom_post_pass": None})
