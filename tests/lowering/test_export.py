"""lowering.export: the hybrid model's prefill and decode steps exported with explicit state
I/O, dynamic batch and T, equal to eager, surviving save/load in a fresh process; programs
that keep state in mutated buffers or inputs are refused."""

import pathlib
import subprocess
import sys
import textwrap

import pytest
import torch

import kda_ops
from lowering import export
from tests.examples.cases import tiny_model

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return tiny_model()


@pytest.fixture(scope="module")
def programs(model):
    return {step: export.export_step(model, step) for step in ("prefill", "decode")}


def _prompt(model, batch, length):
    ids = torch.randint(0, model.config.vocab_size, (batch, length))
    return ids, model.new_cache(batch)


def _assert_step_matches(program, eager_step, ids, cache):
    got = program.module()(ids, *export.flatten_cache(cache))
    logits, new_cache = eager_step(ids, cache)
    expected = (logits, *export.flatten_cache(new_cache))
    assert len(got) == len(expected)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b)
    return new_cache


@pytest.mark.parametrize("batch, length", [(1, 1), (2, 2), (3, 17), (4, 64)])
def test_prefill_then_decode_match_eager(model, programs, batch, length):
    ids, cache = _prompt(model, batch, length)
    cache = _assert_step_matches(programs["prefill"], model.prefill, ids, cache)
    if length < model.config.max_seq_len:  # decode needs a free KV slot
        next_ids = torch.randint(0, model.config.vocab_size, (batch, 1))
        _assert_step_matches(programs["decode"], model.decode, next_ids, cache)


def test_every_state_is_an_explicit_input_and_output(model, programs):
    states = len(export.state_names(model))
    assert states == 3 * 4 + 3  # 3 KDA layers (conv q/k/v + recurrent), 1 attention layer
    kda_ops_in = {
        "prefill": {torch.ops.kda.chunk.default, torch.ops.kda.causal_conv1d.default},
        "decode": {torch.ops.kda.recurrent.default},
    }
    for step, program in programs.items():
        signature = program.graph_signature
        assert len(signature.user_inputs) == 1 + states
        assert len(signature.user_outputs) == 1 + states
        assert not signature.buffers_to_mutate and not signature.user_inputs_to_mutate
        targets = {n.target for n in program.graph.nodes if n.op == "call_function"}
        assert kda_ops_in[step] <= targets
        assert not any("auto_functionalized" in str(t) for t in targets)


def test_state_names_follow_the_layer_layout(model):
    names = export.state_names(model)
    assert names[:4] == ["layer0.conv_q", "layer0.conv_k", "layer0.conv_v", "layer0.recurrent"]
    assert names[-3:] == ["layer3.key", "layer3.value", "layer3.length"]


SUBPROCESS_CHECK = """
import sys, torch
import kda_ops  # registers the kda ops: torch.export.load needs them
for step in ("prefill", "decode"):
    program = torch.export.load(f"{sys.argv[1]}/{step}.pt2")
    inputs, expected = torch.load(f"{sys.argv[1]}/{step}_io.pt")
    got = program.module()(*inputs)
    assert len(got) == len(expected), step
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b)
print("loaded and matched")
"""


def test_save_load_round_trip_in_a_fresh_process(model, programs, tmp_path):
    ids, cache = _prompt(model, 2, 9)
    logits, new_cache = model.prefill(ids, cache)
    next_ids = torch.randint(0, model.config.vocab_size, (2, 1))
    next_logits, next_cache = model.decode(next_ids, new_cache)
    io = {
        "prefill": (
            (ids, *export.flatten_cache(cache)),
            (logits, *export.flatten_cache(new_cache)),
        ),
        "decode": (
            (next_ids, *export.flatten_cache(new_cache)),
            (next_logits, *export.flatten_cache(next_cache)),
        ),
    }
    for step, program in programs.items():
        torch.export.save(program, tmp_path / f"{step}.pt2")
        torch.save(io[step], tmp_path / f"{step}_io.pt")
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(SUBPROCESS_CHECK), str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "loaded and matched" in result.stdout


class BufferStateDecoder(torch.nn.Module):
    """The anti-pattern: the recurrent state lives in a buffer updated in place."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("state", torch.zeros(1, 2, 8, 8))

    def forward(self, q, k, v, g, beta):
        o, new_state = kda_ops.fused_recurrent_kda(
            q, k, v, g, beta, initial_state=self.state, output_final_state=True
        )
        self.state.copy_(new_state)
        return o


class InplaceDecodeStep(torch.nn.Module):
    """The hybrid model's in-place decode (``decode_``): it writes its cache inputs."""

    def __init__(self, model) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids, *states):
        return self.model.decode_(input_ids, export.unflatten_cache(self.model, states))


def test_buffer_state_is_refused_with_a_pointer_to_the_explicit_state_api():
    tokens = (torch.randn(1, 1, 2, 8) for _ in range(3))
    args = (*tokens, -torch.rand(1, 1, 2, 8), torch.rand(1, 1, 2))
    with pytest.raises(export.StateMutationError, match=r"\(state\).*Pass every state as an input"):
        export.export_module(BufferStateDecoder(), args)
    with pytest.raises(ValueError, match=r"HybridLM\.prefill / decode, not decode_"):
        export.export_module(BufferStateDecoder(), args)


def test_inplace_decode_is_refused(model):
    args = export.example_inputs(model, "decode")
    with pytest.raises(export.StateMutationError, match=r"layer0\.conv_q|states"):
        export.export_module(InplaceDecodeStep(model), args)


def test_bad_arguments_raise(model):
    with pytest.raises(ValueError, match="step"):
        export.ExplicitStateStep(model, "generate")
    states = export.flatten_cache(model.new_cache(1))
    with pytest.raises(ValueError, match="15 state tensors, got 14"):
        export.unflatten_cache(model, states[:-1])
