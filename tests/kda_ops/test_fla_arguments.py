"""FLA's arguments of chunk_kda / fused_recurrent_kda / the pool op, each against the
float64 reference or the canonical call it stands for, on CPU."""

import inspect
import warnings

import pytest
import torch

import kda_ops
from tests.kda_ops.inputs import delta_rule_inputs

DELTA_RULE_FUNCTIONS = [kda_ops.chunk_kda, kda_ops.fused_recurrent_kda]
# fla-core 0.6.0's positional parameters, in order (FLA takes A_log / dt_bias /
# chunk_size through **kwargs in chunk_kda).
FLA_POSITIONAL = {
    kda_ops.chunk_kda: (
        "q", "k", "v", "g", "beta", "scale", "initial_state", "output_final_state",
        "use_qk_l2norm_in_kernel", "use_gate_in_kernel", "use_beta_sigmoid_in_kernel",
        "allow_neg_eigval", "safe_gate", "lower_bound", "disable_recompute",
        "return_intermediate_states", "state_v_first", "cu_seqlens", "cu_seqlens_cpu",
        "cp_context", "use_graph", "max_num_seqs",
    ),
    kda_ops.fused_recurrent_kda: (
        "q", "k", "v", "g", "beta", "A_log", "dt_bias", "scale", "initial_state",
        "output_final_state", "use_qk_l2norm_in_kernel", "use_gate_in_kernel",
        "use_beta_sigmoid_in_kernel", "allow_neg_eigval", "lower_bound", "state_v_first",
        "cu_seqlens",
    ),
}  # fmt: skip


def inputs(**kwargs):
    x = delta_rule_inputs(batch=2, length=70, heads=2, value_heads=4, head_k=8, head_v=6,
                          **kwargs)  # fmt: skip
    return dict(q=x.q, k=x.k, v=x.v, g=x.g, beta=x.beta), x


def close(a, b, tol=1e-10):
    assert a.shape == b.shape and a.dtype == b.dtype
    torch.testing.assert_close(a, b, rtol=tol, atol=tol)


@pytest.mark.parametrize("function", DELTA_RULE_FUNCTIONS)
def test_positional_order_is_flas(function):
    parameters = list(inspect.signature(function).parameters.values())
    positional = [p.name for p in parameters if p.kind == p.POSITIONAL_OR_KEYWORD]
    assert tuple(positional) == FLA_POSITIONAL[function]


def test_chunk_size():
    args, _ = inputs()
    o64, s64 = kda_ops.chunk_kda(**args, output_final_state=True)
    o32, s32 = kda_ops.chunk_kda(**args, output_final_state=True, chunk_size=32)
    close(o32, o64)
    close(s32, s64)
    with pytest.raises(ValueError, match="`chunk_size` must be either 32 or 64 for KDA"):
        kda_ops.chunk_kda(**args, chunk_size=16)
    with pytest.raises(ValueError, match="every 64 tokens"):
        kda_ops.chunk_kda(**args, chunk_size=32, return_intermediate_states=True)


@pytest.mark.parametrize("function", DELTA_RULE_FUNCTIONS)
def test_allow_neg_eigval_doubles_the_sigmoid(function):
    args, _ = inputs()
    raw = torch.logit(args.pop("beta")) * 2
    o, state = function(**args, beta=raw, use_beta_sigmoid_in_kernel=True,
                        allow_neg_eigval=True, output_final_state=True)  # fmt: skip
    o_ref, state_ref = function(**args, beta=2 * torch.sigmoid(raw), output_final_state=True)
    close(o, o_ref)
    close(state, state_ref)
    with pytest.raises(ValueError, match="requires `use_beta_sigmoid_in_kernel=True`"):
        function(**args, beta=raw, allow_neg_eigval=True)


@pytest.mark.parametrize("function", DELTA_RULE_FUNCTIONS)
def test_state_v_first(function):
    args, x = inputs()
    o_ref, final_ref = function(**args, initial_state=x.initial_state, output_final_state=True)
    v_first = x.initial_state.transpose(-1, -2).contiguous()
    o, final = function(**args, initial_state=v_first, output_final_state=True,
                        state_v_first=True)  # fmt: skip
    close(o, o_ref)
    close(final, final_ref.transpose(-1, -2).contiguous())
    assert final.is_contiguous()
    with pytest.warns(DeprecationWarning, match="`transpose_state_layout` is deprecated"):
        _, old = function(**args, initial_state=v_first, output_final_state=True,
                          transpose_state_layout=True)  # fmt: skip
    close(old, final)
    with pytest.raises(ValueError, match="not both"):
        function(**args, state_v_first=True, transpose_state_layout=True)


