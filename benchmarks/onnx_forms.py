"""The ONNX forms of a KDA / Gated DeltaNet prefill in onnxruntime (CPU), against each other
and the PyTorch CPU op, in ``--rounds`` rounds of rotated order.

Forms (``lowering.onnx`` modes): ``token`` (opset 18, a ``Scan`` over tokens), ``portable``
(opset 18, 32-token chunks of matrix products in a ``Scan`` over steps of 8 chunks) and
``standard`` (opset 27, onnxruntime's own ``LinearAttention``). Each session gets
``--threads`` intra-op threads and one inter-op thread; PyTorch gets the same
(``torch.set_num_threads``). Every form's output is checked against the PyTorch op before it
is timed.

Usage: ``python benchmarks/onnx_forms.py [--length 2048] [--heads 4] [--dim 64]
[--threads 1 2] [--gates kda gdn] [--rounds 5] [--shared-machine | --no-shared-machine]
[--out benchmarks/results/onnx_forms.json]``.
"""

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import onnxscript
import torch
from harness import rotated_rounds
from results import Results, add_arguments, row

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # lowering/ beside kda_ops

import kda_ops
from lowering import onnx as kda_onnx

FORMS = ("token", "portable", "standard")


class Prefill(torch.nn.Module):
    """One delta-rule prefill with the gate, beta sigmoid and l2norm in the kernel."""

    def __init__(self, heads: int, dim: int, per_head: bool) -> None:
        super().__init__()
        self.A_log = torch.nn.Parameter(torch.zeros(heads), requires_grad=False)
        width = heads * (1 if per_head else dim)
        self.dt_bias = torch.nn.Parameter(torch.zeros(width), requires_grad=False)

    def forward(self, q, k, v, g, beta, state):
        return kda_ops.chunk_kda(
            q, k, v, g, beta, initial_state=state, output_final_state=True,
            use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
            use_beta_sigmoid_in_kernel=True, A_log=self.A_log, dt_bias=self.dt_bias,
            lower_bound=-5.0,
        )  # fmt: skip


def inputs(length: int, heads: int, dim: int, per_head: bool) -> tuple[torch.Tensor, ...]:
    gate = (1, length, heads) if per_head else (1, length, heads, dim)
    return (
        torch.randn(1, length, heads, dim), torch.randn(1, length, heads, dim),
        torch.randn(1, length, heads, dim), torch.randn(gate), torch.randn(1, length, heads),
        torch.randn(1, heads, dim, dim),
    )  # fmt: skip


def session(path: str, threads: int, flush_denormals: bool) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    if flush_denormals:
        # A long chunk's decays underflow into denormal floats, which x86 multiplies
        # about a hundred times slower; ORT flushes them to zero when asked.
        options.add_session_config_entry("session.set_denormal_as_zero", "1")
    return ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])


def run_pytorch(model: torch.nn.Module, example: tuple[torch.Tensor, ...]) -> None:
    with torch.no_grad():
        model(*example)


def wall_ms(fn, repeats: int = 3) -> float:
    """Median wall milliseconds of ``fn`` over ``repeats`` calls."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return float(np.median(times))


def cpu_ms(fn, repeats: int = 3) -> float:
    """Median process CPU milliseconds (all threads) of ``fn`` over ``repeats`` calls: on a
    machine shared with other work, the one-thread figure that waiting does not inflate
    (with more threads it counts their spinning too)."""
    times = []
    for _ in range(repeats):
        start = time.process_time()
        fn()
        times.append((time.process_time() - start) * 1e3)
    return float(np.median(times))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--gates", nargs="+", default=["kda", "gdn"], choices=["kda", "gdn"])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--flush-denormals", action=argparse.BooleanOptionalAction, default=True,
        help="sessions flush denormal floats to zero (session.set_denormal_as_zero); "
        "PyTorch likewise (torch.set_flush_denormal)",
    )  # fmt: skip
    add_arguments(parser, "onnx_forms")
    args = parser.parse_args()
    results = Results.from_args("onnx_forms", args)
    workdir = Path(tempfile.mkdtemp(prefix="onnx_forms_"))
    machine = dict(cpu_cores=os.cpu_count(), onnxruntime=ort.__version__,
                   onnx=onnx.__version__, onnxscript=onnxscript.__version__)  # fmt: skip
    torch.manual_seed(0)
    torch.set_flush_denormal(args.flush_denormals)
    for gate in args.gates:
        per_head = gate == "gdn"
        model = Prefill(args.heads, args.dim, per_head)
        example = inputs(args.length, args.heads, args.dim, per_head)
        names = ["q", "k", "v", "g", "beta", "state"]
        length = torch.export.Dim("T", min=2, max=1 << 20)
        program = torch.export.export(model, example,
                                      dynamic_shapes=({1: length},) * 5 + (None,))  # fmt: skip
        paths = {}
        for form in FORMS:
            paths[form] = str(workdir / f"{gate}_{form}.onnx")
            kda_onnx.export_onnx(program, paths[form], form, input_names=names,
                                 output_names=["o", "final_state"])  # fmt: skip
        feeds = {n: t.numpy() for n, t in zip(names, example)}
        with torch.no_grad():
            expected = [t.numpy() for t in model(*example)]
        case = f"{gate} B1 T{args.length} H{args.heads} D{args.dim} fp32"
        for threads in args.threads:
            torch.set_num_threads(threads)
            calls, errors = {}, {}
            for form in FORMS:
                run = session(paths[form], threads, args.flush_denormals)
                got = run.run(None, feeds)
                errors[form] = max(float(np.abs(g - e).max()) for g, e in zip(got, expected))
                calls[form] = lambda run=run, feeds=feeds: run.run(None, feeds)
            calls["pytorch"] = lambda model=model, example=example: run_pytorch(model, example)
            for metric, timer in (("wall", wall_ms), ("cpu", cpu_ms)):
                times = rotated_rounds(calls, args.rounds, timer=timer)
                for name, values in times.items():
                    extra = dict(threads=threads, onnx_opset=kda_onnx.MODE_OPSETS.get(name),
                                 flush_denormals=args.flush_denormals, **machine)  # fmt: skip
                    if name in errors:
                        extra["max_abs_error_vs_pytorch"] = errors[name]
                    library = "pytorch-cpu" if name == "pytorch" else f"onnxruntime-{name}"
                    results.add(row(case, library, metric, values, "ms", **extra))
                    print(f"{case} threads={threads} {library} {metric}: "
                          f"{np.median(values):.2f} ms")  # fmt: skip
    print(f"wrote {os.path.relpath(args.out)}")


if __name__ == "__main__":
    main()
