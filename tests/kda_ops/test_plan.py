"""One plan per delta-rule call (``kda_ops.plan``): its rules, ``kda_ops.explain``, the
one-time warning, the support matrix the documents show, and every entry point (the public
functions, the ops called directly, segmented, context-parallel, speculative, the FLA and
transformers integrations) following the plan for float16, bfloat16 at 192 key columns
and float64 on CPU, against the float64 token recurrence."""

import dataclasses
import importlib.util
import itertools
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Optional

import pytest
import torch
import torch.distributed as dist
from torch import Tensor

import kda_ops
from kda_ops import plan, reference, speculative
from kda_ops.distributed import chunk_kda_cp
from kda_ops.integrations import _transformers as transformers_kernels
from kda_ops.integrations import fla
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
        ("chunk", "cuda", torch.bfloat16, 192, True, ("triton", torch.bfloat16, ())),
        ("chunk", "cuda", torch.bfloat16, 256, True, ("triton", torch.bfloat16, ())),
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
    assert kda_ops.explain(q).compute_dtype == torch.bfloat16
    assert kda_ops.explain(q.half()).compute_dtype == torch.float32
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


# Every entry point of the delta rule in the three cases the rules single out, on CPU (the
# reference): the plan kda_ops.explain gives, no warning (off CUDA the reference is the kernel
# by design), and the results against the float64 token recurrence of kda_ops.reference.
CASES = {
    # name: (dtype, head_k)
    "float16": (torch.float16, 16),
    "bfloat16_k192": (torch.bfloat16, 192),
    "float64": (torch.float64, 16),
}
CPU_PLANS = {
    # (case, kind): (compute dtype, reasons)
    ("float16", "chunk"): (torch.float32, (plan.OFF_CUDA, plan.FP16_IN_FP32)),
    ("bfloat16_k192", "chunk"): (torch.bfloat16, (plan.OFF_CUDA,)),
    ("float64", "chunk"): (torch.float64, (plan.OFF_CUDA,)),
    # the token recurrence computes its state in fp32 whatever its inputs' dtype
    ("float16", "recurrent"): (torch.float16, (plan.OFF_CUDA,)),
    ("bfloat16_k192", "recurrent"): (torch.bfloat16, (plan.OFF_CUDA,)),
    ("float64", "recurrent"): (torch.float64, (plan.OFF_CUDA,)),
}
TOLERANCE = {torch.float16: 2e-3, torch.bfloat16: 1e-2, torch.float64: 1e-10}
BATCH, LENGTH, CHUNK = 2, 128, 64  # two chunks a sequence
POOL_SLOTS, ACCEPTED = (2, 0), (4, 6)  # pool entries: sequence n's slot; drafts of 6 tokens
PRIMALS = ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "initial_state")


@dataclasses.dataclass
class Call:
    """An entry point's inputs: q, k ``[B, T, H, K]`` and v ``[B, T, HV, V]`` in the case's
    dtype; with ``in_kernel`` g and beta raw (the gate and the beta sigmoid in the kernel,
    A_log and dt_bias float32), else g the log-decay (float32, ``[B, T, HV, K]`` or
    ``[B, T, HV]``) and beta after its sigmoid; the initial state ``[B, HV, K, V]``
    float32 (float64 in the float64 case, where every tensor is float64)."""

    q: Tensor
    k: Tensor
    v: Tensor
    g: Tensor
    beta: Tensor
    A_log: Optional[Tensor]
    dt_bias: Optional[Tensor]
    initial_state: Tensor
    in_kernel: bool

    @property
    def kwargs(self) -> dict:
        """The public functions' options (l2norm in the kernel always)."""
        if not self.in_kernel:
            return {"use_qk_l2norm_in_kernel": True}
        return dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=self.A_log,
                    dt_bias=self.dt_bias, use_beta_sigmoid_in_kernel=True)  # fmt: skip

    def op_args(self, *between: object) -> tuple:
        """The ops' (and the reference's) flat arguments: the seven inputs, ``between``,
        the options."""
        return (self.q, self.k, self.v, self.g, self.beta, self.A_log, self.dt_bias, *between,
                self.q.shape[-1] ** -0.5, None, True, self.in_kernel)  # fmt: skip

    def tokens(self, count: int) -> "Call":
        """The first ``count`` tokens."""
        per_token = ("q", "k", "v", "g", "beta")
        return dataclasses.replace(self, **{
            name: getattr(self, name)[:, :count] for name in per_token
        })  # fmt: skip

    def double(self) -> "Call":
        def wide(t):
            return None if t is None else t.detach().double()

        return dataclasses.replace(self, **{name: wide(getattr(self, name)) for name in PRIMALS})

    def pool(self) -> tuple[Tensor, Tensor]:
        """A state pool with sequence n's initial state in slot ``POOL_SLOTS[n]`` (the other
        slot zero), and those slots."""
        slots = torch.tensor(POOL_SLOTS)
        pool = self.initial_state.new_zeros(len(POOL_SLOTS) + 1, *self.initial_state.shape[1:])
        pool[slots] = self.initial_state
        return pool, slots