def test_state_v_first_chunk_states():
    args, x = inputs()
    with torch.no_grad():
        _, _, h = kda_ops.chunk_kda(**args, initial_state=x.initial_state,
                                    return_intermediate_states=True)  # fmt: skip
        _, _, h_v = kda_ops.chunk_kda(
            **args, initial_state=x.initial_state.transpose(-1, -2), state_v_first=True,
            return_intermediate_states=True,
        )  # fmt: skip
    close(h_v, h.transpose(-1, -2).contiguous())


def test_state_v_first_pool():
    args, _ = inputs(dtype=torch.float64)
    token = {name: t[:, :1] for name, t in args.items()}
    pool = torch.randn(5, 4, 8, 6, dtype=torch.float64)
    slots = torch.tensor([3, 1])
    expected = pool.clone()
    o_ref = kda_ops.fused_recurrent_kda_inplace(**token, state_pool=expected, state_indices=slots)
    v_first = pool.transpose(-1, -2).contiguous()
    o = kda_ops.fused_recurrent_kda_inplace(**token, state_pool=v_first, state_indices=slots,
                                            state_v_first=True)  # fmt: skip
    close(o, o_ref)
    close(v_first, expected.transpose(-1, -2).contiguous())
    with pytest.raises(ValueError, match="`state_pool` must be contiguous"):
        kda_ops.fused_recurrent_kda_inplace(**token, state_pool=pool.transpose(-1, -2),
                                            state_indices=slots)  # fmt: skip


def test_cu_seqlens_cpu_gives_flas_exact_chunk_rows():
    x = delta_rule_inputs(length=150, heads=2, head_k=8, head_v=6)
    args = dict(q=x.q, k=x.k, v=x.v, g=x.g, beta=x.beta)
    cu_seqlens = torch.tensor([0, 10, 80, 150])
    with torch.no_grad():
        o, _, h = kda_ops.chunk_kda(**args, cu_seqlens=cu_seqlens,
                                    return_intermediate_states=True)  # fmt: skip
        o_cpu, _, h_exact = kda_ops.chunk_kda(
            **args, cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens.clone(),
            return_intermediate_states=True,
        )  # fmt: skip
    assert h.shape[1] == 150 // 64 + 3 and h_exact.shape[1] == 1 + 2 + 2
    close(o_cpu, o)
    close(h_exact, h[:, :5])
    with pytest.raises(ValueError, match="`cu_seqlens_cpu` must have the shape"):
        kda_ops.chunk_kda(**args, cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens[:2])
    with pytest.raises(ValueError, match="`cu_seqlens_cpu` needs `cu_seqlens`"):
        kda_ops.chunk_kda(**args, cu_seqlens_cpu=cu_seqlens)


def test_graph_mode_arguments():
    x = delta_rule_inputs(length=20)
    args = dict(q=x.q, k=x.k, v=x.v, g=x.g, beta=x.beta, cu_seqlens=torch.tensor([0, 5, 20]))
    o, _ = kda_ops.chunk_kda(**args, use_graph=True, max_num_seqs=2)
    close(o, kda_ops.chunk_kda(**args)[0])
    with pytest.raises(ValueError, match="`max_num_seqs` \\(4\\) must equal"):
        kda_ops.chunk_kda(**args, use_graph=True, max_num_seqs=4)
    with pytest.raises(ValueError, match="`cp_context`"):
        kda_ops.chunk_kda(**args, cp_context=object())


@pytest.mark.parametrize("function", DELTA_RULE_FUNCTIONS)
def test_gate_parameter_shapes(function):
    args, x = inputs(raw_gate=True)
    gate = dict(use_gate_in_kernel=True, lower_bound=-5.0)
    o_ref, _ = function(**args, A_log=x.A_log, dt_bias=x.dt_bias, **gate)
    o, _ = function(**args, A_log=x.A_log.view(1, 1, 4, 1), dt_bias=x.dt_bias.view(4, 8),
                    **gate)  # fmt: skip
    close(o, o_ref)
    # FLA: no A_log with a lower bound is the rate exp(0) = 1.
    o_none, _ = function(**args, A_log=None, dt_bias=x.dt_bias, **gate)
    o_zero, _ = function(**args, A_log=torch.zeros_like(x.A_log), dt_bias=x.dt_bias, **gate)
    close(o_none, o_zero)
    with pytest.raises(ValueError, match="needs `A_log` of shape \\(HV,\\) unless `lower_bound`"):
        function(**args, use_gate_in_kernel=True)


