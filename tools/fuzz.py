"""Random supported delta-rule calls against the float64 reference, each case in a process
of its own so that a fault (an illegal address that kills the CUDA context, a hang) cannot
hide the other cases.

A case is drawn from ``--seed`` and its index: an entry point (``chunk_kda`` forward or
training, ``fused_recurrent_kda``, ``chunk_kda_segmented``, the ``kda::chunk`` op called
directly, ``speculative.verify``), head dims 16 to 256 with K != V, grouped value heads,
fixed length or packed sequences of random lengths (1 included), a dtype, a gate (KDA's
safe and softplus gates, Gated DeltaNet's scalar gate, pre-activated decays), l2norm and
the beta sigmoid in the kernel or not, an initial state or none, K- or V-first states,
and for training ``disable_recompute``. Its outputs, final state and gradients are
compared with the same call in float64 by FLA's relative error (``‖ref − x‖ / ‖ref‖``):
under 1e-3 for fp32 inputs, 1e-2 (outputs, states) and 3e-2 (gradients) for bf16 / fp16.

Each case ends as one JSON line (``--out``): ``pass``, ``wrong`` (an error over its
tolerance), ``error`` (an exception: a supported call must not raise), ``fault`` (the
process died) or ``timeout``, with the command that reruns it alone.

Usage (from the repository root; CUDA runs the kernels, CPU the reference)::

    python tools/fuzz.py --cases 300 --seed 0 --out fuzz.jsonl [--jobs 4] [--timeout 300]
    python tools/fuzz.py --seed 0 --index 17          # one case, in this process
    python tools/fuzz.py --cases 400 --select dtype=bfloat16 --select K=192,256
                                                      # the drawn cases that match
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DIMS = (16, 32, 60, 64, 100, 128, 192, 256)
ENTRIES = ("chunk", "chunk_train", "recurrent", "segmented", "op", "verify")
GATES = ("kda_safe", "kda_softplus", "gdn_softplus", "kda_pregated", "gdn_pregated")


def draw(seed: int, index: int) -> dict:
    """Case ``index`` of ``seed``: a supported configuration."""
    rng = random.Random(seed * 1_000_003 + index)
    entry = rng.choice(ENTRIES)
    heads = rng.choice((1, 2, 4))
    case = dict(
        seed=seed, index=index, entry=entry, K=rng.choice(DIMS), V=rng.choice(DIMS),
        H=heads, HV=heads * rng.choice((1, 2)), gate=rng.choice(GATES),
        dtype=rng.choice(("bfloat16", "float16", "float32")),
        l2norm=rng.random() < 0.7, beta_sigmoid=rng.random() < 0.7,
        initial_state=rng.random() < 0.6, v_first=rng.random() < 0.3,
        disable_recompute=entry == "chunk_train" and rng.random() < 0.5,
    )  # fmt: skip
    packed = entry in ("chunk", "chunk_train", "recurrent", "op") and rng.random() < 0.4
    if packed:
        lengths = [rng.choice((1, rng.randint(1, 64), rng.randint(1, 400))) for _ in range(3)]
        case.update(batch=1, lengths=lengths)
    elif entry == "segmented":
        segments = rng.choice((1, 2, 4))
        case.update(batch=rng.choice((1, 2)), length=64 * segments * rng.randint(1, 3),
                    segments=segments)  # fmt: skip
    elif entry == "verify":
        case.update(batch=rng.choice((1, 3)), length=rng.randint(1, 8))
    else:
        case.update(batch=rng.choice((1, 2)), length=rng.choice((1, rng.randint(2, 600))))
    if entry in ("segmented", "op", "verify"):
        case["v_first"] = False  # these take K-first states only
    return case


def tolerance(dtype: str, name: str) -> float:
    if dtype == "float32":
        return 1e-3
    return 1e-2 if name in ("o", "state") else 3e-2


def inputs(case: dict, device: str) -> tuple[dict, dict]:
    """(tensors, keyword options) of ``case`` in float64 on ``device``."""
    import torch

    torch.manual_seed(case["seed"] * 7919 + case["index"])
    K, V, H, HV = case["K"], case["V"], case["H"], case["HV"]
    lengths = case.get("lengths")
    batch, length = case["batch"], sum(lengths) if lengths else case["length"]
    f64 = dict(device=device, dtype=torch.float64)
    q, k = torch.randn(batch, length, H, K, **f64), torch.randn(batch, length, H, K, **f64)
    if not case["l2norm"]:  # unit rows, as a model that normalises outside would pass
        q, k = q / q.norm(dim=-1, keepdim=True), k / k.norm(dim=-1, keepdim=True)
    scalar = case["gate"].startswith("gdn")
    gate_shape = (batch, length, HV) if scalar else (batch, length, HV, K)
    pregated = case["gate"].endswith("pregated")
    g = -torch.rand(gate_shape, **f64) * 0.5 if pregated else torch.randn(gate_shape, **f64)
    beta = torch.randn(batch, length, HV, **f64)
    if not case["beta_sigmoid"]:
        beta = beta.sigmoid()
    x = dict(q=q, k=k, v=torch.randn(batch, length, HV, V, **f64), g=g, beta=beta)
    options = dict(use_qk_l2norm_in_kernel=case["l2norm"],
                   use_beta_sigmoid_in_kernel=case["beta_sigmoid"],
                   use_gate_in_kernel=not pregated)  # fmt: skip
    if not pregated:
        x["A_log"] = torch.rand(HV, **f64) * 0.5
        x["dt_bias"] = torch.randn(HV if scalar else HV * K, **f64)
        if case["gate"] == "kda_safe":
            options["lower_bound"] = -5.0
    n_seqs = len(lengths) if lengths else batch
    if lengths:
        bounds = [0]
        for n in lengths:
            bounds.append(bounds[-1] + n)
        options["cu_seqlens"] = torch.tensor(bounds, device=device, dtype=torch.int32)
    if case["initial_state"] or case["entry"] == "verify":
        x["initial_state"] = torch.randn(n_seqs, HV, K, V, **f64)
    return x, options


def run(case: dict, device: str) -> dict:
    """The case's call in its dtype and in float64; the relative error of each result."""
    import torch

    import kda_ops
    from kda_ops import speculative

    x, options = inputs(case, device)
    dtype = getattr(torch, case["dtype"])
    # q, k, v, beta in the case's dtype; the gate, its parameters and the state in fp32.
    low = {name: t.to(dtype if name in ("q", "k", "v", "beta") else torch.float32)
           for name, t in x.items()}  # fmt: skip
    entry, v_first = case["entry"], case["v_first"]

    def call(tensors: dict, train: bool) -> dict[str, torch.Tensor]:
        tensors = dict(tensors)
        state = tensors.pop("initial_state", None)
        if state is not None and v_first:
            state = state.transpose(-1, -2).contiguous()
        common = dict(options, initial_state=state)
        if v_first:
            common["state_v_first"] = True
        if entry in ("chunk", "chunk_train"):
            o, final = kda_ops.chunk_kda(**tensors, **common, output_final_state=True,
                                         disable_recompute=case["disable_recompute"])  # fmt: skip
        elif entry == "recurrent":
            o, final = kda_ops.fused_recurrent_kda(**tensors, **common, output_final_state=True)
        elif entry == "segmented":
            o, final = kda_ops.chunk_kda_segmented(**tensors, **common, output_final_state=True,
                                                   num_segments=case["segments"])  # fmt: skip
        elif entry == "op":
            q = tensors["q"]
            o, final = torch.ops.kda.chunk(
                q, tensors["k"], tensors["v"], tensors["g"], tensors["beta"],
                tensors.get("A_log"), tensors.get("dt_bias"), state, options.get("cu_seqlens"),
                q.shape[-1] ** -0.5, options.get("lower_bound"),
                options["use_qk_l2norm_in_kernel"], options["use_beta_sigmoid_in_kernel"],
            )  # fmt: skip
        else:  # verify: the draft tokens' outputs and the states after each, from a pool
            o, final = speculative.verify(**tensors, state_pool=state.contiguous(), **options)
        if v_first:
            final = final.transpose(-1, -2)
        results = {"o": o, "state": final}
        if train:
            names = [n for n, t in tensors.items() if t.requires_grad]
            cotangent = torch.ones_like(o) / o.numel() ** 0.5
            grads = torch.autograd.grad(o, [tensors[n] for n in names], cotangent)
            results.update({f"d{n}": grad for n, grad in zip(names, grads)})
        return results

    train = entry == "chunk_train"
    if train:
        low = {n: t.detach().requires_grad_() for n, t in low.items()}
        x = {n: t.detach().requires_grad_() for n, t in x.items()}
    started = time.perf_counter()
    got = call(low, train)
    if device == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    want = call(x, train)
    errors = {}
    for name, expected in want.items():
        actual, expected = got[name].detach().double(), expected.detach()
        norm = expected.norm()
        distance = (actual - expected).norm()
        errors[name] = float(distance / norm if norm > 0 else distance)
    bad = {n: e for n, e in errors.items() if not e <= tolerance(case["dtype"], n)}
    return dict(status="wrong" if bad else "pass", errors=errors, over=bad, seconds=seconds)


