"""Which code serves a delta-rule call, and in which precision: one decision
(:func:`plan_delta_rule`) that every entry point asks, the public functions
(``chunk_kda``, ``chunk_kda_segmented``, ``chunk_kda_cp``, the integrations through them)
and the ops called directly alike.

The rules, in order (each plan names the ones it applied in ``reasons``):

1. The chunk function computes float16 inputs in float32: the chunk kernels' fp16
   intermediates (w, u, qg, kd, Aqk) missed FLA's tolerances.
2. Off CUDA the PyTorch reference is the kernel (the CPU build of every op), in the same
   compute dtype.
3. float64 inputs run the reference on any device: it is the oracle's dtype, which the
   Triton kernels (fp32 accumulation) do not compute in.
4. On CUDA without Triton the reference serves the call, much slower.

bfloat16 is computed in bfloat16 at every key width. Past 128 key columns the chunk
recurrence once returned wrong states in the training forward's 64-token steps at 32 value
columns; a kernel of that loop with no kda_ops code is wrong the same way on an H100 with
Triton 3.6 (``tools/triton_repro_32cols.py``,
``benchmarks/results/triton_repro_32cols_h100.log``), and the 16-bit scans past 128 key
columns never take 32 columns
(``kernels.chunk.planning.scan_column_splits``). So planned, the head-dim matrix's bf16
cells at K = 192 and 256 pass forward and backward
(``benchmarks/results/head_dim_matrix_wide_bf16_h100.jsonl``), and the forward takes a
fortieth of the time it took computed in float32 (``benchmarks/results/wide_keys_h100.json``).

On CUDA, rules 1 and 4 give a slower path than the inputs ask for: the first call that
takes one warns, once per rule, naming the reason. :func:`explain` returns the plan
for given inputs without running anything. :func:`support_matrix` asks :func:`decide` for
every kind, device, dtype, key width and Triton install, and
:func:`render_support_matrix` makes that a Markdown table (the README's and
docs/api.md's, which ``tools/support_matrix.py`` rewrites).
"""

import dataclasses
import itertools
import warnings
from typing import Literal, Optional

import torch
from torch import Tensor

from kda_ops import kernels
from kda_ops.validation import MAX_HEAD_DIM

Kind = Literal["chunk", "recurrent"]
Implementation = Literal["triton", "reference"]

FP16_IN_FP32 = (
    "float16 chunk inputs are computed in float32 (fp16 intermediates miss FLA's tolerances)"
)
NO_TRITON = "Triton is not installed: the PyTorch reference serves CUDA inputs (much slower)"
FLOAT64 = "float64 inputs run the PyTorch reference (the oracle's dtype)"
OFF_CUDA = "off CUDA the PyTorch reference is the kernel"
TRAIN_OP_DTYPE = (
    "kda::chunk_train called directly with inputs the chunk kernels compute in another dtype "
    "runs the PyTorch reference (chunk_kda converts them first)"
)
# The rules that make a call slower or less precise than its inputs ask for.
WARNED = (FP16_IN_FP32, NO_TRITON, TRAIN_OP_DTYPE)


@dataclasses.dataclass(frozen=True)
class DeltaRulePlan:
    """How a delta-rule call runs: ``implementation`` ("triton": the CUDA kernels;
    "reference": the PyTorch reference), ``compute_dtype`` (the dtype q, k and v are
    computed in; o comes back in v's dtype), and the rules that decided it (``reasons``,
    the module docstring's wording)."""

    kind: Kind
    implementation: Implementation
    compute_dtype: torch.dtype
    reasons: tuple[str, ...] = ()


def plan_delta_rule(q: Tensor, kind: Kind, dtype: Optional[torch.dtype] = None) -> DeltaRulePlan:
    """The plan of a ``kind`` call ("chunk": the chunked forward and backward;
    "recurrent": the token recurrence, which computes in fp32 whatever its inputs) on q
    ``[B, T, H, K]``, whose device and key columns it reads, and q, k and v in ``dtype``
    (default q's: the public functions' common dtype)."""
    dtype = q.dtype if dtype is None else dtype
    return decide(kind, q.device.type, dtype, q.shape[-1], kernels.AVAILABLE)


