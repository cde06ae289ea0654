"""The time of a chunk-recurrence step on one long sequence, in two forms of the kernel:
the production one (``chunk_recurrence_kernel``, launched as ``recurrence_launches``
plans it) and one that holds the state transposed, ``Sᵀ [BV, K]``, with the value columns
as the products' rows.

Why the second form: one long sequence with few heads is bound by the latency of the
recurrence's serial steps, not by bandwidth or tensor-core time, and in the production
form each step takes the state and ``v_new`` from a product's accumulator layout into
another product's operand layout through shared memory (a store, a barrier, a load), twice
on the serial chain (sm_90, Triton 3.6: ``ttg.local_alloc`` of ``b_state`` and ``v_new``
in the loop). Transposed, ``v_newᵀ = uᵀ - Sᵀ wᵀ``, ``oᵀ = Sᵀ qgᵀ + v_newᵀ Aqkᵀ`` and
``Sᵀ = Sᵀ diag(Γ_C) + v_newᵀ kd`` take ``Sᵀ`` and ``v_newᵀ`` as the left operands, which
Triton converts from an accumulator in registers (at 64 value columns and 4 warps; the
narrower launches go through shared memory in another way), and the loaded tiles as the
right operands straight from shared memory. Whether that is faster per step is what this
tool measures (``benchmarks/results/recurrence_forms_h100.log``: it is not).

Both forms run on the same random intermediates (w, u, qg, kd, Aqk, chunk log-decay of
one prepare's layout; fixed length, 16-token steps, no initial state) and must agree: the
transposed form's o and final state are compared with the production form's.

Usage, from the repository root on a CUDA machine::

    python tools/recurrence_forms.py [--shapes 32768x32 131072x16] [--json forms.jsonl]

Each line names the form, its value columns and warps, the time of the whole scan and of
one step (µs), and the relative difference of o and the final state from the production
form's.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

REPO = Path(__file__).resolve().parents[1]
STEP = 16  # the inference forward's recurrence step
# (value columns, warps) of the transposed form: a product's rows are its value columns,
# 16 a warp, so 16 columns take one warp and 64 a warpgroup (Hopper's wgmma).
TRANSPOSED_LAUNCHES = ((16, 1), (32, 2), (32, 4), (64, 4))


@triton.jit(do_not_specialize=["length"])
def transposed_recurrence_kernel(w, u, qg, kd, aqk, chunk_decay, o, final_state, length,
                                 HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                                 BV: tl.constexpr, STEP: tl.constexpr, STAGES: tl.constexpr,
                                 DOT_PRECISION: tl.constexpr):  # fmt: skip
    """A program a value block of a sequence-head (grid: ``V // BV`` × sequences · HV),
    the state ``Sᵀ [BV, K]`` fp32 in registers; the intermediates and outputs as the
    production kernel takes them (w, qg, kd ``[N, T, HV, K]``, u and o ``[N, T, HV, V]``,
    Aqk ``[chunks, HV, STEP, STEP]``, the chunks' log-decay ``[chunks, HV, K]``, the final
    state ``[N, HV, K, V]``), ``length`` a multiple of ``STEP``."""
    i_v = tl.program_id(0)
    i_nh = tl.program_id(1)
    i_n = i_nh // HV
    i_hv = i_nh % HV
    offs_k = tl.arange(0, K)
    offs_v = i_v * BV + tl.arange(0, BV)
    rows = tl.arange(0, STEP)
    dot_dtype = w.dtype.element_ty
    steps = length // STEP
    state_t = tl.zeros([BV, K], dtype=tl.float32)
    for c in tl.range(0, steps, num_stages=STAGES):
        tokens = ((i_n * length + c * STEP + rows) * HV + i_hv).to(tl.int64)
        b_w = tl.load(w + tokens[:, None] * K + offs_k[None, :])
        b_qg = tl.load(qg + tokens[:, None] * K + offs_k[None, :])
        b_kd = tl.load(kd + tokens[:, None] * K + offs_k[None, :])
        b_u_t = tl.load(u + tokens[None, :] * V + offs_v[:, None])  # [BV, STEP]
        chunk = ((i_n * steps + c) * HV + i_hv).to(tl.int64)
        b_aqk = tl.load(aqk + (chunk * STEP + rows)[:, None] * STEP + rows[None, :])
        b_aqk = tl.where(rows[:, None] >= rows[None, :], b_aqk, 0.0)
        decay = tl.exp(tl.load(chunk_decay + chunk * K + offs_k))
        b_state = state_t.to(dot_dtype)
        v_new_t = b_u_t.to(tl.float32) - tl.dot(b_state, tl.trans(b_w),
                                                input_precision=DOT_PRECISION)  # fmt: skip
        v_low = v_new_t.to(dot_dtype)
        o_t = tl.dot(b_state, tl.trans(b_qg), input_precision=DOT_PRECISION)
        o_t += tl.dot(v_low, tl.trans(b_aqk.to(dot_dtype)), input_precision=DOT_PRECISION)
        tl.store(o + tokens[None, :] * V + offs_v[:, None], o_t.to(o.dtype.element_ty))
        state_t = state_t * decay[None, :] + tl.dot(v_low, b_kd, input_precision=DOT_PRECISION)
    tl.store(final_state + i_nh.to(tl.int64) * K * V + offs_k[None, :] * V + offs_v[:, None],
             state_t)  # fmt: skip


def intermediates(batch: int, length: int, value_heads: int, dim: int, dtype: torch.dtype,
                  device: str, seed: int = 0) -> tuple[torch.Tensor, ...]:  # fmt: skip
    """Random (w, u, qg, kd, Aqk, chunk log-decay) in the prepare's layouts, scaled so that
    the state stays bounded over long scans."""
    generator = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=generator) * scale).to(device)

    tokens = (batch, length, value_heads, dim)
    chunks = batch * length // STEP
    w, qg, kd = (rand(*tokens, scale=s).to(dtype) for s in (0.02, 0.1, 0.02))
    u = rand(*tokens).to(dtype)
    aqk = rand(chunks, value_heads, STEP, STEP, scale=0.1).to(dtype)
    decay = -torch.rand(chunks, value_heads, dim, generator=generator).to(device) * 0.05
    return w, u, qg, kd, aqk, decay


def production(inputs: tuple[torch.Tensor, ...], batch: int, length: int):
    """The production form: ``(run, launch settings)``, ``run()`` giving (o, final state)."""
    sys.path.insert(0, str(REPO))
    from kda_ops.kernels.chunk.recurrence import recurrence_launches

    w, u = inputs[0], inputs[1]
    value_heads, dim = u.shape[2], u.shape[3]
    o = torch.empty_like(u)
    final = torch.empty(batch, value_heads, dim, dim, device=u.device)
    precision = "ieee" if w.dtype == torch.float32 else "tf32"
    launches = recurrence_launches(inputs, None, None, None, length, o, final, None, precision)
    settings = [{name: launch.args[name] for name in ("BV", "STAGES", "num_warps")}
                for launch in launches]  # fmt: skip

    def run():
        for launch in launches:
            launch.run()
        return o, final

    return run, settings


def transposed(inputs: tuple[torch.Tensor, ...], batch: int, length: int, columns: int,
               warps: int, stages: int = 3):  # fmt: skip
    """The transposed form at ``columns`` value columns and ``warps`` warps: ``run()``
    giving (o, final state)."""
    w, u = inputs[0], inputs[1]
    value_heads, dim = u.shape[2], u.shape[3]
    o = torch.empty_like(u)
    final = torch.empty(batch, value_heads, dim, dim, device=u.device)
    precision = "ieee" if w.dtype == torch.float32 else "tf32"
    grid = (dim // columns, batch * value_heads)

    def run():
        transposed_recurrence_kernel[grid](*inputs, o, final, length, HV=value_heads, K=dim,
                                           V=dim, BV=columns, STEP=STEP, STAGES=stages,
                                           DOT_PRECISION=precision, num_warps=warps)  # fmt: skip
        return o, final

    return run


def difference(got: torch.Tensor, expected: torch.Tensor) -> float:
    expected = expected.double()
    return ((got.double() - expected).norm() / expected.norm().clamp_min(1e-30)).item()


def measure(length: int, value_heads: int, dim: int = 128, batch: int = 1,
            dtype: torch.dtype = torch.bfloat16, timed: bool = True) -> list[dict]:  # fmt: skip
    """Each form's line for one shape (``timed=False``: the differences only)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    inputs = intermediates(batch, length, value_heads, dim, dtype, device)
    reference_run, settings = production(inputs, batch, length)
    o_ref, state_ref = (x.clone() for x in reference_run())
    forms = [("production", settings, reference_run)]
    for columns, warps in TRANSPOSED_LAUNCHES:
        if columns <= dim:
            run = transposed(inputs, batch, length, columns, warps)
            forms.append(("transposed", [{"BV": columns, "num_warps": warps}], run))
    lines = []
    for name, launch, run in forms:
        o, state = run()
        line = dict(form=name, launches=launch, T=length, HV=value_heads, D=dim, batch=batch,
                    o_vs_production=difference(o, o_ref),
                    state_vs_production=difference(state, state_ref))  # fmt: skip
        if timed:
            from triton.testing import do_bench

            ms = do_bench(run, warmup=10, rep=50, return_mode="median")
            line.update(scan_us=ms * 1e3, step_us=ms * 1e3 / (length // STEP))
        lines.append(line)
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--shapes",
        nargs="+",
        default=["32768x32", "131072x16", "8192x96"],
        help="TOKENSxVALUE_HEADS of one sequence (default: %(default)s)",
    )
    parser.add_argument("--json", type=Path, help="append the lines to this file")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("times a GPU kernel: run it on a CUDA machine")
    out = args.json.open("a") if args.json else None
    for shape in args.shapes:
        length, value_heads = (int(x) for x in shape.split("x"))
        for line in measure(length, value_heads):
            print(json.dumps(line), flush=True)
            if out is not None:
                out.write(json.dumps(line) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
