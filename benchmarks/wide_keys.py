"""bf16 ``chunk_kda`` past 128 key columns in bf16 against the same call on float32 copies
of q, k and v (what the plan computed such calls in before the bf16 kernels served them),
forward and training step (forward + backward), in rounds of rotated order. Each forward
row also gives its relative error against the float64 reference on the first two heads,
so the time is read beside the accuracy.

Usage (GPU): ``python benchmarks/wide_keys.py [--keys 192 256] [--length 8192]
[--heads 16] [--rounds 5] [--no-shared-machine] [--out benchmarks/results/wide_keys.json]``.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable

import torch
from harness import relative_error, rotated_rounds, time_ms
from results import Results, add_arguments, row

import kda_ops

REFERENCE_HEADS = 2
PATHS = {"fp32 copies": torch.float32, "bf16": torch.bfloat16}
OPTIONS = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
               use_beta_sigmoid_in_kernel=True, lower_bound=-5.0)  # fmt: skip


def inputs(batch: int, length: int, heads: int, key_dim: int, value_dim: int) -> dict:
    def rand(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, device="cuda", dtype=dtype)

    return dict(
        q=rand(batch, length, heads, key_dim), k=rand(batch, length, heads, key_dim),
        v=rand(batch, length, heads, value_dim), g=rand(batch, length, heads, key_dim),
        beta=rand(batch, length, heads), A_log=torch.zeros(heads, device="cuda"),
        dt_bias=torch.zeros(heads * key_dim, device="cuda"),
    )  # fmt: skip


def in_dtype(args: dict, dtype: torch.dtype) -> dict:
    """``args`` with q, k and v in ``dtype`` (the gate, beta and parameters as they are)."""
    return {n: (x.to(dtype) if n in ("q", "k", "v") else x) for n, x in args.items()}


def forward(args: dict) -> Callable[[], torch.Tensor]:
    """The forward, o in bf16 (as the plan's float32 path returned it)."""
    return lambda: kda_ops.chunk_kda(**args, **OPTIONS)[0].bfloat16()


def training(args: dict, grad_o: torch.Tensor) -> Callable[[], None]:
    leaves = {name: x.detach().requires_grad_(x.is_floating_point()) for name, x in args.items()}

    def step():
        o = kda_ops.chunk_kda(**leaves, **OPTIONS)[0]
        o.backward(grad_o.to(o.dtype))
        for x in leaves.values():
            x.grad = None

    return step


def reference_error(args: dict, dtype: torch.dtype) -> float:
    """Relative error of the forward with q, k, v in ``dtype`` on the first heads against
    float64."""
    few = {n: (x[:, :, :REFERENCE_HEADS] if x.dim() > 1 else x) for n, x in args.items()}
    few["A_log"] = args["A_log"][:REFERENCE_HEADS]
    few["dt_bias"] = args["dt_bias"][: REFERENCE_HEADS * args["q"].shape[-1]]
    got = forward(in_dtype(few, dtype))()
    expected = kda_ops.chunk_kda(**{n: x.double() for n, x in few.items()}, **OPTIONS)[0]
    return relative_error(got, expected)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keys", type=int, nargs="*", default=[192, 256])
    parser.add_argument("--value-dim", type=int, default=128)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--length", type=int, default=8192)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=5)
    add_arguments(parser, "wide_keys")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU: it times the chunk kernels")
    results = Results.from_args("wide_keys", args)
    torch.manual_seed(0)
    for key_dim in args.keys:
        case_inputs = inputs(args.batch, args.length, args.heads, key_dim, args.value_dim)
        grad_o = torch.randn_like(case_inputs["v"])
        case = f"{args.batch}x{args.length} H{args.heads} K{key_dim} V{args.value_dim} bf16"
        for step, make in (("forward", forward), ("training", None)):
            calls = {
                name: make(in_dtype(case_inputs, dtype))
                if make
                else training(in_dtype(case_inputs, dtype), grad_o)
                for name, dtype in PATHS.items()
            }
            for call in calls.values():  # compile outside the timed rounds
                call()
            times = rotated_rounds(calls, args.rounds, time_ms)
            for name, values in times.items():
                extra = {"step": step, "path": name}
                if step == "forward":
                    extra["relative_error"] = reference_error(case_inputs, PATHS[name])
                results.add(row(case, "kda-ops", f"{step} {name}", values, "ms", **extra))
                spread = f"[{min(values):.3f}-{max(values):.3f}]"
                error = f" err {extra['relative_error']:.2e}" if "relative_error" in extra else ""
                median = statistics.median(values)
                print(f"{case} {step:8s} {name:12s} {median:.3f} ms {spread}{error}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
