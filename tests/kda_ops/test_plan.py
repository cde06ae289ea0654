"""One plan per delta-rule call (``kda_ops.plan``): its rules, ``kda_ops.explain``, the
one-time warning, the support matrix the documents show, and every chunk entry point
computing in the plan's dtype."""

import dataclasses
import importlib.util
import itertools
import warnings
from pathlib import Path

import pytest
import torch

import kda_ops
from kda_ops import plan
from kda_ops.plan import decide
from tests.kda_ops.inputs import delta_rule_inputs
from tests.kda_ops.kernels.devices import relative_error

ROOT = Path(__file__).resolve().parents[2]
_SPEC = importlib.util.spec_from_file_location(
    "support_matrix", ROOT / "tools" / "support_matrix.py"
)
support_matrix_tool = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(support_matrix_tool)


@pytest.mark.parametrize(
    ("kind", "device", "dtype", "head_k", "triton", "expected"),
    [
        ("chunk", "cuda", torch.bfloat16, 128, True, ("triton", torch.bfloat16, ())),
        ("chunk", "cuda", torch.float32, 256, True, ("triton", torch.float32, ())),
        ("chunk", "cuda", torch.float16, 64, True, ("triton", torch.float32,
                                                    (plan.FP16_IN_FP32,))),
        ("chunk", "cuda", torch.bfloat16, 192, True, ("triton", torch.float32,
                                                      (plan.WIDE_BF16_IN_FP32,))),
        ("chunk", "cuda", torch.float64, 64, True, ("reference", torch.float64,
                                                    (plan.FLOAT64,))),
        ("chunk", "cuda", torch.bfloat16, 64, False, ("reference", torch.bfloat16,
                                                      (plan.NO_TRITON,))),
        ("chunk", "cpu", torch.float16, 64, True, ("reference", torch.float32,
                                                   (plan.OFF_CUDA, plan.FP16_IN_FP32))),
        # the token recurrence computes in fp32 whatever its inputs
        ("recurrent", "cuda", torch.float16, 64, True, ("triton", torch.float16, ())),
        ("recurrent", "cuda", torch.bfloat16, 256, True, ("triton", torch.bfloat16, ())),
    ],
)  # fmt: skip
def test_rules(kind, device, dtype, head_k, triton, expected):
    decided = decide(kind, device, dtype, head_k, triton)
    assert (decided.implementation, decided.compute_dtype, decided.reasons) == expected


def test_explain_takes_the_widest_dtype_and_names_the_kind():
    q = torch.zeros(1, 4, 1, 192, dtype=torch.bfloat16)
    decided = kda_ops.explain(q, q, q.float())
    assert decided.compute_dtype == torch.float32 and decided.reasons == (plan.OFF_CUDA,)
    assert kda_ops.explain(q).compute_dtype == torch.float32
    assert kda_ops.explain(q, kind="recurrent").compute_dtype == torch.bfloat16
    with pytest.raises(ValueError, match="`kind`"):
        kda_ops.explain(q, kind="chunked")


