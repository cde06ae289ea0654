"""lowering.tensorrt: every TensorRT-bound kernel AOT-compiles to sm_90 PTX with the ABI
TensorRT's AOT launcher uses (CPU); the PTX, loaded through the CUDA driver and launched
with exactly that argument list and grid, matches the reference (GPU)."""

import dataclasses
import json
import os
import pathlib
import subprocess
import sys
import types

import pytest
import torch

from kda_ops import reference
from kda_ops.kernels.chunk.launch import chunk_plan
from kda_ops.kernels.gate import gate_launch
from lowering import tensorrt as trt_kernels
from tests.lowering.ptx_launch import launch_ptx

ROOT = pathlib.Path(__file__).resolve().parents[2]
# The tiny hybrid model's dims (tests/examples/cases.py): 2 heads x 16, conv width 4.
CONFIG = dict(heads=2, value_heads=2, head_k=16, head_v=16, lower_bound=-5.0, channels=32,
              width=4, dim=16, eps=1e-6, activation="sigmoid")  # fmt: skip


DTYPES = ("float16", "bfloat16", "float32")
REPORT_SCRIPT = """
import json, sys
from lowering.tensorrt import abi_report
print(json.dumps(abi_report(json.loads(sys.argv[1]), tuple(sys.argv[2:]))))
"""


