"""GPU: under ``mode="reduce-overhead"`` the in-place decode step and the prefill are captured
in CUDA graphs; decode carries its states correctly across replays, and prefill replays from
one static empty cache match eager for new prompts."""

import pytest
import torch
from torch._dynamo.utils import counters
from torch._inductor import cudagraph_trees

from examples.hybrid_model import mark_cache_static
from tests.examples.cases import BATCH, assert_caches_close, clone_cache, tiny_model, token_ids

STEPS = 64
PROMPT = 8


def assert_one_graph_recorded_without_skips() -> None:
    assert counters["inductor"]["cudagraph_skips"] == 0
    manager = cudagraph_trees.get_manager(torch.cuda.current_device(), create_if_none_exists=False)
    assert manager is not None and any(manager.roots.values())  # a graph was recorded
    assert sum(counters["graph_break"].values()) == 0


@pytest.mark.gpu
def test_reduce_overhead_decode_is_cudagraphed_and_carries_state():
    torch._dynamo.reset()
    counters.clear()
    model, ids = tiny_model(device="cuda"), token_ids(PROMPT + STEPS, device="cuda")
    # The KV cache must hold the prompt and every decoded token.
    _, cache = model.prefill(ids[:, :PROMPT], model.new_cache(BATCH, max_seq_len=PROMPT + STEPS))
    expected_cache = clone_cache(cache)
    mark_cache_static(cache)
    compiled = torch.compile(model.decode_, backend="kda", mode="reduce-overhead", fullgraph=True)
    for t in range(PROMPT, PROMPT + STEPS):
        token = ids[:, t : t + 1]
        logits = compiled(token, cache).clone()  # replays overwrite the graph's output
        torch.testing.assert_close(logits, model.decode_(token, expected_cache))
    assert_caches_close(cache, expected_cache)
    assert cache[-1].length.tolist() == [PROMPT + STEPS] * BATCH
    assert_one_graph_recorded_without_skips()


@pytest.mark.gpu
def test_reduce_overhead_prefill_is_cudagraphed_and_matches_eager():
    torch._dynamo.reset()
    counters.clear()
    model = tiny_model(device="cuda")
    empty = model.new_cache(BATCH, max_seq_len=PROMPT)
    mark_cache_static(empty)  # prefill is functional: every call reads the same empty cache
    compiled = torch.compile(model.prefill, backend="kda", mode="reduce-overhead", fullgraph=True)
    for _ in range(4):  # warm-up, record, then replays with new prompts
        ids = token_ids(PROMPT, device="cuda")
        logits, cache = compiled(ids, empty)
        expected_logits, expected_cache = model.prefill(ids, empty)
        torch.testing.assert_close(logits, expected_logits)
        assert_caches_close(cache, expected_cache)
        del logits, cache  # the next replay overwrites the graph's outputs
    assert all(t.count_nonzero() == 0 for state in empty for t in state)
    assert_one_graph_recorded_without_skips()