def decide(kind: Kind, device_type: str, dtype: torch.dtype, head_k: int,
           triton_available: bool) -> DeltaRulePlan:  # fmt: skip
    """The rules (module docstring) as a pure function of what they read. The chunk
    function's compute dtype is the same on every device (the CPU reference computes what
    the CUDA kernels would), so that a call gives one result wherever it runs."""
    compute, reasons = dtype, ()
    if kind == "chunk" and dtype == torch.float16:
        compute, reasons = torch.float32, (FP16_IN_FP32,)
    if device_type != "cuda":
        return DeltaRulePlan(kind, "reference", compute, (OFF_CUDA, *reasons))
    if dtype == torch.float64:
        return DeltaRulePlan(kind, "reference", dtype, (FLOAT64,))
    if not triton_available:
        return DeltaRulePlan(kind, "reference", compute, (NO_TRITON, *reasons))
    return DeltaRulePlan(kind, "triton", compute, reasons)


_WARNED: set[str] = set()


def warned_reasons(plan: DeltaRulePlan) -> tuple[str, ...]:
    """The reasons of ``plan`` that :func:`announce` warns of (once each): those that give
    a slower or less precise path than the inputs ask for (``WARNED``), not off CUDA (where
    the reference is the kernel by design)."""
    if OFF_CUDA in plan.reasons:
        return ()
    return tuple(reason for reason in plan.reasons if reason in WARNED)


def announce(plan: DeltaRulePlan) -> None:
    """Warns once per rule where ``plan`` takes a slower or less precise path than its
    inputs ask for (:func:`warned_reasons`). Not while tracing (the plan of a traced call
    is the one its eager calls announce)."""
    if torch.compiler.is_compiling():
        return
    for reason in warned_reasons(plan):
        if reason not in _WARNED:
            _WARNED.add(reason)
            warnings.warn(f"kda_ops: {reason}", stacklevel=3)


def compute_inputs(q: Tensor, k: Tensor, v: Tensor, kind: Kind) -> tuple[Tensor, Tensor, Tensor]:
    """q, k and v (one dtype) in the plan's compute dtype, the plan announced."""
    plan = plan_delta_rule(q, kind)
    announce(plan)
    if plan.compute_dtype != q.dtype:
        q, k, v = q.to(plan.compute_dtype), k.to(plan.compute_dtype), v.to(plan.compute_dtype)
    return q, k, v


def explain(q: Tensor, k: Optional[Tensor] = None, v: Optional[Tensor] = None,
            kind: Kind = "chunk") -> DeltaRulePlan:  # fmt: skip
    """The plan ``kda_ops.chunk_kda`` (``kind="chunk"``) or ``fused_recurrent_kda``
    (``"recurrent"``) follows for these q, k, v ``[B, T, H, K]`` / ``[B, T, HV, V]``
    (mixed dtypes are computed in the widest, as the functions do); nothing runs."""
    if kind not in ("chunk", "recurrent"):
        raise ValueError(f'explain: `kind` must be "chunk" or "recurrent", got {kind!r}')
    dtype = q.dtype
    for tensor in (k, v):
        if tensor is not None:
            dtype = torch.promote_types(dtype, tensor.dtype)
    return plan_delta_rule(q, kind, dtype)


# The axes of the support matrix: every value decide() reads. Any device but CUDA is "cpu".
KINDS: tuple[Kind, ...] = ("chunk", "recurrent")
DEVICE_TYPES = ("cuda", "cpu")
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


@dataclasses.dataclass(frozen=True)
class SupportRow:
    """One cell of the support matrix: the plan :func:`decide` gives a ``kind`` call on
    ``device_type`` with q, k, v in ``dtype``, every key width in ``key_dims`` (a range
    within 1..MAX_HEAD_DIM) and Triton installed or not."""

    kind: Kind
    device_type: str
    dtype: torch.dtype
    key_dims: range
    triton_available: bool
    plan: DeltaRulePlan