def make_call(case: str, in_kernel: bool = True, scalar_gate: bool = False) -> Call:
    dtype, head_k = CASES[case]
    wide = torch.float64 if dtype == torch.float64 else torch.float32
    x = delta_rule_inputs(batch=BATCH, length=LENGTH, heads=1, value_heads=2, head_k=head_k,
                          head_v=16, raw_gate=True, scalar_gate=scalar_gate,
                          dtype=wide)  # fmt: skip
    q, k, v = (t.to(dtype) for t in (x.q, x.k, x.v))
    if in_kernel:
        return Call(q, k, v, x.g.to(dtype), x.beta.to(dtype), x.A_log, x.dt_bias,
                    x.initial_state, True)  # fmt: skip
    # the model computed the log-decay (float32, as transformers passes it) and beta's sigmoid
    g, beta = torch.nn.functional.logsigmoid(x.g), torch.sigmoid(x.beta).to(dtype)
    return Call(q, k, v, g, beta, None, None, x.initial_state, False)


def oracle(call: Call, tokens: Optional[int] = None) -> tuple[Tensor, Tensor]:
    """o and the state after the first ``tokens`` tokens (all by default): the token
    recurrence of ``kda_ops.reference`` (float64 for a float64 ``call``)."""
    call = call if tokens is None else call.tokens(tokens)
    return reference.delta_rule(reference.recurrent_delta_rule,
                                *call.op_args(call.initial_state, None))  # fmt: skip


def cotangents(call: Call) -> tuple[Tensor, Tensor]:
    """Seeded weights of o and the final state in the loss, in their dtypes."""
    generator = torch.Generator().manual_seed(1)
    grad_o = torch.randn(call.v.shape, generator=generator, dtype=torch.float64)
    grad_state = torch.randn(call.initial_state.shape, generator=generator, dtype=torch.float64)
    return grad_o.to(call.v.dtype), grad_state.to(call.initial_state.dtype)


def gradients(forward: Callable[[Call], tuple[Tensor, Tensor]], call: Call) -> dict[str, Tensor]:
    """The gradients of ``<o, grad_o> + <final state, grad_state>`` (:func:`cotangents`)
    through ``forward`` with respect to every input tensor."""
    leaves = dataclasses.replace(call, **{
        name: getattr(call, name).detach().requires_grad_() for name in PRIMALS
    })  # fmt: skip
    grad_o, grad_state = cotangents(call)
    o, state = forward(leaves)
    loss = (o * grad_o.to(o.dtype)).sum() + (state * grad_state.to(state.dtype)).sum()
    grads = torch.autograd.grad(loss, [getattr(leaves, name) for name in PRIMALS])
    return {f"grad_{name}": grad for name, grad in zip(PRIMALS, grads)}


def o_and_final_state(call: Call) -> dict[str, Tensor]:
    o, state = oracle(call)
    return {"o": o, "final_state": state}


def chunk_starts(call: Call) -> Tensor:
    """``[B, NT, HV, K, V]``: the state before tokens 0, 64, ..."""
    starts = [oracle(call, tokens)[1] for tokens in range(CHUNK, LENGTH, CHUNK)]
    return torch.stack([call.initial_state, *starts], dim=1)


