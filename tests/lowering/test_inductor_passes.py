"""The kda Inductor passes: on small traced graphs (no code generation), what they match,
what they leave alone, and that rewritten graphs compute the same values; compiled with the
kda backend, every spelling of each fusion (one test per form) fused and equal to eager."""

import importlib.metadata
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch._inductor.pattern_matcher import fwd_only
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

import lowering.inductor as inductor
from examples.hybrid_model import conv_update_torch, gated_rms_norm_torch, rms_norm_torch
from lowering.inductor import canonical
from tests.lowering.compiled import assert_close, compile_kda, op_arguments
from tests.lowering.conv_cases import BATCH, CHANNELS, WIDTH, check_formulation

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
    assert inductor.KDAPassManager()(gm.graph) is None
    gm.recompile()
    assert not any(str(t).startswith("kda.") for t in _targets(gm))
    # the canonical rewrites left in the graph change no value: bit for bit as eager
    torch.testing.assert_close(gm(x, weight), fn(x, weight), rtol=0, atol=0)


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


def test_conv_update_pass_fuses_a_conv_without_silu_but_not_a_per_row_weight():
    def fn(x, state, weight):
        window = torch.cat([state, x.unsqueeze(-1)], dim=-1)
        return (window * weight).sum(-1), window[..., 1:]

    args = (torch.randn(2, 8), torch.randn(2, 8, 3), torch.randn(8, 4))
    gm, count = _run_pass(inductor.ConvUpdatePass(), fn, args)
    assert count == 1
    for got, expected in zip(gm(*args), fn(*args)):
        torch.testing.assert_close(got, expected)
    per_row = (args[0], args[1], torch.randn(2, 8, 4))  # not a depthwise conv weight
    assert _run_pass(inductor.ConvUpdatePass(), fn, per_row)[1] == 0


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


# Spellings of the decode conv update: (x, conv_state, weight, bias, activation) -> y, the
# state written back in place. Each is fused by the pass of its state layout, with and
# without bias, with and without SiLU (tests.lowering.conv_cases.VARIANTS).


def _act(y, activation):
    return F.silu(y) if activation == "silu" else y


def keepdim_column(u, conv_state, w, bias, activation):
    """The issue's form: u ``[B, D, 1]``, ``sum(-1, keepdim=True)``."""
    window = torch.cat([conv_state[:, :, 1:], u], dim=-1)
    y = (window * w).sum(-1, keepdim=True)
    if bias is not None:
        y = y + bias[:, None]
    conv_state.copy_(window)
    return _act(y, activation)


def sum_then_unsqueeze_column(u, conv_state, w, bias, activation):
    window = torch.cat([conv_state[..., 1:], u], 2)
    y = (window * w).sum(2).unsqueeze(-1)
    if bias is not None:
        y = bias.unsqueeze(-1) + y
    conv_state.copy_(window)
    return _act(y, activation)


def torch_sum_weight_first(x, conv_state, w, bias, activation):
    """``torch.sum(w * window, dim=2)``: operands swapped, a positive dim, ``[..., None]``."""
    window = torch.cat((conv_state[:, :, 1:], x[..., None]), dim=2)
    y = torch.sum(w * window, dim=2)
    if bias is not None:
        y = bias + y
    conv_state.copy_(window)
    return _act(y, activation)


def einsum_window(x, conv_state, w, bias, activation):
    window = torch.cat([conv_state[..., 1:], x.unsqueeze(-1)], -1)
    y = torch.einsum("bdw,dw->bd", window, w)
    if bias is not None:
        y = y + bias
    conv_state.copy_(window)
    return _act(y, activation)


def conv1d_window(u, conv_state, w, bias, activation):
    """``F.conv1d`` over the window, the ``[D, W]`` weight unsqueezed, bias in the conv."""
    window = torch.cat([conv_state[:, :, 1:], u], dim=-1)
    y = F.conv1d(window, w.unsqueeze(1), bias, groups=window.shape[1])
    conv_state.copy_(window)
    return _act(y, activation)


def conv1d_module_weight(u, conv_state, w, bias, activation):
    """``F.conv1d`` with ``nn.Conv1d``'s depthwise ``[D, 1, W]`` weight."""
    window = torch.cat([conv_state[:, :, 1:], u], dim=-1)
    y = F.conv1d(window, w, bias, groups=w.shape[0])
    conv_state.copy_(window)
    return _act(y, activation)


def upcast_window(x, conv_state, w, bias, activation):
    """The weighted sum in float32, y cast back."""
    window = torch.cat([conv_state[..., 1:], x.unsqueeze(-1)], -1)
    y = (window.float() * w.float()).sum(-1)
    if bias is not None:
        y = y + bias.float()
    conv_state.copy_(window)
    return _act(y, activation).to(x.dtype)


