"""The hybrid example model under ``torch.compile(backend="kda")`` on CPU: the passes fire at
every expected site, compiled equals eager, one graph with no breaks, dynamic T without
recompiles, in-place state updates with no state copy, and the FX graph cache across
processes."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch._dynamo.utils import counters
from torch._inductor.utils import run_and_get_code

from examples.hybrid_model import HybridConfig, HybridLM, rms_norm_torch
from lowering.inductor import PASS_MANAGER
from tests.examples.cases import (
    BATCH,
    CONFIG,
    assert_caches_close,
    clone_cache,
    tiny_model,
    token_ids,
)
from tests.lowering.compiled import op_arguments

ROOT = Path(__file__).resolve().parents[2]
KDA_LAYERS = CONFIG.kda_layer_count
CONVS_PER_KDA_LAYER = 3  # q, k, v


@pytest.fixture(autouse=True)
def _fresh_compile():
    """Each test compiles from scratch (a cache hit would skip the passes it counts)."""
    torch._dynamo.reset()
    counters.clear()
    PASS_MANAGER.reset_counts()
    with torch._inductor.config.patch(fx_graph_cache=False):
        yield


def _expected_counts(recurrent: int, conv: int, norm: int) -> dict[str, int]:
    matched = {"recurrent_state": recurrent, "conv_update": conv, "gated_rms_norm": norm}
    return {**dict.fromkeys(PASS_MANAGER.counts, 0), **matched}


def _graph_breaks() -> int:
    return sum(counters["graph_break"].values())


def test_prefill_fuses_gated_norms_and_matches_eager():
    model, ids = tiny_model(), token_ids(9)
    compiled = torch.compile(model.prefill, backend="kda", fullgraph=True)
    logits, cache = compiled(ids, model.new_cache(BATCH))
    expected_logits, expected_cache = model.prefill(ids, model.new_cache(BATCH))
    torch.testing.assert_close(logits, expected_logits)
    assert_caches_close(cache, expected_cache)
    assert _graph_breaks() == 0
    assert PASS_MANAGER.counts == _expected_counts(0, 0, KDA_LAYERS)


def test_training_step_compiles_without_breaks_and_matches_eager_gradients():
    """Forward, loss and backward of the model in training mode, one graph: the KDA core
    and the short convs through their ops' autograd. The gated-norm pass leaves training
    graphs alone (its intermediates are saved for the backward)."""
    model = HybridLM(CONFIG).train()
    ids, targets = token_ids(24), token_ids(24)
    params = list(model.parameters())

    def loss_fn(ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits, _ = model.prefill(ids, model.new_cache(BATCH))
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())

    expected = torch.autograd.grad(loss_fn(ids, targets), params)
    compiled = torch.compile(loss_fn, backend="kda", fullgraph=True)
    got = torch.autograd.grad(compiled(ids, targets), params)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b)
    assert _graph_breaks() == 0
    assert PASS_MANAGER.counts == _expected_counts(0, 0, 0)


def test_inplace_decode_updates_states_in_place_with_no_copy():
    model, ids = tiny_model(), token_ids(7)
    _, cache = model.prefill(ids[:, :6], model.new_cache(BATCH))
    expected_cache = clone_cache(cache)
    expected = model.decode_(ids[:, 6:], expected_cache)

    compiled = torch.compile(model.decode_, backend="kda", fullgraph=True)
    logits, (code,) = run_and_get_code(compiled, ids[:, 6:], cache)
    torch.testing.assert_close(logits, expected)
    assert_caches_close(cache, expected_cache)
    assert _graph_breaks() == 0
    convs = KDA_LAYERS * CONVS_PER_KDA_LAYER
    assert PASS_MANAGER.counts == _expected_counts(KDA_LAYERS, convs, KDA_LAYERS)
    # Re-inplaced: every fused op writes a graph input (argN_1) directly, not a copy.
    conv_states = op_arguments(code, "kda.causal_conv1d_update_.default", 1)
    recurrent_states = op_arguments(code, "kda.recurrent_.default", 7)
    assert len(conv_states) == convs and len(recurrent_states) == KDA_LAYERS
    assert all(arg.startswith("arg") for arg in conv_states + recurrent_states)


def test_functional_decode_matches_eager_and_keeps_the_functional_recurrence():
    model, ids = tiny_model(), token_ids(7)
    _, cache = model.prefill(ids[:, :6], model.new_cache(BATCH))
    untouched = clone_cache(cache)
    compiled = torch.compile(model.decode, backend="kda", fullgraph=True)
    logits, new_cache = compiled(ids[:, 6:], cache)
    expected_logits, expected_cache = model.decode(ids[:, 6:], cache)
    torch.testing.assert_close(logits, expected_logits)
    assert_caches_close(new_cache, expected_cache)
    assert_caches_close(cache, untouched, rtol=0, atol=0)
    assert _graph_breaks() == 0
    convs = KDA_LAYERS * CONVS_PER_KDA_LAYER
    assert PASS_MANAGER.counts == _expected_counts(0, convs, KDA_LAYERS)


def test_dynamic_prompt_length_compiles_once():
    model = tiny_model()
    compiled = torch.compile(model.prefill, backend="kda", fullgraph=True)
    for length in (5, 7, 11):  # none equal to a model dim, which duck sizing would tie
        ids = token_ids(length)
        torch._dynamo.mark_dynamic(ids, 1)
        got, _ = compiled(ids, model.new_cache(BATCH))
        torch.testing.assert_close(got, model.prefill(ids, model.new_cache(BATCH))[0])
    assert counters["stats"]["unique_graphs"] == 1
    assert sum(counters["recompiles"].values()) == 0


class PlainNormModel(torch.nn.Module):
    """A norm with no gate, a sigmoid after it: nothing for the kda passes."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(32, 32)
        self.weight = torch.nn.Parameter(torch.randn(32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(rms_norm_torch(self.proj(x), self.weight, 1e-6)) * x


def test_unrelated_model_is_not_rewritten():
    model, x = PlainNormModel().eval().requires_grad_(False), torch.randn(4, 32)
    compiled = torch.compile(model, backend="kda", fullgraph=True)
    _, (code,) = run_and_get_code(compiled, x)
    torch.testing.assert_close(compiled(x), model(x))
    assert set(PASS_MANAGER.counts.values()) == {0}
    assert "torch.ops.kda" not in code


def test_stock_inductor_with_options_runs_the_passes():
    from lowering.inductor import inductor_options

    model, ids = tiny_model(HybridConfig(num_layers=1)), token_ids(4)
    compiled = torch.compile(model.prefill, options=inductor_options(), fullgraph=True)
    compiled(ids, model.new_cache(BATCH))
    assert PASS_MANAGER.counts["gated_rms_norm"] == 1


CACHE_SCRIPT = """
import torch
from torch._dynamo.utils import counters
from tests.examples.cases import BATCH, tiny_model, token_ids
from examples.hybrid_model import HybridConfig
model = tiny_model(HybridConfig(num_layers=1))
torch.compile(model.prefill, backend="kda", fullgraph=True)(token_ids(6), model.new_cache(BATCH))
print("hits", counters["inductor"]["fxgraph_cache_hit"], "misses",
      counters["inductor"]["fxgraph_cache_miss"])
"""


@pytest.mark.slow  # compiles the model in two fresh processes
def test_second_process_hits_the_fx_graph_cache(tmp_path):
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path), "PYTHONPATH": str(ROOT)}

    def run() -> list[str]:
        done = subprocess.run([sys.executable, "-c", CACHE_SCRIPT], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=300)  # fmt: skip
        assert done.returncode == 0, done.stderr
        return done.stdout.split()[-4:]

    assert run() == ["hits", "0", "misses", "1"]
    assert run() == ["hits", "1", "misses", "0"]
