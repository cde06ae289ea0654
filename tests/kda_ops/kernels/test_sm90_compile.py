"""The conv kernels compile for sm_90 in every specialization their launchers pick (CPU, no
GPU needed). Without a GPU the other kernel tests run them in Triton's interpreter, which
accepts code the compiler rejects, such as a loop-carried tile that changes shape."""

import itertools
import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[3]
BASE = dict(D=4096, W=4, BT=64, BD=128, BN=8, HAS_BIAS=True, SILU=True)
VARIANTS = {
    **{
        f"causal_conv1d_kernel/state={s}/indices={i}/varlen={v}": (
            "causal_conv1d_kernel", dict(BW=4, HAS_STATE=s, USE_INDICES=i, IS_VARLEN=v)
        )
        for s, i, v in itertools.product((False, True), repeat=3)
    },
    **{
        f"conv_grad_z_kernel/state={s}/varlen={v}": (
            "conv_grad_z_kernel", dict(BW=4, HAS_STATE=s, IS_VARLEN=v)
        )
        for s, v in itertools.product((False, True), repeat=2)
    },
}  # fmt: skip
POINTER_TYPES = {"state_indices": "*i32", "cu_seqlens": "*i32", "grad_z": "*fp32",
                 "dweight_parts": "*fp32", "dbias_parts": "*fp32"}  # fmt: skip
SCRIPT = """
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kda_ops.kernels import conv

base, variants, pointer_types = (json.loads(a) for a in sys.argv[1:])
results = {}
for name, (kernel_name, flags) in variants.items():
    kernel = getattr(conv, kernel_name)
    constexprs = {**base, **flags}
    signature, attrs = {}, {}
    for index, arg in enumerate(kernel.arg_names):
        if arg in constexprs:
            signature[arg] = "constexpr"
        elif arg in ("length", "n_seqs"):
            signature[arg] = "i32"
        else:  # aligned like every tensor a launcher passes
            signature[arg] = pointer_types.get(arg, "*bf16")
            attrs[(index,)] = [["tt.divisibility", 16]]
    source = ASTSource(kernel, signature, attrs=attrs, constexprs={
        (kernel.arg_names.index(k),): v for k, v in constexprs.items()})
    try:
        triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
        results[name] = "ok"
    except Exception as error:
        results[name] = f"{type(error).__name__}: {error}"
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def compiled():
    """Compile in a process without TRITON_INTERPRET (interpreted kernels can't compile)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    args = (json.dumps(x) for x in (BASE, VARIANTS, POINTER_TYPES))
    result = subprocess.run([sys.executable, "-c", SCRIPT, *args], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=600)  # fmt: skip
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.splitlines()[-1])


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_conv_kernel_compiles_for_sm90(compiled, variant):
    assert compiled[variant] == "ok"
