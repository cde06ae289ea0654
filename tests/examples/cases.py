"""Shared set-up for the hybrid-model tests: a tiny model, prompts and cache helpers."""

import torch

from examples.hybrid_model import Cache, HybridConfig, HybridLM

CONFIG = HybridConfig()  # 4 layers: 3 KDA + 1 attention
BATCH = 2


def tiny_model(config: HybridConfig = CONFIG, device: str = "cpu") -> HybridLM:
    return HybridLM(config).to(device).eval().requires_grad_(False)


def token_ids(length: int, config: HybridConfig = CONFIG, device: str = "cpu") -> torch.Tensor:
    return torch.randint(0, config.vocab_size, (BATCH, length), device=device)


def clone_cache(cache: Cache) -> Cache:
    return tuple(type(state)(*(t.clone() for t in state)) for state in cache)


def assert_caches_close(got: Cache, expected: Cache, **tolerances: float) -> None:
    for got_state, expected_state in zip(got, expected):
        for a, b in zip(got_state, expected_state):
            torch.testing.assert_close(a, b, **tolerances)