def with_h(call: Call) -> dict[str, Tensor]:
    return {**o_and_final_state(call), "h": chunk_starts(call)}


def with_chunk_states(call: Call) -> dict[str, Tensor]:
    return {**o_and_final_state(call), "chunk_states": chunk_starts(call)}


def oracle_gradients(call: Call) -> dict[str, Tensor]:
    return gradients(oracle, call)


def drafts_committed(call: Call) -> dict[str, Tensor]:
    """Speculative decoding of ``max(ACCEPTED)`` draft tokens from the pool: o, the state
    after every draft token, and each sequence's state after its accepted tokens."""
    drafts = max(ACCEPTED)
    after = torch.stack([oracle(call, tokens)[1] for tokens in range(1, drafts + 1)], dim=1)
    committed = after[torch.arange(BATCH), torch.tensor(ACCEPTED) - 1]
    return {"o": oracle(call, drafts)[0], "states": after, "final_state": committed}


def drafts_replayed(call: Call) -> dict[str, Tensor]:
    """:func:`drafts_committed`'s committed states (a replay returns nothing else)."""
    return {"final_state": drafts_committed(call)["final_state"]}


@dataclasses.dataclass(frozen=True)
class Entry:
    kind: plan.Kind
    run: Callable[[Call], dict[str, Tensor]]
    expected: Callable[[Call], dict[str, Tensor]] = o_and_final_state
    in_kernel: bool = True  # else the log-decay and beta after its sigmoid (:class:`Call`)
    scalar_gate: bool = False  # Gated DeltaNet's [B, T, HV] decay


ENTRIES: dict[str, Entry] = {}


def entry(name: str, kind: plan.Kind, **options: object) -> Callable:
    def register(run: Callable[[Call], dict[str, Tensor]]) -> Callable:
        ENTRIES[name] = Entry(kind, run, **options)
        return run

    return register


def _o_state(o: Tensor, state: Tensor) -> dict[str, Tensor]:
    return {"o": o, "final_state": state}


@entry("chunk_kda", "chunk")
def _(c):
    return _o_state(*kda_ops.chunk_kda(c.q, c.k, c.v, c.g, c.beta, initial_state=c.initial_state,
                                       output_final_state=True, **c.kwargs))  # fmt: skip


@entry("chunk_kda training", "chunk", expected=oracle_gradients)
def _(c):
    def forward(leaves):
        return kda_ops.chunk_kda(leaves.q, leaves.k, leaves.v, leaves.g, leaves.beta,
                                 initial_state=leaves.initial_state, output_final_state=True,
                                 **leaves.kwargs)  # fmt: skip

    return gradients(forward, c)


@entry("chunk_kda return_intermediate_states", "chunk", expected=with_h)
def _(c):
    o, state, h = kda_ops.chunk_kda(c.q, c.k, c.v, c.g, c.beta, initial_state=c.initial_state,
                                    output_final_state=True, return_intermediate_states=True,
                                    **c.kwargs)  # fmt: skip
    return {"o": o, "final_state": state, "h": h}


@entry("chunk_kda_segmented 1 segment", "chunk")
def _(c):
    return _o_state(*kda_ops.chunk_kda_segmented(
        c.q, c.k, c.v, c.g, c.beta, initial_state=c.initial_state, output_final_state=True,
        num_segments=1, **c.kwargs))  # fmt: skip


@entry("chunk_kda_segmented 2 segments", "chunk")
def _(c):
    return _o_state(*kda_ops.chunk_kda_segmented(
        c.q, c.k, c.v, c.g, c.beta, initial_state=c.initial_state, output_final_state=True,
        num_segments=2, **c.kwargs))  # fmt: skip


@entry("chunk_kda_cp one rank", "chunk")
def _(c):
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        return _o_state(*chunk_kda_cp(c.q, c.k, c.v, c.g, c.beta, initial_state=c.initial_state,
                                      output_final_state=True, **c.kwargs))  # fmt: skip
    finally:
        dist.destroy_process_group()


@entry("kda::chunk", "chunk")
def _(c):
    return _o_state(*torch.ops.kda.chunk(*c.op_args(c.initial_state, None)))


