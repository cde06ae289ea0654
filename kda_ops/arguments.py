"""FLA's accepted argument forms, mapped onto the canonical inputs of the ``kda`` ops.

fla-core 0.6.0 accepts more spellings than the ops' schemas take: ``A_log`` of any shape
holding HV values (``[1, 1, HV, 1]``), ``dt_bias`` as ``[HV, K]``, ``A_log=None`` with a
``lower_bound``, q / k / v of different float dtypes, initial states in half precision,
beta scaled to (0, 2) (``allow_neg_eigval``), states stored V-first (``state_v_first``,
the layout of SGLang's and vLLM's pools). The public functions normalize them here, before
the argument checks, so the ops, their fakes and the kernels see one form only.
"""

from __future__ import annotations

import warnings
from typing import Optional

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import is_fake

from kda_ops import reference
from kda_ops.signature import DeltaRuleInputs, DeltaRuleOptions
from kda_ops.validation import FLOAT_DTYPES, INDEX_DTYPES, ArgumentChecker, check_delta_rule

# What FLA accepts; the kernels always run 64-token chunks, so only chunk states differ.
KDA_CHUNK_SIZES = (32, 64)


def as_vector(x: Optional[Tensor], size: int) -> Optional[Tensor]:
    """``x`` as ``[size]`` when it holds ``size`` values in any shape (FLA's ``A_log`` of
    ``[1, 1, HV, 1]``, ``dt_bias`` of ``[HV, K]``); other shapes are left to the checks."""
    if isinstance(x, Tensor) and x.dim() != 1 and x.numel() == size:
        return x.reshape(size)
    return x


def gate_tensors(
    check: ArgumentChecker,
    use_gate_in_kernel: bool,
    A_log: Optional[Tensor],
    dt_bias: Optional[Tensor],
    lower_bound: Optional[float],
    g: object,
) -> tuple[Optional[Tensor], Optional[Tensor]]:
    """``(A_log [HV], dt_bias [HV * K] or [HV])`` for a gate computed in the kernel.

    FLA lets ``A_log`` be ``None`` when ``lower_bound`` is set: the gate is then
    ``lower_bound * sigmoid(g + dt_bias)``, which is the safe gate with ``A_log = 0``.
    Without ``use_gate_in_kernel`` both pass through (the checks ignore them)."""
    if not use_gate_in_kernel or not isinstance(g, Tensor) or g.dim() not in (3, 4):
        return A_log, dt_bias
    heads = g.shape[2]
    channels = heads * (g.shape[3] if g.dim() == 4 else 1)
    if A_log is None:
        if lower_bound is None:
            check.fail(
                ValueError,
                "`use_gate_in_kernel=True` needs `A_log` of shape (HV,) unless `lower_bound` "
                "is set",
            )
        A_log = torch.zeros(heads, dtype=torch.float32, device=g.device)
    return as_vector(A_log, heads), as_vector(dt_bias, channels)


def common_dtype(q: object, k: object, v: object) -> Optional[torch.dtype]:
    """The dtype q, k and v are computed in when FLA's callers mix them (q / k in fp32 with
    v in fp16, say): the widest of the three; ``None`` when they agree or are not all
    float tensors (then the checks report what is wrong)."""
    tensors = (q, k, v)
    if not all(isinstance(x, Tensor) and x.dtype in FLOAT_DTYPES for x in tensors):
        return None
    dtypes = {x.dtype for x in tensors}
    if len(dtypes) == 1:
        return None
    widest = q.dtype
    for x in tensors[1:]:
        widest = torch.promote_types(widest, x.dtype)
    return widest


def beta_for_kernel(
    check: ArgumentChecker, beta: Tensor, use_beta_sigmoid: bool, allow_neg_eigval: bool
) -> tuple[Tensor, bool]:
    """``(beta, use_beta_sigmoid)`` for the ops. ``allow_neg_eigval`` (FLA: only with the
    sigmoid in the kernel) scales beta to (0, 2): computed here (in fp32 at least), so the
    ops get a post-sigmoid beta."""
    if not allow_neg_eigval:
        return beta, use_beta_sigmoid
    if not use_beta_sigmoid:
        check.fail(ValueError, "`allow_neg_eigval=True` requires `use_beta_sigmoid_in_kernel=True`")
    return 2 * torch.sigmoid(beta.to(torch.promote_types(beta.dtype, torch.float32))), False


def fla_inputs(
    check: ArgumentChecker,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    beta: Tensor,
    g: Tensor,
    use_gate_in_kernel: bool,
    A_log: Optional[Tensor],
    dt_bias: Optional[Tensor],
    lower_bound: Optional[float],
    use_beta_sigmoid: bool,
    allow_neg_eigval: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Optional[Tensor], Optional[Tensor], bool]:
    """FLA's accepted forms of q, k, v, the gate tensors and beta as the ops' inputs
    (:func:`common_dtype`, :func:`gate_tensors`, :func:`beta_for_kernel`): ``(q, k, v,
    beta, A_log, dt_bias, use_beta_sigmoid)``, q / k / v in one dtype."""
    dtype = common_dtype(q, k, v)
    if dtype is not None:
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    A_log, dt_bias = gate_tensors(check, use_gate_in_kernel, A_log, dt_bias, lower_bound, g)
    if isinstance(beta, Tensor):
        beta, use_beta_sigmoid = beta_for_kernel(check, beta, use_beta_sigmoid, allow_neg_eigval)
    return q, k, v, beta, A_log, dt_bias, use_beta_sigmoid


