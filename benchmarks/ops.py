"""Kernel benchmarks against flash-linear-attention (fla-core 0.6.0) in the same process.

Usage (GPU): ``python benchmarks/ops.py [--only chunk96 conv ...] [--json out.json]``.
"""

import argparse

import torch
from fla.modules.causal_conv1d.ops import causal_conv1d as fla_causal_conv1d
from fla.modules.causal_conv1d.ops import causal_conv1d_update as fla_conv_update
from fla.modules.fused_norm_gate import rms_norm_gated as fla_rms_norm_gated
from fla.ops.kda import chunk_kda as fla_chunk_kda
from fla.ops.kda import fused_recurrent_kda as fla_fused_recurrent_kda
from harness import Row, copy_bandwidth_tbs, graph_time_ms, report, time_ms

import kda_ops

DEVICE = "cuda"
LOWER_BOUND = -5.0


def kda_inputs(batch, length, heads, dim=128):
    def rand(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, device=DEVICE, dtype=dtype)

    return dict(
        q=rand(batch, length, heads, dim), k=rand(batch, length, heads, dim),
        v=rand(batch, length, heads, dim), g=rand(batch, length, heads, dim),
        beta=rand(batch, length, heads),
        A_log=torch.zeros(heads, device=DEVICE), dt_bias=torch.zeros(heads * dim, device=DEVICE),
    )  # fmt: skip


IN_KERNEL = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                 use_beta_sigmoid_in_kernel=True, lower_bound=LOWER_BOUND)  # fmt: skip


def bench_decode(batch=256, heads=32, dim=128) -> list[Row]:
    x = kda_inputs(batch, 1, heads, dim)
    state = torch.randn(batch, heads, dim, dim, device=DEVICE)
    pool = state.clone()
    state_bytes = 2 * state.numel() * 4

    def ours():
        return kda_ops.fused_recurrent_kda(**x, initial_state=state, output_final_state=True,
                                           **IN_KERNEL)  # fmt: skip

    def ours_pool():
        return kda_ops.fused_recurrent_kda_inplace(**x, state_pool=pool, **IN_KERNEL)

    def peer():
        return fla_fused_recurrent_kda(**x, initial_state=state, output_final_state=True,
                                       **IN_KERNEL)  # fmt: skip

    peer_ms = time_ms(peer)
    case = f"decode B={batch} H={heads} D={dim} fp32 state"
    return [
        Row(case + " (functional)", time_ms(ours), peer_ms, state_bytes),
        Row(case + " (in-place pool)", time_ms(ours_pool), peer_ms, state_bytes),
    ]


def bench_gated_norm(tokens=8192, heads=32, dim=128) -> list[Row]:
    """Eager (host dispatch included) and in a CUDA graph (kernel time; 200 MB a call,
    past L2)."""
    x, gate = torch.randn(2, tokens, heads, dim, device=DEVICE, dtype=torch.bfloat16).unbind(0)
    weight = torch.ones(dim, device=DEVICE)
    nbytes = 3 * x.numel() * x.element_size()

    def ours():
        return kda_ops.gated_rms_norm(x, gate, weight, 1e-5, "sigmoid")

    def peer():
        return fla_rms_norm_gated(x, gate, weight, None, activation="sigmoid", eps=1e-5)

    case = f"gated RMSNorm T={tokens} H={heads} D={dim} bf16"
    return [
        Row(case + ", eager", time_ms(ours), time_ms(peer), nbytes),
        Row(case + ", CUDA graph", graph_time_ms([ours]), graph_time_ms([peer]), nbytes),
    ]


def bench_conv_update(batch=256, channels=3 * 32 * 128, width=4, copies=4) -> list[Row]:
    """Eager (host dispatch included) and in a CUDA graph over ``copies`` input sets (kernel
    time; 50 MB a call, so four sets pass L2)."""
    sets = []
    for _ in range(copies):
        x = torch.randn(batch, channels, device=DEVICE, dtype=torch.bfloat16)
        pool = torch.randn(batch, channels, width - 1, device=DEVICE, dtype=torch.bfloat16)
        fla_cache = torch.randn(batch, channels, width, device=DEVICE, dtype=torch.bfloat16)
        sets.append((x, pool, fla_cache))
    weight = torch.randn(channels, width, device=DEVICE, dtype=torch.bfloat16)
    nbytes = 2 * sets[0][1].numel() * 2 + 2 * sets[0][0].numel() * 2
    ours = [lambda x=x, pool=pool: kda_ops.causal_conv1d_update_inplace(x, pool, weight)
            for x, pool, _ in sets]  # fmt: skip
    peer = [lambda x=x, cache=cache: fla_conv_update(x, cache, weight=weight, activation="silu")
            for x, _, cache in sets]  # fmt: skip
    case = f"conv update B={batch} D={channels} W={width} bf16"
    return [
        Row(case + ", eager", time_ms(ours[0]), time_ms(peer[0]), nbytes),
        Row(case + ", CUDA graph", graph_time_ms(ours), graph_time_ms(peer), nbytes),
    ]


