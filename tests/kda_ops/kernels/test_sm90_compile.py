"""Kernels compile for sm_90 in the specializations their launchers pick (CPU, no GPU
needed): the conv kernels in every one, the gate kernel with both gates, the forward's
recurrence (whose pipeline stages must fit shared memory), the backward's prepare kernel
in each of its launches, its WY, pairs, gate and recompute kernels; and, past 128 key or
value columns, every kernel of the chunked forward and backward (and the recurrent and
gate kernels) as their launchers' pure launch functions configure them, within Hopper's
shared memory.
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
import torch

from kda_ops.kernels.chunk import FORWARD_CHUNK
from kda_ops.kernels.chunk.backward.gate import GATE_COLUMNS, GATE_WARPS
from kda_ops.kernels.chunk.backward.layout import key_columns
from kda_ops.kernels.chunk.backward.pairs import (
    DIAGONAL_PRECISION,
    PAIRS_COLUMNS,
    PAIRS_STAGES,
    pair_warps,
)
from kda_ops.kernels.chunk.backward.recompute import REBUILD_WARPS, rebuild_blocks
from kda_ops.kernels.chunk.backward.state import STATE_WARPS
from kda_ops.kernels.chunk.backward.wy import wy_launch
from kda_ops.kernels.chunk.planning import (
    WINDOW_PREPARE_REGISTERS,
    WINDOW_RECURRENCE_REGISTERS,
    dot_block,
    prepare_warps,
    scan_config,
    scan_stages,
    scan_warps,
)
from kda_ops.kernels.chunk.recurrence import unmasked_full_steps
from kda_ops.kernels.conv.backward import BACKWARD_ROWS
from kda_ops.kernels.conv.forward import PREFILL_ROWS
from kda_ops.kernels.sizes import SM90_SHARED_MEMORY, cdiv
from tests.sweeps import sweep

ROOT = pathlib.Path(__file__).resolve().parents[3]
WY_TUNED = wy_launch(128, 128, 2)  # the bf16 launch at K = V = 128
CONV = dict(D=4096, W=4, BD=128, BN=8, BW=4, HAS_BIAS=True, SILU=True)
GATE = dict(HV=32, K=128, BK=128, ROWS=64, HAS_DT_BIAS=True)
PREPARE = dict(H=32, HV=32, K=128, V=128, BK=128, BV=128, BN=1, SCALAR_GATE=False,
               USE_GATE=True, HAS_DT_BIAS=True, USE_L2NORM=True, USE_BETA_SIGMOID=True,
               IS_VARLEN=False, DOT_PRECISION="tf32")  # fmt: skip


def recurrence(value_columns: int, dtype: str = "bf16", aqk: str = "bf16", width: int = 128,
               store_output: bool = True, store_states: bool = False,
               step: int = FORWARD_CHUNK, window_steps: int = 0) -> tuple:  # fmt: skip
    """``chunk_recurrence_kernel`` as ``recurrence_launches`` launches it (K = V = 128) with
    inputs of ``dtype`` and Aqk of ``aqk`` in steps of ``step`` tokens (the forward's; 64
    for the training forward's); ``width`` 256 is the segmented path's maps pass;
    ``window_steps`` > 0 the pipelined forward's time windows."""
    size = {"bf16": 2, "fp32": 4}
    stages = scan_stages(128, value_columns, size[dtype], size[aqk], store_output,
                         SM90_SHARED_MEMORY, step)  # fmt: skip
    precision = "tf32" if dtype == "bf16" else "ieee"
    constexprs = dict(HV=32, K=128, V=128, WIDTH=width, BK=128, BV=value_columns, STEP=step,
                      HAS_INITIAL_STATE=window_steps > 0, IS_VARLEN=False,
                      DOT_PRECISION=precision,
                      STORE_CHUNK_STATES=store_states, STORE_OUTPUT=store_output,
                      STAGES=stages, WINDOW_STEPS=window_steps,
                      UNMASKED_FULL_STEPS=unmasked_full_steps(precision, step))  # fmt: skip
    types = {name: f"*{dtype}" for name in ("w", "u", "qg", "kd", "o", "chunk_states")}
    types.update(aqk=f"*{aqk}", initial_state="*fp32", final_state="*fp32")
    return "chunk.recurrence", "chunk_recurrence_kernel", constexprs, types


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
        SCALAR_GATE=False,
    )
    types = {name: "*bf16" for name in ("w", "qg", "kd", "aqk", "grad_o", "dstates")}
    types.update(grad_final_state="*fp32", grad_initial_state="*fp32")
    return ("chunk.backward.state", "chunk_bwd_state_kernel", constexprs, types,
            {"num_warps": 8, "num_stages": stages})  # fmt: skip


