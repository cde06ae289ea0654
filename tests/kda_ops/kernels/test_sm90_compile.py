"""Kernels compile for sm_90 in the specializations their launchers pick (CPU, no GPU
needed): the conv kernels in every one, the gate kernel with both gates, the forward's
recurrence (whose pipeline stages must fit shared memory), the backward's prepare kernel
in each of its launches, its WY, pairs, gate and recompute kernels.
Without a GPU the other kernel tests run them in Triton's interpreter, which accepts code
the compiler rejects (a loop-carried tile that changes shape or type) and skips libdevice
calls."""

import itertools
import json
import os
import pathlib
import subprocess
import sys

import pytest

from kda_ops.kernels.chunk import scan_stages
from kda_ops.kernels.conv import BACKWARD_ROWS, PREFILL_ROWS
from kda_ops.kernels.sizes import SM90_SHARED_MEMORY

ROOT = pathlib.Path(__file__).resolve().parents[3]
CONV = dict(D=4096, W=4, BD=128, BN=8, BW=4, HAS_BIAS=True, SILU=True)
GATE = dict(HV=32, K=128, BK=128, ROWS=64, HAS_DT_BIAS=True)
PREPARE = dict(H=32, HV=32, K=128, V=128, BK=128, BV=128, BN=1, SCALAR_GATE=False,
               USE_GATE=True, HAS_DT_BIAS=True, USE_L2NORM=True, USE_BETA_SIGMOID=True,
               IS_VARLEN=False, DOT_PRECISION="tf32")  # fmt: skip


def recurrence(value_columns: int, dtype: str = "bf16", aqk: str = "bf16", width: int = 128,
               store_output: bool = True, store_states: bool = False) -> tuple:  # fmt: skip
    """``chunk_recurrence_kernel`` as ``_recurrence`` launches it (K = V = 128) with inputs
    of ``dtype`` and Aqk of ``aqk``; ``width`` 256 is the segmented path's maps pass."""
    size = {"bf16": 2, "fp32": 4}
    stages = scan_stages(128, value_columns, size[dtype], size[aqk], store_output,
                         SM90_SHARED_MEMORY)  # fmt: skip
    constexprs = dict(HV=32, K=128, V=128, WIDTH=width, BK=128, BV=value_columns,
                      HAS_INITIAL_STATE=False, IS_VARLEN=False,
                      DOT_PRECISION="tf32" if dtype == "bf16" else "ieee",
                      STORE_CHUNK_STATES=store_states, STORE_OUTPUT=store_output,
                      STAGES=stages)  # fmt: skip
    types = {name: f"*{dtype}" for name in ("w", "u", "qg", "kd", "o", "chunk_states")}
    return "chunk", "chunk_recurrence_kernel", constexprs, {**types, "aqk": f"*{aqk}"}


def ds_scan(value_columns: int) -> tuple:
    """The backward's ``chunk_bwd_state_kernel`` as its launcher runs it on bf16 inputs
    (K = V = 128, 8 warps)."""
    stages = scan_stages(128, value_columns, 2, 2, True, SM90_SHARED_MEMORY)
    constexprs = dict(
        HV=32,
        K=128,
        V=128,
        BK=128,
        BV=value_columns,
        CHUNK=64,
        HAS_INITIAL_STATE=False,
        IS_VARLEN=False,
        DOT_PRECISION="tf32",
    )
    types = {name: "*bf16" for name in ("w", "qg", "kd", "aqk", "grad_o", "dstates")}
    types.update(grad_final_state="*fp32", grad_initial_state="*fp32")
    return ("chunk_backward", "chunk_bwd_state_kernel", constexprs, types,
            {"num_warps": 8, "num_stages": stages})  # fmt: skip