@entry("kda::chunk_train", "chunk")
def _(c):
    o, state, saved = torch.ops.kda.chunk_train(*c.op_args(c.initial_state, None), False)
    assert saved == []  # off CUDA the backward differentiates the reference
    return _o_state(o, state)


@entry("kda::chunk_states", "chunk", expected=with_chunk_states)
def _(c):
    o, state, rows = torch.ops.kda.chunk_states(*c.op_args(c.initial_state, None))
    return {"o": o, "final_state": state, "chunk_states": rows.unflatten(0, (BATCH, -1))}


@entry("kda::delta_rule_backward", "chunk", expected=oracle_gradients)
def _(c):
    grads = torch.ops.kda.delta_rule_backward(*c.op_args(c.initial_state, None, *cotangents(c)))
    return {f"grad_{name}": grad for name, grad in zip(PRIMALS, grads)}


@entry("kda::chunk_backward", "chunk", expected=oracle_gradients)
def _(c):
    *_, saved = torch.ops.kda.chunk_train(*c.op_args(c.initial_state, None), False)
    grads = torch.ops.kda.chunk_backward(*c.op_args(c.initial_state, None, *cotangents(c), saved))
    return {f"grad_{name}": grad for name, grad in zip(PRIMALS, grads)}


@entry("fla chunk_gated_delta_rule", "chunk", in_kernel=False, scalar_gate=True)
def _(c):
    return _o_state(*fla.chunk_gated_delta_rule(c.q, c.k, c.v, c.g, c.beta,
                                                initial_state=c.initial_state,
                                                output_final_state=True, **c.kwargs))  # fmt: skip


@entry("transformers chunk_delta_rule", "chunk", in_kernel=False)
def _(c):
    return _o_state(*transformers_kernels.chunk_delta_rule(
        c.q, c.k, c.v, c.g, c.beta, initial_state=c.initial_state, output_final_state=True,
        **c.kwargs))  # fmt: skip


@entry("fused_recurrent_kda", "recurrent")
def _(c):
    return _o_state(*kda_ops.fused_recurrent_kda(c.q, c.k, c.v, c.g, c.beta,
                                                 initial_state=c.initial_state,
                                                 output_final_state=True, **c.kwargs))  # fmt: skip


@entry("kda::recurrent", "recurrent")
def _(c):
    return _o_state(*torch.ops.kda.recurrent(*c.op_args(c.initial_state, None)))


@entry("fused_recurrent_kda_inplace", "recurrent")
def _(c):
    pool, slots = c.pool()
    o = kda_ops.fused_recurrent_kda_inplace(c.q, c.k, c.v, c.g, c.beta, pool, slots, **c.kwargs)
    return _o_state(o, pool[slots])


@entry("kda::recurrent_", "recurrent")
def _(c):
    pool, slots = c.pool()
    o = torch.ops.kda.recurrent_(*c.op_args(pool, slots, None))
    return _o_state(o, pool[slots])


@entry("speculative verify, commit", "recurrent", expected=drafts_committed)
def _(c):
    c = c.tokens(max(ACCEPTED))
    pool, slots = c.pool()
    o, states = speculative.verify(c.q, c.k, c.v, c.g, c.beta, pool, slots, **c.kwargs)
    speculative.commit(pool, states, torch.tensor(ACCEPTED), slots)
    return {"o": o, "states": states, "final_state": pool[slots]}


@entry("speculative commit_by_replay", "recurrent", expected=drafts_replayed)
def _(c):
    c = c.tokens(max(ACCEPTED))
    pool, slots = c.pool()
    speculative.commit_by_replay(c.q, c.k, c.v, c.g, c.beta, pool, torch.tensor(ACCEPTED),
                                 slots, **c.kwargs)  # fmt: skip
    return {"final_state": pool[slots]}


@entry("fla fused_recurrent_gated_delta_rule", "recurrent", in_kernel=False, scalar_gate=True)
def _(c):
    return _o_state(*fla.fused_recurrent_gated_delta_rule(
        c.q, c.k, c.v, g=c.g, beta=c.beta, initial_state=c.initial_state,
        output_final_state=True, **c.kwargs))  # fmt: skip