WINDOW_PREPARE = ("chunk.prepare", "chunk_prepare_kernel",
                  dict(PREPARE, SAFE_GATE=True, USE_LOWER_BOUND=True, CHUNKS="all",
                       BLOCKS=FORWARD_CHUNK // 16, WINDOW=128))  # fmt: skip
SCANS = {
    **{f"chunk_recurrence_kernel/bf16/columns={n}": recurrence(n) for n in (32, 64, 128)},
    # the training forward: 64-token steps, chunk states written
    "chunk_recurrence_kernel/training": recurrence(64, store_states=True, step=64),
    # the inference forward's chunk states (a prefix cache's), every fourth step
    "chunk_recurrence_kernel/chunk_states": recurrence(64, store_states=True),
    "chunk_recurrence_kernel/fp32": recurrence(64, "fp32", "fp32"),
    "chunk_recurrence_kernel/maps": recurrence(64, width=256, store_output=False),
    # the pipelined forward: a time window of 128 steps from the carried state
    "chunk_recurrence_kernel/window": recurrence(64, window_steps=128),
    # 32 columns: the heads past the first wave at H = 96 (``scan_launches``)
    **{f"chunk_bwd_state_kernel/columns={n}": ds_scan(n) for n in (32, 64, 128)},
}
VARIANTS = {  # name: (module in kda_ops.kernels, kernel, constexprs[, argument types,
    **SCANS,  # launch options])
    **{
        f"causal_conv1d_kernel/state={s}/indices={i}/varlen={v}": (
            "conv.forward", "causal_conv1d_kernel",
            # The final state in this kernel unless packed or a pool rewritten in place.
            dict(CONV, BT=PREFILL_ROWS, HAS_STATE=s, USE_INDICES=i, IS_VARLEN=v,
                 FINAL_STATE=not (i or v)),
        )
        for s, i, v in itertools.product((False, True), repeat=3)
    },
    **{
        f"conv_grad_z_kernel/state={s}/varlen={v}": (
            "conv.backward", "conv_grad_z_kernel",
            dict(CONV, BT=BACKWARD_ROWS, HAS_STATE=s, IS_VARLEN=v),
        )
        for s, v in itertools.product((False, True), repeat=2)
    },
    **{
        f"conv_step_w4_kernel/sequences={n}/indices={i}": (
            "conv.step", "conv_step_w4_kernel",
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
    **{  # the forward's prepare, 16-token chunks
        f"chunk_prepare_kernel/{chunks}": ("chunk.prepare", "chunk_prepare_kernel",
                                           dict(PREPARE, SAFE_GATE=safe, USE_LOWER_BOUND=safe,
                                                CHUNKS=chunks, BLOCKS=FORWARD_CHUNK // 16,
                                                WINDOW=0))
        for safe, chunks in ((True, "all"), (False, "bounded"), (False, "unbounded"))
    },
    **{  # Gated DeltaNet's scalar gate, one launch: 16-token (inference) and 64-token chunks
        f"chunk_prepare_kernel/scalar_gate/{16 * blocks}": (
            "chunk.prepare", "chunk_prepare_kernel",
            dict(PREPARE, H=16, SCALAR_GATE=True, SAFE_GATE=False, USE_LOWER_BOUND=False,
                 CHUNKS="all", BLOCKS=blocks, WINDOW=0),
        )
        for blocks in (FORWARD_CHUNK // 16, 4)
    },
    "chunk_bwd_prepare_kernel/scalar_gate": (
        "chunk.backward.prepare", "chunk_bwd_prepare_kernel",
        dict(PREPARE, H=16, SCALAR_GATE=True, SAFE_GATE=False, USE_LOWER_BOUND=False,
             CHUNKS="all"),
    ),
    # the pipelined forward's prepare: 128 chunks of every sequence
    "chunk_prepare_kernel/window": WINDOW_PREPARE,
    # the windows' kernels at their register caps (``window_registers``)
    "chunk_prepare_kernel/window/capped": (*WINDOW_PREPARE, {},
                                           {"num_warps": 4, "maxnreg": WINDOW_PREPARE_REGISTERS}),
    "chunk_recurrence_kernel/window/capped": (
        *recurrence(64, window_steps=128),
        {"num_warps": 4, "maxnreg": WINDOW_RECURRENCE_REGISTERS},
    ),
    **{  # the backward's prepare: the forward's program with its extra outputs
        f"chunk_bwd_prepare_kernel/{chunks}": ("chunk.backward.prepare", "chunk_bwd_prepare_kernel",
                                               dict(PREPARE, SAFE_GATE=safe,
                                                    USE_LOWER_BOUND=safe, CHUNKS=chunks))
        for safe, chunks in ((True, "all"), (False, "bounded"), (False, "unbounded"))
    },
    # the WY kernel, with the l2norm factors the prepare stored; with the scalar gate it
    # also takes the pair terms
    **{
        f"chunk_bwd_wy_kernel/scalar_gate={scalar}": (
            "chunk.backward.wy", "chunk_bwd_wy_kernel",
            dict(H=32, HV=32, K=128, V=128, BK=128, BV=128, BV_STEP=32, BK_STEP=32, BN=1,
                 CHUNK=64, USE_L2NORM=True, USE_BETA_SIGMOID=True, IS_VARLEN=False,
                 DOT_PRECISION="tf32", SCALAR_GATE=scalar, PAIR_STEP=WY_TUNED.pair_step,
                 PAIR_STAGES=WY_TUNED.pair_stages),
            {}, {"num_warps": WY_TUNED.warps, "num_stages": WY_TUNED.stages},
        )
        for scalar in (False, True)
    },
    # the pairs kernel, one program a row block, in each of its launches
    **{
        f"chunk_bwd_pairs_kernel/{chunks}": (
            "chunk.backward.pairs", "chunk_bwd_pairs_kernel",
            dict(H=32, HV=32, K=128, BK=PAIRS_COLUMNS, BN=1, CHUNK=64, BLOCK=16,
                 SAFE_GATE=chunks == "all", USE_L2NORM=True, USE_BETA_SIGMOID=True,
                 IS_VARLEN=False, DOT_PRECISION="tf32", DIAGONAL_PRECISION=DIAGONAL_PRECISION,
                 CHUNKS=chunks),
            {}, {"num_warps": pair_warps(chunks), "num_stages": PAIRS_STAGES},
        )
        for chunks in ("all", "bounded", "unbounded")
    },
    # the gate's backward after it (which also completes dβ): KDA's gate, GDN's scalar one
    **{
        f"chunk_bwd_gate_kernel/scalar_gate={scalar}": (
            "chunk.backward.gate", "chunk_bwd_gate_kernel",
            dict(HV=32, K=128, BK=32, BN=1, CHUNK=64, N_SHARES=2, SCALAR_GATE=scalar,
                 USE_GATE=True, HAS_DT_BIAS=True, USE_LOWER_BOUND=not scalar,
                 USE_BETA_SIGMOID=True, IS_VARLEN=False),
        )
        for scalar in (False, True)
    },
    # G, w, qg, kd rebuilt from the inputs and kept T: KDA's gate, GDN's scalar one
    **{
        f"chunk_bwd_recompute_kernel/scalar_gate={scalar}": (
            "chunk.backward.recompute", "chunk_bwd_recompute_kernel",
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
             "window_first": "i32", "window_begin": "i32",
             "chunk_offsets": "*i32", "state_chunks": "*i32", "sequence_order": "*i64",
             "cum_g": "*fp32", "aqk": "*fp32", "solve": "*fp32",
             "chunk_decay": "*fp32", "q_norm": "*fp32", "k_norm": "*fp32",
             "unbounded": "*i8", "redo": "*i8",
             "dv_new": "*fp32", "dq_rows": "*fp32", "dk_rows": "*fp32", "d_cum_rows": "*fp32",
             "dbeta": "*fp32", "d_aqk_tiles": "*fp32", "d_a_tiles": "*fp32",
             "dbeta_part": "*fp32", "dbeta_rows": "*fp32", "dA_log_part": "*fp32",
             "ddt_part": "*fp32", "dg": "*fp32"}  # fmt: skip

# Past 128 key or value columns, each kernel as its launcher configures it on an H200
# (132 SMs, 227 KB of shared memory a block), from the same launch functions; a head dim
# of 192 takes 256-wide tiles, as 256 does. Sequence-heads: enough to fill the SMs
# (a scan takes its widest value blocks) or few (its narrowest). fp32 products compile
# to FMA loops for minutes at wide tiles: fp32 covers the kernels whose fp32 launch
# differs (the scans' columns and stages, the WY kernel's key step).
SMS = 132
ITEMSIZE = {"bf16": 2, "fp32": 4}
MANY_HEADS, FEW_HEADS = 4096, 4


def _typed(dtype: str, *names: str) -> dict[str, str]:
    return {name: f"*{dtype}" for name in names}


def _dot_precision(dtype: str) -> str:
    return "ieee" if dtype == "fp32" else "tf32"


def forward_scan(head_k: int, head_v: int, dtype: str, sequence_heads: int,
                 maps: bool = False, store_states: bool = False,
                 step: int = FORWARD_CHUNK) -> tuple:  # fmt: skip
    """``chunk_recurrence_kernel`` as ``recurrence_launches`` launches it; ``maps``: the
    segmented path's first pass (K transition columns, no outputs); ``step`` 64: the
    training forward's."""
    width = head_v + head_k if maps else head_v
    block_k, size = dot_block(head_k), ITEMSIZE[dtype]
    columns, stages = scan_config(block_k, dot_block(width), sequence_heads, SMS, size, size,
                                  not maps, SM90_SHARED_MEMORY, rows=step)  # fmt: skip
    constexprs = dict(HV=32, K=head_k, V=head_v, WIDTH=width, BK=block_k, BV=columns, STEP=step,
                      HAS_INITIAL_STATE=not maps, IS_VARLEN=maps,
                      DOT_PRECISION=_dot_precision(dtype), STORE_CHUNK_STATES=store_states,
                      STORE_OUTPUT=not maps, STAGES=stages, WINDOW_STEPS=0,
                      UNMASKED_FULL_STEPS=unmasked_full_steps(_dot_precision(dtype),
                                                              step))  # fmt: skip
    types = _typed(dtype, "w", "u", "qg", "kd", "o", "chunk_states", "aqk")
    types.update(initial_state="*fp32", final_state="*fp32")
    return ("chunk.recurrence", "chunk_recurrence_kernel", constexprs, types,
            {"num_warps": scan_warps(block_k)})  # fmt: skip


def backward_scan(head_k: int, head_v: int, dtype: str, sequence_heads: int) -> tuple:
    """``chunk_bwd_state_kernel`` as ``launch_chunk_kda_backward`` launches it."""
    block_k, size = dot_block(head_k), ITEMSIZE[dtype]
    columns, stages = scan_config(block_k, dot_block(head_v), sequence_heads, SMS, size, size,
                                  True, SM90_SHARED_MEMORY, pipelined=dtype != "fp32",
                                  run_ahead=False)  # fmt: skip
    constexprs = dict(HV=32, K=head_k, V=head_v, BK=block_k, BV=columns, CHUNK=64,
                      HAS_INITIAL_STATE=True, IS_VARLEN=False,
                      DOT_PRECISION=_dot_precision(dtype), SCALAR_GATE=False)  # fmt: skip
    types = _typed(dtype, "w", "qg", "kd", "aqk", "grad_o", "dstates")
    types.update(grad_final_state="*fp32", grad_initial_state="*fp32")
    return ("chunk.backward.state", "chunk_bwd_state_kernel", constexprs, types,
            {"num_warps": STATE_WARPS, "num_stages": stages})  # fmt: skip


def wy(head_k: int, head_v: int, dtype: str) -> tuple:
    """``chunk_bwd_wy_kernel`` as ``launch_chunk_kda_backward`` launches it."""
    block_k, block_v = dot_block(head_k), dot_block(head_v)
    launch = wy_launch(block_k, block_v, ITEMSIZE[dtype])
    constexprs = dict(H=32, HV=32, K=head_k, V=head_v, BK=block_k, BV=block_v,
                      BV_STEP=launch.value_step, BK_STEP=launch.key_step, BN=1, CHUNK=64,
                      USE_L2NORM=True, USE_BETA_SIGMOID=True, IS_VARLEN=False,
                      DOT_PRECISION=_dot_precision(dtype), SCALAR_GATE=False,
                      PAIR_STEP=launch.pair_step, PAIR_STAGES=launch.pair_stages)  # fmt: skip
    types = _typed(dtype, "q", "k", "v", "beta", "w", "chunk_states", "dstates", "grad_o",
                   "v_new_rows", "d_ru_rows", "dv")  # fmt: skip
    low = "*fp32" if dtype == "fp32" else f"*{dtype}"  # fp32 inputs: no low-precision tiles
    types.update(d_aqk_low=low, d_a_low=low)
    return ("chunk.backward.wy", "chunk_bwd_wy_kernel", constexprs, types,
            {"num_warps": launch.warps, "num_stages": launch.stages})  # fmt: skip


def prepare(head_k: int, head_v: int, backward: bool, safe: bool) -> tuple:
    """The forward's or the backward's prepare kernel in bf16, as launched (the safe gate's
    single launch, or the softplus gate's first)."""
    block_k = dot_block(head_k)
    constexprs = dict(PREPARE, K=head_k, V=head_v, BK=block_k, BV=dot_block(head_v),
                      SAFE_GATE=safe, USE_LOWER_BOUND=safe,
                      CHUNKS="all" if safe else "bounded")  # fmt: skip
    module, kernel = (("chunk.backward.prepare", "chunk_bwd_prepare_kernel") if backward
                      else ("chunk.prepare", "chunk_prepare_kernel"))  # fmt: skip
    if not backward:  # the forward's 16-token chunks (the backward's program takes 64)
        constexprs.update(BLOCKS=FORWARD_CHUNK // 16, WINDOW=0)
    return module, kernel, constexprs, {}, {"num_warps": prepare_warps(block_k)}


def key_split_kernels(head_k: int) -> dict[str, tuple]:
    """The backward's kernels split over the key columns, and its dq / dk kernel, in bf16
    with the safe gate, as launched."""
    block_k, cuda = dot_block(head_k), torch.device("cuda")
    pair_k, gate_k = (key_columns(block_k, c, cuda) for c in (PAIRS_COLUMNS, GATE_COLUMNS))
    _, rebuild_k = rebuild_blocks(head_k)
    gate = dict(SCALAR_GATE=False, USE_GATE=True, HAS_DT_BIAS=True, USE_LOWER_BOUND=True,
                USE_BETA_SIGMOID=True, IS_VARLEN=False)  # fmt: skip
    return {
        "chunk_bwd_pairs_kernel": ("chunk.backward.pairs", "chunk_bwd_pairs_kernel",
                                   dict(H=32, HV=32, K=head_k, BK=pair_k, BN=1, CHUNK=64,
                                        BLOCK=16, SAFE_GATE=True, USE_L2NORM=True,
                                        USE_BETA_SIGMOID=True, IS_VARLEN=False,
                                        DOT_PRECISION="tf32",
                                        DIAGONAL_PRECISION=DIAGONAL_PRECISION, CHUNKS="all"),
                                   {}, {"num_warps": pair_warps("all"),
                                        "num_stages": PAIRS_STAGES}),
        "chunk_bwd_gate_kernel": ("chunk.backward.gate", "chunk_bwd_gate_kernel",
                                  dict(gate, HV=32, K=head_k, BK=gate_k, BN=1, CHUNK=64,
                                       N_SHARES=cdiv(head_k, pair_k)),
                                  {}, {"num_warps": GATE_WARPS}),
        "chunk_bwd_recompute_kernel": ("chunk.backward.recompute", "chunk_bwd_recompute_kernel",
                                       dict(gate, H=32, HV=32, K=head_k, BK=rebuild_k, BN=1,
                                            USE_L2NORM=True, DOT_PRECISION="tf32"),
                                       {}, {"num_warps": REBUILD_WARPS}),
        "chunk_bwd_qk_kernel": ("chunk.backward.qk", "chunk_bwd_qk_kernel",
                                dict(H=32, HV=32, K=head_k, BK=block_k, BT=32, USE_L2NORM=True),
                                {"d_unit": "*fp32", "n_tokens": "i32"}, {"num_warps": 4}),
    }  # fmt: skip


def recurrent(head_k: int, head_v: int) -> tuple:
    """``recurrent_kda_kernel`` as ``launch_recurrent_kda`` picks its blocks (a pool
    decode: indices, packed sequences)."""
    block_k = dot_block(head_k)
    block_v = min(dot_block(head_v), 32 if block_k <= 128 else 16)
    constexprs = dict(H=32, HV=32, K=head_k, V=head_v, BK=block_k, BV=block_v,
                      SCALAR_GATE=False, USE_GATE=True, HAS_DT_BIAS=True, USE_LOWER_BOUND=True,
                      USE_L2NORM=True, USE_BETA_SIGMOID=True, HAS_STATE_IN=True,
                      USE_INDICES=True, IS_VARLEN=True, STORE_FINAL_STATE=True,
                      STORE_STEP_STATES=False, STATE_IN_V_FIRST=False,
                      STATE_OUT_V_FIRST=False)  # fmt: skip
    types = {"state_in": "*fp32", "state_out": "*fp32", "step_states": "*fp32"}
    return "recurrent", "recurrent_kda_kernel", constexprs, types, {"num_warps": 4}


WIDE_DIMS = ((256, 256), (192, 192), (256, 128), (128, 256), (256, 64), (64, 256), (256, 16))


def wide_variants() -> dict[str, tuple]:
    """Every launch past 128 key or value columns the matrix covers, by name."""
    variants = {}
    for head_k, head_v in WIDE_DIMS:
        dims = f"K={head_k}/V={head_v}"
        regimes = {"many": MANY_HEADS}
        if head_k == head_v == 256:
            regimes["few"] = FEW_HEADS
        for regime, heads in regimes.items():
            for name, scan in (("forward_scan", forward_scan), ("backward_scan", backward_scan)):
                variants[f"{dims}/{name}/bf16/{regime}"] = scan(head_k, head_v, "bf16", heads)
        variants[f"{dims}/wy/bf16"] = wy(head_k, head_v, "bf16")
    for regime, heads in (("many", MANY_HEADS), ("few", FEW_HEADS)):
        maps = forward_scan(256, 256, "bf16", heads, maps=True)
        variants[f"K=256/V=256/forward_maps/bf16/{regime}"] = maps
    for regime, heads in (("many", MANY_HEADS), ("few", FEW_HEADS)):
        # Few heads: 16 value columns at 2 stages (``scan_column_splits``).
        training = forward_scan(256, 256, "bf16", heads, store_states=True, step=64)
        variants[f"K=256/V=256/forward_scan/bf16/training/{regime}"] = training
    # fp32 past 128 key columns (at up to 128 the scans launch as at K = V = 128).
    variants["K=256/V=256/forward_scan/fp32"] = forward_scan(256, 256, "fp32", MANY_HEADS)
    variants["K=256/V=256/backward_scan/fp32"] = backward_scan(256, 256, "fp32", MANY_HEADS)
    for head_k in (256, 64):
        variants[f"K={head_k}/V=256/wy/fp32"] = wy(head_k, 256, "fp32")
    for backward, safe in ((False, True), (True, False)):
        name = "chunk_bwd_prepare_kernel" if backward else "chunk_prepare_kernel"
        variants[f"K=256/V=256/{name}"] = prepare(256, 256, backward, safe)
    for name, spec in key_split_kernels(256).items():
        variants[f"K=256/{name}"] = spec
    variants["K=256/V=256/recurrent_kda_kernel"] = recurrent(256, 256)
    gate = dict(GATE, K=256, BK=256, ROWS=32, USE_LOWER_BOUND=True)  # launch_kda_gate's rows
    variants["K=256/kda_gate_kernel"] = ("gate", "kda_gate_kernel", gate)
    return variants


WIDE = {f"wide/{name}": spec for name, spec in wide_variants().items()}
VARIANTS.update(WIDE)

# Each variant compiled by ``tools/sass_report.py`` (its ``compile_cubin``), in workers of
# a process without the interpreter.
SCRIPT = """
import json, multiprocessing, sys
sys.path.insert(0, "tools")
from sass_report import compile_cubin

def compile_variant(item):
    name, spec = item
    try:
        _, shared = compile_cubin(*spec, arg_types)
        return name, {"error": None, "shared": shared}
    except Exception as error:
        return name, {"error": f"{type(error).__name__}: {error}"}

variants, arg_types, workers = (json.loads(a) for a in sys.argv[1:])
with multiprocessing.get_context("fork").Pool(workers) as pool:
    results = dict(pool.imap_unordered(compile_variant, variants, chunksize=1))
print(json.dumps(results))
"""


# Slow compiles (fp32 FMA products, the unrolled prepare kernels) go first, so that the
# workers (one a CPU core of the CI machine) finish together.
SLOW = ("fp32", "prepare")
WORKERS = 2


# The default run compiles each kernel once, in the launch the H100 / H200 numbers come
# from (bf16, K = V = 128; the wide tiles at 256 x 256, which the H200 once refused); every
# other specialization is in the exhaustive sweep (pytest -m exhaustive).
REPRESENTATIVE = [
    "causal_conv1d_kernel/state=True/indices=False/varlen=False",
    "conv_grad_z_kernel/state=True/varlen=False",
    "conv_step_w4_kernel/sequences=4/indices=True",
    "kda_gate_kernel/lower_bound=True",
    "chunk_prepare_kernel/all",
    "chunk_recurrence_kernel/bf16/columns=64",
    "chunk_bwd_prepare_kernel/all",
    "chunk_bwd_wy_kernel/scalar_gate=False",
    "chunk_bwd_wy_kernel/scalar_gate=True",
    "chunk_bwd_pairs_kernel/all",
    "chunk_bwd_gate_kernel/scalar_gate=False",
    "chunk_bwd_recompute_kernel/scalar_gate=False",
    "chunk_bwd_state_kernel/columns=64",
    "wide/K=256/V=256/forward_scan/bf16/many",
]


def variant_sweep(names) -> list:
    """``names`` sorted, as the ``variant`` parameter: the representative ones by default,
    the rest marked ``exhaustive``."""
    names = sorted(names)
    return sweep(names, keep=[(name,) for name in REPRESENTATIVE if name in names])


@pytest.fixture(scope="module")
def compiled(request):
    """Compile in a process without TRITON_INTERPRET (interpreted kernels can't compile):
    the variants of the tests this run selected, not the deselected sweep's."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    selected = {
        item.callspec.params["variant"]
        for item in request.session.items
        if item.module is request.module
        and "variant" in getattr(getattr(item, "callspec", None), "params", {})
    }
    names = sorted(selected, key=lambda name: not any(word in name for word in SLOW))
    args = (json.dumps(x) for x in ([[n, VARIANTS[n]] for n in names], ARG_TYPES, WORKERS))
    result = subprocess.run([sys.executable, "-c", SCRIPT, *args], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=900)  # fmt: skip
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.splitlines()[-1])


@pytest.mark.parametrize("variant", variant_sweep(VARIANTS))
def test_kernel_compiles_for_sm90(compiled, variant):
    assert compiled[variant]["error"] is None


@pytest.mark.parametrize("variant", variant_sweep(SCANS))
def test_scan_stages_fit_shared_memory(compiled, variant):
    """``scan_stages`` takes 3 stages only where their buffers fit (a launch past the
    limit fails on the GPU, not here)."""
    assert compiled[variant]["shared"] <= SM90_SHARED_MEMORY


@pytest.mark.parametrize("variant", variant_sweep(WIDE))
def test_wide_head_dims_fit_shared_memory(compiled, variant):
    """Past 128 key or value columns every launch fits Hopper's shared memory (the H200
    refused the recurrence at K = V = 256 with 2 stages: 233 KB at 32 value columns,
    257 KB at 64)."""
    assert compiled[variant]["shared"] <= SM90_SHARED_MEMORY


def test_scans_run_ahead_where_they_fit():
    """Launches up to 64 value columns get 3 stages (the training forward's, the maps
    pass's and the 16-token steps of fp32 inputs too); 128 value columns 2."""
    stages = {name: spec[4]["num_stages"] if len(spec) > 4 else spec[2]["STAGES"]
              for name, spec in SCANS.items()}  # fmt: skip
    assert stages == {"chunk_recurrence_kernel/bf16/columns=32": 3,
                      "chunk_recurrence_kernel/bf16/columns=64": 3,
                      "chunk_recurrence_kernel/bf16/columns=128": 2,
                      "chunk_recurrence_kernel/training": 3,
                      "chunk_recurrence_kernel/chunk_states": 3,
                      "chunk_recurrence_kernel/fp32": 3,
                      "chunk_recurrence_kernel/maps": 3,
                      "chunk_recurrence_kernel/window": 3,
                      "chunk_bwd_state_kernel/columns=32": 3,
                      "chunk_bwd_state_kernel/columns=64": 3,
                      "chunk_bwd_state_kernel/columns=128": 2}  # fmt: skip


def test_launches_up_to_128_columns_as_tuned():
    """The warps and steps of the K, V <= 128 launches, as measured on the H200."""
    for block in (16, 32, 64, 128):
        assert prepare_warps(block) == 4
        assert scan_warps(block) == 4
        for block_v in (16, 32, 64, 128):
            for itemsize, stages in ((2, 2), (4, 1)):
                launch = wy_launch(block, block_v, itemsize)
                # The scalar gate's pair loop at 64 key columns a step, one stage: the launch
                # Triton 3.6's bundled ptxas assembles correctly on Hopper.
                assert launch._asdict() == dict(
                    value_step=min(block_v, 32),
                    key_step=min(block, 32),
                    warps=4,
                    stages=stages,
                    pair_step=64,
                    pair_stages=1,
                )
    assert [rebuild_blocks(k) for k in (16, 60, 64, 100, 128)] == [
        (1, 16), (1, 64), (1, 64), (2, 64), (2, 64)]  # fmt: skip


def test_scan_kernels_take_their_length_unspecialized():
    """The variants compiled here take ``length`` as an i32, as the GPU launches them only if
    Triton does not specialize it: a length of 1 becomes a constant, a variant that at
    K = 256 in fp32 needs 245760 bytes (the recurrence) and 253952 (the dS scan) of
    shared memory, past Hopper's 232448 (a one-token training call failed so on an H100)."""
    from kda_ops.kernels.chunk.backward.state import chunk_bwd_state_kernel
    from kda_ops.kernels.chunk.recurrence import chunk_recurrence_kernel

    for kernel in (chunk_recurrence_kernel, chunk_bwd_state_kernel):
        # The interpreter keeps triton.jit's arguments in kwargs; the compiler's JITFunction
        # turns them into argument indices.
        options = getattr(kernel, "kwargs", None) or {}
        names = options.get("do_not_specialize") or [
            kernel.arg_names[i] for i in getattr(kernel, "do_not_specialize", ())
        ]
        assert "length" in names, kernel.fn.__name__
