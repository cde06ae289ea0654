"""Per-kernel GPU time of one chunk_kda training step (forward + backward of every input;
with ``--forward`` the forward alone), ours and flash-linear-attention's (fla-core 0.6.0)
in the same process: where the time of ``ops.py``'s rows goes, kernel by kernel
(torch.profiler, µs a step, averaged over ``--steps`` profiled steps after three warm-up
steps), in ``--rounds`` rounds of rotated order.

With ``--forward``, FlashKDA's forward too where ``flash_kda`` imports and supports the
case, and ours a second time in one pass ("kda-ops one pass"): the shipped forward runs
long sequences in time windows on two streams, where a window's recurrence overlaps the
next window's prepare, so each kernel's profiled time includes the SMs it shares. One
pass runs the prepare alone on the GPU, the time to set beside FlashKDA's prepare kernel.

Usage (GPU): ``python benchmarks/kernel_split.py [--heads 64] [--length 8192] [--softplus]
[--disable-recompute] [--varlen] [--forward] [--steps 5] [--rounds 1]
[--shared-machine | --no-shared-machine] [--out benchmarks/results/kernel_split.json]``.
"""

import argparse
import contextlib
from collections import Counter
from functools import partial
from unittest import mock

import torch
from fla.ops.kda import chunk_kda as fla_chunk_kda
from harness import import_flash_kda, kernel_times_us, rotated_rounds
from ops import (
    GDN_OPTIONS,
    LOWER_BOUND,
    NAMES,
    VARLEN,
    chunk_options,
    flash_kda_call,
    flash_kda_supports,
    gdn_inputs,
    kda_inputs,
    varlen_cu_seqlens,
)
from results import Results, add_arguments, row

import kda_ops


def print_table(name: str, times: Counter, rows: int = 16) -> None:
    total = sum(times.values())
    print(f"\n{name}: {total:.0f} µs a step\n\n| kernel | µs | share |\n| --- | ---: | ---: |")
    for kernel, us in times.most_common(rows):
        print(f"| `{kernel[:80]}` | {us:.0f} | {us / total:.1%} |")
    rest = total - sum(us for _, us in times.most_common(rows))
    if rest > 0:
        print(f"| {len(times) - rows} others | {rest:.0f} | {rest / total:.1%} |")


ONE_PASS = "kda-ops one pass"
NAMES = {**NAMES, ONE_PASS: "kda-ops in one pass"}


def one_pass():
    """Our forward in one pass over each sequence, never in time windows (the launcher's
    window choice patched to 0 windows' steps), around the profiled calls."""
    return mock.patch("kda_ops.kernels.chunk.launch.pipeline_window_steps",
                      lambda *_: 0)  # fmt: skip


def forward_steps(x: dict, options: dict) -> dict:
    """library -> its forward call (``ONE_PASS`` runs under :func:`one_pass`)."""
    steps = {
        "kda-ops": lambda: kda_ops.chunk_kda(**x, **options),
        ONE_PASS: lambda: kda_ops.chunk_kda(**x, **options),
        "fla": lambda: fla_chunk_kda(**x, **options),
    }
    flash_kda = import_flash_kda()
    if flash_kda is not None and flash_kda_supports(x, options):
        steps["flash_kda"] = flash_kda_call(flash_kda, x, options, options.get("cu_seqlens"),
                                            final_state=False)  # fmt: skip
    return steps


def training_steps(x: dict, options: dict) -> dict:
    """library -> a forward + backward of every input."""
    leaves = [t.requires_grad_() for t in x.values()]
    grad_o = torch.randn_like(x["v"])

    def step(chunk_kda):
        o, _ = chunk_kda(**x, **options)
        return torch.autograd.grad(o, leaves, grad_o, allow_unused=True)

    return {"kda-ops": lambda: step(kda_ops.chunk_kda), "fla": lambda: step(fla_chunk_kda)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--heads", type=int, default=64)
    parser.add_argument("--length", type=int, default=8192)
    parser.add_argument("--softplus", action="store_true", help="Kimi Linear's unbounded gate")
    parser.add_argument("--disable-recompute", action="store_true")
    parser.add_argument("--varlen", action="store_true",
                        help="the forward's packed varlen lengths in --length tokens")  # fmt: skip
    parser.add_argument("--forward", action="store_true",
                        help="the forward alone, FlashKDA's and ours in one pass too")  # fmt: skip
    parser.add_argument("--gdn", type=int, default=None, metavar="HV",
                        help="Gated DeltaNet with HV value heads (--heads q/k heads; "
                             "ours alone: fla-core refuses GDN training, FLA #640)")  # fmt: skip
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=1, help="rounds of rotated order")
    add_arguments(parser, "kernel_split")
    args = parser.parse_args()
    results = Results.from_args("kernel_split", args)
    if args.gdn is not None:
        x = gdn_inputs(1, args.length, args.heads, args.gdn)
        options = dict(GDN_OPTIONS, disable_recompute=args.disable_recompute)
    else:
        x = kda_inputs(1, args.length, args.heads)
        options = dict(chunk_options(None if args.softplus else LOWER_BOUND),
                       disable_recompute=args.disable_recompute)  # fmt: skip
    step_name = "forward" if args.forward else "forward + backward"
    if args.varlen:
        options["cu_seqlens"] = varlen_cu_seqlens(args.length)
        step_name += f" varlen {len(VARLEN) - 1} seqs"
    heads = f"H={args.heads}" + ("" if args.gdn is None else f" HV={args.gdn} gdn")
    case = f"chunk_kda {step_name} B=1 T={args.length} {heads} D=128 bf16" + (
        ", softplus gate" if args.softplus else "") + (
        ", disable_recompute" if args.disable_recompute else "")  # fmt: skip
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}: B=1 T={args.length} "
          f"H={args.heads} D=128 bf16, {options}")  # fmt: skip
    steps = forward_steps(x, options) if args.forward else training_steps(x, options)
    if args.gdn is not None:  # FLA's KDA functions are not its GDN; FlashKDA is KDA only
        steps = {name: call for name, call in steps.items() if name.startswith("kda-ops")}

    def profiled(library: str) -> Counter:
        grad = torch.no_grad() if args.forward else contextlib.nullcontext()
        with grad, one_pass() if library == ONE_PASS else contextlib.nullcontext():
            times = kernel_times_us(steps[library], args.steps)
        print_table(NAMES[library], times)
        return times

    calls = {library: partial(profiled, library) for library in steps}
    rounds = rotated_rounds(calls, args.rounds, timer=lambda call: call())
    for library, times in rounds.items():
        kernels = sum(times, Counter()).most_common()
        results.add([row(case, library, "step_time", [sum(t.values()) for t in times], "us",
                         steps=args.steps)] + [
            row(case, library, "kernel_time", [t[kernel] for t in times], "us",
                kernel=kernel, steps=args.steps)
            for kernel, _ in kernels])  # fmt: skip
    print(f"\nwrote {results.path}")


if __name__ == "__main__":
    main()
