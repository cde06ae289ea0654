"""transformers hybrid models: transformers + FLA (eager) vs transformers + kda_ops
(``kda_ops.integrations.enable()`` and ``torch.compile(fullgraph=True)``), tokens/s for
prefill and decode, printed as a table with ratios. Needs a CUDA GPU, ``fla-core`` and
``transformers==5.24.0``.

    python benchmarks/transformers_models.py [--quick] [--model kimi_linear|qwen3_next] \
        [--shared-machine | --no-shared-machine] [--out benchmarks/results/transformers_models.json]
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
from collections.abc import Callable

import torch
from results import Results, add_arguments, row

os.environ.setdefault("FLA_DISABLE_BACKEND_DISPATCH", "1")  # FLA's Triton path

REQUIRED_TRANSFORMERS = "5.24.0"


def _check_environment() -> None:
    import transformers

    problems = []
    if not torch.cuda.is_available():
        problems.append("a CUDA GPU")
    if transformers.__version__ != REQUIRED_TRANSFORMERS:
        problems.append(
            f"transformers=={REQUIRED_TRANSFORMERS} (found {transformers.__version__}; "
            f"`pip install transformers=={REQUIRED_TRANSFORMERS}`)"
        )
    try:
        import fla.ops.kda  # noqa: F401  (transformers binds FLA only when importable)
    except ImportError:
        problems.append("fla-core (`pip install --no-deps fla-core==0.6.0 einops`)")
    if problems:
        sys.exit("transformers_models.py needs " + ", ".join(problems))


def build(name: str, quick: bool) -> torch.nn.Module:
    """Four layers (3 linear attention + 1 full) at Kimi-Linear-48B / Qwen3-Next attention dims."""
    from transformers import (
        KimiLinearConfig,
        KimiLinearForCausalLM,
        Qwen3NextConfig,
        Qwen3NextForCausalLM,
    )

    layers = ["linear_attention"] * 3 + ["full_attention"]
    hidden = 1024 if quick else 2304
    if name == "kimi_linear":
        config = KimiLinearConfig(
            hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=4,
            num_attention_heads=32, num_key_value_heads=32, linear_head_dim=128,
            linear_num_heads=32, layer_types=layers, mlp_layer_types=["dense"] * 4,
        )  # fmt: skip
        model_class = KimiLinearForCausalLM
    else:
        config = Qwen3NextConfig(
            hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=4,
            num_attention_heads=16, num_key_value_heads=2, head_dim=256,
            linear_num_key_heads=16, linear_num_value_heads=32, num_experts=0, layer_types=layers,
        )  # fmt: skip
        model_class = Qwen3NextForCausalLM
    config._attn_implementation = "sdpa"
    return model_class(config).to("cuda", torch.bfloat16).eval()


def seconds(fn: Callable[[], object], repeats: int) -> float:
    """Median wall time of ``fn`` on the GPU (after two warm-up calls)."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


def prefill_tokens_per_s(model, prompt: torch.Tensor) -> float:
    return prompt.numel() / seconds(lambda: model(prompt, logits_to_keep=1), repeats=5)


def decode_tokens_per_s(model, step_model, prompt: torch.Tensor, steps: int) -> float:
    """Tokens/s of ``steps`` single-token decode steps after the prompt (cache reused)."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    token = model(prompt, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)

    def run() -> None:
        step_cache = copy.deepcopy(cache)
        for _ in range(steps):
            step_model(token, cache=step_cache, use_cache=True)

    return prompt.shape[0] * steps / seconds(run, repeats=3)


@torch.no_grad()
def measure(name: str, args: argparse.Namespace) -> list[tuple[str, float, float]]:
    import kda_ops.integrations as integrations

    model = build(name, args.quick)
    prompt = torch.randint(0, 1000, (1, args.prefill_len), device="cuda")
    decode_prompt = torch.randint(0, 1000, (args.decode_batch, args.decode_prompt), device="cuda")
    fla_prefill = prefill_tokens_per_s(model, prompt)
    fla_decode = decode_tokens_per_s(model, model, decode_prompt, args.decode_steps)
    integrations.enable([name])
    try:
        compiled = torch.compile(model, fullgraph=True)
        ours_prefill = prefill_tokens_per_s(compiled, prompt)
        ours_decode = decode_tokens_per_s(model, compiled, decode_prompt, args.decode_steps)
    finally:
        integrations.disable()
    return [
        (f"{name} prefill B=1 T={args.prefill_len}", fla_prefill, ours_prefill),
        (
            f"{name} decode B={args.decode_batch} after {args.decode_prompt}",
            fla_decode,
            ours_decode,
        ),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["kimi_linear", "qwen3_next", "all"], default="all")
    parser.add_argument("--quick", action="store_true", help="small dims and lengths")
    add_arguments(parser, "transformers_models")
    args = parser.parse_args()
    args.prefill_len = 1024 if args.quick else 8192
    args.decode_batch, args.decode_prompt = (8, 128) if args.quick else (64, 512)
    args.decode_steps = 8 if args.quick else 32
    _check_environment()
    import transformers

    results = Results.from_args("transformers_models", args)
    results.environment["versions"]["transformers"] = transformers.__version__
    names = ["kimi_linear", "qwen3_next"] if args.model == "all" else [args.model]
    print(f"{'case':<44} {'FLA eager tok/s':>16} {'kda_ops compiled tok/s':>23} {'ratio':>7}")
    for name in names:  # each model's rows as soon as they are measured
        for case, fla, ours in measure(name, args):
            print(f"{case:<44} {fla:>16.0f} {ours:>23.0f} {ours / fla:>6.2f}x", flush=True)
            results.add([
                row(case, "fla", "throughput", [fla], "tokens/s", path="transformers + FLA eager"),
                row(case, "kda-ops", "throughput", [ours], "tokens/s",
                    path="transformers + kda_ops.integrations, torch.compile"),
            ])  # fmt: skip
    print(f"wrote {results.path}")


if __name__ == "__main__":
    main()
