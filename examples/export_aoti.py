"""Package the hybrid model's prefill and decode steps with AOTInductor, run them from C++.

``python examples/export_aoti.py [OUT_DIR] [--runner PATH]`` (from the repository root)
writes ``OUT_DIR/prefill.pt2`` and ``decode.pt2`` for the tiny :class:`HybridConfig` model
(``lowering.aoti.package_steps``; the weights are inside), then prefills random prompts and
decodes greedily with the packages and with the eager model and compares the logits. With
``--runner`` (the C++ program of ``examples/aoti_runner/``, built as its CMakeLists.txt
says) the packages run in that process, which has no Python interpreter; without it they
run here through ``torch._inductor.aoti_load_package``. ``--device cuda`` builds CUDA
packages, which launch kda's Triton kernels from C++.
"""

from __future__ import annotations

import argparse
import pathlib
import subprocess
import sys
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

if __package__ in (None, ""):  # run as a file: the repository root holds `examples`
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from examples.hybrid_model import HybridConfig, HybridLM
from lowering import aoti, export

# The runner's greedy run: per step (0 = the prefill) the last position's logits
# [B, vocab] and the next tokens [B].
Greedy = list[tuple[Tensor, Tensor]]


def greedy_steps(
    step: Callable[..., Sequence[Tensor]], prompts: Tensor, states: Sequence[Tensor], steps: int
) -> Greedy:
    """Prefill ``prompts`` [B, T] then ``steps`` greedy decode steps through ``step(name,
    input_ids, *states) -> (logits, *new_states)``."""
    ids, results = prompts, []
    for index in range(steps + 1):
        logits, *states = step("prefill" if index == 0 else "decode", ids, *states)
        last = logits[:, -1].float()
        results.append((last, last.argmax(-1)))
        ids = results[-1][1].unsqueeze(1)
    return results


def eager_steps(model: HybridLM, prompts: Tensor, steps: int) -> Greedy:
    """:func:`greedy_steps` of the eager model's functional steps."""
    modules = {name: export.ExplicitStateStep(model, name) for name in ("prefill", "decode")}
    states = export.flatten_cache(model.new_cache(prompts.shape[0]))
    with torch.no_grad():
        return greedy_steps(lambda name, *args: modules[name](*args), prompts.to(states[0].device),
                            states, steps)  # fmt: skip


def package_steps_here(
    paths: dict[str, str], model: HybridLM, prompts: Tensor, steps: int
) -> Greedy:
    """:func:`greedy_steps` of the packages loaded into this process."""
    loaded = {name: torch._inductor.aoti_load_package(path) for name, path in paths.items()}
    states = export.flatten_cache(model.new_cache(prompts.shape[0]))
    return greedy_steps(lambda name, *args: loaded[name](*args), prompts.to(states[0].device),
                        states, steps)  # fmt: skip


def runner_steps(
    runner: pathlib.Path, package_dir: pathlib.Path, prompts: Tensor, steps: int
) -> Greedy:
    """:func:`greedy_steps` of the packages in ``package_dir`` run by the C++ ``runner``."""
    ids = [",".join(map(str, prompt)) for prompt in prompts.tolist()]
    command = [str(runner), str(package_dir), str(steps), *ids]
    output = subprocess.run(command, check=True, capture_output=True, text=True).stdout
    logits: dict[int, list[list[float]]] = {}
    tokens: dict[int, list[int]] = {}
    for line in output.splitlines():
        kind, step, *values = line.split()
        if kind == "logits":
            logits.setdefault(int(step), []).append([float(v) for v in values[1:]])
        elif kind == "tokens":
            tokens[int(step)] = [int(v) for v in values]
    return [(torch.tensor(logits[s]), torch.tensor(tokens[s])) for s in range(steps + 1)]


def largest_difference(got: Greedy, expected: Greedy) -> float:
    """The largest absolute logit difference over all steps (inf where tokens differ)."""
    if any(not torch.equal(a[1].cpu(), b[1].cpu()) for a, b in zip(got, expected, strict=True)):
        return float("inf")
    return max((a[0].cpu() - b[0].cpu()).abs().max().item() for a, b in zip(got, expected))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "out_dir",
        nargs="?",
        default="aoti_out",
        type=pathlib.Path,
        help="where the .pt2 packages go (default: aoti_out)",
    )
    parser.add_argument(
        "--runner",
        type=pathlib.Path,
        help="the built C++ runner (examples/aoti_runner); default: run here",
    )
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--prompt-length", type=int, default=7)
    parser.add_argument("--steps", type=int, default=8, help="decode steps after the prefill")
    args = parser.parse_args()
    torch.manual_seed(0)
    model = HybridLM(HybridConfig()).to(args.device).eval().requires_grad_(False)
    if args.prompt_length + args.steps > model.config.max_seq_len:
        parser.error(f"--prompt-length + --steps must be at most {model.config.max_seq_len}")
    paths = aoti.package_steps(model, args.out_dir)
    print("packages:", ", ".join(paths.values()))
    prompts = torch.randint(model.config.vocab_size, (args.batch, args.prompt_length))
    if args.runner is None:
        got = package_steps_here(paths, model, prompts, args.steps)
    else:
        got = runner_steps(args.runner, args.out_dir, prompts, args.steps)
    where = "here" if args.runner is None else f"in {args.runner}"
    difference = largest_difference(got, eager_steps(model, prompts, args.steps))
    print(f"packages run {where}: tokens {[t.tolist() for _, t in got]}")
    print(f"largest logit difference from eager over {args.steps + 1} steps: {difference:.3g}")


if __name__ == "__main__":
    main()
