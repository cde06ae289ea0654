"""One long sequence against the same tokens batched, KDA and Gated DeltaNet (forward).

A single sequence leaves most SMs idle in the serial inter-chunk recurrence; how much it
costs against the same tokens as ``--split`` sequences is the measure here. For each
library, kind (``kda``: per-channel gate, safe gate -5; ``gdn``: one decay a head,
softplus gate, q / k heads half the value heads as in Qwen3-Next), length T and value
heads H (bf16, D = 128, gate / beta sigmoid / l2norm in the kernel):

- ``chunk_kda`` on ``B = 1, T`` and on ``B = split, T / split``: time, tokens per second
  and their ratio (target: long / batched <= 1.15);
- with ``--variants``, the long sequence through ``launch_chunk_kda`` with the forward's
  choices forced: 16- or 64-token chunks (``chunk``) and 1 to 8 recurrence segments
  (``segments``), beside the planned call;
- with ``--fla``, FLA 0.6.0 on both shapes of the same cases.

Cases with more than ``--max-head-tokens`` tokens × heads are skipped (memory). The
results are written after each case, so a run stopped by ``--budget-s`` keeps what it
measured; ``benchmarks/plot.py``-style plot with ``--plot``.

Usage (GPU): ``python benchmarks/long_sequence.py [--kinds kda gdn] [--lengths 8192 ...]
[--heads 8 16 ...] [--variants] [--fla] [--budget-s 400] [--plot out.png]
[--out benchmarks/results/long_sequence.json]``.
"""

import argparse
import time

import torch
from harness import kernel_times_us, relative_error, time_ms
from results import Results, add_arguments, row

import kda_ops
from kda_ops.kernels.chunk.launch import launch_chunk_kda
from kda_ops.signature import DeltaRuleInputs, DeltaRuleOptions

DEVICE = "cuda"
DIM = 128
OPTIONS = {
    "kda": dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                use_beta_sigmoid_in_kernel=True, lower_bound=-5.0),
    "gdn": dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                use_beta_sigmoid_in_kernel=True),
}  # fmt: skip
VARIANTS = [(chunk, segments) for chunk in (16, 64) for segments in (1, 2, 4, 8)]


