"""A self-contained Triton kernel (no kda_ops import) with the shape of the chunk
recurrence's step loop, to tell whether the wrong bf16 answers of 64-token steps at 32 value
columns (past 128 key columns, and in the unmasked loop) are Triton's: a state ``[BK, BV]``
fp32 in registers, and per 64-row step ``v_new = u - w S``, ``o = qg S + A v_new``,
``S = diag(decay) S + kdᵀ v_new`` with bf16 dot operands, the rows of a partial last step
masked. The same arithmetic in PyTorch (fp32 with the kernel's bf16 roundings) is the
expectation. No kda_ops code is involved: a wrong answer here is the compiler's.

Usage, on a CUDA machine::

    python tools/triton_repro_32cols.py                      # the default grid, a line each
    python tools/triton_repro_32cols.py --steps 16 --keys 128 --stages 3   # inference's steps
    python tools/triton_repro_32cols.py --case '{"K": 192, "BV": 32, "warps": 4}'

Each case prints ``ok`` / ``WRONG`` with the relative errors of o and the final state, or
the exception (an illegal address kills the process: the grid runs each case in a child).
The first line names the ptxas that assembled the kernels: Triton 3.6 bundles ptxas 12.8.93,
which FLA found miscompiling Hopper kernels of this family (wrong values, invalid
shared-memory accesses, on byte-identical PTX that ptxas 13.1 assembles correctly:
fla-org/flash-linear-attention#1262; triton-lang/triton#11366); ``TRITON_PTXAS_PATH``
picks another (``tools/device_run.sh``'s ``PTXAS``).
"""

from __future__ import annotations

import argparse
import itertools
import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import torch
import triton
import triton.language as tl

TOLERANCE = 1e-2


@triton.jit(do_not_specialize=["length"])
def step_loop_kernel(w, u, qg, kd, aqk, decay, o, final_state, length,
                     K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                     STEP: tl.constexpr, STAGES: tl.constexpr, UNMASKED: tl.constexpr,
                     DOT: tl.constexpr):  # fmt: skip
    """One program a value block: the steps over ``length`` rows of one sequence. With
    ``UNMASKED`` the full steps run in a loop without row masks, then the partial one."""
    i_v = tl.program_id(0)
    offs_k = tl.arange(0, BK)
    offs_v = i_v * BV + tl.arange(0, BV)
    mask_k = offs_k < K
    mask_v = offs_v < V
    rows = tl.arange(0, STEP)
    state = tl.zeros([BK, BV], dtype=tl.float32)
    steps = tl.cdiv(length, STEP)
    full = length // STEP if UNMASKED else 0
    for partial in tl.static_range(0 if UNMASKED else 1, 2):
        first = full if partial else 0
        last = steps if partial else full
        for c in tl.range(first, last, num_stages=1 if (UNMASKED and partial) else STAGES):
            in_seq = (c * STEP + rows < length) if partial else rows < STEP
            token = (c * STEP + rows)[:, None]
            mask_rk = in_seq[:, None] & mask_k[None, :]
            mask_rv = in_seq[:, None] & mask_v[None, :]
            b_w = tl.load(w + token * K + offs_k[None, :], mask=mask_rk, other=0.0)
            b_qg = tl.load(qg + token * K + offs_k[None, :], mask=mask_rk, other=0.0)
            b_kd = tl.load(kd + token * K + offs_k[None, :], mask=mask_rk, other=0.0)
            b_u = tl.load(u + token * V + offs_v[None, :], mask=mask_rv, other=0.0)
            b_a = tl.load(aqk + (c * STEP + rows)[:, None] * STEP + rows[None, :])
            b_a = tl.where(rows[:, None] >= rows[None, :], b_a, 0.0)
            b_decay = tl.load(decay + c * K + offs_k, mask=mask_k, other=0.0)
            b_state = state.to(DOT)
            v_new = b_u.to(tl.float32) - tl.dot(b_w, b_state)
            v_new = tl.where(mask_rv, v_new, 0.0).to(DOT)
            b_o = tl.dot(b_qg, b_state) + tl.dot(b_a, v_new)
            tl.store(o + token * V + offs_v[None, :], b_o, mask=mask_rv)
            state = state * b_decay[:, None] + tl.dot(tl.trans(b_kd), v_new)
    tl.store(final_state + offs_k[:, None] * V + offs_v[None, :], state,
             mask=mask_k[:, None] & mask_v[None, :])  # fmt: skip