def roll_column_keepdim(u, conv_state, w, bias, activation):
    """Mamba's roll-and-assign with u ``[B, D, 1]`` assigned to ``[:, :, -1:]``."""
    conv_state.copy_(torch.roll(conv_state, shifts=-1, dims=-1))
    conv_state[:, :, -1:] = u
    y = torch.sum(conv_state * w, dim=-1, keepdim=True)
    if bias is not None:
        y = y + bias[:, None]
    return _act(y, activation)


def roll_einsum(x, conv_state, w, bias, activation):
    conv_state.copy_(conv_state.roll(-1, 2))
    conv_state[:, :, -1] = x
    y = torch.einsum("bdw,dw->bd", conv_state, w)
    if bias is not None:
        y = y + bias
    return _act(y, activation)


def tail_column_keepdim(u, conv_state, w, bias, activation):
    """A ``W - 1`` state: the window is ``cat(state, u)``, the new state its tail."""
    window = torch.cat([conv_state, u], dim=-1)
    y = (window * w).sum(dim=-1, keepdim=True)
    if bias is not None:
        y = y + bias.unsqueeze(-1)
    conv_state.copy_(window[..., 1:])
    return _act(y, activation)


def tail_conv1d(x, conv_state, w, bias, activation):
    window = torch.cat([conv_state, x.unsqueeze(-1)], dim=-1)
    y = F.conv1d(window, w.unsqueeze(1), bias, groups=w.shape[0]).squeeze(-1)
    conv_state.copy_(window[:, :, 1:])
    return _act(y, activation)


FLAT, COLUMN = (BATCH, CHANNELS), (BATCH, CHANNELS, 1)
CONV_FORMS = {
    "keepdim_column": (keepdim_column, "conv_update_window", COLUMN, {}),
    "sum_then_unsqueeze_column": (sum_then_unsqueeze_column, "conv_update_window", COLUMN, {}),
    "torch_sum_weight_first": (torch_sum_weight_first, "conv_update_window", FLAT, {}),
    "einsum_window": (einsum_window, "conv_update_window", FLAT, {}),
    "conv1d_window": (conv1d_window, "conv_update_window", COLUMN, {}),
    "conv1d_module_weight": (conv1d_module_weight, "conv_update_window", COLUMN,
                             {"weight_shape": (CHANNELS, 1, WIDTH)}),
    "upcast_window": (upcast_window, "conv_update_window", FLAT, {}),
    "roll_column_keepdim": (roll_column_keepdim, "conv_update_roll", COLUMN, {}),
    "roll_einsum": (roll_einsum, "conv_update_roll", FLAT, {}),
    "tail_column_keepdim": (tail_column_keepdim, "conv_update", COLUMN,
                            {"state_width": WIDTH - 1}),
    "tail_conv1d": (tail_conv1d, "conv_update", FLAT, {"state_width": WIDTH - 1}),
}  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("form", sorted(CONV_FORMS))
def test_every_conv_update_spelling_fuses_in_place(form, dtype):
    """Compiled with the kda backend: the fused in-place op at every site, on the model's
    own state, outputs and states as eager's."""
    update, pass_name, x_shape, shapes = CONV_FORMS[form]
    check_formulation(update, pass_name, dtype, x_shape, **shapes)


def test_conv_update_of_wrong_width_is_left_alone():
    """A window one column wider than the weight would broadcast nowhere; a cat of a
    state W wide with a column on a W-column weight is not a conv step, and neither
    is a keepdim sum over a [B, D, 2] x."""

    def fn(x2, state, weight, x, other):
        window = torch.cat([state[..., 1:], x2], -1)  # [B, D, W + 1]
        y2 = (window[..., 1:] * weight).sum(-1)
        state.copy_(window[..., 1:])
        wide = torch.cat([other, x.unsqueeze(-1)], -1)[..., 1:]  # W-column state, tail form
        y = F.silu((wide * weight).sum(-1))
        other.copy_(wide)
        return y2, y

    args = (torch.randn(BATCH, CHANNELS, 2), torch.randn(BATCH, CHANNELS, WIDTH),
            torch.randn(CHANNELS, WIDTH), torch.randn(BATCH, CHANNELS),
            torch.randn(BATCH, CHANNELS, WIDTH))  # fmt: skip
    eager = [a.clone() for a in args]
    expected = fn(*eager)
    out, counts, code = compile_kda(fn, *args)
    assert counts == {} and "kda." not in code
    for got, want in zip(out, expected):
        torch.testing.assert_close(got, want)


# Spellings of the gated RMSNorm: (x, gate, weight, eps) -> y; each fuses to
# kda.gated_rms_norm with the activation given.


def rsqrt_pow_sigmoid(x, gate, weight, eps):
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (normed * weight.float() * torch.sigmoid(gate.float())).to(x.dtype)


