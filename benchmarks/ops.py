"""Kernel benchmarks against flash-linear-attention (fla-core 0.6.0) and, for the chunk
forward, FlashKDA where ``flash_kda`` imports, all in the same process, in ``--rounds``
rounds of rotated order (median and spread over the rounds). The chunk forward and the
training step are timed eagerly and as the same call captured once in a CUDA graph and
replayed; each library's forward output is checked against the float64 reference
(``kda_ops.reference``).

Usage (GPU): ``python benchmarks/ops.py [--only chunk96 conv ...] [--rounds 3]
[--shared-machine | --no-shared-machine] [--out benchmarks/results/ops.json]``. Without a
GPU (or with ``--tiny``) the chunk forward cases run on tiny shapes, kda-ops only on CPU:
a check of the plumbing, not of the kernels.
"""

import argparse
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from harness import (
    capture_graph,
    copy_bandwidth_tbs,
    cpu_time_ms,
    import_fla_chunk_kda,
    import_flash_kda,
    relative_error,
    rotated_rounds,
    time_ms,
)
from results import Results, add_arguments, row

import kda_ops
from kda_ops import reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
LOWER_BOUND = -5.0
VARLEN = [0, 100, 300, 1200, 3000, 4096, 8192]  # the lengths, 8192 tokens in all
REFERENCE_HEADS = 2  # the float64 reference runs on the first heads only
NAMES = {"kda-ops": "kda-ops", "fla": "FLA", "flash_kda": "FlashKDA"}


def varlen_bounds(length: int) -> list[int]:
    """``cu_seqlens`` of the issue's varlen lengths (``VARLEN``) scaled to ``length`` tokens."""
    return [bound * length // VARLEN[-1] for bound in VARLEN]


def varlen_cu_seqlens(length: int) -> torch.Tensor:
    """``varlen_bounds(length)`` as the int32 ``cu_seqlens`` tensor the ops take."""
    return torch.tensor(varlen_bounds(length), device=DEVICE, dtype=torch.int32)


def kda_inputs(batch, length, heads, dim=128, dtype=torch.bfloat16):
    def rand(*shape, dtype=dtype):
        return torch.randn(*shape, device=DEVICE, dtype=dtype)

    return dict(
        q=rand(batch, length, heads, dim), k=rand(batch, length, heads, dim),
        v=rand(batch, length, heads, dim), g=rand(batch, length, heads, dim),
        beta=rand(batch, length, heads),
        A_log=torch.zeros(heads, device=DEVICE), dt_bias=torch.zeros(heads * dim, device=DEVICE),
    )  # fmt: skip


IN_KERNEL = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                 use_beta_sigmoid_in_kernel=True, lower_bound=LOWER_BOUND)  # fmt: skip


def chunk_options(lower_bound: float | None) -> dict:
    """``IN_KERNEL`` with ``lower_bound`` (None: Kimi Linear's softplus gate) and FLA's
    ``safe_gate`` hint wherever there is a bound, so that FLA runs its safe-gate path
    (kda-ops picks its kernels from ``lower_bound`` and ignores the hint)."""
    return dict(IN_KERNEL, lower_bound=lower_bound, safe_gate=lower_bound is not None)


@dataclass
class Settings:
    rounds: int = 3
    final_state: bool = False
    graph: bool = True
    tiny: bool = False
    fla_chunk_kda: Callable | None = None
    flash_kda: object = None
    results: Results | None = None
    timer: Callable = field(default=time_ms)
    libraries: list[str] = field(default_factory=lambda: ["kda-ops"])  # the table's columns


# ----------------------------------------------------------------------------------------
# Measuring and printing


def fmt_spread(values: list[float] | None) -> str:
    if not values:
        return "-"
    return f"{statistics.median(values):.1f} [{min(values):.1f}–{max(values):.1f}]"


def print_header(libraries: list[str]) -> None:
    peers = [name for name in libraries if name != "kda-ops"]
    cells = " | ".join(f"{NAMES[name]} µs" for name in libraries)
    ratios = "".join(f" kda-ops / {NAMES[name]} |" for name in peers)
    print(f"\n| case | timing | {cells} |{ratios} kda-ops TB/s |")
    print("| --- | --- |" + " ---: |" * (2 * len(libraries)), flush=True)