def inputs(kind: str, batch: int, length: int, value_heads: int) -> dict:
    """KDA: H = HV q / k heads and a ``[B, T, HV, D]`` gate; GDN: HV / 2 q / k heads and a
    ``[B, T, HV]`` gate."""
    heads = value_heads if kind == "kda" else max(1, value_heads // 2)

    def rand(*shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        return torch.randn(*shape, device=DEVICE, dtype=dtype)

    gate_shape = (batch, length, value_heads) + ((DIM,) if kind == "kda" else ())
    return dict(
        q=rand(batch, length, heads, DIM), k=rand(batch, length, heads, DIM),
        v=rand(batch, length, value_heads, DIM), g=rand(*gate_shape),
        beta=rand(batch, length, value_heads),
        A_log=torch.zeros(value_heads, device=DEVICE),
        dt_bias=torch.zeros(value_heads * (DIM if kind == "kda" else 1), device=DEVICE),
    )  # fmt: skip


def batched(x: dict, split: int) -> dict:
    """The same tokens as ``split`` sequences."""
    return {name: t.reshape(split, t.shape[1] // split, *t.shape[2:]) if t.dim() > 1 else t
            for name, t in x.items()}  # fmt: skip


def kernel_args(x: dict, kind: str) -> tuple:
    """``launch_chunk_kda``'s positional arguments for ``x``."""
    options = OPTIONS[kind]
    inputs = DeltaRuleInputs(*(x[name] for name in DeltaRuleInputs._fields))
    return inputs, None, None, DeltaRuleOptions(DIM**-0.5, options.get("lower_bound"), True, True)


def fla_call(kind: str):
    if kind == "kda":
        from fla.ops.kda import chunk_kda
    else:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as chunk_kda
    return chunk_kda


def run_case(kind: str, length: int, value_heads: int, split: int, variants: bool,
             fla: bool, results: Results) -> None:  # fmt: skip
    options = OPTIONS[kind]
    long = inputs(kind, 1, length, value_heads)
    split_x = batched(long, split)
    case = f"{kind} fwd B=1 T={length} HV={value_heads} D={DIM}"
    extra = dict(kind=kind, T=length, HV=value_heads, split=split)
    libraries = {"kda-ops": kda_ops.chunk_kda}
    if fla:
        libraries["fla"] = fla_call(kind)
    rows = []
    with torch.no_grad():
        for library, call in libraries.items():
            long_ms = time_ms(lambda c=call: c(**long, **options))
            split_ms = time_ms(lambda c=call: c(**split_x, **options))
            rows += [
                row(case, library, "time_long", [long_ms * 1e3], "us", **extra),
                row(case, library, "time_batched", [split_ms * 1e3], "us", **extra),
                row(case, library, "long_over_batched", [long_ms / split_ms], "ratio", **extra),
                row(case, library, "tokens_per_s_long", [length / long_ms * 1e3], "1/s",
                    **extra),
            ]  # fmt: skip
            print(f"{case} {library}: long {long_ms * 1e3:.1f} µs, batched x{split} "
                  f"{split_ms * 1e3:.1f} µs, ratio {long_ms / split_ms:.3f}, "
                  f"{length / long_ms / 1e3:.2f} M tok/s", flush=True)  # fmt: skip
        if variants:
            args = kernel_args(long, kind)
            planned, _ = kda_ops.chunk_kda(**long, **options)
            for chunk, segments in VARIANTS:
                if length % (64 * segments) or length // segments < 1024:
                    continue
                ms = time_ms(lambda c=chunk, s=segments: launch_chunk_kda(*args, segments=s,
                                                                          chunk=c))  # fmt: skip
                o, _ = launch_chunk_kda(*args, segments=segments, chunk=chunk)
                difference = relative_error(o, planned)
                kernels = kernel_times_us(lambda c=chunk, s=segments: launch_chunk_kda(
                    *args, segments=s, chunk=c), steps=3)  # fmt: skip
                kernels = {name[:60]: us for name, us in kernels.items()}
                rows.append(row(case, "kda-ops", "time_long_variant", [ms * 1e3], "us",
                                chunk=chunk, segments=segments, o_vs_planned=difference,
                                kernels_us=kernels, **extra))  # fmt: skip
                split = ", ".join(f"{name} {us:.0f}" for name, us in kernels.items())
                print(f"    chunk {chunk}, {segments} segments: {ms * 1e3:.1f} µs "
                      f"(o vs planned {difference:.1e}); kernels µs: {split}",
                      flush=True)  # fmt: skip
    results.add(rows)


def plot(results: Results, path: str) -> None:
    """Tokens per second of the long sequence against T, a line per kind and head count,
    the batched shape dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7, 4.5))
    series: dict[tuple, dict[str, list]] = {}
    for r in results.rows:
        if r.get("library") != "kda-ops" or r["metric"] not in ("time_long", "time_batched"):
            continue
        line = series.setdefault((r["kind"], r["HV"], r["metric"]), {"T": [], "rate": []})
        line["T"].append(r["T"])
        line["rate"].append(r["T"] / r["median"])  # tokens per µs = M tokens / s
    for (kind, heads, metric), line in sorted(series.items()):
        style = "-" if metric == "time_long" else "--"
        label = f"{kind} HV={heads} " + ("B=1" if metric == "time_long" else "batched")
        axis.plot(line["T"], line["rate"], style, marker="o", label=label)
    axis.set_xscale("log", base=2)
    axis.set_xlabel("tokens T")
    axis.set_ylabel("M tokens / s (forward)")
    axis.legend(fontsize=7, ncol=2)
    axis.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    print(f"wrote {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kinds", nargs="+", default=["kda", "gdn"], choices=list(OPTIONS))
    parser.add_argument("--lengths", nargs="+", type=int,
                        default=[8192, 32768, 131072, 524288, 1048576])  # fmt: skip
    parser.add_argument("--heads", nargs="+", type=int, default=[8, 16, 32, 64],
                        help="value heads")  # fmt: skip
    parser.add_argument("--split", type=int, default=8, help="batch of the same tokens")
    parser.add_argument("--variants", action="store_true", help="forced chunk / segments")
    parser.add_argument("--fla", action="store_true", help="FLA 0.6.0 on the same cases")
    parser.add_argument("--max-head-tokens", type=int, default=2**23)
    parser.add_argument("--budget-s", type=float, default=None, help="stop starting cases after")
    parser.add_argument("--plot", default=None, help="PNG of tokens / s against T")
    add_arguments(parser, "long_sequence")
    args = parser.parse_args()
    results = Results.from_args("long_sequence", args)
    started = time.monotonic()
    for kind in args.kinds:
        for heads in args.heads:
            for length in args.lengths:
                if length * heads > args.max_head_tokens:
                    continue
                if args.budget_s is not None and time.monotonic() - started > args.budget_s:
                    print(f"budget of {args.budget_s} s spent: stopping before {kind} "
                          f"T={length} HV={heads}")  # fmt: skip
                    break
                run_case(kind, length, heads, args.split, args.variants, args.fla, results)
                torch.cuda.empty_cache()
    if args.plot:
        plot(results, args.plot)
    print(f"\nwrote {results.path}")


if __name__ == "__main__":
    main()
