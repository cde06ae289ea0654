"""GPU: the in-place decode step under ``mode="reduce-overhead"`` is captured in CUDA graphs
and carries its states correctly across replays."""

import pytest
import torch
from torch._dynamo.utils import counters
from torch._inductor import cudagraph_trees

from examples.hybrid_model import mark_cache_static
from tests.examples.cases import BATCH, assert_caches_close, clone_cache, tiny_model, token_ids

STEPS = 64
PROMPT = 8


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
    assert counters["inductor"]["cudagraph_skips"] == 0
    manager = cudagraph_trees.get_manager(torch.cuda.current_device(), create_if_none_exists=False)
    assert manager is not None and any(manager.roots.values())  # a graph was recorded
    assert sum(counters["graph_break"].values()) == 0
