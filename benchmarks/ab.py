"""A/B timing of kernel changes: one chunk_kda training step (forward + backward of every
input; gate, beta sigmoid and l2norm in the kernel; random gate parameters), or with
``--forward`` the inference forward, timed from several source trees, each in a process
of its own, in rounds of alternating order, and every tree's gradients (or outputs)
compared with the first tree's. Ours only: FLA's time moves by
several percent between machines (``docs/benchmarks.md``), while trees timed one after
another on one GPU compare with each other.

A tree is a directory holding a ``kda_ops`` package (``.``: this checkout; the GPU
machine's copy of the working tree has no ``.git``, so take other trees there as
directories, e.g. made by ``git archive REF kda_ops | tar -x -C DIR``) or a git ref of this
repository (its ``kda_ops`` taken with ``git archive``), optionally with module constants
of ``kda_ops.kernels`` set: ``TREE[:MODULE.NAME=VALUE,...]``, e.g.
``main:chunk.backward.state.STATE_WARPS=4``. ``--gdn``: Gated DeltaNet (Qwen3-Next's
layer core: ``--heads`` value heads, half as many q / k heads, a scalar gate).

Usage (GPU): ``python benchmarks/ab.py main my-branch my-branch:chunk.backward.state.STATE_WARPS=4
[--rounds 2] [--heads 64] [--length 8192] [--softplus | --gdn] [--disable-recompute] [--varlen]
[--forward] [--shared-machine | --no-shared-machine] [--out benchmarks/results/ab.json]``.
Without a GPU it runs kda_ops' CPU path, the PyTorch reference (small
shapes: ``--length 128 --heads 2 --dim 16``), which checks the plumbing, not the kernels.
"""

import argparse
import ast
import importlib
import io
import json
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import torch
from harness import relative_error, time_ms
from results import Results, add_arguments, row

ROOT = Path(__file__).resolve().parents[1]
GRADIENTS = ("q", "k", "v", "g", "beta", "A_log", "dt_bias")


def parse_tree(spec: str) -> tuple[str, dict[str, object]]:
    """``TREE[:MODULE.NAME=VALUE,...]`` -> (tree, {"MODULE.NAME": value})."""
    ref, _, settings = spec.partition(":")
    values = {}
    for item in filter(None, settings.split(",")):
        name, sep, value = item.partition("=")
        if not sep or "." not in name:
            raise ValueError(f"setting {item!r} of {spec!r} is not MODULE.NAME=VALUE")
        values[name] = ast.literal_eval(value)
    return ref, values


def materialise(ref: str, into: Path) -> Path:
    """The directory holding ``ref``'s ``kda_ops``: ``ref`` itself where it is one."""
    if (Path(ref) / "kda_ops").is_dir():
        return Path(ref).resolve()
    archive = subprocess.run(["git", "archive", "--format=tar", ref, "kda_ops"], cwd=ROOT,
                             check=True, capture_output=True).stdout  # fmt: skip
    tree = into / ref.replace("/", "_")
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(tree, filter="data")
    return tree