def failure_site(error: BaseException) -> dict:
    """Where ``error`` was raised: the innermost kda_ops frame (``file:line function``) and,
    where a Triton kernel's launch raised it (a compile error, OutOfResources), the
    kernel's name and its launch's non-tensor arguments (constexprs, warps, stages)."""
    site: dict = {}
    trace = error.__traceback__
    while trace is not None:
        frame = trace.tb_frame
        path = frame.f_code.co_filename
        if "kda_ops" in path:
            site["frame"] = f"{path.split('kda_ops')[-1]}:{trace.tb_lineno} {frame.f_code.co_name}"
        runner = frame.f_locals.get("self")
        fn = getattr(runner, "fn", None)
        if callable(fn) and "kwargs" in frame.f_locals and "kernel" not in site:
            site["kernel"] = getattr(fn, "__name__", repr(fn))
            site["launch"] = {name: value for name, value in frame.f_locals["kwargs"].items()
                              if isinstance(value, (bool, int, float, str))}  # fmt: skip
        trace = trace.tb_next
    return site


def command(case: dict) -> str:
    return f"python tools/fuzz.py --seed {case['seed']} --index {case['index']}"


def selected(case: dict, selections: list[str]) -> bool:
    """Whether ``case`` matches every ``KEY=VALUE[,VALUE...]`` of ``selections``."""
    for selection in selections:
        key, _, values = selection.partition("=")
        if key not in case:
            raise ValueError(f"--select {selection!r}: cases have no {key!r}")
        if str(case[key]) not in values.split(","):
            return False
    return True