SCANS = {
    **{f"chunk_recurrence_kernel/bf16/columns={n}": recurrence(n) for n in (32, 64, 128)},
    # the training forward: chunk states written
    "chunk_recurrence_kernel/training": recurrence(64, store_states=True),
    "chunk_recurrence_kernel/fp32": recurrence(64, "fp32", "fp32"),
    "chunk_recurrence_kernel/maps": recurrence(64, width=256, store_output=False),
    **{f"chunk_bwd_state_kernel/columns={n}": ds_scan(n) for n in (64, 128)},
}
VARIANTS = {  # name: (module in kda_ops.kernels, kernel, constexprs[, argument types,
    **SCANS,  # launch options])
    **{
        f"causal_conv1d_kernel/state={s}/indices={i}/varlen={v}": (
            "conv", "causal_conv1d_kernel",
            # The final state in this kernel unless packed or a pool rewritten in place.
            dict(CONV, BT=PREFILL_ROWS, HAS_STATE=s, USE_INDICES=i, IS_VARLEN=v,
                 FINAL_STATE=not (i or v)),
        )
        for s, i, v in itertools.product((False, True), repeat=3)
    },
    **{
        f"conv_grad_z_kernel/state={s}/varlen={v}": (
            "conv", "conv_grad_z_kernel", dict(CONV, BT=BACKWARD_ROWS, HAS_STATE=s, IS_VARLEN=v)
        )
        for s, v in itertools.product((False, True), repeat=2)
    },
    **{
        f"conv_step_w4_kernel/sequences={n}/indices={i}": (
            "conv", "conv_step_w4_kernel",
            dict(D=12288, BG=128, NB=n, HAS_BIAS=True, HAS_STATE=True, USE_INDICES=i,
                 SILU=True),
        )
        for n, i in itertools.product((1, 4), (False, True))
    },
    **{
        f"kda_gate_kernel/lower_bound={b}": ("gate", "kda_gate_kernel",
                                             dict(GATE, USE_LOWER_BOUND=b))
        for b in (False, True)
    },
    **{  # the backward's prepare: the forward's program with its extra outputs
        f"chunk_bwd_prepare_kernel/{chunks}": ("chunk_backward", "chunk_bwd_prepare_kernel",
                                               dict(PREPARE, SAFE_GATE=safe,
                                                    USE_LOWER_BOUND=safe, CHUNKS=chunks))
        for safe, chunks in ((True, "all"), (False, "bounded"), (False, "unbounded"))
    },
    # the WY kernel, with the l2norm factors the prepare stored
    "chunk_bwd_wy_kernel": ("chunk_backward", "chunk_bwd_wy_kernel",
                            dict(H=32, HV=32, K=128, V=128, BK=128, BV=128, BV_STEP=32,
                                 BK_STEP=32, BN=1, CHUNK=64, USE_L2NORM=True,
                                 USE_BETA_SIGMOID=True, IS_VARLEN=False,
                                 DOT_PRECISION="tf32")),
    # the pairs kernel, one program a row block, in each of its launches
    **{
        f"chunk_bwd_pairs_kernel/{chunks}": (
            "chunk_backward", "chunk_bwd_pairs_kernel",
            dict(H=32, HV=32, K=128, BK=64, BN=1, CHUNK=64, BLOCK=16, SAFE_GATE=chunks == "all",
                 USE_L2NORM=True, USE_BETA_SIGMOID=True, IS_VARLEN=False,
                 DOT_PRECISION="tf32", CHUNKS=chunks),
        )
        for chunks in ("all", "bounded", "unbounded")
    },
    # the gate's backward after it (which also completes dβ): KDA's gate, GDN's scalar one
    **{
        f"chunk_bwd_gate_kernel/scalar_gate={scalar}": (
            "chunk_backward", "chunk_bwd_gate_kernel",
            dict(HV=32, K=128, BK=32, BN=1, CHUNK=64, N_SHARES=2, SCALAR_GATE=scalar,
                 USE_GATE=True, HAS_DT_BIAS=True, USE_LOWER_BOUND=not scalar,
                 USE_BETA_SIGMOID=True, IS_VARLEN=False),
        )
        for scalar in (False, True)
    },
    # G, w, qg, kd rebuilt from the inputs and kept T: KDA's gate, GDN's scalar one
    **{
        f"chunk_bwd_recompute_kernel/scalar_gate={scalar}": (
            "chunk_backward", "chunk_bwd_recompute_kernel",
            dict(H=32, HV=32, K=128, BK=32, BN=1, SCALAR_GATE=scalar,
                 USE_GATE=True, HAS_DT_BIAS=True, USE_LOWER_BOUND=not scalar,
                 USE_L2NORM=True, USE_BETA_SIGMOID=True, IS_VARLEN=False,
                 DOT_PRECISION="tf32"),
        )
        for scalar in (False, True)
    },
}  # fmt: skip
ARG_TYPES = {"state_indices": "*i32", "cu_seqlens": "*i32", "grad_z": "*fp32",
             "dweight_parts": "*fp32", "dbias_parts": "*fp32", "A_log": "*fp32",
             "dt_bias": "*fp32", "out": "*fp32", "length": "i32", "first_head": "i32",
             "n_seqs": "i32",
             "n_rows": "i32", "batch": "i32", "lower_bound": "fp32", "scale": "fp32",
             "chunk_offsets": "*i32", "cum_g": "*fp32", "aqk": "*fp32", "solve": "*fp32",
             "chunk_decay": "*fp32", "q_norm": "*fp32", "k_norm": "*fp32",
             "unbounded": "*i8", "redo": "*i8",
             "dv_new": "*fp32", "dq_rows": "*fp32", "dk_rows": "*fp32", "d_cum_rows": "*fp32",
             "dbeta": "*fp32", "d_aqk_tiles": "*fp32", "d_a_tiles": "*fp32",
             "dbeta_part": "*fp32", "dbeta_rows": "*fp32", "dA_log_part": "*fp32",
             "ddt_part": "*fp32", "dg": "*fp32"}  # fmt: skip
