"""The chunk op's head-dim matrix on a GPU: every (K, V, dtype, varlen, gate) cell in a
process of its own, so that a fault in one cannot hide the others.

A cell runs ``kda_ops.chunk_kda`` (l2norm, gate and beta sigmoid in the kernel, an initial
state, GVA with HV = 2 H) forward, backward, and backward with ``disable_recompute=True``,
and compares o, the final state and every gradient with the same call in float64 (the
reference) by FLA's relative error (``benchmarks/harness.py``). It passes under 1e-3 for
fp32, 1e-2 for o / state and 3e-2 for gradients in bf16 / fp16. One JSON line per case
goes to ``--json`` (with the time the kda-ops call took, compilation included); a cell
that crashed or ran out of time is recorded with its exit code and the case it was in.

Usage, from the repository root on a CUDA machine::

    python tools/head_dim_matrix.py --json matrix.jsonl --jobs 6 \
        [--dims 16 32 60 64 100 128 192 256] [--dtypes bfloat16 float16 float32] \
        [--pairs 256x64 64x256] [--gates safe softplus] [--cell-timeout 400]
"""

from __future__ import annotations

import argparse
import itertools
import json
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[1]
MODES = ("fwd", "bwd", "bwd_disable_recompute")
GRADIENTS = ("dq", "dk", "dv", "dg", "dbeta", "dA_log", "ddt_bias", "dh0")
SAFE_LOWER_BOUND = -5.0


def tolerance(dtype: str, name: str) -> float:
    if dtype == "float32":
        return 1e-3
    return 1e-2 if name in ("o", "ht") else 3e-2