def measure(case: str, timing: str, calls: dict[str, Callable], s: Settings,
            bytes_moved: int = 0, timer: Callable | None = None,
            **extra) -> dict[str, list[float]]:  # fmt: skip
    """Times ``calls`` (library -> callable) in rotated rounds, prints the row (median
    [min–max] µs over rounds) and adds a results row per library. ``timing`` is "eager"
    or "CUDA graph"."""
    errors: dict[str, str] = {}
    times = rotated_rounds(calls, s.rounds, timer or s.timer, errors)
    us = {name: [ms * 1e3 for ms in values] for name, values in times.items()}
    metric = "time" if timing == "eager" else "time_cuda_graph"
    rows = [row(case, name, metric, values, "us", timing=timing, bytes_moved=bytes_moved,
                **extra) for name, values in us.items()]  # fmt: skip
    rows += [{"case": case, "library": name, "metric": metric, "error": error, **extra}
             for name, error in errors.items()]  # fmt: skip
    if s.results is not None:
        s.results.add(rows)
    libraries = s.libraries
    median = {name: row_["median"] for name, row_ in zip(us, rows)}
    cells = " | ".join(fmt_spread(us.get(name)) if name not in errors else "failed"
                       for name in libraries)  # fmt: skip
    ratios = "".join(
        f" {median['kda-ops'] / median[name]:.2f}x |" if "kda-ops" in median and name in median
        else " - |" for name in libraries if name != "kda-ops"
    )  # fmt: skip
    bandwidth = "-"
    if bytes_moved and "kda-ops" in median:
        bandwidth = f"{bytes_moved / (median['kda-ops'] * 1e-6) / 1e12:.2f}"
    print(f"| {case} | {timing} | {cells} |{ratios} {bandwidth} |", flush=True)
    for name, error in errors.items():
        print(f"    {NAMES.get(name, name)} {timing} failed: {error[:300]}", flush=True)
    return us


# ----------------------------------------------------------------------------------------
# Chunk forward: kda-ops, FLA, FlashKDA


def chunk_calls(x: dict, options: dict, s: Settings, cu_seqlens=None,
                graph: bool = False) -> dict[str, Callable]:  # fmt: skip
    """library -> a call of its chunk forward on ``x`` returning o. Buffers, dtype and layout
    conversions (FlashKDA's int64 offsets, ``[H, K]`` dt_bias, its output and its
    ``[N, H, V, K]`` final state) are made here, outside the timed calls. ``graph``: the
    calls as captured into a CUDA graph (FLA's ``use_graph`` mode for packed sequences)."""
    fixed = dict(options, output_final_state=s.final_state, cu_seqlens=cu_seqlens)
    calls = {"kda-ops": lambda: kda_ops.chunk_kda(**x, **fixed)[0]}
    if s.fla_chunk_kda is not None and x["q"].is_cuda:
        peer = s.fla_chunk_kda
        fla_options = dict(fixed)
        if graph and cu_seqlens is not None:
            fla_options.update(use_graph=True, max_num_seqs=len(cu_seqlens) - 1)
        calls["fla"] = lambda: peer(**x, **fla_options)[0]
    if s.flash_kda is not None and x["q"].is_cuda and flash_kda_supports(x, options):
        calls["flash_kda"] = flash_kda_call(s.flash_kda, x, options, cu_seqlens, s.final_state)
    return calls


def flash_kda_supports(x: dict, options: dict) -> bool:
    """FlashKDA's contract: bf16, K = V = 128, no grouped value heads, and always the safe
    gate (lower bound in [-5, 0]), l2norm and beta sigmoid."""
    q, v = x["q"], x["v"]
    bound = options.get("lower_bound")
    return (q.dtype == torch.bfloat16 and q.shape[-1] == v.shape[-1] == 128
            and q.shape[2] == v.shape[2] and bound is not None and -5.0 <= bound <= 0.0
            and options["use_qk_l2norm_in_kernel"] and options["use_gate_in_kernel"]
            and options["use_beta_sigmoid_in_kernel"])  # fmt: skip