@entry("fla fused_recurrent_kda_fwd pool", "recurrent")
def _(c):
    pool, slots = c.pool()
    o, returned = fla.fused_recurrent_kda_fwd(c.q, c.k, c.v, c.g, c.beta, initial_state=pool,
                                              inplace_final_state=True, ssm_state_indices=slots,
                                              **c.kwargs)  # fmt: skip
    assert returned is pool
    return _o_state(o, pool[slots])


@entry("transformers recurrent_delta_rule", "recurrent", in_kernel=False)
def _(c):
    return _o_state(*transformers_kernels.recurrent_delta_rule(
        c.q, c.k, c.v, c.g, c.beta, initial_state=c.initial_state, output_final_state=True,
        **c.kwargs))  # fmt: skip


def _expected_dtype(key: str, call: Call) -> torch.dtype:
    """o comes back in v's dtype, h in q's, a gradient in its input's, states in the state
    dtype (float32; float64 for float64 inputs)."""
    if key.startswith("grad_"):
        return getattr(call, key.removeprefix("grad_")).dtype
    return {"o": call.v.dtype, "h": call.q.dtype}.get(key, call.initial_state.dtype)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("name", list(ENTRIES))
def test_every_entry_point_follows_the_plan(name, case, monkeypatch):
    """The entry point's plan (kda_ops.explain) is the case's; the call warns of nothing
    (off CUDA); its results have their dtypes and match the float64 recurrence."""
    entry = ENTRIES[name]
    call = make_call(case, entry.in_kernel, entry.scalar_gate)
    compute_dtype, reasons = CPU_PLANS[case, entry.kind]
    explained = kda_ops.explain(call.q, call.k, call.v, kind=entry.kind)
    assert explained == plan.DeltaRulePlan(entry.kind, "reference", compute_dtype, reasons)
    monkeypatch.setattr(plan, "_WARNED", set())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = entry.run(call)
    assert [str(w.message) for w in caught if "kda_ops" in str(w.message)] == []
    want = entry.expected(call.double())
    assert got.keys() == want.keys()
    tolerance = TOLERANCE[CASES[case][0]]
    for key, result in got.items():
        assert result.dtype == _expected_dtype(key, call), key
        assert result.shape == want[key].shape, key
        assert relative_error(result, want[key]) < tolerance, key


@pytest.mark.gpu
def test_the_chunk_op_called_directly_follows_the_plan_in_its_kernels(monkeypatch):
    """kda::chunk with fp16 runs the Triton kernels on float32 copies (once the reference,
    silently), announced once; its o is chunk_kda's. bf16 at K = 192 runs them in bf16."""
    from kda_ops.kernels.chunk import launch

    launched = []
    kernel = launch.launch_chunk_kda

    def recorded(inputs, *args, **kwargs):
        launched.append(inputs.q.dtype)
        return kernel(inputs, *args, **kwargs)

    monkeypatch.setattr(kda_ops.delta_rule_ops, "launch_chunk_kda", recorded)
    monkeypatch.setattr(plan, "_WARNED", set())
    x = delta_rule_inputs(batch=1, length=300, heads=1, value_heads=2, head_k=192,
                          head_v=64, raw_gate=True)  # fmt: skip
    g, beta, A_log, dt_bias = (t.cuda() for t in (x.g, x.beta, x.A_log, x.dt_bias))
    for dtype, computed in ((torch.float16, torch.float32), (torch.bfloat16, torch.bfloat16)):
        launched.clear()
        q, k, v = (t.cuda().to(dtype) for t in (x.q, x.k, x.v))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            o, _ = torch.ops.kda.chunk(q, k, v, g, beta, A_log, dt_bias, None, None,
                                       192**-0.5, None, True, True)  # fmt: skip
        said = [str(w.message) for w in caught if "kda_ops" in str(w.message)]
        assert said == ([f"kda_ops: {plan.FP16_IN_FP32}"] if dtype == torch.float16 else [])
        assert launched == [computed] and o.dtype == dtype
        expected, _ = kda_ops.chunk_kda(q, k, v, g, beta, use_gate_in_kernel=True, A_log=A_log,
                                        dt_bias=dt_bias, use_qk_l2norm_in_kernel=True,
                                        use_beta_sigmoid_in_kernel=True)  # fmt: skip
        assert torch.equal(o, expected)
