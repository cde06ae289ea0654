"""Export the hybrid model's prefill and decode steps to ONNX, in both modes.

``python examples/export_onnx.py [OUT_DIR]`` (from the repository root) writes
``{prefill,decode}_{portable,plugin}.onnx`` for the tiny :class:`HybridConfig` model.
Inputs are ``input_ids`` then every state
(``layer{i}.conv_q`` ... ``layer{i}.length``, see ``lowering.export.state_names``); outputs
``logits`` then ``new.<state name>``. Batch is dynamic in both steps and T in prefill. The
portable files run in onnxruntime; the plugin files hold one ``kda``-domain node per op for
TensorRT (``lowering/tensorrt.py``).
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import torch

if __package__ in (None, ""):  # run as a file: the repository root holds `examples`
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from examples.hybrid_model import HybridConfig, HybridLM
from lowering import export
from lowering import onnx as kda_onnx

STEPS = ("prefill", "decode")


def io_names(model: HybridLM) -> tuple[list[str], list[str]]:
    """ONNX graph input and output names of a step."""
    states = export.state_names(model)
    return ["input_ids", *states], ["logits", *(f"new.{name}" for name in states)]


def export_hybrid(
    model: HybridLM, out_dir: pathlib.Path, modes: tuple[str, ...] = kda_onnx.MODES
) -> dict[tuple[str, str], pathlib.Path]:
    """Export both steps of ``model`` in every mode; returns ``{(step, mode): path}``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    inputs, outputs = io_names(model)
    paths = {}
    for step in STEPS:
        program = export.export_step(model, step)
        for mode in modes:
            path = out_dir / f"{step}_{mode}.onnx"
            kda_onnx.export_onnx(program, str(path), mode, inputs, outputs)
            paths[step, mode] = path
    return paths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", nargs="?", default="onnx_out", type=pathlib.Path,
                        help="where the .onnx files go (default: onnx_out)")  # fmt: skip
    out_dir = parser.parse_args().out_dir
    torch.manual_seed(0)
    model = HybridLM(HybridConfig()).eval().requires_grad_(False)
    for (step, mode), path in export_hybrid(model, out_dir).items():
        print(f"{step:8s} {mode:9s} {path}")


if __name__ == "__main__":
    main()
