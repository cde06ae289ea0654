"""Localizes a wrong or faulting Gated DeltaNet backward on a GPU: runs one training call
(``tools/fuzz.py``'s cases, against the float64 reference) with the WY kernel's launch
overridden, each (case, launch) in a process of its own, so that a fault cannot hide the
others. The scalar gate's WY kernel also takes the pair terms (its pair loop); the launch
fields are ``wy.WyLaunch``'s: ``value_step``, ``key_step``, ``warps``, ``stages``,
``pair_step``, ``pair_stages`` (a field left out keeps the planned value).

Usage, from the repository root on a CUDA machine::

    python tools/wy_probe.py --json probe.jsonl [--jobs 6]           # the default set
    python tools/wy_probe.py --one '{"case": {...}, "launch": {"pair_stages": 2}}'

Each line holds the case, the launch, ``status`` (fuzz's: pass / wrong / error, or
fault / timeout where the process died) and the errors.
"""

from __future__ import annotations

import argparse
import itertools
import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))
import fuzz  # noqa: E402  (tools/, beside this file)

# Gated DeltaNet bf16 training calls: fuzz seed 0's case 3 (one token, two sequences,
# K = 60), and longer fixed-length and packed ones at K = 60 / 128.
GDN = dict(seed=0, entry="chunk_train", H=4, HV=8, gate="gdn_softplus", dtype="bfloat16",
           l2norm=True, beta_sigmoid=True, initial_state=True, v_first=False,
           disable_recompute=False)  # fmt: skip
CASES = [
    fuzz.draw(0, 3),
    dict(GDN, index=1000, K=128, V=128, batch=2, length=1000),
    dict(GDN, index=1001, K=60, V=128, batch=1, lengths=[1, 300, 57], disable_recompute=True),
    dict(GDN, index=1002, K=128, V=64, batch=2, length=333, gate="gdn_pregated"),
]
LAUNCHES = [
    {},  # as planned
    {"pair_step": 64},
    {"pair_step": 32},
    {"warps": 8},
    # FLA's fix for its WY backward on Hopper (fla-org/flash-linear-attention#984): 2 warps,
    # no wgmma (mma.sync), which spill here (672 stack bytes, sm_90, Triton 3.6)
    {"warps": 2},
    {"pair_step": 64, "pair_stages": 2},
]


def run_one(spec: dict) -> dict:
    """``spec``'s case with its WY launch, in this process."""
    import torch

    from kda_ops.kernels.chunk.backward import wy

    planned = wy.wy_launch
    wy.wy_launch = lambda *args: planned(*args)._replace(**spec["launch"])
    device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        return dict(spec, **fuzz.run(spec["case"], device))
    except Exception as error:
        return dict(spec, status="error", error=repr(error)[:1000], **fuzz.failure_site(error))


def run_in_process(spec: dict, timeout: float) -> dict:
    command = [sys.executable, __file__, "--one", json.dumps(spec)]
    try:
        done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return dict(spec, status="timeout")
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        return dict(spec, status="fault", returncode=done.returncode, stderr=done.stderr[-1500:])
    return json.loads(lines[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--one", help="one {case, launch} JSON, run here")
    parser.add_argument("--jobs", type=int, default=4)
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--json", type=Path, help="JSON lines, one per (case, launch)")
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(run_one(json.loads(args.one))), flush=True)
        return 0
    specs = [dict(case=case, launch=launch) for case, launch in itertools.product(CASES, LAUNCHES)]
    out = args.json.open("a") if args.json else None
    failed = 0
    with ThreadPoolExecutor(args.jobs) as pool:
        for result in pool.map(lambda spec: run_in_process(spec, args.timeout), specs):
            failed += result["status"] != "pass"
            case = result["case"]
            print(f"{result['status']:7s} K={case['K']} V={case['V']} index={case['index']} "
                  f"launch={result['launch']} {result.get('over') or result.get('error') or ''}",
                  flush=True)  # fmt: skip
            if out is not None:
                out.write(json.dumps(result) + "\n")
                out.flush()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
