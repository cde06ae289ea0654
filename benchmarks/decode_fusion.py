"""Decode step of unchanged transformers Qwen3-Next and Kimi Linear models (no
``kda_ops.integrations.enable()``), ``torch.compile(fullgraph=True)`` with
``backend="kda"`` (its passes fuse every conv update and gated RMSNorm into the kda ops)
against stock Inductor, in one process.

The models run transformers' own PyTorch formulations (what they run without FLA or
causal-conv1d installed), at 2048 hidden units with 128-wide heads, bf16, three
linear-attention layers and one full-attention layer after a 16-token prompt. Per step:
do_bench median of one decode call (host dispatch included) followed by the crop of the
attention layer's new key and value (same in both, so that the call repeats on the same
shapes), and the same step replayed from a CUDA graph (device time without host dispatch,
which the step's eager time is mostly made of at these sizes), B = 1 and 64, in
``--rounds`` rounds of rotated order. Needs a CUDA GPU and ``transformers==5.24.0``. Usage::

    python benchmarks/decode_fusion.py [--rounds 3] [--no-shared-machine] [--out ...]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root

from harness import graph_time_ms, rotated_rounds, time_ms  # benchmarks/, the script's folder
from results import Results, add_arguments, row

from lowering.inductor import PASS_MANAGER, kda_backend
from tests.kda_ops.integrations.models import (
    kimi_linear_model,
    qwen3_next_model,
    transformers_reference,
)

PROMPT = 16
VOCAB = 4096
SIZES = dict(vocab_size=VOCAB, hidden_size=2048, intermediate_size=4096, num_attention_heads=16)
MODELS = {
    "qwen3_next": lambda: qwen3_next_model(**SIZES, num_key_value_heads=2,
                                           linear_num_key_heads=8, linear_num_value_heads=16),
    "kimi_linear": lambda: kimi_linear_model(**SIZES, num_key_value_heads=16, kv_lora_rank=512,
                                             qk_rope_head_dim=64, qk_nope_head_dim=128,
                                             v_head_dim=128, linear_num_heads=16),
}  # fmt: skip


def bench_model(name: str, batch: int, rounds: int, results: Results) -> None:
    model = MODELS[name]().to("cuda", torch.bfloat16)
    ids = torch.randint(3, VOCAB, (batch, PROMPT + 1), device="cuda")
    with transformers_reference(name), torch.no_grad():
        cache = model(ids[:, :PROMPT], use_cache=True).past_key_values
        token = ids[:, PROMPT:]

        from transformers.cache_utils import LinearAttentionLayer

        attention = [layer for layer in cache.layers if not isinstance(layer, LinearAttentionLayer)]

        def decode():
            return model(token, past_key_values=cache, use_cache=True).logits

        def step(compiled):
            def call():
                compiled()
                for layer in attention:
                    layer.crop(-1)

            return call

        calls, fused = {}, {}
        torch._dynamo.reset()  # the earlier cases' entries, under the same code object
        # The callable, not the name: the name resolves through the installed entry point.
        for backend, compiler in (("kda", kda_backend), ("inductor", "inductor")):
            PASS_MANAGER.reset_counts()
            compiled = torch.compile(decode, backend=compiler, fullgraph=True)
            calls[backend] = step(compiled)
            # A graph-cache hit would skip the passes and leave their match counts empty.
            with torch._inductor.config.patch(fx_graph_cache=False):
                calls[backend]()
            fused[backend] = {n: c for n, c in PASS_MANAGER.counts.items() if c}
        timers = {"decode step": time_ms, "decode step, CUDA-graph replay": graph_timer}
        errors: dict[str, str] = {}
        times = {metric: rotated_rounds(calls, rounds, timer, errors)
                 for metric, timer in timers.items()}  # fmt: skip
    case = f"{name} B={batch}"
    cells = []
    for metric, by_backend in times.items():
        if set(by_backend) != {"kda", "inductor"}:  # a capture failed: no ratio to give
            cells.append(" | ".join(["-"] * 3))
            continue
        kda, stock = (statistics.median(by_backend[b]) * 1e3 for b in ("kda", "inductor"))
        spread = {b: f"{min(v) * 1e3:.1f}–{max(v) * 1e3:.1f}" for b, v in by_backend.items()}
        cells.append(f"{kda:.1f} [{spread['kda']}] | {stock:.1f} [{spread['inductor']}] "
                     f"| {kda / stock:.3f}")  # fmt: skip
        results.add([row(case, f"torch.compile(backend={b!r})", metric, [t * 1e3 for t in v],
                         "us", fused=fused[b]) for b, v in by_backend.items()])  # fmt: skip
    for backend, error in errors.items():
        print(f"{case} {backend}: {error}", flush=True)
    print(f"| {case} | {' | '.join(cells)} | {fused['kda']} |", flush=True)


def graph_timer(call) -> float:
    """The step's milliseconds replayed from a CUDA graph captured on it. The replays read
    the attention cache tensors of the capture, which the crops let go: their memory stays
    with the caching allocator, so the replays read stale values in the same time."""
    return graph_time_ms([call])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="rounds of rotated order")
    parser.add_argument("--model", choices=[*MODELS, "all"], default="all")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 64])
    add_arguments(parser, "decode_fusion")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/decode_fusion.py needs a CUDA GPU")
    results = Results.from_args("decode_fusion", args)
    print(f"{torch.cuda.get_device_name()}; µs a decode step: median [min–max] over rounds, "
          "eager dispatch, then CUDA-graph replay")  # fmt: skip
    print(
        '| case | backend="kda" | stock Inductor | kda / stock '
        '| backend="kda", graph | stock, graph | kda / stock, graph | kda passes matched |'
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    for name in MODELS if args.model == "all" else [args.model]:
        for batch in args.batch:
            bench_model(name, batch, args.rounds, results)
    print(f"\nwrote {results.path}")


if __name__ == "__main__":
    main()