def state_v_first(
    check: ArgumentChecker, state_v_first: bool, transpose_state_layout: Optional[bool]
) -> bool:
    """``state_v_first``, with FLA's deprecated spelling ``transpose_state_layout``."""
    if transpose_state_layout is None:
        return bool(state_v_first)
    if state_v_first:
        check.fail(
            ValueError,
            "pass `state_v_first`, not both it and the deprecated `transpose_state_layout`",
        )
    warnings.warn(
        f"{check.function}: `transpose_state_layout` is deprecated, use `state_v_first`",
        DeprecationWarning,
        stacklevel=3,
    )
    return bool(transpose_state_layout)


def key_first(state: Optional[Tensor], v_first: bool) -> Optional[Tensor]:
    """A state given in the caller's layout as ``[..., K, V]`` (a view for V-first)."""
    if state is None or not v_first or not isinstance(state, Tensor) or state.dim() < 2:
        return state
    return state.transpose(-1, -2)


def caller_layout(state: Optional[Tensor], v_first: bool) -> Optional[Tensor]:
    """A ``[..., K, V]`` state returned in the caller's layout (contiguous, like FLA's)."""
    if state is None or not v_first:
        return state
    return state.transpose(-1, -2).contiguous()


def state_dtype(inputs: Tensor) -> torch.dtype:
    return torch.float64 if inputs.dtype == torch.float64 else torch.float32


def final_state_shape(q: Tensor, v: Tensor, cu_seqlens: Optional[Tensor]) -> tuple[int, ...]:
    """``[N, HV, K, V]``: the delta rule's final state shape (N sequences)."""
    n_seqs = q.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
    return (n_seqs, v.shape[2], q.shape[3], v.shape[3])


def new_final_state(q: Tensor, v: Tensor, cu_seqlens: Optional[Tensor]) -> Tensor:
    """An uninitialized final state: :func:`final_state_shape`, :func:`state_dtype`."""
    return q.new_empty(final_state_shape(q, v, cu_seqlens), dtype=state_dtype(q))


def initial_state(state: object, inputs: object) -> object:
    """FLA's callers pass fp16 / bf16 initial states too: the ops take fp32 (fp64 for fp64
    inputs); other values are left to the checks."""
    if not (isinstance(state, Tensor) and isinstance(inputs, Tensor)):
        return state
    if state.dtype in FLOAT_DTYPES and inputs.dtype in FLOAT_DTYPES:
        return state.to(state_dtype(inputs))
    return state


def chunk_size(
    check: ArgumentChecker,
    size: object,
    return_intermediate_states: bool,
    allowed: tuple[int, ...] = KDA_CHUNK_SIZES,
    family: str = "KDA",
) -> None:
    """FLA's ``chunk_size`` (KDA: 32 or 64; Gated DeltaNet: 16, 32 or 64). The results do
    not depend on it except the chunk states, which kda_ops keeps every 64 tokens."""
    if size not in allowed:
        # FLA's wording, which callers match on.
        names = (
            f"either {allowed[0]} or {allowed[1]}"
            if len(allowed) == 2
            else (", ".join(str(n) for n in allowed[:-1]) + f", or {allowed[-1]}")
        )
        check.fail(ValueError, f"`chunk_size` must be {names} for {family}, got {size}")
    if size != 64 and return_intermediate_states:
        check.fail(
            ValueError,
            "`return_intermediate_states=True` keeps the state every 64 tokens: pass "
            "`chunk_size=64`",
        )


def host_seqlens(
    check: ArgumentChecker,
    cu_seqlens_cpu: object,
    cu_seqlens: object,
    length: Optional[int] = None,
) -> None:
    """FLA's ``cu_seqlens_cpu`` (a host copy of ``cu_seqlens``, to spare a sync): checked
    for shape and kind, and its offsets (start at 0, non-decreasing, end at ``length``,
    the packed T, where given) at no sync, since they are on the host already; the
    kernels need no host copy."""
    if cu_seqlens_cpu is None:
        return
    if cu_seqlens is None:
        check.fail(ValueError, "`cu_seqlens_cpu` needs `cu_seqlens`")
    host = check.tensor("cu_seqlens_cpu", cu_seqlens_cpu, dims=1, dtypes=INDEX_DTYPES)
    if host.device.type != "cpu":
        check.fail(ValueError, f"`cu_seqlens_cpu` must be on the CPU, got {host.device}")
    if isinstance(cu_seqlens, Tensor) and host.shape != cu_seqlens.shape:
        check.fail(
            ValueError,
            f"`cu_seqlens_cpu` must have the shape of `cu_seqlens` ({tuple(cu_seqlens.shape)}), "
            f"got {tuple(host.shape)}",
        )
    if host.shape[0] < 2:
        check.fail(ValueError, "`cu_seqlens_cpu` must hold at least 2 offsets [0, ..., T]")
    if not torch.compiler.is_compiling() and not is_fake(host):
        check.offsets("cu_seqlens_cpu", host, length)


