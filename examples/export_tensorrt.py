"""Build TensorRT engines for the hybrid model's decode and prefill steps.

``python examples/export_tensorrt.py [OUT_DIR]`` (from the repository root, on a machine
with an sm_90 GPU, TensorRT >= 10.x with ``tensorrt.plugin``, and for (a) Torch-TensorRT)
writes, per step:

(a) ``{step}_torch_trt.engine``: the exported program (``lowering.export.export_step``)
    converted by Torch-TensorRT, the ``kda`` ops through the converters of
    ``lowering.tensorrt_plugins`` (AOT plugins: the chunk prefill as the prepare ->
    recurrence chain);
(b) ``{step}_onnx.engine``: the plugin-mode ONNX file (``examples.export_onnx``) parsed by
    ``trt.OnnxParser``, each ``kda``-domain node found as the ``kda::<op>`` plugin
    (the chunk prefill is the ``chunk_prepare`` -> ``chunk_recurrence`` node pair).

Batch is dynamic (1 to 8), and T in prefill (1 to 64). Without TensorRT it exits with a
message; it has never been run (TensorRT cannot be installed where it was written).
"""

from __future__ import annotations

import argparse
import importlib.util
import pathlib
import sys

import torch

if __package__ in (None, ""):  # run as a file: the repository root holds `examples`
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from examples import export_onnx
from examples.hybrid_model import HybridConfig, HybridLM
from lowering import export

MAX_BATCH, MAX_LENGTH = 8, 64


def require_tensorrt() -> None:
    """Exit with a clear message when TensorRT (``tensorrt.plugin``) is not importable."""
    if importlib.util.find_spec("tensorrt") is None:
        sys.exit(
            "examples/export_tensorrt.py needs TensorRT >= 10.x (`tensorrt.plugin`) and an sm_90 "
            "GPU; `tensorrt` is not importable here."
        )


def build_from_onnx(path: pathlib.Path, step: str) -> bytes:
    """(b) Serialized engine from a plugin-mode ONNX file."""
    import tensorrt as trt

    from lowering.tensorrt_plugins import register_plugins

    register_plugins()
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(0)
    parser = trt.OnnxParser(network, logger)
    if not parser.parse(path.read_bytes()):
        errors = "\n".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise RuntimeError(f"{path}: ONNX parse failed:\n{errors}")
    config = builder.create_builder_config()
    profile = builder.create_optimization_profile()
    for index in range(network.num_inputs):
        tensor = network.get_input(index)
        low, opt, high = _profile(tuple(tensor.shape), step)
        profile.set_shape(tensor.name, low, opt, high)
    config.add_optimization_profile(profile)
    engine = builder.build_serialized_network(network, config)
    if engine is None:
        raise RuntimeError(f"{path}: engine build failed")
    return bytes(engine)


def _profile(shape: tuple[int, ...], step: str) -> tuple[tuple, ...]:
    """(min, opt, max) shapes of an input: dynamic dim 0 is batch (1..MAX_BATCH), any
    other dynamic dim is T (1..MAX_LENGTH, prefill only)."""

    def bounds(index: int, dim: int) -> tuple[int, int, int]:
        if dim >= 0:
            return dim, dim, dim
        high = MAX_BATCH if index == 0 else MAX_LENGTH
        return 1, high // 2, high

    ranges = [bounds(i, d) for i, d in enumerate(shape)]
    return tuple(tuple(r[j] for r in ranges) for j in range(3))


def program_inputs(torch_tensorrt: object, model: HybridLM, step: str) -> list:
    """``torch_tensorrt.Input`` s of the exported step with the ranges above (batch dim 0 of
    every input, prefill's T dim 1 of ``input_ids``): example tensors would fix the engine
    to their B = 3, T = 5."""
    inputs = []
    for index, x in enumerate(export.example_inputs(model, step)):
        dynamic = {0, 1} if index == 0 and step == "prefill" else {0}
        shape = tuple(-1 if d in dynamic else n for d, n in enumerate(x.shape))
        low, opt, high = _profile(shape, step)
        inputs.append(torch_tensorrt.Input(min_shape=low, opt_shape=opt, max_shape=high,
                                           dtype=x.dtype))  # fmt: skip
    return inputs


def build_from_program(model: HybridLM, step: str, device: str = "cuda") -> bytes:
    """(a) Serialized engine from the exported program through Torch-TensorRT."""
    import torch_tensorrt

    from lowering.tensorrt_plugins import register_torch_tensorrt_converters

    register_torch_tensorrt_converters()
    model = model.to(device)
    program = export.export_step(model, step)
    return torch_tensorrt.dynamo.convert_exported_program_to_serialized_trt_engine(
        program, arg_inputs=program_inputs(torch_tensorrt, model, step), min_block_size=1
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", nargs="?", default="trt_out", type=pathlib.Path,
                        help="where the engines and ONNX files go (default: trt_out)")  # fmt: skip
    out_dir = parser.parse_args().out_dir
    require_tensorrt()
    torch.manual_seed(0)
    model = HybridLM(HybridConfig()).eval().requires_grad_(False)
    onnx_files = export_onnx.export_hybrid(model, out_dir, modes=("plugin",))
    for step in export_onnx.STEPS:
        path = out_dir / f"{step}_onnx.engine"
        path.write_bytes(build_from_onnx(onnx_files[step, "plugin"], step))
        print(f"{step:8s} onnx       {path}")
        if importlib.util.find_spec("torch_tensorrt") is None:
            print(f"{step:8s} torch_trt  skipped: torch_tensorrt is not importable")
            continue
        path = out_dir / f"{step}_torch_trt.engine"
        path.write_bytes(build_from_program(model, step))
        print(f"{step:8s} torch_trt  {path}")


if __name__ == "__main__":
    main()
