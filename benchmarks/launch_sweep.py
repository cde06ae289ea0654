"""Launch-size sweeps of the chunk kernels whose sizes the launchers pick (key or value
columns a program, warps, pipeline stages): the backward's kernels and the forward's
recurrence, each launched alone on random inputs shaped as a training step's (B = 1,
T = 8192, D = 128, bf16, safe gate -5, l2norm and beta sigmoid in the kernel), µs a launch
as the mean of ``triton.testing.do_bench`` (50 ms warm-up, 300 ms of runs). Ours only:
these pick launch constants in ``kda_ops/kernels/chunk/backward/`` and ``chunk/``;
``ab.py`` then times the whole step.

Usage (GPU): ``python benchmarks/launch_sweep.py [--heads 64] [--length 8192] [--only
prepare wy rebuild gate pairs state recurrence] [--shared-machine | --no-shared-machine]
[--out benchmarks/results/launch_sweep.json]``.
"""

import argparse
import itertools
from functools import partial

import torch
from ops import LOWER_BOUND, kda_inputs
from results import Results, add_arguments, row
from triton.runtime.errors import OutOfResources
from triton.testing import do_bench

from kda_ops.kernels.chunk.backward.gate import GATE_FLAGS, chunk_bwd_gate_kernel
from kda_ops.kernels.chunk.backward.pairs import PAIRS_FLAGS, chunk_bwd_pairs_kernel
from kda_ops.kernels.chunk.backward.prepare import chunk_bwd_prepare_kernel
from kda_ops.kernels.chunk.backward.recompute import RECOMPUTE_FLAGS, chunk_bwd_recompute_kernel
from kda_ops.kernels.chunk.backward.state import chunk_bwd_state_kernel
from kda_ops.kernels.chunk.backward.wy import chunk_bwd_wy_kernel
from kda_ops.kernels.chunk.device import CHUNK
from kda_ops.kernels.chunk.planning import prepare_flags
from kda_ops.kernels.chunk.recurrence import chunk_recurrence_kernel
from kda_ops.signature import DeltaRuleInputs, DeltaRuleOptions

DIM = 128


def launch_us(launch) -> float:
    return 1000 * do_bench(launch, warmup=50, rep=300)


