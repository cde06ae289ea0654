"""In-device context parallelism: one long sequence vs the same tokens as a batch.

A single ``B = 1`` sequence leaves most SMs idle in the serial inter-chunk recurrence. Our
``chunk_kda`` runs that recurrence in segments on such shapes (``recurrence_segments``:
each segment's affine map, the maps composed, the segments rerun from exact incoming
states); ``kda_ops.chunk_kda_segmented`` does the same at the op level. This times, in
one process (bf16, D = 128, safe gate -5, gate / beta / l2norm in kernel, forward):

- FLA 0.6.0 ``chunk_kda`` on ``B = 1, T`` and on ``B = S, T / S`` (the peer's own gap);
- our ``chunk_kda`` on both shapes, and its recurrence forced to 1..16 segments;
- our ``chunk_kda_segmented`` on ``B = 1, T`` (planned segments and a few fixed counts);

and prints the long sequence's output error (FLA's relative-RMSE metric) of ours against
FLA's and of the planned segments against one serial scan.

Targets: our long / our split batch <= 1.05, segments faster than one scan on the long
sequence, the long output no farther from float64 than FLA's (the distance between the
two, printed too, is about sqrt(2) times either's from float64: a threshold on it would
flag two equally accurate outputs).

Usage (GPU, fla-core 0.6.0): ``python benchmarks/cp.py [--quick] [--shared-machine |
--no-shared-machine] [--out benchmarks/results/cp.json]``.
"""

import argparse

import torch
from fla.ops.kda import chunk_kda as fla_chunk_kda
from harness import Row, relative_error, report, time_ms
from results import Results, add_arguments, row

import kda_ops
from kda_ops.kernels.chunk.launch import launch_chunk_kda
from kda_ops.kernels.chunk.segments import recurrence_segments
from kda_ops.segmented import plan_segments
from kda_ops.signature import DeltaRuleInputs, DeltaRuleOptions

DEVICE = "cuda"
IN_KERNEL = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                 use_beta_sigmoid_in_kernel=True, lower_bound=-5.0)  # fmt: skip


