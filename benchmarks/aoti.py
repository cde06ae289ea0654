"""The hybrid example model's steps as AOTInductor packages (``lowering.aoti``) against the
same steps in eager PyTorch and compiled with ``backend="kda"``, on the CPU, in one process.

Times a decode step (batch 1 and 64 after an empty cache) and a prefill (batch 1, T = 48)
of the tiny :class:`HybridConfig` model: the package through ``aoti_load_package`` (the
call goes straight to the compiled C++), eager ``lowering.export.ExplicitStateStep``, and
``torch.compile(backend="kda")`` of it. Rounds rotate the order; a round's value is the
median of its calls (``harness.rotated_rounds``, ``harness.cpu_time_ms``). Writes the rows
to ``--out`` (default ``benchmarks/results/aoti.json``). Usage::

    python benchmarks/aoti.py --no-shared-machine
"""

from __future__ import annotations

import argparse
import functools
import statistics
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
    add_arguments(parser, "aoti")
    args = parser.parse_args()
    results = Results.from_args("aoti", args)
    torch.manual_seed(0)
    model = HybridLM(HybridConfig()).eval().requires_grad_(False)
    with tempfile.TemporaryDirectory() as directory:
        packages = {step: torch._inductor.aoti_load_package(path)
                    for step, path in aoti.package_steps(model, directory).items()}  # fmt: skip
    for step, batch, length in CASES:
        eager = export.ExplicitStateStep(model, step)
        compiled = torch.compile(eager, backend=kda_backend, dynamic=False)
        runs = {"package": packages[step], "eager": eager, "compile(kda)": compiled}
        ids = torch.randint(model.config.vocab_size, (batch, length))
        inputs = (ids, *export.flatten_cache(model.new_cache(batch)))
        calls = {name: functools.partial(run, *inputs) for name, run in runs.items()}
        timer = functools.partial(cpu_time_ms, repeats=args.calls)
        with torch.no_grad():
            values = rotated_rounds(calls, args.rounds, timer)
        case = f"{step} B={batch} T={length}"
        results.add(row(case, name, "step time", [ms * 1e3 for ms in times], "us")
                    for name, times in values.items())  # fmt: skip
        print(case, "  ".join(f"{name} {statistics.median(v) * 1e3:.0f} us"
                              for name, v in values.items()))  # fmt: skip


if __name__ == "__main__":
    main()