def graph_mode(
    check: ArgumentChecker, use_graph: object, max_num_seqs: object, cu_seqlens: object
) -> None:
    """FLA's ``use_graph`` / ``max_num_seqs``: accepted (kda_ops' launches are capturable
    as they are); ``max_num_seqs`` must be the number of sequences ``cu_seqlens`` holds."""
    if not isinstance(use_graph, bool):
        check.fail(TypeError, f"`use_graph` must be a bool, got {type(use_graph).__name__}")
    if max_num_seqs is None:
        return
    if isinstance(cu_seqlens, Tensor) and max_num_seqs != cu_seqlens.shape[0] - 1:
        check.fail(
            ValueError,
            f"`max_num_seqs` ({max_num_seqs}) must equal the sequences in `cu_seqlens` "
            f"({cu_seqlens.shape[0] - 1}): pad `cu_seqlens` with empty sequences",
        )


def no_context_parallel(check: ArgumentChecker, cp_context: object) -> None:
    if cp_context is not None:
        check.fail(
            ValueError,
            "`cp_context` (FLA's context parallelism) is not supported: use "
            "kda_ops.distributed.chunk_kda_cp",
        )


def resolve_scale(scale: Optional[float], head_k: int) -> float:
    """FLA's default scale, 1 / sqrt(K), when none is given."""
    return head_k**-0.5 if scale is None else float(scale)


def gate_arguments(
    function: str,
    use_gate_in_kernel: bool,
    A_log: Optional[Tensor],
    dt_bias: Optional[Tensor],
    lower_bound: Optional[float],
    safe_gate: bool = False,
) -> tuple[Optional[Tensor], Optional[Tensor], Optional[float]]:
    """The gate tensors the op sees: none unless the gate is computed in the kernel
    (FLA ignores A_log / dt_bias / lower_bound otherwise, and so do we, with a warning)."""
    if not use_gate_in_kernel:
        given = {"A_log": A_log, "dt_bias": dt_bias, "lower_bound": lower_bound}
        ignored = ", ".join(f"`{name}`" for name, value in given.items() if value is not None)
        if ignored and not torch.compiler.is_compiling():
            warnings.warn(
                f"{function}: {ignored} ignored without `use_gate_in_kernel=True` "
                "(g is then the log-decay itself, as in FLA)",
                stacklevel=4,  # the caller of the public function
            )
        return None, None, None
    if safe_gate and not (
        lower_bound is not None and reference.SAFE_GATE_LOWER_BOUND <= lower_bound < 0
    ):
        ArgumentChecker(function).fail(
            ValueError,
            f"`safe_gate=True` needs `lower_bound` in [{reference.SAFE_GATE_LOWER_BOUND}, 0), "
            f"got {lower_bound}",
        )
    return A_log, dt_bias, None if lower_bound is None else float(lower_bound)


def delta_rule_arguments(
    function: str,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    *,
    scale: Optional[float],
    use_qk_l2norm_in_kernel: bool,
    use_gate_in_kernel: bool,
    use_beta_sigmoid_in_kernel: bool,
    A_log: Optional[Tensor],
    dt_bias: Optional[Tensor],
    lower_bound: Optional[float],
    initial_state: Optional[Tensor] = None,
    cu_seqlens: Optional[Tensor] = None,
    safe_gate: bool = False,
    global_offsets: bool = False,
) -> tuple[DeltaRuleInputs, DeltaRuleOptions]:
    """Checks ``chunk_kda``-style arguments in their canonical forms (errors name
    ``function``) and resolves them into what the delta-rule ops take: the gate tensors
    only with ``use_gate_in_kernel`` (:func:`gate_arguments`), the default scale.
    ``global_offsets``: ``cu_seqlens`` spans more tokens than q holds (context
    parallelism), so its end is not checked against q's length."""
    check_delta_rule(
        function, q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound,
        use_gate_in_kernel=use_gate_in_kernel, cu_seqlens=cu_seqlens, initial_state=initial_state,
        global_offsets=global_offsets,
    )  # fmt: skip
    A_log, dt_bias, lower_bound = gate_arguments(
        function, use_gate_in_kernel, A_log, dt_bias, lower_bound, safe_gate
    )
    options = DeltaRuleOptions(
        scale=resolve_scale(scale, q.shape[-1]),
        lower_bound=lower_bound,
        use_qk_l2norm=use_qk_l2norm_in_kernel,
        use_beta_sigmoid=use_beta_sigmoid_in_kernel,
    )
    return DeltaRuleInputs(q, k, v, g, beta, A_log, dt_bias), options