def inputs(batch: int, length: int, heads: int, dim: int) -> dict:
    def rand(*shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        return torch.randn(*shape, device=DEVICE, dtype=dtype)

    return dict(
        q=rand(batch, length, heads, dim), k=rand(batch, length, heads, dim),
        v=rand(batch, length, heads, dim), g=rand(batch, length, heads, dim),
        beta=rand(batch, length, heads), A_log=torch.zeros(heads, device=DEVICE),
        dt_bias=torch.zeros(heads * dim, device=DEVICE),
    )  # fmt: skip


def run(length: int, split: int, heads: int, dim: int, segment_counts: list[int],
        results: Results) -> list[Row]:  # fmt: skip
    long = inputs(1, length, heads, dim)
    batched = {
        name: t.reshape(split, length // split, *t.shape[2:]) if t.dim() > 1 else t
        for name, t in long.items()
    }
    fla_long = time_ms(lambda: fla_chunk_kda(**long, **IN_KERNEL))
    fla_split = time_ms(lambda: fla_chunk_kda(**batched, **IN_KERNEL))
    ours_long = time_ms(lambda: kda_ops.chunk_kda(**long, **IN_KERNEL))
    ours_split = time_ms(lambda: kda_ops.chunk_kda(**batched, **IN_KERNEL))
    shape_long, shape_split = f"B=1 T={length}", f"B={split} T={length // split}"
    rows = [
        Row(f"chunk_kda {shape_long} H={heads} D={dim}", ours_long, fla_long),
        Row(f"chunk_kda {shape_split} H={heads} D={dim}", ours_split, fla_split),
    ]
    planned = plan_segments(1, length, heads, torch.device(DEVICE))
    for segments in dict.fromkeys([planned, *segment_counts]):
        ms = time_ms(
            lambda s=segments: kda_ops.chunk_kda_segmented(**long, **IN_KERNEL, num_segments=s)
        )
        label = " (planned)" if segments == planned else ""
        rows.append(Row(f"segmented S={segments}{label} {shape_long}", ms, fla_long))
        if segments == planned:
            planned_ms = ms
    rows += recurrence_rows(long, length, dim, fla_long, ours_split)
    print_errors(long, dim, f"chunk_kda {shape_long} H={heads} D={dim}", results)
    print(f"\nFLA long / FLA split: {fla_long / fla_split:.3f}")
    print(f"ours plain long / ours split: {ours_long / ours_split:.3f}")
    print(f"ours segmented (S={planned}) long / ours split: {planned_ms / ours_split:.3f} "
          "(target <= 1.05)")  # fmt: skip
    print(f"ours segmented (S={planned}) / ours plain, long: {planned_ms / ours_long:.3f} "
          "(target < 1)")  # fmt: skip
    return rows


def kernel_args(long: dict, dim: int) -> tuple:
    """``launch_chunk_kda``'s positional arguments for the long sequence."""
    inputs = DeltaRuleInputs(*(long[name] for name in DeltaRuleInputs._fields))
    return inputs, None, None, DeltaRuleOptions(dim**-0.5, IN_KERNEL["lower_bound"], True, True)


def first_heads(x: dict, heads: int, dim: int) -> dict:
    """``x``'s first ``heads`` heads, in float64."""
    return {name: (t[..., :heads * dim] if name == "dt_bias" else
                   t[:heads] if t.dim() == 1 else t[:, :, :heads]).double()
            for name, t in x.items()}  # fmt: skip


def print_errors(long: dict, dim: int, case: str, results: Results) -> None:
    """Output errors on the long sequence: ours (planned segments) against FLA's and
    against our own single serial scan; ours and FLA's against the float64 reference on
    two heads (the two bf16 outputs round independently, so their distance from each
    other is about sqrt(2) times their distance from float64)."""
    ours, _ = kda_ops.chunk_kda(**long, **IN_KERNEL)
    peer, _ = fla_chunk_kda(**long, **IN_KERNEL)
    args = kernel_args(long, dim)
    one_scan, _ = launch_chunk_kda(*args, segments=1)
    print(
        f"long output: ours vs FLA {relative_error(ours, peer):.2e}, "
        f"planned segments vs one scan {relative_error(ours, one_scan):.2e}"
    )
    reference, _ = kda_ops.chunk_kda(**first_heads(long, 2, dim), **IN_KERNEL)
    ours_error = relative_error(ours[:, :, :2], reference)
    peer_error = relative_error(peer[:, :, :2], reference)
    print(f"long output against float64 (2 heads): ours {ours_error:.2e}, FLA {peer_error:.2e} "
          f"(target: ours <= FLA's)")  # fmt: skip
    results.add([
        row(case, "kda-ops", "o_error_vs_float64", [ours_error], "relative", heads=2),
        row(case, "fla", "o_error_vs_float64", [peer_error], "relative", heads=2),
        row(case, "kda-ops", "o_error_vs_fla", [relative_error(ours, peer)], "relative"),
        row(case, "kda-ops", "o_error_vs_one_scan", [relative_error(ours, one_scan)],
            "relative"),
    ])  # fmt: skip


def recurrence_rows(long: dict, length: int, dim: int, fla_long: float,
                    ours_split: float) -> list[Row]:  # fmt: skip
    """Our chunk forward with its recurrence in S segments (S = 1: one serial scan; the
    rest: ``_segmented_recurrence``), kernel-level, on the long sequence."""
    args = kernel_args(long, dim)
    planned = recurrence_segments(1, length, *long["v"].shape[2:], None, torch.device(DEVICE))
    rows = []
    for segments in (1, 2, 4, 8, 16):
        ms = time_ms(lambda s=segments: launch_chunk_kda(*args, segments=s))
        label = " (planned)" if segments == planned else ""
        rows.append(Row(f"recurrence in S={segments}{label} segments B=1 T={length}", ms,
                        fla_long))  # fmt: skip
        print(f"recurrence S={segments} long / ours split: {ms / ours_split:.3f}")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="T = 16384 (smoke run)")
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--split", type=int, default=8, help="batch of the split comparison")
    add_arguments(parser, "cp")
    args = parser.parse_args()
    results = Results.from_args("cp", args)
    length = 16384 if args.quick else 131072
    counts = [2, 4] if args.quick else [4, 8, 16]
    report(
        "In-device context parallelism: one long sequence vs a batch (ratio = ours / FLA)",
        {"cp": lambda: run(length, args.split, args.heads, args.dim, counts, results)},
        results,
    )
    print(f"\nwrote {results.path}")


if __name__ == "__main__":
    main()