@pytest.fixture(scope="module")
def abi():
    """AOT-compile in a process without TRITON_INTERPRET (interpreted kernels can't compile)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, "-c", REPORT_SCRIPT, json.dumps(CONFIG), *DTYPES],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.splitlines()[-1])


@pytest.mark.parametrize("name", sorted(trt_kernels.PLUGINS))
@pytest.mark.parametrize("dtype", DTYPES)
def test_plugin_kernel_ptx_has_tensorrt_aot_abi(abi, name, dtype):
    entry = abi[f"{name}/{dtype}"]
    assert entry["sm_90"]
    # inputs, int32s, outputs, then one pointer a scratch size the compiled metadata has
    assert entry["params"] == entry["expected"]
    assert ".f32" not in entry["params"] and ".f64" not in entry["params"]  # no floats
    # Triton's scratch pointers are in the entry (TensorRT passes nothing there, which the
    # launch test's null pointers stand for); with scratch sizes 0 they are never read.
    assert entry["scratch"] and set(entry["scratch"].values()) == {0}
    # TensorRT documents no opt-in past CUDA's default 48 KB of dynamic shared memory.
    assert entry["shared"] <= trt_kernels.TENSORRT_SHARED_MEMORY


class _StagedKernel:
    """A plugin kernel whose shared memory is ``per_stage`` bytes a pipeline stage."""

    name = "chunk_recurrence"

    def __init__(self, per_stage):
        self.per_stage, self.compiled = per_stage, []

    def constexprs(self, config):
        return {"STAGES": config.get("stages") or 3}

    def compile(self, dtype, config):
        stages = self.constexprs(config)["STAGES"]
        self.compiled.append(stages)
        return types.SimpleNamespace(metadata=types.SimpleNamespace(shared=self.per_stage * stages))


def test_tensorrt_compile_drops_pipeline_stages_to_fit_48_kb():
    kernel = _StagedKernel(30 * 1024)
    compiled = trt_kernels.compile_for_tensorrt(kernel, "float32", {"head_k": 16})
    assert kernel.compiled == [3, 2, 1] and compiled.metadata.shared == 30 * 1024


def test_tensorrt_compile_warns_about_kernels_over_48_kb():
    kernel = _StagedKernel(60 * 1024)
    with pytest.warns(UserWarning, match=r"61440 bytes of shared memory, past the 49152"):
        compiled = trt_kernels.compile_for_tensorrt(kernel, "bfloat16", {"head_k": 128})
    assert kernel.compiled == [3, 2, 1] and compiled.metadata.shared == 60 * 1024


def test_expected_abi_orders_inputs_ints_outputs():
    plugin = trt_kernels.PLUGINS["recurrent"]
    assert trt_kernels.expected_abi(plugin, 2) == [".u64"] * 8 + [".u32"] + [".u64"] * 4


def test_plan_that_branches_on_a_dynamic_dim_is_refused():
    """A launch chosen by comparing a dynamic dim (here the gate's rows) holds for some
    shapes only: the planning records the comparison as a guard and no plugin takes it."""

    def planner(tensors, config, target):
        rows = "R" if tensors.size("R") > 1000 else 1000
        return gate_launch(tensors(rows, 2, 16), tensors(2, float32=True),
                           tensors(32, float32=True), None)  # fmt: skip

    plugin = dataclasses.replace(trt_kernels.PLUGINS["gate"], planner=planner)
    with pytest.raises(ValueError, match="depends on the symbolic dims"):
        plugin.constexprs({**CONFIG, "dtype": "float16"})


def test_plan_that_writes_a_buffer_the_plugin_lacks_is_refused():
    """Without the safe gate ``chunk_plan`` launches the prepare twice, the bounded launch
    flagging chunks in an int8 buffer for the unbounded one: the single-kernel plugin has
    no output for it, and takes the one-launch plan only."""

    def planner(tensors, config, target):
        inputs, options = trt_kernels._delta_arguments(tensors, config)
        return chunk_plan(inputs, None, None, options, target=target).launches[0]

    plugin = dataclasses.replace(trt_kernels.PLUGINS["chunk_prepare"], planner=planner)
    config = {**CONFIG, "lower_bound": None, "dtype": "bfloat16"}
    with pytest.raises(ValueError, match=r"writes \['unbounded'\], which are no outputs"):
        plugin.constexprs(config)
    assert trt_kernels.PLUGINS["chunk_prepare"].constexprs(config)["CHUNKS"] == "all"


@pytest.mark.parametrize("name", sorted(trt_kernels.PLUGINS))
def test_plugin_roles_follow_kernel_parameter_order(name):
    """Plugin inputs, int scalars and outputs appear in the kernel in that order."""
    plugin = trt_kernels.PLUGINS[name]
    roles = (*plugin.inputs, *plugin.int_args, *plugin.outputs)
    assert [a for a in plugin.kernel.arg_names if a in roles] == list(roles)


def test_signature_rejects_unknown_dtype():
    with pytest.raises(ValueError, match="dtype"):
        trt_kernels.PLUGINS["gate"].signature("int8", CONFIG)


@pytest.mark.gpu
def test_gated_rms_norm_and_recurrent_ptx_launched_like_tensorrt_match_reference():
    """Launch the PTX through the CUDA driver with TensorRT's argument list: input
    pointers, int32 scalars, output pointers, two null scratch pointers."""
    torch.cuda.init()
    cases = _gpu_cases()
    config = {**CONFIG, "dtype": "float16"}
    for name, (inputs, outputs, expected) in cases.items():
        plugin = trt_kernels.PLUGINS[name]
        shapes = {n: tuple(t.shape) for n, t in inputs.items()}
        grid = plugin.grid(shapes, config)
        launch_ptx(
            plugin.compile("float16", config), grid, 32 * plugin.warps(config),
            list(inputs.values()), plugin.launch_args(shapes, config), list(outputs.values()),
        )  # fmt: skip
        for got, want in zip(outputs.values(), expected):
            torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


def _gpu_cases():
    cuda = dict(device="cuda")
    x, gate = torch.randn(3, 5, 16, dtype=torch.float16, **cuda), torch.randn(3, 5, 16, **cuda)
    gate, weight = gate.half(), torch.randn(16, dtype=torch.float16, **cuda)
    norm = (dict(x=x, gate=gate, weight=weight), dict(y=torch.empty_like(x)),
            [reference.gated_rms_norm(x, gate, weight, CONFIG["eps"], "sigmoid")])  # fmt: skip
    q, k, v = (torch.randn(2, 1, 2, 16, dtype=torch.float16, **cuda) for _ in range(3))
    g, beta = torch.randn(2, 1, 2, 16, dtype=torch.float16, **cuda), torch.randn(2, 1, 2, **cuda)
    A_log, dt_bias = torch.randn(2, **cuda), torch.randn(32, **cuda)
    state = torch.randn(2, 2, 16, 16, **cuda)
    args = (q, k, v, g, beta.half(), A_log, dt_bias, state)
    o, final = reference.delta_rule(
        reference.recurrent_delta_rule, *args, None, 16**-0.5, -5.0, True, True
    )
    outputs = dict(o=torch.empty_like(v), state_out=torch.empty_like(state))
    recurrent = (dict(zip(trt_kernels.PLUGINS["recurrent"].inputs, args)), outputs, [o, final])
    return {"gated_rms_norm": norm, "recurrent": recurrent}
