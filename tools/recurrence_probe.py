"""Localizes a wrong chunk forward on a GPU: runs the forward's two kernels (prepare,
recurrence) in a chosen dtype with chosen recurrence launch settings, and compares o and
the final state with the float64 reference; each case in a process of its own, so that a
fault cannot hide the others.

A case may take its recurrence's inputs from the fp32 prepare (cast to the case's dtype:
``--source fp32_prepare``), which tells a wrong prepare from a wrong recurrence, and may
override the recurrence launch's ``BV`` / ``STAGES`` / ``num_warps`` /
``UNMASKED_FULL_STEPS``, which tells which setting a wrong answer needs. The default set
covers the two open questions of the bf16 chunk path: the recurrence past 128 key
columns, and the unmasked loop of 64-token steps.

Usage, from the repository root on a CUDA machine::

    python tools/recurrence_probe.py --json probe.jsonl [--jobs 6] [--cell-timeout 240]
    python tools/recurrence_probe.py --case '{"K": 256, "V": 128, ...}'   # one case
    python tools/recurrence_probe.py --cases '[{"K": 256, ...}, ...]' --json probe.jsonl

A case whose relative error passes FLA's bf16 tolerance (1e-2 for o and the state)
prints ``ok``; the JSON line holds both errors, NaN counts and the exit code.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[1]
TOLERANCE = 1e-2


@dataclasses.dataclass(frozen=True)
class Case:
    """One forward: shapes, the gate ("kda": per channel, "gdn": scalar), the prepare's
    chunk (16 or 64 tokens), the dtype of both kernels, where the recurrence's inputs come
    from ("own": this dtype's prepare; "fp32_prepare": the fp32 prepare's, cast), and
    recurrence launch overrides (``None``: as planned)."""

    K: int
    V: int
    T: int = 1000
    batch: int = 2
    heads: int = 2
    value_heads: int = 4
    varlen: bool = False
    gate: str = "kda"
    chunk: int = 16
    dtype: str = "bfloat16"
    source: str = "own"
    BV: Optional[int] = None
    STAGES: Optional[int] = None
    num_warps: Optional[int] = None
    UNMASKED_FULL_STEPS: Optional[bool] = None
    initial_state: bool = True


def default_cases() -> list[Case]:
    """Past 128 key columns in bf16 (the widths, both gates, both chunks, the fp32
    prepare's intermediates, narrower value blocks, more or fewer warps and stages), the
    128-column controls, and the 64-token steps with and without the unmasked loop."""
    cases = []
    for K, V, chunk, gate in itertools.product((128, 192, 256), (64, 128), (16, 64),
                                               ("kda", "gdn")):  # fmt: skip
        cases.append(Case(K=K, V=V, chunk=chunk, gate=gate))
    for K in (192, 256):
        cases.append(Case(K=K, V=128, source="fp32_prepare"))
        cases.append(Case(K=K, V=128, chunk=64, source="fp32_prepare"))
        cases.append(Case(K=K, V=128, varlen=True))
        cases.append(Case(K=K, V=128, T=64, initial_state=True))
        cases.append(Case(K=K, V=128, T=4096))
        for BV in (16, 32):
            cases.append(Case(K=K, V=128, BV=BV))
        for warps in (4, 8):
            cases.append(Case(K=K, V=128, num_warps=warps, BV=32))
        for stages in (1, 2):
            cases.append(Case(K=K, V=128, STAGES=stages))
        cases.append(Case(K=K, V=128, dtype="float32"))
    for T, unmasked in itertools.product((1000, 1024, 4096 + 17), (False, True)):
        cases.append(Case(K=128, V=128, T=T, chunk=64, UNMASKED_FULL_STEPS=unmasked))
        cases.append(Case(K=64, V=64, T=T, chunk=64, UNMASKED_FULL_STEPS=unmasked))
    return cases


def run_case(case: Case) -> dict[str, object]:
    """The case's forward in this process; returns its errors against float64."""
    import torch

    from kda_ops import reference
    from kda_ops.kernels.chunk import launch as chunk_launch
    from kda_ops.kernels.chunk.recurrence import recurrence_launches
    from kda_ops.kernels.sizes import cdiv
    from kda_ops.signature import DeltaRuleInputs, DeltaRuleOptions

    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: TRITON_INTERPRET=1
    dtype = getattr(torch, case.dtype)
    B = 1 if case.varlen else case.batch
    H, HV, T, K, V = case.heads, case.value_heads, case.T, case.K, case.V
    cu_seqlens = None
    if case.varlen:
        cut = sorted({1, T // 7, T // 2 + 3})
        cu_seqlens = torch.tensor([0, *cut, T], device=device, dtype=torch.int32)
    n_seqs = B if cu_seqlens is None else cu_seqlens.numel() - 1
    gate_shape = (B, T, HV, K) if case.gate == "kda" else (B, T, HV)
    raw = DeltaRuleInputs(
        q=torch.randn(B, T, H, K, device=device),
        k=torch.randn(B, T, H, K, device=device),
        v=torch.randn(B, T, HV, V, device=device),
        g=torch.randn(gate_shape, device=device),
        beta=torch.randn(B, T, HV, device=device),
        A_log=torch.rand(HV, device=device) * 2 - 1,
        dt_bias=torch.randn(HV * K if case.gate == "kda" else HV, device=device),
    )
    state = torch.randn(n_seqs, HV, K, V, device=device) if case.initial_state else None
    options = DeltaRuleOptions(scale=K**-0.5, lower_bound=-5.0, use_qk_l2norm=True,
                               use_beta_sigmoid=True)  # fmt: skip

    def in_dtype(inputs: DeltaRuleInputs, to: torch.dtype) -> DeltaRuleInputs:
        return inputs.map_tokens(lambda x: x.to(to))

    expected_o, expected_state = reference.delta_rule(
        reference.chunk_delta_rule, *in_dtype(raw, torch.float64)[:5],
        raw.A_log.double(), raw.dt_bias.double(),
        None if state is None else state.double(), cu_seqlens, *options,
    )  # fmt: skip

    inputs = in_dtype(raw, dtype)
    prepare = chunk_launch.plan_prepare(inputs, cu_seqlens, options, case.chunk)
    for launch in prepare.launches():
        launch.run()
    intermediates = prepare.intermediates
    if case.source == "fp32_prepare":
        exact = chunk_launch.plan_prepare(in_dtype(raw, torch.float32), cu_seqlens, options,
                                          case.chunk)  # fmt: skip
        for launch in exact.launches():
            launch.run()
        intermediates = tuple(x.to(y.dtype) for x, y in zip(exact.intermediates, intermediates))
        intermediates = (*intermediates[:5], exact.intermediates[5])  # chunk_decay stays fp32
    o = torch.empty_like(inputs.v)
    final_state = torch.empty(n_seqs, HV, K, V, device=device)
    launches = recurrence_launches(intermediates, state, cu_seqlens, prepare.chunk_offsets, T,
                                   o, final_state, None, prepare.precision)  # fmt: skip
    settings = []
    for launch in launches:
        args = dict(launch.args)
        old_columns = args["BV"]
        heads = launch.grid[0] // cdiv(args["WIDTH"], old_columns)
        for name in ("BV", "STAGES", "num_warps", "UNMASKED_FULL_STEPS"):
            if getattr(case, name) is not None:
                args[name] = getattr(case, name)
        settings.append({name: args[name] for name in
                         ("BV", "STAGES", "num_warps", "UNMASKED_FULL_STEPS", "STEP")})  # fmt: skip
        grid = (cdiv(args["WIDTH"], args["BV"]) * heads,)
        launch.kernel[grid](**args)
    if device == "cuda":
        torch.cuda.synchronize()

    def error(got: torch.Tensor, expected: torch.Tensor) -> float:
        expected = expected.double()
        return ((got.double() - expected).norm() / expected.norm().clamp_min(1e-30)).item()

    o_error, state_error = error(o, expected_o), error(final_state, expected_state)
    return dict(
        o=o_error, state=state_error, o_nan=int(o.isnan().sum()),
        state_nan=int(final_state.isnan().sum()), launches=settings,
        ok=o_error < TOLERANCE and state_error < TOLERANCE,
    )  # fmt: skip


def run_isolated(case: Case, timeout: float) -> dict[str, object]:
    """``run_case`` in a subprocess; a fault or a timeout is a result too."""
    command = [sys.executable, __file__, "--case", json.dumps(dataclasses.asdict(case))]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout,
                              cwd=REPO)  # fmt: skip
    except subprocess.TimeoutExpired:
        return {"case": dataclasses.asdict(case), "rc": "timeout", "ok": False}
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    result = json.loads(lines[-1]) if lines else {"ok": False, "stderr": done.stderr[-2000:]}
    return {"case": dataclasses.asdict(case), "rc": done.returncode, **result}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--case", help="one case as JSON (Case's fields), run in this process")
    parser.add_argument("--cases", help="a JSON list of cases to run in place of the default set")
    parser.add_argument("--json", type=Path, help="where the results go, a JSON line a case")
    parser.add_argument("--jobs", type=int, default=6)
    parser.add_argument("--cell-timeout", type=float, default=240.0)
    args = parser.parse_args()
    if args.case is not None:
        print(json.dumps(run_case(Case(**json.loads(args.case)))), flush=True)
        return
    cases = default_cases() if args.cases is None else [Case(**c) for c in json.loads(args.cases)]
    failed = 0
    with ThreadPoolExecutor(args.jobs) as pool:
        for result in pool.map(lambda c: run_isolated(c, args.cell_timeout), cases):
            failed += not result["ok"]
            case = {k: v for k, v in result["case"].items() if v is not None}
            status = "ok" if result["ok"] else "FAIL"
            print(status, case, {k: result.get(k) for k in ("o", "state", "rc")}, flush=True)
            if args.json is not None:
                with args.json.open("a") as file:
                    file.write(json.dumps(result) + "\n")
    print(f"{len(cases) - failed} / {len(cases)} cases within {TOLERANCE}")


if __name__ == "__main__":
    main()