def test_a_slower_cuda_path_warns_once_per_rule(monkeypatch):
    monkeypatch.setattr(plan, "_WARNED", set())
    fp16 = plan.DeltaRulePlan("chunk", "triton", torch.float32, (plan.FP16_IN_FP32,))
    with pytest.warns(UserWarning, match="float16 chunk inputs are computed in float32"):
        plan.announce(fp16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plan.announce(fp16)  # said already
        plan.announce(decide("chunk", "cpu", torch.float16, 64, True))  # CPU: by design
        plan.announce(decide("chunk", "cuda", torch.bfloat16, 64, True))  # nothing to say
    with pytest.warns(UserWarning, match="Triton is not installed"):
        plan.announce(decide("chunk", "cuda", torch.bfloat16, 64, False))


def test_the_support_matrix_is_decide_everywhere():
    """Every kind, device, dtype, key width 1..256 and Triton install falls in one row of the
    matrix, whose plan is decide's for it."""
    rows = plan.support_matrix()
    covered = [(r.kind, r.device_type, r.dtype, head_k, r.triton_available)
               for r in rows for head_k in r.key_dims]  # fmt: skip
    space = itertools.product(plan.KINDS, plan.DEVICE_TYPES, plan.DTYPES,
                              range(1, plan.MAX_HEAD_DIM + 1), (True, False))  # fmt: skip
    assert sorted(covered, key=str) == sorted(space, key=str)
    for row in rows:
        for head_k in row.key_dims:
            assert row.plan == decide(row.kind, row.device_type, row.dtype, head_k,
                                      row.triton_available)  # fmt: skip


def test_the_support_matrix_follows_a_changed_rule(monkeypatch):
    """A rule added to decide (float32 past 200 key columns) shows as its own columns and a
    numbered reason: the matrix holds no copy of the rules."""
    original = plan.decide
    added = "float32 past 200 key columns takes a made-up path"

    def with_a_rule_added(kind, device_type, dtype, head_k, triton_available):
        decided = original(kind, device_type, dtype, head_k, triton_available)
        if dtype == torch.float32 and head_k > 200:
            return dataclasses.replace(decided, reasons=(*decided.reasons, added))
        return decided

    before = plan.render_support_matrix()
    monkeypatch.setattr(plan, "decide", with_a_rule_added)
    assert plan.key_dim_bands(torch.float32) == (range(1, 201), range(201, 257))
    after = plan.render_support_matrix()
    header = after.splitlines()[0]
    assert "| float32, K ≤ 200 | float32, K > 200 |" in header
    assert f". {added}." in after and added not in before


@pytest.mark.parametrize("document", support_matrix_tool.DOCUMENTS, ids=lambda p: p.name)
def test_the_documents_show_the_rules_support_matrix(document):
    """README.md and docs/api.md hold exactly the rendered matrix between their markers: a
    rule changed without ``python tools/support_matrix.py`` fails here."""
    shown = support_matrix_tool.block(document.read_text(), document.name)
    assert shown == plan.render_support_matrix()


CASES = {
    # name: (dtype, head_k)
    "float16": (torch.float16, 16),
    "bfloat16_k192": (torch.bfloat16, 192),
    "float64": (torch.float64, 16),
}


@pytest.mark.parametrize("case", list(CASES))
def test_every_chunk_entry_point_computes_in_the_plans_dtype(case):
    """chunk_kda, chunk_kda_segmented (one and two segments) and the kda::chunk op called
    directly give chunk_kda's result in v's dtype; the plan's compute dtype is float32
    for float16 and wide bfloat16, float64 for float64."""
    dtype, head_k = CASES[case]
    x = delta_rule_inputs(batch=1, length=128, heads=1, value_heads=2, head_k=head_k,
                          head_v=16, raw_gate=True)  # fmt: skip
    q, k, v = (t.to(dtype) for t in (x.q, x.k, x.v))
    gate = dict(use_gate_in_kernel=True, A_log=x.A_log, dt_bias=x.dt_bias,
                use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True)  # fmt: skip
    expected_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    assert kda_ops.explain(q, k, v).compute_dtype == expected_dtype
    o, _ = kda_ops.chunk_kda(q, k, v, x.g, x.beta, **gate)
    results = {
        "segmented, 1": kda_ops.chunk_kda_segmented(q, k, v, x.g, x.beta, num_segments=1,
                                                    **gate)[0],
        "segmented, 2": kda_ops.chunk_kda_segmented(q, k, v, x.g, x.beta, num_segments=2,
                                                    **gate)[0],
        "op": torch.ops.kda.chunk(q, k, v, x.g, x.beta, x.A_log, x.dt_bias, None, None,
                                  head_k**-0.5, None, True, True)[0],
    }  # fmt: skip
    truth, _ = kda_ops.chunk_kda(*(t.double() for t in (q, k, v, x.g, x.beta)),
                                 **{**gate, "A_log": x.A_log.double(),
                                    "dt_bias": x.dt_bias.double()})  # fmt: skip
    assert o.dtype == dtype
    tolerance = {torch.float16: 2e-3, torch.bfloat16: 1e-2, torch.float64: 1e-10}[dtype]
    assert relative_error(o, truth) < tolerance
    for name, result in results.items():
        assert result.dtype == dtype, name
        assert relative_error(result, truth) < tolerance, name


@pytest.mark.gpu
def test_the_chunk_op_called_directly_runs_the_kernels_in_float32(monkeypatch):
    """kda::chunk with bf16 and K = 192 runs the Triton kernels on float32 copies (once
    the reference, silently), announced once; its o is chunk_kda's."""
    from kda_ops.kernels.chunk import launch

    launched = []
    kernel = launch.launch_chunk_kda

    def recorded(inputs, *args, **kwargs):
        launched.append(inputs.q.dtype)
        return kernel(inputs, *args, **kwargs)

    monkeypatch.setattr(kda_ops.delta_rule, "launch_chunk_kda", recorded)
    monkeypatch.setattr(plan, "_WARNED", set())
    x = delta_rule_inputs(batch=1, length=300, heads=1, value_heads=2, head_k=192,
                          head_v=64, raw_gate=True)  # fmt: skip
    q, k, v = (t.cuda().bfloat16() for t in (x.q, x.k, x.v))
    g, beta, A_log, dt_bias = (t.cuda() for t in (x.g, x.beta, x.A_log, x.dt_bias))
    with pytest.warns(UserWarning, match="past 128 key columns"):
        o, _ = torch.ops.kda.chunk(q, k, v, g, beta, A_log, dt_bias, None, None, 192**-0.5,
                                   None, True, True)  # fmt: skip
    assert launched == [torch.float32] and o.dtype == torch.bfloat16
    expected, _ = kda_ops.chunk_kda(q, k, v, g, beta, use_gate_in_kernel=True, A_log=A_log,
                                    dt_bias=dt_bias, use_qk_l2norm_in_kernel=True,
                                    use_beta_sigmoid_in_kernel=True)  # fmt: skip
    assert torch.equal(o, expected)