def run_cell(
    K: int, V: int, dtype_name: str, varlen: bool, gate: str, modes: list[str], device: str
) -> None:
    """One cell in this process; prints a JSON line when each case starts and ends (with
    the compute dtype the plan gave the call)."""
    import torch

    import kda_ops

    sys.path.insert(0, str(REPO / "benchmarks"))  # the benchmarks' accuracy metric
    from harness import relative_error

    torch.manual_seed(0)
    H, HV, T = 2, 4, 300
    B = 1 if varlen else 2
    cu_seqlens = torch.tensor([0, 37, 200, T], device=device) if varlen else None
    sequences = 3 if varlen else B
    inputs = dict(
        q=torch.randn(B, T, H, K, device=device),
        k=torch.randn(B, T, H, K, device=device),
        v=torch.randn(B, T, HV, V, device=device),
        g=torch.randn(B, T, HV, K, device=device),
        beta=torch.randn(B, T, HV, device=device),
        A_log=torch.rand(HV, device=device),
        dt_bias=torch.randn(HV * K, device=device),
        initial_state=0.1 * torch.randn(sequences, HV, K, V, device=device),
    )
    grad_o = torch.randn(B, T, HV, V, device=device)
    lower_bound = SAFE_LOWER_BOUND if gate == "safe" else None

    def call(dtype: torch.dtype, disable_recompute: bool, grad: bool) -> list:
        params = torch.float64 if dtype == torch.float64 else torch.float32
        args = {
            name: x.to(params if name in ("A_log", "dt_bias", "initial_state") else dtype)
            .detach()
            .requires_grad_(grad)
            for name, x in inputs.items()
        }
        o, ht = kda_ops.chunk_kda(
            **args, output_final_state=True, use_qk_l2norm_in_kernel=True,
            use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
            lower_bound=lower_bound, cu_seqlens=cu_seqlens,
            disable_recompute=disable_recompute,
        )  # fmt: skip
        results = [o, ht]
        if grad:
            ((o * grad_o.to(o.dtype)).sum() + ht.sum()).backward()
            results += [x.grad for x in args.values()]
        return results

    probe = torch.empty(1, 1, 1, K, device=device, dtype=getattr(torch, dtype_name))
    compute_dtype = str(kda_ops.explain(probe).compute_dtype).removeprefix("torch.")
    for mode in modes:
        case = dict(K=K, V=V, dtype=dtype_name, varlen=varlen, gate=gate, mode=mode,
                    compute_dtype=compute_dtype)  # fmt: skip
        print(json.dumps({"start": case}), flush=True)
        start = time.monotonic()
        try:
            grad = mode != "fwd"
            got = call(getattr(torch, dtype_name), mode == "bwd_disable_recompute", grad)
            if device == "cuda":
                torch.cuda.synchronize()
            case["seconds_kda"] = round(time.monotonic() - start, 1)
            ref = call(torch.float64, False, grad)
            names = ("o", "ht", *GRADIENTS)
            case["error"] = {n: round(relative_error(x, r), 6) for n, r, x in zip(names, ref, got)}
            case["ok"] = all(e < tolerance(dtype_name, n) for n, e in case["error"].items())
        except Exception as exc:  # recorded, the next case still runs
            case["ok"] = False
            case["exception"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
        print(json.dumps(case), flush=True)


def cells(args: argparse.Namespace) -> list[tuple[int, int, str, bool, str]]:
    shapes = [(d, d) for d in args.dims]
    shapes += [tuple(int(n) for n in pair.split("x")) for pair in args.pairs]
    return [
        (K, V, dtype, varlen, gate)
        for (K, V), dtype, varlen, gate in itertools.product(
            shapes, args.dtypes, (False, True), args.gates
        )
    ]


def launch(cell: tuple, args: argparse.Namespace, deadline: Optional[float]) -> list[dict]:
    K, V, dtype, varlen, gate = cell
    label = dict(K=K, V=V, dtype=dtype, varlen=varlen, gate=gate)
    if deadline is not None and time.monotonic() > deadline:
        return [{**label, "not_run": "deadline"}]
    command = [sys.executable, __file__, "--cell", str(K), str(V), dtype, str(int(varlen)), gate,
               "--device", args.device, "--modes", *args.modes]  # fmt: skip
    try:
        done = subprocess.run(
            command, capture_output=True, text=True, timeout=args.cell_timeout, cwd=REPO
        )
        stdout, code = done.stdout, done.returncode
    except subprocess.TimeoutExpired as exc:
        stdout = exc.stdout.decode() if isinstance(exc.stdout, bytes) else exc.stdout or ""
        code = "timeout"
    lines = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    results = [line for line in lines if "start" not in line]
    if code != 0:
        started = [line["start"] for line in lines if "start" in line]
        last = started[-1] if len(started) > len(results) else None
        results.append({**label, "ok": False, "exit": code, "in_case": last})
    return results


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dims", type=int, nargs="*", default=[16, 32, 60, 64, 100, 128, 192, 256])
    parser.add_argument("--pairs", nargs="*", default=["256x64", "64x256"],
                        help="K x V shapes besides the square ones")  # fmt: skip
    parser.add_argument("--dtypes", nargs="*", default=["bfloat16", "float16", "float32"])
    parser.add_argument("--gates", nargs="*", default=["safe", "softplus"])
    parser.add_argument("--modes", nargs="*", default=list(MODES), choices=MODES)
    parser.add_argument("--device", default="cuda", help="cpu: a check of the tool itself")
    parser.add_argument("--jobs", type=int, default=4, help="cells run at once")
    parser.add_argument("--cell-timeout", type=float, default=600.0)
    parser.add_argument("--deadline", type=float, help="seconds after which no cell starts")
    parser.add_argument("--json", type=Path, help="JSON lines, one per case")
    parser.add_argument("--cell", nargs=5, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.cell:
        K, V, dtype, varlen, gate = args.cell
        run_cell(int(K), int(V), dtype, varlen == "1", gate, args.modes, args.device)
        return 0
    deadline = None if args.deadline is None else time.monotonic() + args.deadline
    failed = 0
    out = args.json.open("a") if args.json else None
    with ThreadPoolExecutor(args.jobs) as pool:
        for results in pool.map(lambda cell: launch(cell, args, deadline), cells(args)):
            for result in results:
                failed += result.get("ok") is False
                line = json.dumps(result)
                print(line, flush=True)
                if out is not None:
                    out.write(line + "\n")
                    out.flush()
    if out is not None:
        out.close()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