def bench_conv_prefill(length=8192, channels=32 * 128, width=4) -> list[Row]:
    """One q/k/v short conv of the hybrid model's prefill, from a state (as the model calls
    it) and from none, eager (host dispatch included) and in a CUDA graph (kernel time; 134
    MB a call, past L2); FLA's Triton backend, whose state keeps W inputs where ours keeps
    W - 1."""
    x = torch.randn(1, length, channels, device=DEVICE, dtype=torch.bfloat16)
    weight = torch.randn(channels, width, device=DEVICE, dtype=torch.bfloat16)
    state = torch.randn(1, channels, width - 1, device=DEVICE, dtype=torch.bfloat16)
    fla_state = torch.nn.functional.pad(state, (1, 0))
    rows = []
    for ours_state, peer_state, label in ((state, fla_state, "state"), (None, None, "no state")):

        def ours(initial=ours_state):
            return kda_ops.causal_conv1d(x, weight, initial_state=initial, activation="silu")

        def peer(initial=peer_state):
            return fla_causal_conv1d(x, weight, initial_state=initial, output_final_state=True,
                                     activation="silu", backend="triton")  # fmt: skip

        case = f"conv prefill B=1 T={length} D={channels} W={width} bf16, {label}"
        nbytes = 2 * x.numel() * x.element_size()
        rows.append(Row(case + ", eager", time_ms(ours), time_ms(peer), nbytes))
        rows.append(Row(case + ", CUDA graph", graph_time_ms([ours]), graph_time_ms([peer]),
                        nbytes))  # fmt: skip
    return rows


def bench_chunk(heads, length=8192, dim=128, lower_bound=LOWER_BOUND) -> Row:
    """Forward; ``lower_bound=None`` is Kimi Linear's unbounded softplus gate."""
    x = kda_inputs(1, length, heads, dim)
    options = dict(IN_KERNEL, lower_bound=lower_bound)
    ours = time_ms(lambda: kda_ops.chunk_kda(**x, **options))
    peer = time_ms(lambda: fla_chunk_kda(**x, **options))
    nbytes = 5 * x["q"].numel() * 2
    gate = ", softplus gate" if lower_bound is None else f", lower bound {lower_bound}"
    return Row(f"chunk_kda fwd B=1 T={length} H={heads} D={dim} bf16{gate}", ours, peer, nbytes)


def bench_chunk_varlen(heads=96, dim=128) -> Row:
    """Packed sequences of the issue's lengths, filled up to the same 8192 tokens."""
    cu_seqlens = torch.tensor([0, 100, 300, 1200, 3000, 4096, 8192], device=DEVICE,
                              dtype=torch.int32)  # fmt: skip
    x = kda_inputs(1, int(cu_seqlens[-1]), heads, dim)
    ours = time_ms(lambda: kda_ops.chunk_kda(**x, cu_seqlens=cu_seqlens, **IN_KERNEL))
    peer = time_ms(lambda: fla_chunk_kda(**x, cu_seqlens=cu_seqlens, **IN_KERNEL))
    nbytes = 5 * x["q"].numel() * 2
    return Row(f"chunk_kda fwd varlen 6 seqs, 8192 tokens, H={heads} D={dim} bf16", ours, peer,
               nbytes)  # fmt: skip


def bench_chunk_backward(heads=64, length=8192, dim=128, lower_bound=LOWER_BOUND,
                         disable_recompute=False) -> Row:  # fmt: skip
    """Training step of one layer: forward + backward of every input (gate, beta and
    l2norm in the kernel), timed and with the peak memory each allocates;
    ``lower_bound=None`` is Kimi Linear's softplus gate; ``disable_recompute`` is passed
    to both (each keeps its forward's intermediates for its backward)."""
    x = kda_inputs(1, length, heads, dim)
    options = dict(IN_KERNEL, lower_bound=lower_bound, disable_recompute=disable_recompute)
    leaves = [t.requires_grad_() for t in x.values()]
    grad_o = torch.randn_like(x["v"])

    def train_step(chunk_kda):
        def step():
            o, _ = chunk_kda(**x, **options)
            return torch.autograd.grad(o, leaves, grad_o, allow_unused=True)

        return step

    def peak_gib(step) -> float:
        """Peak memory of one step beyond what is allocated before it."""
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step()
        torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - base) / 2**30

    ours, peer = train_step(kda_ops.chunk_kda), train_step(fla_chunk_kda)
    ours_ms, peer_ms = time_ms(ours), time_ms(peer)  # also the warm-up (compile, autotune)
    memory = f"peak GiB ours {peak_gib(ours):.2f} / FLA {peak_gib(peer):.2f}"
    gate = ", softplus gate" if lower_bound is None else ""
    gate += ", disable_recompute" if disable_recompute else ""
    return Row(f"chunk_kda fwd+bwd B=1 T={length} H={heads} D={dim} bf16{gate}, {memory}",
               ours_ms, peer_ms)  # fmt: skip


BENCHES = {
    "chunk96": lambda: [bench_chunk(96)],
    "chunk64": lambda: [bench_chunk(64)],
    "chunk32": lambda: [bench_chunk(32)],  # Kimi Linear's heads (benchmarks/hybrid.py)
    "chunk32_softplus": lambda: [bench_chunk(32, lower_bound=None)],  # ... and its gate
    "chunk_varlen": lambda: [bench_chunk_varlen()],
    "chunk_backward": lambda: [bench_chunk_backward()],
    "chunk_backward_softplus": lambda: [bench_chunk_backward(lower_bound=None)],
    "chunk_backward_kept": lambda: [bench_chunk_backward(disable_recompute=True)],
    "decode": bench_decode,
    "norm": bench_gated_norm,
    "conv": bench_conv_update,
    "conv_prefill": bench_conv_prefill,
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json")
    parser.add_argument("--only", nargs="+", choices=list(BENCHES), help="a subset, in order")
    args = parser.parse_args()
    print(f"copy bandwidth: {copy_bandwidth_tbs():.2f} TB/s", flush=True)
    benches = {name: BENCHES[name] for name in args.only or BENCHES}
    report("kda-ops kernels vs flash-linear-attention 0.6.0", benches, args.json)


if __name__ == "__main__":
    main()