@pytest.mark.parametrize("function", DELTA_RULE_FUNCTIONS)
def test_mixed_dtypes_run_in_the_widest(function):
    args, x = inputs(dtype=torch.float32)
    mixed = dict(args, v=args["v"].half())
    o, final = function(**mixed, initial_state=x.initial_state.half(), output_final_state=True)
    widest = dict(args, v=args["v"].half().float())
    o_ref, final_ref = function(**widest, initial_state=x.initial_state.half().float(),
                                output_final_state=True)  # fmt: skip
    assert o.dtype == torch.float16 and final.dtype == torch.float32
    close(o, o_ref.half(), tol=1e-3)
    close(final, final_ref, tol=1e-6)


@pytest.mark.parametrize("dtype, head_k", [(torch.float16, 8), (torch.float16, 192)])
def test_chunk_computes_in_float32_where_the_kernels_need_it(dtype, head_k):
    """fp16 runs as the fp32 call on the same values (``kda_ops.plan``,
    ``kda_ops.explain``): outputs and gradients in the input dtype; bf16 runs in bf16 at
    every key width."""
    x = delta_rule_inputs(batch=1, length=70, heads=1, value_heads=1, head_k=head_k, head_v=8)
    do = torch.randn_like(x.v).to(dtype).float()
    results = []
    for compute in (dtype, torch.float32):
        qkv = {n: getattr(x, n).to(dtype).to(compute).requires_grad_() for n in ("q", "k", "v")}
        o, _ = kda_ops.chunk_kda(**qkv, g=x.g, beta=x.beta)
        o = o.to(dtype)
        (o.float() * do).sum().backward()
        results.append([o] + [qkv[n].grad.to(dtype) for n in ("q", "k", "v")])
    assert kda_ops.explain(x.q.to(dtype)).compute_dtype == torch.float32
    assert results[0][0].dtype == dtype and results[0][1].dtype == dtype
    for got, expected in zip(*results):
        assert torch.equal(got, expected)
    assert kda_ops.explain(x.q.bfloat16()).compute_dtype == torch.bfloat16


def test_chunk_states_in_the_input_dtype():
    args, _ = inputs(dtype=torch.float32)
    half = {name: t.bfloat16() for name, t in args.items()}
    with torch.no_grad():
        _, _, h = kda_ops.chunk_kda(**half, return_intermediate_states=True)
    assert h.dtype == torch.bfloat16


@pytest.mark.parametrize("function", DELTA_RULE_FUNCTIONS)
def test_unknown_keyword_is_a_type_error(function):
    args, _ = inputs()
    with pytest.raises(TypeError, match="unexpected keyword"):
        function(**args, chunk_sizes=64)


@pytest.mark.parametrize("use_reentrant", [True, False])
@pytest.mark.parametrize("function", DELTA_RULE_FUNCTIONS)
def test_gradient_checkpointing(function, use_reentrant):
    _, x = inputs(requires_grad=True)

    def layer(q, k, v, g, beta, initial_state):
        o, final = function(q, k, v, g, beta, initial_state=initial_state,
                            output_final_state=True)  # fmt: skip
        return o.square().sum() + final.sum()

    primals = (x.q, x.k, x.v, x.g, x.beta, x.initial_state)
    layer(*primals).backward()
    plain = [p.grad.clone() for p in primals]
    for p in primals:
        p.grad = None
    loss = torch.utils.checkpoint.checkpoint(layer, *primals, use_reentrant=use_reentrant)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loss.backward()
    for p, expected in zip(primals, plain):
        close(p.grad, expected)


@pytest.mark.parametrize("function", DELTA_RULE_FUNCTIONS)
def test_gate_parameters_without_the_in_kernel_gate_warn(function):
    """FLA ignores A_log / dt_bias / lower_bound unless use_gate_in_kernel; so do we, aloud."""
    args, x = inputs()
    plain, _ = function(**args)
    with pytest.warns(UserWarning, match="`A_log`, `lower_bound` ignored without"):
        o, _ = function(**args, A_log=x.A_log, lower_bound=-5.0)
    close(o, plain)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        function(**args, use_gate_in_kernel=True, A_log=x.A_log, lower_bound=-5.0)