class Inputs:
    """``ops.py``'s inputs of one training step, other tensors of its shapes, and the
    launcher's flags for them."""

    def __init__(self, length: int, heads: int):
        torch.manual_seed(0)
        self.length, self.heads, self.chunks = length, heads, length // CHUNK
        x = kda_inputs(1, length, heads, DIM)
        self.q, self.k, self.g, self.beta = x["q"], x["k"], x["g"], x["beta"]
        self.A_log, self.dt_bias = x["A_log"], x["dt_bias"]
        inputs = DeltaRuleInputs(*(x[name] for name in DeltaRuleInputs._fields))
        options = DeltaRuleOptions(DIM**-0.5, LOWER_BOUND, True, True)
        self.flags = prepare_flags(inputs, None, options)

    def f32(self, *shape: int, scale: float = 1.0) -> torch.Tensor:
        return torch.randn(*shape, device="cuda") * scale

    def flags_of(self, names) -> dict:
        return {name: self.flags[name] for name in names}

    def tiles(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """A ``[chunks, H, 64, 64]`` tile per chunk and head (T, dA fp32; Aqk in q's dtype,
        as the launchers keep it)."""
        return self.f32(self.chunks, self.heads, CHUNK, CHUNK, scale=0.01).to(dtype)

    def cumulative_gate(self) -> torch.Tensor:
        """A decreasing in-chunk cumsum of gates in [-0.5, 0], fp32 ``[1, T, H, D]``."""
        steps = torch.rand(1, self.chunks, CHUNK, self.heads, DIM, device="cuda") * 0.5
        return -steps.cumsum(2).reshape(1, self.length, self.heads, DIM)


def sweep_rebuild(x: Inputs):
    solve = x.tiles()
    q_norm, k_norm = (torch.rand(1, x.length, x.heads, device="cuda") + 0.5 for _ in range(2))
    cum_g = torch.empty(1, x.length, x.heads, DIM, device="cuda")
    w, qg, kd = (torch.empty_like(x.q) for _ in range(3))
    for columns, warps in itertools.product((32, 64, 128), (2, 4, 8)):
        grid = (x.chunks, x.heads, DIM // columns)
        yield f"rebuild, {columns} columns, {warps} warps", partial(
            chunk_bwd_recompute_kernel[grid],
            x.q, x.k, x.g, x.beta, x.A_log, x.dt_bias, None, None, solve, q_norm, k_norm,
            DIM**-0.5, LOWER_BOUND, x.length, 1, cum_g, w, qg, kd, H=x.heads, HV=x.heads,
            K=DIM, BK=columns, BN=1, **x.flags_of(RECOMPUTE_FLAGS), num_warps=warps,
        )  # fmt: skip


def sweep_gate(x: Inputs):
    d_cum = x.f32(1, x.length, x.heads, DIM)
    dbeta_rows = x.f32(1, x.length, x.heads)
    dbeta_part = x.f32(1, x.length, x.heads, 2)  # the pairs kernel's shares at 64 columns
    dg, dbeta = torch.empty_like(x.g), torch.empty_like(x.beta)
    for columns, warps in itertools.product((16, 32, 64, 128), (1, 2, 4)):
        shares = DIM // columns
        dA_log_part = torch.zeros(x.chunks, x.heads, shares, device="cuda")
        ddt_part = torch.zeros(x.chunks, x.heads, DIM, device="cuda")
        grid = (x.chunks * shares, x.heads)
        yield f"gate, {columns} columns, {warps} warps", partial(
            chunk_bwd_gate_kernel[grid],
            x.g, x.A_log, x.dt_bias, x.beta, None, None, d_cum, dbeta_rows, dbeta_part,
            LOWER_BOUND, x.length, 1, dg, dA_log_part, ddt_part, dbeta, HV=x.heads, K=DIM,
            BK=columns, BN=1, CHUNK=CHUNK, N_SHARES=2, **x.flags_of(GATE_FLAGS),
            num_warps=warps,
        )  # fmt: skip


def sweep_pairs(x: Inputs):
    """The pairs kernel on its dense path (the safe gate) and on its dyadic one (every
    chunk flagged unbounded, as Kimi Linear's softplus gate can leave them), by the
    diagonal blocks' fp32 dot precision, key columns, warps and stages."""
    cum_g = x.cumulative_gate()
    q_norm, k_norm = (torch.rand(1, x.length, x.heads, device="cuda") + 0.5 for _ in range(2))
    d_aqk, d_a = x.tiles(), x.tiles()
    d_aqk_low, d_a_low = d_aqk.to(torch.bfloat16), d_a.to(torch.bfloat16)
    rows = [x.f32(1, x.length, x.heads, DIM) for _ in range(3)]
    flagged = torch.ones(x.chunks * x.heads, dtype=torch.int8, device="cuda")
    sizes = itertools.product(("dense", "dyadic"), ("ieee", "tf32x3", "bf16x3"), (32, 64),
                              (1, 2, 4), (1, 2))  # fmt: skip
    for path, diagonal, columns, warps, stages in sizes:
        dbeta_part = torch.empty(1, x.length, x.heads, DIM // columns, device="cuda")
        grid = (x.chunks * 4 * (DIM // columns), x.heads)
        flags = dict(x.flags_of(PAIRS_FLAGS), SAFE_GATE=path == "dense")
        case = (f"pairs, {path}, {diagonal} diagonal, {columns} columns, {warps} warps, "
                f"{stages} stages")  # fmt: skip
        yield case, partial(
            chunk_bwd_pairs_kernel[grid],
            x.q, x.k, x.beta, None, None, cum_g, q_norm, k_norm, d_aqk, d_a, d_aqk_low,
            d_a_low, flagged, x.length, 1, *rows, dbeta_part, H=x.heads, HV=x.heads, K=DIM,
            BK=columns, BN=1, CHUNK=CHUNK, BLOCK=16, **flags, DIAGONAL_PRECISION=diagonal,
            CHUNKS="all" if path == "dense" else "unbounded", num_warps=warps,
            num_stages=stages,
        )  # fmt: skip


def sweep_state(x: Inputs):
    w, qg, kd, grad_o = (0.1 * torch.randn_like(x.q) for _ in range(4))
    aqk, cum_g = x.tiles(x.q.dtype), x.cumulative_gate()
    grad_final = torch.zeros(1, x.heads, DIM, DIM, device="cuda")
    dv_new = torch.empty(1, x.length, x.heads, DIM, device="cuda")
    dstates = torch.empty(x.chunks, x.heads, DIM, DIM, device="cuda", dtype=torch.bfloat16)
    # 16 columns left out: slower than 32 at every warp and stage count tried, and at 4
    # warps and 3 stages the launch faulted (an illegal address, Triton 3.6).
    for columns, warps, stages in itertools.product((32, 64, 128), (4, 8), (1, 2, 3)):
        grid = (DIM // columns * x.heads,)
        yield f"dS scan, {columns} value columns, {warps} warps, {stages} stages", partial(
            chunk_bwd_state_kernel[grid],
            w, qg, kd, aqk, cum_g, grad_o, grad_final, None, None, None, x.length, 0, dv_new,
            dstates, None, HV=x.heads, K=DIM, V=DIM, BK=DIM, BV=columns, CHUNK=CHUNK,
            HAS_INITIAL_STATE=False, IS_VARLEN=False, DOT_PRECISION="tf32",
            num_warps=warps, num_stages=stages,
        )  # fmt: skip


def sweep_recurrence(x: Inputs):
    """The inference forward's recurrence (outputs, no chunk states). The launcher takes
    the fewest value columns that leave every program an SM of its own, else 64 where
    those get 3 stages (``scan_value_columns``, ``scan_stages``): at H = 96, 64 columns at
    3 stages in two waves of programs."""
    w, u, qg, kd = (0.1 * torch.randn_like(x.q) for _ in range(4))
    aqk = x.tiles(x.q.dtype)
    chunk_decay = -torch.rand(x.chunks, x.heads, DIM, device="cuda")
    o = torch.empty_like(x.q)
    final_state = torch.empty(1, x.heads, DIM, DIM, device="cuda")
    for columns, warps, stages in itertools.product((32, 64, 128), (4, 8), (2, 3)):
        grid = (DIM // columns * x.heads,)
        yield f"recurrence, {columns} value columns, {warps} warps, {stages} stages", partial(
            chunk_recurrence_kernel[grid],
            w, u, qg, kd, aqk, chunk_decay, None, None, None, None, None, x.length, 0, 0, o,
            final_state, None, HV=x.heads, K=DIM, V=DIM, WIDTH=DIM, BK=DIM, BV=columns,
            STEP=CHUNK, HAS_INITIAL_STATE=False, IS_VARLEN=False, DOT_PRECISION="tf32",
            STORE_CHUNK_STATES=False, STORE_OUTPUT=True, STAGES=stages, WINDOW_STEPS=0,
            UNMASKED_FULL_STEPS=True, num_warps=warps,
        )  # fmt: skip


def sweep_prepare(x: Inputs):
    """Kernel 1 as the training forward launches it (no G stored)."""
    v = torch.randn_like(x.q)
    w, u, qg, kd = (torch.empty_like(x.q) for _ in range(4))
    aqk, solve = x.tiles(x.q.dtype), x.tiles()
    chunk_decay = torch.empty(x.chunks, x.heads, DIM, device="cuda")
    q_norm, k_norm = (torch.empty(1, x.length, x.heads, device="cuda") for _ in range(2))
    for warps in (4, 8, 16):
        yield f"kernel 1, {warps} warps", partial(
            chunk_bwd_prepare_kernel[(x.chunks, x.heads)],
            x.q, x.k, v, x.g, x.beta, x.A_log, x.dt_bias, None, None, DIM**-0.5, LOWER_BOUND,
            x.length, 1, None, w, u, qg, kd, aqk, solve, chunk_decay, q_norm, k_norm, None,
            None, H=x.heads, HV=x.heads, K=DIM, V=DIM, BK=DIM, BV=DIM, BN=1, **x.flags,
            CHUNKS="all", num_warps=warps,
        )  # fmt: skip


def sweep_wy(x: Inputs):
    v, w, grad_o, v_new_rows, d_ru_rows, dv = (0.1 * torch.randn_like(x.q) for _ in range(6))
    cum_g = x.cumulative_gate()
    q_norm, k_norm = (torch.rand(1, x.length, x.heads, device="cuda") + 0.5 for _ in range(2))
    states, dstates = (0.1 * torch.randn(x.chunks, x.heads, DIM, DIM, device="cuda",
                                         dtype=torch.bfloat16) for _ in range(2))  # fmt: skip
    dv_new = x.f32(1, x.length, x.heads, DIM)
    solve, d_aqk, d_a = x.tiles(), x.tiles(), x.tiles()
    d_aqk_low, d_a_low = (torch.empty_like(solve, dtype=torch.bfloat16) for _ in range(2))
    rows = [torch.empty(1, x.length, x.heads, DIM, device="cuda") for _ in range(3)]
    dbeta = torch.empty(1, x.length, x.heads, device="cuda")
    # 3 stages: each loop's loads run a step ahead instead of being waited for at once
    # (sm_90, Triton 3.6: 131 KB of shared memory at 32 / 32, one program an SM; 90 KB at
    # 16 / 16, two).
    sizes = [(value_step, key_step, 4, 2) for value_step in (16, 32, 64)
             for key_step in (16, 32, 64)] + [(32, 32, 8, 2), (32, 32, 4, 1)] + [
             (value_step, key_step, 4, 3) for value_step in (16, 32)
             for key_step in (16, 32)]  # fmt: skip
    for value_step, key_step, warps, stages in sizes:
        case = f"WY, value step {value_step}, key step {key_step}, {warps} warps, {stages} stages"
        yield case, partial(
            chunk_bwd_wy_kernel[(x.chunks, x.heads)],
            x.q, x.k, v, x.beta, None, None, cum_g, q_norm, k_norm, w, states, dstates, grad_o,
            dv_new, DIM**-0.5, x.length, 1, solve, d_aqk, d_a, d_aqk_low, d_a_low, v_new_rows,
            d_ru_rows, *rows, dv, dbeta, H=x.heads, HV=x.heads, K=DIM, V=DIM, BK=DIM, BV=DIM,
            BV_STEP=value_step, BK_STEP=key_step, BN=1, CHUNK=CHUNK, USE_L2NORM=True,
            USE_BETA_SIGMOID=True, IS_VARLEN=False, DOT_PRECISION="tf32", num_warps=warps,
            num_stages=stages,
        )  # fmt: skip


SWEEPS = {"prepare": sweep_prepare, "wy": sweep_wy, "rebuild": sweep_rebuild,
          "gate": sweep_gate, "pairs": sweep_pairs, "state": sweep_state,
          "recurrence": sweep_recurrence}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--only", nargs="+", choices=list(SWEEPS), help="a subset, in order")
    parser.add_argument("--heads", type=int, default=64)
    parser.add_argument("--length", type=int, default=8192)
    add_arguments(parser, "launch_sweep")
    args = parser.parse_args()
    results = Results.from_args("launch_sweep", args)
    x = Inputs(args.length, args.heads)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}: B=1 T={args.length} "
          f"H={args.heads} D={DIM} bf16\n\n| launch | µs |\n| --- | ---: |")  # fmt: skip
    for name in args.only or SWEEPS:
        for case, launch in SWEEPS[name](x):
            extra = dict(sweep=name, T=args.length, H=args.heads, D=DIM)
            try:
                us = launch_us(launch)
            except OutOfResources as error:  # e.g. 3 stages' buffers past shared memory
                print(f"| {case} | does not fit: {error} |", flush=True)
                results.add({"case": case, "library": "kda-ops", "metric": "launch_time",
                             "error": f"does not fit: {error}", **extra})  # fmt: skip
                continue
            print(f"| {case} | {us:.1f} |", flush=True)
            results.add(row(case, "kda-ops", "launch_time", [us], "us",
                            timer="do_bench mean", **extra))  # fmt: skip
    print(f"\nwrote {results.path}")


if __name__ == "__main__":
    main()