def flash_kda_call(flash_kda, x: dict, options: dict, cu_seqlens, final_state: bool):
    q, v = x["q"], x["v"]
    heads, dim = q.shape[2], q.shape[3]
    sequences = q.shape[0] if cu_seqlens is None else len(cu_seqlens) - 1
    out = torch.empty_like(v)
    dt_bias = x["dt_bias"].view(heads, dim)  # FlashKDA's [H, K]: the same memory
    offsets = None if cu_seqlens is None else cu_seqlens.to(torch.int64)
    # FlashKDA's final state is [N, H, V, K] (ours and FLA's [N, H, K, V]): written in its
    # own layout, never transposed in the timed call.
    state = (torch.empty(sequences, heads, v.shape[3], dim, device=q.device) if final_state
             else None)  # fmt: skip

    def call():
        flash_kda.fwd(q, x["k"], v, x["g"], x["beta"], dim**-0.5, out, A_log=x["A_log"],
                      dt_bias=dt_bias, lower_bound=options["lower_bound"], initial_state=None,
                      final_state=state, cu_seqlens=offsets)  # fmt: skip
        return out

    return call


def reference_output(x: dict, options: dict, cu_seqlens) -> torch.Tensor:
    """The float64 reference's o on the first ``REFERENCE_HEADS`` heads."""
    heads, dim = min(REFERENCE_HEADS, x["q"].shape[2]), x["q"].shape[3]
    part = {name: (t[: heads * dim] if name == "dt_bias" else t[:heads] if t.dim() == 1
                   else t[:, :, :heads]).double() for name, t in x.items()}  # fmt: skip
    o, _ = reference.delta_rule(
        reference.chunk_delta_rule, part["q"], part["k"], part["v"], part["g"], part["beta"],
        part["A_log"], part["dt_bias"], None, cu_seqlens, dim**-0.5, options["lower_bound"],
        options["use_qk_l2norm_in_kernel"], options["use_beta_sigmoid_in_kernel"],
    )  # fmt: skip
    return o


def accuracy(case: str, calls: dict[str, Callable], x: dict, options: dict, cu_seqlens,
             s: Settings, **extra) -> None:  # fmt: skip
    """Each library's o against the float64 reference on the first heads (FLA's metric,
    ||o - ref|| / ||ref||), printed and added as rows."""
    want = reference_output(x, options, cu_seqlens)
    heads = want.shape[2]
    rows, cells = [], []
    for name, call in calls.items():
        try:
            got = call()[:, :, :heads]
        except Exception as error:
            rows.append({"case": case, "library": name, "metric": "o_error_vs_float64",
                         "error": repr(error), **extra})  # fmt: skip
            cells.append(f"{NAMES[name]} failed")
            continue
        error = relative_error(got, want)
        rows.append(row(case, name, "o_error_vs_float64", [error], "relative",
                        heads=heads, **extra))  # fmt: skip
        cells.append(f"{NAMES[name]} {error:.2e}")
    if s.results is not None:
        s.results.add(rows)
    print(f"    o vs float64 ({heads} heads): " + ", ".join(cells), flush=True)


def chunk_case(case: str, x: dict, options: dict, s: Settings, cu_seqlens=None,
               **extra) -> dict[str, list[float]]:  # fmt: skip
    """Eager, CUDA graph and accuracy of the chunk forward on ``x``; returns the eager µs."""
    nbytes = 5 * x["q"].numel() * x["q"].element_size()  # q, k, v, g in, o out
    extra = dict(extra, lower_bound=options["lower_bound"], final_state=s.final_state)
    with torch.no_grad():
        calls = chunk_calls(x, options, s, cu_seqlens)
        eager = measure(case, "eager", calls, s, nbytes, **extra)
        if s.graph and x["q"].is_cuda:
            graphed = chunk_calls(x, options, s, cu_seqlens, graph=True)
            measure_replays(case, graphed, s, nbytes, **extra)
        accuracy(case, calls, x, options, cu_seqlens, s, **extra)
    return eager