def expected(w, u, qg, kd, aqk, decay, step: int):
    """The kernel's arithmetic in PyTorch: fp32 state, dot operands in the inputs' dtype."""
    length, K = w.shape
    V = u.shape[1]
    state = torch.zeros(K, V, device=w.device)
    o = torch.empty(length, V, device=w.device)
    for c in range(-(-length // step)):
        rows = slice(c * step, min((c + 1) * step, length))
        n = rows.stop - rows.start
        b_state = state.to(w.dtype).float()
        v_new = (u[rows].float() - w[rows].float() @ b_state).to(w.dtype).float()
        a = aqk[c * step : c * step + n, :n].float().tril()
        o[rows] = qg[rows].float() @ b_state + a @ v_new
        state = state * decay[c][:, None] + kd[rows].float().T @ v_new
    return o, state


def run_case(K: int, V: int = 128, BV: int = 32, length: int = 1000, step: int = 64,
             warps: int = 4, stages: int = 2, unmasked: bool = False,
             dtype: str = "bfloat16", device: str = "cuda") -> dict:  # fmt: skip
    torch.manual_seed(0)
    dev, low = device, getattr(torch, dtype)
    scale = K**-0.5
    w = (scale * torch.randn(length, K, device=dev)).to(low)
    qg = (scale * torch.randn(length, K, device=dev)).to(low)
    kd = (scale * torch.randn(length, K, device=dev)).to(low)
    u = torch.randn(length, V, device=dev).to(low)
    steps = -(-length // step)
    aqk = (0.1 * torch.randn(steps * step, step, device=dev)).to(low)
    decay = torch.rand(steps, K, device=dev) * 0.2 + 0.8
    o = torch.empty(length, V, device=dev, dtype=low)
    final = torch.empty(K, V, device=dev)
    BK = triton.next_power_of_2(K)
    step_loop_kernel[(triton.cdiv(V, BV),)](
        w, u, qg, kd, aqk, decay, o, final, length, K=K, V=V, BK=BK, BV=BV, STEP=step,
        STAGES=stages, UNMASKED=unmasked, DOT=tl.bfloat16 if dtype == "bfloat16" else tl.float32,
        num_warps=warps, num_stages=stages,
    )  # fmt: skip
    if dev == "cuda":
        torch.cuda.synchronize()
    want_o, want_state = expected(w, u, qg, kd, aqk, decay, step)
    errors = {
        "o": float((o.float() - want_o).norm() / want_o.norm()),
        "state": float((final - want_state).norm() / want_state.norm()),
    }
    return dict(errors=errors, ok=all(e < TOLERANCE for e in errors.values()))


def grid(keys=(128, 192, 256), columns=(16, 32, 64), warps=(4, 8), stages=(1, 2, 3),
         steps=(64,), unmasked=(False, True)) -> list[dict]:  # fmt: skip
    """The cases of every combination, less those past Hopper's shared memory (wide keys
    at 64 columns with more than one stage)."""
    cases = []
    for K, BV, n_warps, n_stages, step, loose in itertools.product(
        keys, columns, warps, stages, steps, unmasked
    ):
        if K > 128 and n_stages > 1 and (BV == 64 or n_stages > 2):
            continue
        cases.append(dict(K=K, BV=BV, warps=n_warps, stages=n_stages, step=step, unmasked=loose))
    return cases


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--case", help="one case's keyword arguments as JSON, run here")
    parser.add_argument("--timeout", type=float, default=120.0)
    parser.add_argument("--jobs", type=int, default=8, help="cases run at once")
    for name, default in (("keys", [128, 192, 256]), ("columns", [16, 32, 64]),
                          ("warps", [4, 8]), ("stages", [1, 2, 3]), ("steps", [64])):  # fmt: skip
        parser.add_argument(f"--{name}", type=int, nargs="+", default=default,
                            help=f"the grid's {name} (default: %(default)s)")  # fmt: skip
    args = parser.parse_args(argv)
    cases = grid(keys=args.keys, columns=args.columns, warps=args.warps, stages=args.stages,
                 steps=args.steps)  # fmt: skip
    if args.case:
        case = json.loads(args.case)
        try:
            result = run_case(**case)
        except Exception as error:  # recorded, as the grid's other cases
            result = dict(ok=False, exception=f"{type(error).__name__}: {str(error)[:300]}")
        print(json.dumps(dict(case, **result)), flush=True)
        return 0

    def run_child(case: dict) -> dict:
        command = [sys.executable, __file__, "--case", json.dumps(case)]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout)
        except subprocess.TimeoutExpired:
            return dict(case, ok=False, exit="timeout")
        lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
        if lines:
            return json.loads(lines[-1])
        return dict(case, ok=False, exit=done.returncode, stderr=done.stderr[-300:])

    ptxas = triton.knobs.nvidia.ptxas  # TRITON_PTXAS_PATH's, else the one Triton bundles
    print(f"triton {triton.__version__}, ptxas {ptxas.version} ({ptxas.path})", flush=True)
    wrong = unfit = 0
    with ThreadPoolExecutor(args.jobs) as pool:
        for result in pool.map(run_child, cases):
            # A launch past shared memory is refused before it runs: no answer, not a wrong one.
            past_shared = str(result.get("exception", "")).startswith("OutOfResources")
            unfit += past_shared
            wrong += not result["ok"] and not past_shared
            label = "ok    " if result["ok"] else "UNFIT " if past_shared else "WRONG "
            print(label + json.dumps(result), flush=True)
    print(f"{wrong} of {len(cases)} cases wrong ({unfit} past shared memory, not run)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
