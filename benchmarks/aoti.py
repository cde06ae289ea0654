"""The hybrid example model's steps as AOTInductor packages (``lowering.aoti``) against the
same steps in eager PyTorch and compiled with ``backend="kda"``, in one process.

Times a decode step (batch 1 and 64 after an empty cache) and a prefill (batch 1, T = 48)
of the tiny :class:`HybridConfig` model: the package through ``aoti_load_package`` (the
call goes straight to the compiled C++), eager ``lowering.export.ExplicitStateStep``, and
``torch.compile(backend="kda")`` of it; on CUDA (``--device cuda``) that compile also with
``mode="reduce-overhead"`` (CUDA graphs), and the package's kernels are kda's Triton ones,
timed by the C++ runner (``--runner``) rather than loaded into Python.
Rounds rotate the order; a round's value is the median of its calls
(``harness.rotated_rounds``; ``harness.cpu_time_ms`` wall time, synchronized on CUDA).
Writes the rows to ``--out`` (default ``benchmarks/results/aoti.json``, or
``aoti_cuda.json``). Usage::

    python benchmarks/aoti.py --no-shared-machine [--device cuda]
"""

from __future__ import annotations

import argparse
import functools
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the examples/ folder

from harness import cpu_time_ms, rotated_rounds  # benchmarks/, the script's folder
from results import Results, add_arguments, row

from examples.hybrid_model import HybridConfig, HybridLM
from lowering import aoti, export
from lowering.inductor import kda_backend

CASES = (("decode", 1, 1), ("decode", 64, 1), ("prefill", 1, 48))  # step, batch, T


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--calls", type=int, default=100, help="timed calls a round")
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    parser.add_argument("--runner", type=Path, help="the built C++ runner: also time its decode")
    known, _ = parser.parse_known_args()
    benchmark = "aoti" if known.device == "cpu" else f"aoti_{known.device}"
    add_arguments(parser, benchmark)
    args = parser.parse_args()
    results = Results.from_args(benchmark, args)
    torch.manual_seed(0)
    model = HybridLM(HybridConfig()).to(args.device).eval().requires_grad_(False)
    cuda = args.device == "cuda"
    directory = tempfile.mkdtemp()
    paths = aoti.package_steps(model, directory)
    # A CUDA package loaded into this Python process crashed on the H200 (torch 2.11, a
    # segfault in the package's own device-string parsing) while the C++ runner ran the
    # same packages: on CUDA the runner alone times them.
    packages = {} if cuda else {step: torch._inductor.aoti_load_package(path)
                                for step, path in paths.items()}  # fmt: skip
    for step, batch, length in CASES:
        eager = export.ExplicitStateStep(model, step)
        compiled = torch.compile(eager, backend=kda_backend, dynamic=False)
        runs = {"eager": eager, "compile(kda)": compiled}
        if step in packages:
            runs["package"] = packages[step]
        if cuda:
            runs["compile(kda, reduce-overhead)"] = torch.compile(
                eager, backend=kda_backend, mode="reduce-overhead", dynamic=False
            )
        ids = torch.randint(model.config.vocab_size, (batch, length), device=args.device)
        inputs = (ids, *export.flatten_cache(model.new_cache(batch)))
        calls = {name: _synchronized(functools.partial(run, *inputs), cuda)
                 for name, run in runs.items()}  # fmt: skip
        timer = functools.partial(cpu_time_ms, repeats=args.calls)
        with torch.no_grad():
            values = rotated_rounds(calls, args.rounds, timer)
        case = f"{step} B={batch} T={length}"
        results.add(row(case, name, "step time", [ms * 1e3 for ms in times], "us")
                    for name, times in values.items())  # fmt: skip
        if args.runner is not None and step == "decode":
            times = _runner_decode_us(args.runner, directory, model, batch, args.rounds, args.calls)
            values["C++ runner"] = [us * 1e-3 for us in times]
            results.add([row(case, "C++ runner", "step time", times, "us")])
        print(case, "  ".join(f"{name} {statistics.median(v) * 1e3:.0f} us"
                              for name, v in values.items()))  # fmt: skip


def _runner_decode_us(runner: Path, directory: str, model: HybridLM, batch: int, rounds: int,
                      steps: int) -> list[float]:  # fmt: skip
    """Per round (a process), the median microseconds of the C++ runner's decode calls after
    a one-token prompt of ``batch`` sequences, the first two decode steps left out (warm-up)."""
    prompt = [str(token) for token in range(batch)]
    medians = []
    for _ in range(rounds):
        command = [str(runner), directory, str(steps + 2), *prompt]
        output = subprocess.run(command, check=True, capture_output=True, text=True).stdout
        times = [float(line.split()[2]) for line in output.splitlines()
                 if line.startswith("time ") and int(line.split()[1]) > 2]  # fmt: skip
        medians.append(statistics.median(times))
    return medians


def _synchronized(call, cuda: bool):
    """``call``, then a wait for the GPU on CUDA: a step's wall time to its results."""
    if not cuda:
        return call

    def synchronized():
        call()
        torch.cuda.synchronize()

    return synchronized


if __name__ == "__main__":
    main()
