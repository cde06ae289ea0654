"""What the plan's rule 2 costs: bf16 ``chunk_kda`` past 128 key columns computed in fp32
(``kda_ops.plan.BF16_CHUNK_MAX_KEY_DIM`` = 128, the detour) against the same call in bf16
(the limit raised to the key width), forward and training step (forward + backward), in
rounds of rotated order. Each row also gives both results' relative error against the
float64 reference on the first two heads, so the time saved is read beside the accuracy
it keeps.

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
import kda_ops.plan

DETOUR_LIMIT = 128
REFERENCE_HEADS = 2
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


def with_limit(limit: int, call: Callable[[], object]) -> Callable[[], object]:
    """``call`` run with the plan's bf16 key-width limit set to ``limit``."""

    def limited():
        saved = kda_ops.plan.BF16_CHUNK_MAX_KEY_DIM
        kda_ops.plan.BF16_CHUNK_MAX_KEY_DIM = limit
        try:
            return call()
        finally:
            kda_ops.plan.BF16_CHUNK_MAX_KEY_DIM = saved

    return limited


def forward(args: dict) -> Callable[[], torch.Tensor]:
    return lambda: kda_ops.chunk_kda(**args, **OPTIONS)[0]


def training(args: dict, grad_o: torch.Tensor) -> Callable[[], None]:
    leaves = {name: x.detach().requires_grad_(x.is_floating_point()) for name, x in args.items()}

    def step():
        o = kda_ops.chunk_kda(**leaves, **OPTIONS)[0]
        o.backward(grad_o)
        for x in leaves.values():
            x.grad = None

    return step


def reference_error(args: dict, limit: int) -> float:
    """Relative error of the forward output at ``limit`` on the first heads against
    float64."""
    few = {n: (x[:, :, :REFERENCE_HEADS] if x.dim() > 1 else x) for n, x in args.items()}
    few["A_log"] = args["A_log"][:REFERENCE_HEADS]
    few["dt_bias"] = args["dt_bias"][: REFERENCE_HEADS * args["q"].shape[-1]]
    got = with_limit(limit, forward(few))()
    wide = {n: x.double() for n, x in few.items()}
    expected = kda_ops.chunk_kda(**wide, **OPTIONS)[0]
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
        limits = {"fp32 detour": DETOUR_LIMIT, "bf16": key_dim}
        for step, make in (("forward", forward), ("training", None)):
            calls = {
                name: with_limit(
                    limit, make(case_inputs) if make else training(case_inputs, grad_o)
                )
                for name, limit in limits.items()
            }
            for call in calls.values():  # compile outside the timed rounds
                call()
            times = rotated_rounds(calls, args.rounds, time_ms)
            for name, values in times.items():
                extra = {"step": step, "path": name, "limit": limits[name]}
                if step == "forward":
                    extra["relative_error"] = reference_error(case_inputs, limits[name])
                results.add(row(case, "kda-ops", f"{step} {name}", values, "ms", **extra))
                spread = f"[{min(values):.3f}-{max(values):.3f}]"
                error = f" err {extra['relative_error']:.2e}" if "relative_error" in extra else ""
                median = statistics.median(values)
                print(f"{case} {step:8s} {name:12s} {median:.3f} ms {spread}{error}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