SCRIPT = """
import importlib, json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

variants, arg_types = (json.loads(a) for a in sys.argv[1:])
results = {}
for name, (module, kernel_name, constexprs, *extra) in variants.items():
    kernel = getattr(importlib.import_module(f"kda_ops.kernels.{module}"), kernel_name)
    # A constexpr left out would compile as a pointer argument, a variant never launched.
    missing = [kernel.arg_names[i] for i in kernel.constexprs
               if kernel.arg_names[i] not in constexprs]
    if missing:
        results[name] = {"error": f"constexprs not given: {missing}"}
        continue
    types = {**arg_types, **(extra[0] if extra else {})}
    options = {"num_warps": 4, **(extra[1] if len(extra) > 1 else {})}
    signature, attrs = {}, {}
    for index, arg in enumerate(kernel.arg_names):
        if arg in constexprs:
            signature[arg] = "constexpr"
            continue
        signature[arg] = types.get(arg, "*bf16")
        if signature[arg].startswith("*"):  # aligned like every tensor a launcher passes
            attrs[(index,)] = [["tt.divisibility", 16]]
    source = ASTSource(kernel, signature, attrs=attrs, constexprs={
        (kernel.arg_names.index(k),): v for k, v in constexprs.items()})
    try:
        binary = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
        results[name] = {"error": None, "shared": binary.metadata.shared}
    except Exception as error:
        results[name] = {"error": f"{type(error).__name__}: {error}"}
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def compiled():
    """Compile in a process without TRITON_INTERPRET (interpreted kernels can't compile)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    args = (json.dumps(x) for x in (VARIANTS, ARG_TYPES))
    result = subprocess.run([sys.executable, "-c", SCRIPT, *args], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=600)  # fmt: skip
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.splitlines()[-1])


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_kernel_compiles_for_sm90(compiled, variant):
    assert compiled[variant]["error"] is None


@pytest.mark.parametrize("variant", sorted(SCANS))
def test_scan_stages_fit_shared_memory(compiled, variant):
    """``scan_stages`` takes 3 stages only where their buffers fit (a launch past the
    limit fails on the GPU, not here)."""
    assert compiled[variant]["shared"] <= SM90_SHARED_MEMORY


def test_scans_run_ahead_where_they_fit():
    """bf16 launches up to 64 value columns (the training forward's and the maps pass's
    too) get 3 stages; 128 value columns and fp32 inputs 2."""
    stages = {name: spec[4]["num_stages"] if len(spec) > 4 else spec[2]["STAGES"]
              for name, spec in SCANS.items()}  # fmt: skip
    assert stages == {"chunk_recurrence_kernel/bf16/columns=32": 3,
                      "chunk_recurrence_kernel/bf16/columns=64": 3,
                      "chunk_recurrence_kernel/bf16/columns=128": 2,
                      "chunk_recurrence_kernel/training": 3,
                      "chunk_recurrence_kernel/fp32": 2,
                      "chunk_recurrence_kernel/maps": 3,
                      "chunk_bwd_state_kernel/columns=64": 3,
                      "chunk_bwd_state_kernel/columns=128": 2}  # fmt: skip
