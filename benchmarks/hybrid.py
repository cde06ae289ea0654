"""The hybrid example model at Kimi-Linear attention dims: (a) eager with FLA's KDA and
short-conv kernels (how people run it today) vs (b) ``torch.compile(backend="kda")``, in one
process.

Prefill: B = 1, T = 8192, tokens/s, into caches allocated before the timed calls (a
second row allocates and zero-fills each inside the timed call; a third replays (b) as CUDA
graphs, ``mode="reduce-overhead"``, from one static empty cache). Decode:
B = 64 after a 512-token prompt, in-place ``decode_`` (b: ``mode="reduce-overhead"``, CUDA
graphs), tokens/s. Training step: B = 1, T = 8192, forward, cross-entropy loss, backward
and an AdamW step of every parameter, (b) with the loss and its backward compiled (the
optimizer eager in both), tokens/s. Prints a table with the ratios (medians over the timed
calls) and writes the rows, with every call's tokens/s, to ``--out`` (default
``benchmarks/results/hybrid.json``). Needs a CUDA GPU and ``fla-core`` (run with
``FLA_DISABLE_BACKEND_DISPATCH=1``). Usage::

    python benchmarks/hybrid.py            # Kimi-Linear dims, 4 layers (3 KDA + 1 attention)
    python benchmarks/hybrid.py --quick    # small sizes, a smoke run
    python benchmarks/hybrid.py --no-shared-machine   # say nothing else ran on the machine
    python benchmarks/hybrid.py --only training      # a subset of prefill, decode, training
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Literal

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the examples/ folder

from results import Results, add_arguments, row  # benchmarks/, the script's folder

from examples.hybrid_model import (
    Cache,
    HybridConfig,
    HybridLM,
    KDAKernels,
    mark_cache_static,
)
from lowering.inductor import kda_backend  # backend="kda" without the installed entry point


@dataclasses.dataclass(frozen=True)
class Sizes:
    config: HybridConfig
    prefill_length: int
    decode_batch: int
    prompt: int
    decode_steps: int
    train_length: int
    repeats: int


def sizes(quick: bool, layers: int, vocab: int) -> Sizes:
    if quick:
        config = HybridConfig(hidden_size=256, intermediate_size=512, num_heads=4, head_dim=64,
                              num_layers=layers, vocab_size=vocab)  # fmt: skip
        return Sizes(config, prefill_length=512, decode_batch=8, prompt=64, decode_steps=8,
                     train_length=512, repeats=2)  # fmt: skip
    config = HybridConfig.kimi_linear_48b(num_layers=layers, vocab_size=vocab)
    # Median of 10 (was 3; ~0.3 s a side): the prefill ratio sits near its 1.3 target.
    return Sizes(config, prefill_length=8192, decode_batch=64, prompt=512, decode_steps=32,
                 train_length=8192, repeats=10)  # fmt: skip


def fla_kernels() -> KDAKernels:
    try:
        from fla.modules.causal_conv1d.ops import causal_conv1d
        from fla.ops.kda import chunk_kda, fused_recurrent_kda
    except ImportError as error:
        raise SystemExit(f"needs fla-core (pip install fla-core==0.6.0): {error}") from error

    def short_conv(x, weight, initial_state, activation):
        """FLA's conv as its ``ShortConvolution`` runs it (Triton backend); FLA's state keeps
        the last W inputs where ours keeps W - 1."""
        y, final = causal_conv1d(x, weight, initial_state=F.pad(initial_state, (1, 0)),
                                 output_final_state=True, activation=activation,
                                 backend="triton")  # fmt: skip
        return y, final[..., 1:]

    return KDAKernels(chunk=chunk_kda, recurrent=fused_recurrent_kda, conv=short_conv)


WARM_UP_RUNS = 2  # CUDA graph trees record a graph on a function's second call


def timed(fn: Callable[[], object], repeats: int) -> list[float]:
    """Seconds of each of ``repeats`` runs of ``fn()``, after ``WARM_UP_RUNS``."""
    for _ in range(WARM_UP_RUNS):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return times


def prefill_tokens_per_s(
    model: HybridLM,
    prefill: Callable,
    s: Sizes,
    cache: Literal["pool", "allocate", "static"] = "pool",
) -> list[float]:
    """Tokens/s of each timed prefill into an empty cache. ``cache``: "pool", a fresh cache
    each call, all allocated before the timed calls (as a server's state pool is and as
    decode's cache is here); "allocate", allocated (and zero-filled) in the timed call;
    "static", one cache marked as a static address for every call, which CUDA graphs read
    in place (prefill is functional: it reads the empty cache and returns a new one)."""
    ids = torch.randint(0, s.config.vocab_size, (1, s.prefill_length), device="cuda")
    if cache == "allocate":

        def run() -> None:
            prefill(ids, model.new_cache(1, max_seq_len=s.prefill_length))

    elif cache == "static":
        static = model.new_cache(1, max_seq_len=s.prefill_length)
        mark_cache_static(static)

        def run() -> None:
            prefill(ids, static)

    else:
        caches = [
            model.new_cache(1, max_seq_len=s.prefill_length)
            for _ in range(WARM_UP_RUNS + s.repeats)
        ]

        def run() -> None:
            prefill(ids, caches.pop())

    return [s.prefill_length / seconds for seconds in timed(run, s.repeats)]


def prefill_logits_error(eager: HybridLM, compiled: Callable, ours: HybridLM, s: Sizes) -> float:
    """FLA's metric (relative RMSE, float64) of (b)'s prefill logits against (a)'s on one
    prompt: the two paths timed must compute the same model."""
    ids = torch.randint(0, s.config.vocab_size, (1, s.prefill_length), device="cuda")
    want = eager.prefill(ids, eager.new_cache(1, max_seq_len=s.prefill_length))[0].double()
    got = compiled(ids, ours.new_cache(1, max_seq_len=s.prefill_length))[0].double()
    return ((got - want).norm() / want.norm()).item()


def decode_tokens_per_s(decode_: Callable, cache: Cache, s: Sizes) -> list[float]:
    """Tokens/s, a timed run each, of ``decode_steps`` in-place steps, each run restarting
    at the prompt end."""
    ids = torch.randint(0, s.config.vocab_size, (s.decode_batch, 1), device="cuda")
    lengths = [state.length for state in cache if hasattr(state, "length")]

    def run() -> None:
        for length in lengths:
            length.fill_(s.prompt)
        for _ in range(s.decode_steps):
            decode_(ids, cache)

    return [s.decode_batch * s.decode_steps / seconds for seconds in timed(run, s.repeats)]


def language_model_loss(model: HybridLM) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """Next-token cross-entropy of ``model``'s prefill logits (fp32) from an empty cache."""

    def loss(ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits, _ = model.prefill(ids, model.new_cache(ids.shape[0], max_seq_len=ids.shape[1]))
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())

    return loss


def train_tokens_per_s(model: HybridLM, loss: Callable, s: Sizes) -> tuple[list[float], float]:
    """Tokens/s of each timed training step (``loss``, its backward, an AdamW step of every
    parameter of ``model``) and the first step's loss."""
    ids, targets = (torch.randint(0, s.config.vocab_size, (1, s.train_length), device="cuda")
                    for _ in range(2))  # fmt: skip
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    first_loss = loss(ids, targets).item()

    def run() -> None:
        optimizer.zero_grad(set_to_none=True)
        loss(ids, targets).backward()
        optimizer.step()

    return [s.train_length / seconds for seconds in timed(run, s.repeats)], first_loss


def prompt_cache(model: HybridLM, s: Sizes) -> Cache:
    ids = torch.randint(0, s.config.vocab_size, (s.decode_batch, s.prompt), device="cuda")
    cache = model.new_cache(s.decode_batch, max_seq_len=s.prompt + s.decode_steps)
    return model.prefill(ids, cache)[1]


def clone(cache: Cache) -> Cache:
    return tuple(type(state)(*(t.clone() for t in state)) for state in cache)


PHASES = ["prefill", "decode", "training"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes (smoke run)")
    parser.add_argument("--layers", type=int, default=4, help="layers (every 4th attention)")
    parser.add_argument("--vocab", type=int, default=32000, help="vocabulary size")
    parser.add_argument("--only", nargs="+", choices=PHASES, default=PHASES,
                        help="a subset of the phases")  # fmt: skip
    add_arguments(parser, "hybrid")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/hybrid.py needs a CUDA GPU")
    s = sizes(args.quick, args.layers, args.vocab)
    results = Results.from_args("hybrid", args)
    results.environment["settings"] = dataclasses.asdict(s) | {"quick": args.quick}
    torch.manual_seed(0)
    with torch.device("cuda"):
        ours = HybridLM(s.config).to(torch.bfloat16).eval().requires_grad_(False)
        fla = HybridLM(s.config, kernels=fla_kernels()).to(torch.bfloat16).eval()
    fla.load_state_dict(ours.state_dict())
    fla.requires_grad_(False)

    c = s.config
    print(f"hybrid model: {c.num_layers} layers, hidden {c.hidden_size}, {c.num_heads} heads × "
          f"{c.head_dim}, vocab {c.vocab_size}, bf16, {torch.cuda.get_device_name()}")  # fmt: skip
    print("| phase | (a) eager + FLA tok/s | (b) compile kda tok/s | (b)/(a) | target |")
    print("| --- | --- | --- | --- | --- |", flush=True)

    def report(phase: str, eager_rates: list[float], compiled_rates: list[float],
               target: float) -> None:  # fmt: skip
        # Printed as soon as measured: a run cut short still reports what it finished.
        results.add([
            row(phase, "fla", "throughput", eager_rates, "tokens/s", path="(a) eager + FLA"),
            row(phase, "kda-ops", "throughput", compiled_rates, "tokens/s",
                path="(b) torch.compile(backend='kda')", target_ratio=target),
        ])  # fmt: skip
        eager, compiled = statistics.median(eager_rates), statistics.median(compiled_rates)
        print(f"| {phase} | {eager:,.0f} | {compiled:,.0f} | {compiled / eager:.2f} | "
              f">= {target} |", flush=True)  # fmt: skip

    with torch.no_grad():
        if "prefill" in args.only:
            compiled_prefill = torch.compile(ours.prefill, backend=kda_backend, fullgraph=True)
            eager = prefill_tokens_per_s(fla, fla.prefill, s)
            compiled = prefill_tokens_per_s(ours, compiled_prefill, s)
            report(f"prefill B=1 T={s.prefill_length}", eager, compiled, 1.3)
            eager = prefill_tokens_per_s(fla, fla.prefill, s, cache="allocate")
            compiled = prefill_tokens_per_s(ours, compiled_prefill, s, cache="allocate")
            phase = f"prefill B=1 T={s.prefill_length}, cache allocated in the call"
            report(phase, eager, compiled, 1.3)
            logits_error = prefill_logits_error(fla, compiled_prefill, ours, s)
            graphed_prefill = torch.compile(
                ours.prefill, backend=kda_backend, mode="reduce-overhead", fullgraph=True
            )
            eager = prefill_tokens_per_s(fla, fla.prefill, s, cache="static")
            compiled = prefill_tokens_per_s(ours, graphed_prefill, s, cache="static")
            report(f"prefill B=1 T={s.prefill_length}, (b) in CUDA graphs", eager, compiled, 1.3)
            print(f"prefill logits, (b) against (a): relative error {logits_error:.2e}")
            results.add(row(f"prefill B=1 T={s.prefill_length}", "kda-ops",
                            "logits_error_vs_fla_eager", [logits_error], "relative"))  # fmt: skip
        if "decode" in args.only:
            cache_eager = prompt_cache(fla, s)
            cache_compiled = clone(cache_eager)
            mark_cache_static(cache_compiled)
            compiled_decode = torch.compile(
                ours.decode_, backend=kda_backend, mode="reduce-overhead", fullgraph=True
            )
            eager = decode_tokens_per_s(fla.decode_, cache_eager, s)
            compiled = decode_tokens_per_s(compiled_decode, cache_compiled, s)
            report(f"decode B={s.decode_batch} (prompt {s.prompt})", eager, compiled, 2.0)
    if "training" in args.only:
        # Training: fresh copies of the same weights, every parameter trained.
        with torch.device("cuda"):
            ours_train = HybridLM(s.config).to(torch.bfloat16).train()
            fla_train = HybridLM(s.config, kernels=fla_kernels()).to(torch.bfloat16).train()
        ours_train.load_state_dict(ours.state_dict())
        fla_train.load_state_dict(ours.state_dict())
        eager, eager_loss = train_tokens_per_s(fla_train, language_model_loss(fla_train), s)
        compiled_loss = torch.compile(
            language_model_loss(ours_train), backend=kda_backend, fullgraph=True
        )
        compiled, first_loss = train_tokens_per_s(ours_train, compiled_loss, s)
        report(f"training step B=1 T={s.train_length}", eager, compiled, 1.25)
        print(f"\nfirst training loss: (a) {eager_loss:.6f}, (b) {first_loss:.6f}")
        results.add(row(f"training step B=1 T={s.train_length}", "kda-ops",
                        "loss_difference_vs_fla_eager", [abs(first_loss - eager_loss)],
                        "absolute"))  # fmt: skip
    print(f"wrote {results.path}")


if __name__ == "__main__":
    main()