def run_in_process(seed: int, index: int, timeout: float) -> dict:
    """One case in a child process: its JSON line, or how the child died."""
    case = draw(seed, index)
    try:
        done = subprocess.run([sys.executable, __file__, "--seed", str(seed), "--index",
                               str(index), "--json"], cwd=REPO, capture_output=True,
                              text=True, timeout=timeout)  # fmt: skip
    except subprocess.TimeoutExpired:
        return dict(case, status="timeout", command=command(case))
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        return dict(case, status="fault", returncode=done.returncode, stderr=done.stderr[-2000:],
                    command=command(case))  # fmt: skip
    return json.loads(lines[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--index", type=int, default=None, help="run this case here")
    parser.add_argument("--cases", type=int, default=300)
    parser.add_argument("--first", type=int, default=0, help="index of the first case")
    parser.add_argument("--jobs", type=int, default=1, help="cases run at once")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds a case")
    parser.add_argument("--out", default=None, help="JSON lines, one a case")
    parser.add_argument("--select", action="append", default=[], metavar="KEY=V[,V...]",
                        help="run only the drawn cases with these values (repeatable)")  # fmt: skip
    parser.add_argument("--json", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.index is not None:
        import torch

        case = draw(args.seed, args.index)
        device = "cuda" if torch.cuda.is_available() else "cpu"
        try:
            result = dict(case, **run(case, device), device=device)
        except Exception as error:  # a supported call must not raise: reported, not hidden
            result = dict(case, status="error", error=repr(error)[:2000], device=device,
                          **failure_site(error))  # fmt: skip
        result["command"] = command(case)
        print(json.dumps(result) if args.json else json.dumps(result, indent=1))
        return
    indices = [i for i in range(args.first, args.first + args.cases)
               if selected(draw(args.seed, i), args.select)]  # fmt: skip
    print(f"{len(indices)} of {args.cases} drawn cases selected", flush=True)
    counts: dict[str, int] = {}
    out = open(args.out, "a") if args.out else None  # noqa: SIM115 (lines as they come)
    with ThreadPoolExecutor(args.jobs) as pool:
        runs = pool.map(lambda i: run_in_process(args.seed, i, args.timeout), indices)
        for result in runs:
            counts[result["status"]] = counts.get(result["status"], 0) + 1
            if out is not None:
                out.write(json.dumps(result) + "\n")
                out.flush()
            if result["status"] != "pass":
                print(f"{result['status']}: {result['command']}  "
                      f"{result.get('over') or result.get('error') or result.get('returncode')}",
                      flush=True)  # fmt: skip
    print(json.dumps(dict(seed=args.seed, cases=len(indices), counts=counts)))


if __name__ == "__main__":
    main()