def key_dim_bands(dtype: torch.dtype) -> tuple[range, ...]:
    """The key widths 1..MAX_HEAD_DIM cut where :func:`decide`'s plan for ``dtype`` changes
    with K for some kind, device or Triton install (asked at every K, so that the bands are
    the rules' and not a copy of their thresholds)."""
    others = list(itertools.product(KINDS, DEVICE_TYPES, (True, False)))

    def plans(head_k: int) -> list[DeltaRulePlan]:
        return [decide(kind, device, dtype, head_k, triton) for kind, device, triton in others]

    bands, start = [], 1
    for head_k in range(2, MAX_HEAD_DIM + 1):
        if plans(head_k) != plans(head_k - 1):
            bands.append(range(start, head_k))
            start = head_k
    bands.append(range(start, MAX_HEAD_DIM + 1))
    return tuple(bands)


def support_matrix() -> list[SupportRow]:
    """:func:`decide`'s plan for every kind, device ("cuda", or "cpu" for any other),
    dtype (``DTYPES``), band of key widths (:func:`key_dim_bands`) and Triton install, in
    that order of nesting."""
    rows = []
    for kind, device, dtype in itertools.product(KINDS, DEVICE_TYPES, DTYPES):
        for key_dims, triton in itertools.product(key_dim_bands(dtype), (True, False)):
            decided = decide(kind, device, dtype, key_dims[0], triton)
            rows.append(SupportRow(kind, device, dtype, key_dims, triton, decided))
    return rows


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _column_name(dtype: torch.dtype, key_dims: range) -> str:
    low, high = key_dims[0], key_dims[-1]
    if (low, high) == (1, MAX_HEAD_DIM):
        return _dtype_name(dtype)
    if low == 1:
        return f"{_dtype_name(dtype)}, K ≤ {high}"
    if high == MAX_HEAD_DIM:
        return f"{_dtype_name(dtype)}, K > {low - 1}"
    return f"{_dtype_name(dtype)}, {low - 1} < K ≤ {high}"


def render_support_matrix() -> str:
    """:func:`support_matrix` as Markdown: a row per kind, device and Triton install (one for
    both installs where they agree), a column per dtype and band of key widths, each cell
    the implementation and the compute dtype, the numbers of its reasons and "warns" where
    the call warns (:func:`warned_reasons`); then the reasons, numbered. Ends with a
    newline."""
    rows = support_matrix()
    columns = list(dict.fromkeys((row.dtype, row.key_dims) for row in rows))
    plans: dict[tuple[Kind, str, bool], list[DeltaRulePlan]] = {}  # a row's, column by column
    for row in rows:
        plans.setdefault((row.kind, row.device_type, row.triton_available), []).append(row.plan)
    reasons: dict[str, int] = {}

    def cell(plan: DeltaRulePlan) -> str:
        notes = [str(reasons.setdefault(reason, len(reasons) + 1)) for reason in plan.reasons]
        notes += ["warns"] if warned_reasons(plan) else []
        text = f"{plan.implementation}, {_dtype_name(plan.compute_dtype)}"
        return text + (f" ({', '.join(notes)})" if notes else "")

    lines = [
        "| kind | device | Triton | " + " | ".join(_column_name(*c) for c in columns) + " |",
        "| --- " * (3 + len(columns)) + "|",
    ]
    for kind, device in itertools.product(KINDS, DEVICE_TYPES):
        installed, missing = plans[kind, device, True], plans[kind, device, False]
        if installed == missing:
            installs = [("either", installed)]
        else:
            installs = [("installed", installed), ("not installed", missing)]
        for install, row_plans in installs:
            device_name = "CUDA" if device == "cuda" else "CPU"
            lines.append(f"| {kind} | {device_name} | {install} | "
                         + " | ".join(cell(plan) for plan in row_plans) + " |")  # fmt: skip
    lines.append("")
    lines += [f"{number}. {reason}." for reason, number in reasons.items()]
    return "\n".join(lines) + "\n"
