"""lowering.onnx_registry: a fresh interpreter that imports nothing but ``kda_ops`` (not
onnx, onnxscript nor torch.onnx, which that import leaves alone) exports a model calling
kda ops with plain ``torch.onnx.export(..., dynamo=True)``: portable below opset 27,
standard from 27, each run in onnxruntime equal to PyTorch."""

import os
import pathlib
import subprocess
import sys

SCRIPT = r"""
import sys

import torch

import kda_ops

assert not {"onnx", "onnxscript", "torch.onnx", "lowering.onnx"} & set(sys.modules)

import numpy as np
import onnxruntime as ort


class Layer(torch.nn.Module):
    def forward(self, x, q, k, g, beta, state):
        y, _ = kda_ops.causal_conv1d(x, torch.ones(8, 4), None, None, "silu")
        v = y.unflatten(-1, (2, 4)).repeat(1, 1, 1, 2)
        return kda_ops.chunk_kda(q, k, v, g, beta, initial_state=state, output_final_state=True,
                                 use_qk_l2norm_in_kernel=True)


torch.manual_seed(0)
args = (torch.randn(1, 70, 8), torch.randn(1, 70, 1, 8), torch.randn(1, 70, 1, 8),
        -torch.rand(1, 70, 2, 8), torch.rand(1, 70, 2), torch.randn(1, 2, 8, 8))
expected = Layer()(*args)
for opset, promised in ((18, "Scan"), (27, "LinearAttention")):
    program = torch.onnx.export(Layer(), args, dynamo=True, opset_version=opset)
    path = f"{sys.argv[1]}/layer{opset}.onnx"
    program.save(path)
    types = {node.op_type for node in program.model.graph}
    assert promised in types, (opset, types)
    assert program.model.opset_imports[""] == opset
    session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    got = session.run(None, {i.name: a.numpy() for i, a in zip(session.get_inputs(), args)})
    for have, want in zip(got, expected):
        np.testing.assert_allclose(have, want.numpy(), rtol=1e-5, atol=1e-5)
print("exported", opset)
"""


def test_plain_import_and_export_in_a_fresh_interpreter(tmp_path):
    root = pathlib.Path(__file__).resolve().parents[2]
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path)], capture_output=True, text=True,
        timeout=600, cwd=root, env={**os.environ, "PYTHONPATH": str(root)},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "exported 27" in result.stdout