def measure_replays(case: str, calls: dict[str, Callable], s: Settings, bytes_moved: int = 0,
                    **extra) -> None:  # fmt: skip
    """Captures each of ``calls`` into its own CUDA graph and times the replays
    (``measure``'s "CUDA graph" row: device time without host dispatch). A library whose
    call does not capture (a host sync inside it, say on ``cu_seqlens``) is reported and
    recorded with its error instead; the graphs' memory pools are freed afterwards."""
    replays, errors = {}, {}
    for name, call in calls.items():
        try:
            replays[name] = capture_graph([call])
        except Exception as error:
            errors[name] = repr(error)
    if replays:
        measure(case, "CUDA graph", replays, s, bytes_moved, **extra)
    for name, error in errors.items():
        print(f"    {NAMES[name]} does not capture: {error[:300]}", flush=True)
        if s.results is not None:
            s.results.add({"case": case, "library": name, "metric": "time_cuda_graph",
                           "error": error, **extra})  # fmt: skip


def tiny_shape(s: Settings, length: int, heads: int, dim: int = 128) -> tuple[int, int, int]:
    """``(T, H, D)``; with ``tiny``: T = 256, D = 32 and H / 32 heads (at least one)."""
    return (256, max(1, heads // 32), 32) if s.tiny else (length, heads, dim)


def bench_chunk(s: Settings, heads: int, length: int = 8192, dim: int = 128,
                lower_bound=LOWER_BOUND) -> None:  # fmt: skip
    """Forward; ``lower_bound=None`` is Kimi Linear's unbounded softplus gate."""
    length, heads, dim = tiny_shape(s, length, heads, dim)
    x = kda_inputs(1, length, heads, dim)
    gate = ", softplus gate" if lower_bound is None else f", lower bound {lower_bound}"
    case = f"chunk_kda fwd B=1 T={length} H={heads} D={dim} bf16{gate}"
    chunk_case(case, x, chunk_options(lower_bound), s, batch=1, T=length, H=heads, D=dim)


def bench_chunk_varlen(s: Settings, heads: int = 96, dim: int = 128) -> None:
    """Packed sequences of the issue's lengths, filled up to the same 8192 tokens."""
    length, heads, dim = tiny_shape(s, VARLEN[-1], heads, dim)
    bounds = varlen_bounds(length)
    cu_seqlens = varlen_cu_seqlens(length)
    x = kda_inputs(1, length, heads, dim)
    case = f"chunk_kda fwd varlen {len(bounds) - 1} seqs, {length} tokens, H={heads} D={dim} bf16"
    chunk_case(case, x, chunk_options(LOWER_BOUND), s, cu_seqlens, batch=1, T=length, H=heads,
               D=dim, seqlens=bounds)  # fmt: skip


# ----------------------------------------------------------------------------------------
# The other kernels: kda-ops against FLA (CUDA only)


def bench_decode(s: Settings, batch=256, heads=32, dim=128) -> None:
    from fla.ops.kda import fused_recurrent_kda as fla_fused_recurrent_kda

    x = kda_inputs(batch, 1, heads, dim)
    state = torch.randn(batch, heads, dim, dim, device=DEVICE)
    pool = state.clone()
    state_bytes = 2 * state.numel() * 4
    case = f"decode B={batch} H={heads} D={dim} fp32 state"
    ours = {
        "functional": lambda: kda_ops.fused_recurrent_kda(
            **x, initial_state=state, output_final_state=True, **IN_KERNEL),
        "in-place pool": lambda: kda_ops.fused_recurrent_kda_inplace(
            **x, state_pool=pool, **IN_KERNEL),
    }  # fmt: skip

    def peer():
        return fla_fused_recurrent_kda(**x, initial_state=state, output_final_state=True,
                                       **IN_KERNEL)  # fmt: skip

    for label, call in ours.items():
        measure(f"{case} ({label})", "eager", {"kda-ops": call, "fla": peer}, s, state_bytes)


def bench_gated_norm(s: Settings, tokens=8192, heads=32, dim=128) -> None:
    """Eager (host dispatch included) and in a CUDA graph (kernel time; 200 MB a call,
    past L2)."""
    from fla.modules.fused_norm_gate import rms_norm_gated as fla_rms_norm_gated

    x, gate = torch.randn(2, tokens, heads, dim, device=DEVICE, dtype=torch.bfloat16).unbind(0)
    weight = torch.ones(dim, device=DEVICE)
    nbytes = 3 * x.numel() * x.element_size()
    calls = {
        "kda-ops": lambda: kda_ops.gated_rms_norm(x, gate, weight, 1e-5, "sigmoid"),
        "fla": lambda: fla_rms_norm_gated(x, gate, weight, None, activation="sigmoid", eps=1e-5),
    }
    case = f"gated RMSNorm T={tokens} H={heads} D={dim} bf16"
    measure(case, "eager", calls, s, nbytes)
    replays = {name: capture_graph([call]) for name, call in calls.items()}
    measure(case, "CUDA graph", replays, s, nbytes)


def bench_conv_update(s: Settings, batch=256, channels=3 * 32 * 128, width=4, copies=4) -> None:
    """Eager (host dispatch included) and in a CUDA graph over ``copies`` input sets (kernel
    time; 50 MB a call, so four sets pass L2)."""
    from fla.modules.causal_conv1d.ops import causal_conv1d_update as fla_conv_update

    sets = []
    for _ in range(copies):
        x = torch.randn(batch, channels, device=DEVICE, dtype=torch.bfloat16)
        pool = torch.randn(batch, channels, width - 1, device=DEVICE, dtype=torch.bfloat16)
        fla_cache = torch.randn(batch, channels, width, device=DEVICE, dtype=torch.bfloat16)
        sets.append((x, pool, fla_cache))
    weight = torch.randn(channels, width, device=DEVICE, dtype=torch.bfloat16)
    nbytes = 2 * sets[0][1].numel() * 2 + 2 * sets[0][0].numel() * 2
    ours = [lambda x=x, pool=pool: kda_ops.causal_conv1d_update_inplace(x, pool, weight)
            for x, pool, _ in sets]  # fmt: skip
    peer = [lambda x=x, cache=cache: fla_conv_update(x, cache, weight=weight, activation="silu")
            for x, _, cache in sets]  # fmt: skip
    case = f"conv update B={batch} D={channels} W={width} bf16"
    measure(case, "eager", {"kda-ops": ours[0], "fla": peer[0]}, s, nbytes)
    replays = {"kda-ops": capture_graph(ours), "fla": capture_graph(peer)}
    # one replay runs the op on each of the copies: per-call time is a replay's / copies
    measure(case, "CUDA graph", replays, s, nbytes, timer=lambda fn: s.timer(fn) / copies)


def bench_conv_prefill(s: Settings, length=8192, channels=32 * 128, width=4) -> None:
    """One q/k/v short conv of the hybrid model's prefill, from a state (as the model calls
    it) and from none, eager (host dispatch included) and in a CUDA graph (kernel time; 134
    MB a call, past L2); FLA's Triton backend, whose state keeps W inputs where ours keeps
    W - 1."""
    from fla.modules.causal_conv1d.ops import causal_conv1d as fla_causal_conv1d

    x = torch.randn(1, length, channels, device=DEVICE, dtype=torch.bfloat16)
    weight = torch.randn(channels, width, device=DEVICE, dtype=torch.bfloat16)
    state = torch.randn(1, channels, width - 1, device=DEVICE, dtype=torch.bfloat16)
    fla_state = torch.nn.functional.pad(state, (1, 0))
    for ours_state, peer_state, label in ((state, fla_state, "state"), (None, None, "no state")):

        def ours(initial=ours_state):
            return kda_ops.causal_conv1d(x, weight, initial_state=initial, activation="silu")

        def peer(initial=peer_state):
            return fla_causal_conv1d(x, weight, initial_state=initial, output_final_state=True,
                                     activation="silu", backend="triton")  # fmt: skip

        case = f"conv prefill B=1 T={length} D={channels} W={width} bf16, {label}"
        nbytes = 2 * x.numel() * x.element_size()
        calls = {"kda-ops": ours, "fla": peer}
        measure(case, "eager", calls, s, nbytes)
        replays = {name: capture_graph([call]) for name, call in calls.items()}
        measure(case, "CUDA graph", replays, s, nbytes)


def peak_gib(step: Callable[[], object]) -> float:
    """Peak memory of one ``step()`` beyond what is allocated before it, GiB."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**30


def bench_chunk_backward(s: Settings, heads=64, length=8192, dim=128, lower_bound=LOWER_BOUND,
                         disable_recompute=False, varlen=False) -> None:  # fmt: skip
    """Training step of one layer: forward + backward of every input (gate, beta and
    l2norm in the kernel), timed eagerly and replayed from a CUDA graph (forward and
    backward captured together), and with the peak memory each allocates;
    ``lower_bound=None`` is Kimi Linear's softplus gate; ``disable_recompute`` is passed
    to both (each keeps its forward's intermediates for its backward); ``varlen`` packs
    the forward's varlen lengths (``VARLEN``) into the ``length`` tokens."""
    x = kda_inputs(1, length, heads, dim)
    options = dict(chunk_options(lower_bound), disable_recompute=disable_recompute)
    if varlen:
        options["cu_seqlens"] = varlen_cu_seqlens(length)
    leaves = [t.requires_grad_() for t in x.values()]
    grad_o = torch.randn_like(x["v"])

    def train_step(chunk_kda):
        def step():
            o, _ = chunk_kda(**x, **options)
            return torch.autograd.grad(o, leaves, grad_o, allow_unused=True)

        return step

    steps = {"kda-ops": train_step(kda_ops.chunk_kda), "fla": train_step(s.fla_chunk_kda)}
    gate = ", softplus gate" if lower_bound is None else ""
    gate += ", disable_recompute" if disable_recompute else ""
    packed = f" varlen {len(VARLEN) - 1} seqs" if varlen else ""
    case = f"chunk_kda fwd+bwd{packed} B=1 T={length} H={heads} D={dim} bf16{gate}"
    measure(case, "eager", steps, s)  # also the warm-up (compile, autotune)
    if s.graph:
        measure_replays(case, steps, s)
    peaks = {name: peak_gib(step) for name, step in steps.items()}
    if s.results is not None:
        s.results.add([row(case, name, "peak_memory", [gib], "GiB")
                       for name, gib in peaks.items()])  # fmt: skip
    print(f"    peak GiB above the inputs: kda-ops {peaks['kda-ops']:.2f} / "
          f"FLA {peaks['fla']:.2f}", flush=True)  # fmt: skip


# ----------------------------------------------------------------------------------------
# Gated DeltaNet (one decay a head): kda-ops against FLA's chunk_gated_delta_rule


def gdn_inputs(batch, length, heads, value_heads, dim=128, dtype=torch.bfloat16):
    """Qwen3-Next's layer core: q, k ``[B, T, H, D]``, v ``[B, T, HV, D]``, a raw scalar
    gate and beta ``[B, T, HV]``; A_log and dt_bias ``[HV]`` for the in-kernel gate."""

    def rand(*shape, dtype=dtype):
        return torch.randn(*shape, device=DEVICE, dtype=dtype)

    return dict(
        q=rand(batch, length, heads, dim), k=rand(batch, length, heads, dim),
        v=rand(batch, length, value_heads, dim), g=rand(batch, length, value_heads),
        beta=rand(batch, length, value_heads),
        A_log=torch.rand(value_heads, device=DEVICE) * 2.0 - 1.0,
        dt_bias=rand(value_heads, dtype=torch.float32),
    )  # fmt: skip


GDN_OPTIONS = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                   use_beta_sigmoid_in_kernel=True)  # fmt: skip


def fla_chunk_gdn():
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    return chunk_gated_delta_rule


def gdn_reference_output(x: dict) -> torch.Tensor:
    """The float64 reference's o on the first value head's group (one q/k head)."""
    group = x["v"].shape[2] // x["q"].shape[2]
    part = {name: (t[:group] if t.dim() == 1 else t[:, :, :1] if name in ("q", "k")
                   else t[:, :, :group]).double() for name, t in x.items()}  # fmt: skip
    o, _ = kda_ops.chunk_kda(**part, **GDN_OPTIONS)
    return o


def bench_gdn(s: Settings, batch=1, length=32768, heads=16, value_heads=32, dim=128) -> None:
    """Forward, eager and replayed from a CUDA graph, and o against float64."""
    x = gdn_inputs(batch, length, heads, value_heads, dim)
    peer = fla_chunk_gdn()
    calls = {"kda-ops": lambda: kda_ops.chunk_kda(**x, **GDN_OPTIONS)[0],
             "fla": lambda: peer(**x, **GDN_OPTIONS)[0]}  # fmt: skip
    case = f"gdn fwd B={batch} T={length} H={heads} HV={value_heads} D={dim} bf16"
    nbytes = (2 * x["q"].numel() + 2 * x["v"].numel()) * 2  # q, k, v in, o out
    extra = dict(batch=batch, T=length, H=heads, HV=value_heads, D=dim)
    with torch.no_grad():
        measure(case, "eager", calls, s, nbytes, **extra)
        if s.graph:
            measure_replays(case, calls, s, nbytes, **extra)
        want = gdn_reference_output(x)
        group = want.shape[2]
        rows = [row(case, name, "o_error_vs_float64", [relative_error(call()[:, :, :group],
                                                                      want)], "relative")
                for name, call in calls.items()]  # fmt: skip
    if s.results is not None:
        s.results.add(rows)
    print("    o vs float64: " + ", ".join(f"{r['library']} {r['median']:.2e}" for r in rows))


def bench_gdn_training(s: Settings, batch=1, length=32768, heads=16, value_heads=32,
                       dim=128) -> None:  # fmt: skip
    """Training step (forward + backward of every input), eager and replayed, with its
    peak memory. fla-core 0.6.0 refuses GDN training on Hopper with Triton 3.4-3.7.0
    (FLA #640): its row then records the refusal."""
    x = gdn_inputs(batch, length, heads, value_heads, dim)
    leaves = [t.requires_grad_() for t in x.values()]
    grad_o = torch.randn_like(x["v"])
    peer = fla_chunk_gdn()

    def train_step(chunk):
        def step():
            o, _ = chunk(**x, **GDN_OPTIONS)
            return torch.autograd.grad(o, leaves, grad_o, allow_unused=True)

        return step

    steps = {"kda-ops": train_step(kda_ops.chunk_kda), "fla": train_step(peer)}
    case = f"gdn fwd+bwd B={batch} T={length} H={heads} HV={value_heads} D={dim} bf16"
    measure(case, "eager", steps, s)
    if s.graph:
        measure_replays(case, {"kda-ops": steps["kda-ops"]}, s)
    gib = peak_gib(steps["kda-ops"])
    if s.results is not None:
        s.results.add(row(case, "kda-ops", "peak_memory", [gib], "GiB"))
    print(f"    kda-ops peak GiB above the inputs: {gib:.2f}", flush=True)


def bench_gdn_decode(s: Settings, batch=256, heads=16, value_heads=32, dim=128) -> None:
    """One token a sequence with the fp32 state in and out: state traffic per second."""
    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule

    x = gdn_inputs(batch, 1, heads, value_heads, dim)
    state = torch.randn(batch, value_heads, dim, dim, device=DEVICE)
    options = dict(GDN_OPTIONS, initial_state=state, output_final_state=True)
    calls = {"kda-ops": lambda: kda_ops.fused_recurrent_kda(**x, **options),
             "fla": lambda: fused_recurrent_gated_delta_rule(**x, **options)}  # fmt: skip
    case = f"gdn decode B={batch} H={heads} HV={value_heads} D={dim} fp32 state"
    measure(case, "eager", calls, s, 2 * state.numel() * 4)


BENCHES = {
    "chunk96": lambda s: bench_chunk(s, 96),
    "chunk64": lambda s: bench_chunk(s, 64),
    "chunk32": lambda s: bench_chunk(s, 32),  # Kimi Linear's heads (benchmarks/hybrid.py)
    "chunk32_softplus": lambda s: bench_chunk(s, 32, lower_bound=None),  # ... and its gate
    "chunk_varlen": bench_chunk_varlen,
    "chunk_backward": bench_chunk_backward,
    "chunk_backward96": lambda s: bench_chunk_backward(s, heads=96),
    "chunk_backward_varlen": lambda s: bench_chunk_backward(s, heads=96, varlen=True),
    "chunk_backward_softplus": lambda s: bench_chunk_backward(s, lower_bound=None),
    "chunk_backward_kept": lambda s: bench_chunk_backward(s, disable_recompute=True),
    "chunk_backward_kept96": lambda s: bench_chunk_backward(s, heads=96, disable_recompute=True),
    "decode": bench_decode,
    "gdn32k": bench_gdn,
    "gdn8k": lambda s: bench_gdn(s, length=8192),
    "gdn_batch": lambda s: bench_gdn(s, batch=8, length=4096),
    "gdn64": lambda s: bench_gdn(s, value_heads=64),
    "gdn_training": bench_gdn_training,
    "gdn_decode": bench_gdn_decode,
    "norm": bench_gated_norm,
    "conv": bench_conv_update,
    "conv_prefill": bench_conv_prefill,
}
CHUNK_FORWARD = ("chunk96", "chunk64", "chunk32", "chunk32_softplus", "chunk_varlen")


def settings(args: argparse.Namespace, name: str) -> Settings:
    """The peers that import and the timer for this machine (CPU: kda-ops alone)."""
    s = Settings(rounds=args.rounds, final_state=args.final_state, graph=not args.no_graph,
                 tiny=args.tiny or DEVICE == "cpu",
                 results=Results.from_args(name, args))  # fmt: skip
    if DEVICE == "cuda":
        s.fla_chunk_kda = import_fla_chunk_kda()
        s.flash_kda = import_flash_kda()
        s.libraries += ["fla"] * (s.fla_chunk_kda is not None)
        s.libraries += ["flash_kda"] * (s.flash_kda is not None)
    else:
        s.timer = cpu_time_ms
        print("no CUDA GPU: kda-ops alone on CPU, tiny shapes, wall time (a plumbing check)")
    s.results.environment["settings"] = {
        "rounds": s.rounds, "final_state": s.final_state, "tiny": s.tiny, "device": DEVICE,
        "timer": "do_bench median (warmup 25 ms, rep 100 ms)" if DEVICE == "cuda" else
        "perf_counter median of 3", "reference_heads": REFERENCE_HEADS,
    }  # fmt: skip
    return s


def add_common_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rounds", type=int, default=3, help="rounds of rotated order")
    parser.add_argument(
        "--final-state",
        action="store_true",
        help="chunk forward: every library also writes its fp32 final state",
    )
    parser.add_argument("--no-graph", action="store_true", help="eager timing only")
    parser.add_argument(
        "--tiny",
        action="store_true",
        help="chunk forward at T=256 H=2 D=32 (always so without a GPU)",
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="+", choices=list(BENCHES), help="a subset, in order")
    add_common_arguments(parser)
    add_arguments(parser, "ops")
    args = parser.parse_args()
    s = settings(args, "ops")
    names = args.only or list(BENCHES)
    if s.tiny or DEVICE == "cpu":
        skipped = [name for name in names if name not in CHUNK_FORWARD]
        names = [name for name in names if name in CHUNK_FORWARD]
        if skipped and DEVICE == "cpu":
            print(f"skipped without a GPU: {' '.join(skipped)}")
    elif s.fla_chunk_kda is None:
        raise SystemExit("benchmarks/ops.py needs fla-core (pip install fla-core==0.6.0)")
    if DEVICE == "cuda":
        bandwidth = copy_bandwidth_tbs()
        s.results.environment["copy_bandwidth_tbs"] = bandwidth
        print(f"{torch.cuda.get_device_name()}, copy bandwidth: {bandwidth:.2f} TB/s")
    print(f"{s.rounds} rounds of rotated order, µs: median [min–max] over rounds")
    print_header(s.libraries)
    for name in names:
        try:
            BENCHES[name](s)
        except Exception as error:  # one failing case should not cost a run's other rows
            print(f"| {name} failed: {error!r} |", flush=True)
            s.results.add({"case": name, "library": None, "metric": None, "error": repr(error)})
    print(f"\nwrote {s.results.path}")


if __name__ == "__main__":
    main()
