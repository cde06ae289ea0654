"""The chunk forward against sequence length: B = 1, H = 64, D = 128, bf16, safe gate -5,
l2norm / gate / beta sigmoid in the kernel (``ops.py``'s chunk cases), T = 1K, 2K, 4K, ...,
128K, for kda-ops, FLA and FlashKDA where they import, in one process, ``--rounds`` rounds
of rotated order at each T (eager; ``--graph`` also as CUDA-graph replay). Rows go to
``benchmarks/results/chunk_forward.json``; ``plot.py`` draws them.

Usage (GPU): ``python benchmarks/chunk_forward.py [--lengths 1024 ... 131072] [--heads 64]
[--rounds 3] [--graph] [--shared-machine | --no-shared-machine]``. Without a GPU:
kda-ops alone on CPU at ``--lengths 64 128 --heads 2 --dim 32`` or whatever is given (a
check of the plumbing).
"""

import argparse

import torch
from harness import capture_graph
from ops import (
    DEVICE,
    LOWER_BOUND,
    chunk_calls,
    chunk_options,
    kda_inputs,
    measure,
    print_header,
    settings,
)
from results import add_arguments

LENGTHS = [1024 * 2**i for i in range(8)]  # 1K ... 128K


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--lengths",
        type=int,
        nargs="+",
        help=f"T values (default {LENGTHS[0]} to {LENGTHS[-1]}, doubling)",
    )
    parser.add_argument("--heads", type=int, default=64)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3, help="rounds of rotated order")
    parser.add_argument("--graph", action="store_true", help="also time CUDA-graph replay")
    add_arguments(parser, "chunk_forward")
    args = parser.parse_args()
    args.final_state, args.no_graph, args.tiny = False, True, False
    if DEVICE == "cpu" and args.lengths is None:
        args.lengths, args.heads, args.dim = [64, 128], 2, 32
    s = settings(args, "chunk_forward")
    s.results.environment["settings"].update(
        sweep={"B": 1, "H": args.heads, "D": args.dim, "dtype": "bfloat16",
               "lower_bound": LOWER_BOUND, "in_kernel": "l2norm, gate, beta sigmoid"},
    )  # fmt: skip
    print(f"chunk forward B=1 H={args.heads} D={args.dim} bf16, lower bound {LOWER_BOUND}; "
          f"{s.rounds} rounds of rotated order, µs: median [min–max]")  # fmt: skip
    print_header(s.libraries)
    options = chunk_options(LOWER_BOUND)
    for length in args.lengths or LENGTHS:
        x = kda_inputs(1, length, args.heads, args.dim)
        case = f"chunk_kda fwd B=1 T={length} H={args.heads} D={args.dim} bf16"
        extra = dict(batch=1, T=length, H=args.heads, D=args.dim, lower_bound=LOWER_BOUND)
        nbytes = 5 * x["q"].numel() * x["q"].element_size()
        with torch.no_grad():
            measure(case, "eager", chunk_calls(x, options, s), s, nbytes, **extra)
            if args.graph and DEVICE == "cuda":
                calls = chunk_calls(x, options, s, graph=True)
                replays = {name: capture_graph([call]) for name, call in calls.items()}
                measure(case, "CUDA graph", replays, s, nbytes, **extra)
                del replays
        del x
        if DEVICE == "cuda":
            torch.cuda.empty_cache()  # 128K tokens: 2 GiB a tensor
    print(f"\nwrote {s.results.path}")


if __name__ == "__main__":
    main()