def worker(args: argparse.Namespace) -> None:
    """Times the step from ``args.tree`` and saves its gradients (with ``--forward``, its
    outputs); prints JSON."""
    sys.path.insert(0, args.tree)
    import kda_ops

    if not Path(kda_ops.__file__).is_relative_to(args.tree):
        raise RuntimeError(f"kda_ops imported from {kda_ops.__file__}, not {args.tree}")
    from ops import varlen_cu_seqlens  # after the tree's kda_ops, which ops.py imports

    for name, value in json.loads(args.settings).items():
        module_name, _, constant = name.rpartition(".")
        module = importlib.import_module(f"kda_ops.kernels.{module_name}")
        if not hasattr(module, constant):
            raise AttributeError(f"kda_ops.kernels.{module_name} has no {constant}")
        setattr(module, constant, value)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    generator = torch.Generator().manual_seed(0)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=generator) * scale).to(device)

    h, t, d = args.heads, args.length, args.dim
    x = {name: rand(1, t, h, d).to(dtype) for name in ("q", "k", "v", "g")}
    x["beta"] = rand(1, t, h).to(dtype)
    x["A_log"], x["dt_bias"] = rand(h), rand(h * d, scale=0.5)
    if args.gdn:  # Qwen3-Next's layer core: half as many q / k heads, one decay a head
        x["q"], x["k"] = (rand(1, t, h // 2, d).to(dtype) for _ in range(2))
        x["g"], x["dt_bias"] = rand(1, t, h).to(dtype), rand(h, scale=0.5)
    options = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                   use_beta_sigmoid_in_kernel=True, disable_recompute=args.disable_recompute,
                   lower_bound=None if args.softplus or args.gdn else -5.0)  # fmt: skip
    if args.varlen:
        options["cu_seqlens"] = varlen_cu_seqlens(t)
    leaves = [x[name].requires_grad_() for name in GRADIENTS]
    grad_o = rand(1, t, h, d).to(dtype)

    def step():
        if args.forward:
            with torch.no_grad():
                return kda_ops.chunk_kda(**x, **options, output_final_state=True)
        o, _ = kda_ops.chunk_kda(**x, **options)
        return torch.autograd.grad(o, leaves, grad_o)

    torch.save([result.float().cpu() for result in step()], args.grads)
    if device == "cuda":
        ms = time_ms(step)
    else:
        times = []
        for _ in range(3):
            start = time.perf_counter()
            step()
            times.append((time.perf_counter() - start) * 1e3)
        ms = statistics.median(times)
    print(json.dumps({"ms": ms}))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("trees", nargs="*", help="TREE[:MODULE.NAME=VALUE,...]")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--heads", type=int, default=64)
    parser.add_argument("--length", type=int, default=8192)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--softplus", action="store_true", help="Kimi Linear's unbounded gate")
    parser.add_argument("--gdn", action="store_true", help="Gated DeltaNet (module docstring)")
    parser.add_argument("--disable-recompute", action="store_true")
    parser.add_argument("--forward", action="store_true", help="the inference forward alone")
    parser.add_argument("--varlen", action="store_true",
                        help="ops.py's packed varlen lengths in --length tokens")  # fmt: skip
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--tree", help=argparse.SUPPRESS)
    parser.add_argument("--settings", default="{}", help=argparse.SUPPRESS)
    parser.add_argument("--grads", help=argparse.SUPPRESS)
    add_arguments(parser, "ab")
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    if not args.trees:
        parser.error("name at least one tree")
    shape = ["--heads", str(args.heads), "--length", str(args.length), "--dim", str(args.dim)]
    shape += ["--softplus"] * args.softplus + ["--disable-recompute"] * args.disable_recompute
    shape += ["--gdn"] * args.gdn
    shape += ["--forward"] * args.forward + ["--varlen"] * args.varlen
    names = ("o", "final_state") if args.forward else GRADIENTS
    with tempfile.TemporaryDirectory() as scratch:
        scratch = Path(scratch)
        trees = [parse_tree(spec) for spec in args.trees]
        dirs = {ref: materialise(ref, scratch) for ref, _ in trees}
        times = [[] for _ in trees]
        for round_ in range(args.rounds):
            order = range(len(trees)) if round_ % 2 == 0 else reversed(range(len(trees)))
            for index in order:
                ref, settings = trees[index]
                command = [sys.executable, __file__, "--worker", "--tree", str(dirs[ref]),
                           "--settings", json.dumps(settings),
                           "--grads", str(scratch / f"grads_{index}.pt"), *shape]  # fmt: skip
                result = subprocess.run(command, capture_output=True, text=True)
                if result.returncode != 0:
                    raise RuntimeError(f"{args.trees[index]} failed:\n{result.stderr[-4000:]}")
                times[index].append(json.loads(result.stdout.splitlines()[-1])["ms"])
                print(f"round {round_ + 1}: {args.trees[index]} {times[index][-1] * 1e3:.1f} µs",
                      flush=True)  # fmt: skip
        first = torch.load(scratch / "grads_0.pt")
        compared = "outputs" if args.forward else "gradients"
        results = Results.from_args("ab", args)
        step = "forward" if args.forward else "forward + backward"
        case = f"chunk_kda {step} B=1 T={args.length} H={args.heads} D={args.dim}" + (
            ", Gated DeltaNet" if args.gdn else ", softplus gate" if args.softplus else "") + (
            ", varlen" if args.varlen else "") + (
            ", disable_recompute" if args.disable_recompute else "")  # fmt: skip
        print(f"\n| tree | µs a step, by round | vs first | {compared} vs first (rel.) |")
        print("| --- | --- | ---: | --- |")
        base = statistics.median(times[0])
        for index, spec in enumerate(args.trees):
            got = torch.load(scratch / f"grads_{index}.pt")
            errors = [relative_error(a, b) for a, b in zip(got, first)]
            spread = ", ".join(f"{ms * 1e3:.1f}" for ms in times[index])
            ratio = statistics.median(times[index]) / base
            grads = " ".join(f"{n} {e:.1e}" for n, e in zip(names, errors))
            print(f"| {spec} | {spread} | {ratio:.3f} | {grads} |")
            results.add(row(case, f"kda-ops {spec}", "step_time", [ms * 1e3 for ms in times[index]],
                            "us", tree=spec, vs_first=ratio,
                            errors_vs_first=dict(zip(names, errors))))  # fmt: skip
        print(f"\nwrote {results.path}")


if __name__ == "__main__":
    main()