def reciprocal_sqrt_square_silu(x, gate, weight, eps):
    """1 / sqrt, x.square(), F.silu, weight first (FLA's rms_norm_ref order)."""
    xf = x.to(torch.float32)
    rstd = 1 / torch.sqrt(xf.square().mean(dim=-1, keepdim=True) + eps)
    out = weight.float() * (xf * rstd)
    return (out * F.silu(gate.float())).to(x.dtype)


def reciprocal_in_place_gate(x, gate, weight, eps):
    """Every input upcast first, ``x * rstd * weight`` left to right, the gate applied
    in place (FLA's ``rms_norm_ref`` statement order)."""
    wf, xf, gf = weight.float(), x.float(), gate.float()
    rstd = 1 / torch.sqrt(xf.square().mean(dim=-1, keepdim=True) + eps)
    out = xf * rstd * wf
    out *= F.silu(gf)
    return out.to(x.dtype)


def divide_x_times_x_sigmoid_times_gate(x, gate, weight, eps):
    """x / sqrt, the mean of x * x over a positive dim, SiLU by hand as sigmoid(g) * g."""
    xf = x.float()
    variance = (xf * xf).mean(dim=xf.dim() - 1, keepdim=True)
    normed = xf / torch.sqrt(eps + variance)
    gf = gate.float()
    return (torch.sigmoid(gf) * gf * (normed * weight.float())).to(x.dtype)


class VarianceEpsilonNorm(torch.nn.Module):
    """Qwen3-Next's layout (weight on the normed x rounded to x's dtype) with eps as
    ``self.variance_epsilon`` and the gate as ``g * sigmoid(g)``."""

    def __init__(self, weight: torch.Tensor, eps: float) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(weight)
        self.variance_epsilon = eps

    def forward(self, x, gate):
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        h = self.weight * h.to(x.dtype)
        g = gate.to(torch.float32)
        return (h * (g * torch.sigmoid(g))).to(x.dtype)


def variance_epsilon_module(x, gate, weight, eps):
    return VarianceEpsilonNorm(weight, eps)(x, gate)


NORM_FORMS = {
    "rsqrt_pow_sigmoid": (rsqrt_pow_sigmoid, "sigmoid"),
    "reciprocal_sqrt_square_silu": (reciprocal_sqrt_square_silu, "silu"),
    "reciprocal_in_place_gate": (reciprocal_in_place_gate, "silu"),
    "divide_x_times_x_sigmoid_times_gate": (divide_x_times_x_sigmoid_times_gate, "silu"),
    "variance_epsilon_module": (variance_epsilon_module, "silu"),
}


@pytest.mark.parametrize(
    ("dtype", "weight_dtype"),
    [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
     (torch.float16, torch.float32)],
)  # fmt: skip
@pytest.mark.parametrize("form", sorted(NORM_FORMS))
def test_every_gated_norm_spelling_fuses(form, dtype, weight_dtype):
    norm, activation = NORM_FORMS[form]
    x, gate = torch.randn(3, 5, 32, dtype=dtype), torch.randn(3, 5, 32, dtype=dtype)
    weight = torch.randn(32, dtype=weight_dtype)

    def fn(x, gate, weight):
        return norm(x, gate, weight, 1e-5)

    with torch.no_grad():
        expected = fn(x, gate, weight)
        out, counts, code = compile_kda(fn, x, gate, weight)
    assert counts == {"gated_rms_norm": 1}
    assert code.count("kda.gated_rms_norm.default(") == 1
    assert op_arguments(code, "kda.gated_rms_norm.default", 4) == [repr(activation)]
    assert out.dtype == dtype
    assert_close(out, expected, dtype)


def test_canonical_rewrites_are_exact_and_idempotent():
    """Every canonical rewrite keeps the values bit for bit, and a second run finds none."""

    def fn(x, w, b, g):
        window = torch.cat([x[..., 1:], x[..., :1]], -1)
        y = torch.sum(w * window, dim=-1, keepdim=True) + b[:, None]
        variance = x.square().mean(2, keepdim=True)
        return y * torch.sigmoid(g) * g[..., :1], variance, (b + y.squeeze(-1)).pow(2)

    args = (torch.randn(3, 8, 4), torch.randn(8, 4), torch.randn(8), torch.randn(3, 8, 1))
    gm = _trace(fn, args)
    assert canonical.canonicalize(gm.graph) > 0
    gm.recompile()
    assert canonical.canonicalize(gm.graph) == 0
    assert torch.ops.aten.pow.Tensor_Scalar not in _targets(gm)
    for got, expected in zip(gm(*args), fn(*args)):
        torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_uuid_covers_the_canonical_rewrites(monkeypatch, tmp_path):
    """The FX graph cache keys on the uuid: a change to the canonical rewrites (which
    every pattern is traced through) must change it."""
    before = inductor.KDAPassManager().uuid()
    changed = tmp_path / "canonical.py"
    changed.write_text(Path(canonical.__file__).read_text() + "\n# changed\n")
    monkeypatch.setattr(canonical, "__file__", str(changed))
    assert inductor.KDAPassManager().uuid() != before
