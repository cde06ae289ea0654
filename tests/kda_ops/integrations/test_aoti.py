"""AOTInductor packages of transformers models' prefill and decode steps (with
``enable()`` on, states as explicit I/O; CPU packages, and CUDA ones on a GPU): a
left-padded prefill and 8 greedy decode steps through the packages give eager's logits and
tokens, loaded here and, as fixed-shape flat-state steps, in the C++ runner of
``examples/aoti_runner/`` (no Python in its process; Qwen3.5 and Kimi Linear). Each package
compiles in tens of seconds on 2 CPU cores: two layers a model."""

from __future__ import annotations

import pathlib
import subprocess

import pytest
import torch

pytest.importorskip("transformers")

import kda_ops.integrations as integrations
from examples.export_aoti import runner_steps
from kda_ops.integrations.export import (
    DecodeStep,
    PrefillStep,
    layer_types,
    package_flat_state_steps,
)
from lowering import aoti
from tests.kda_ops.integrations.models import BUILDERS, VOCAB, min_prefill_length

TWO_LAYERS = ["linear_attention", "full_attention"]
# Two layers each, one linear-attention and one full-attention.
SIZES = {
    "qwen3_5": {},
    "kimi_linear": dict(num_hidden_layers=2, layer_types=TWO_LAYERS, mlp_layer_types=["dense"] * 2),
    "qwen3_next": dict(num_hidden_layers=2, layer_types=TWO_LAYERS),
    "qwen3_5_moe": {},
    "olmo_hybrid": {},
    "glm5_next": {},
}
# GLM5-next's prefill exports, but Inductor cannot compile it: its sparse-attention indexer's
# top-k gives a data-dependent size that Inductor's bmm layout choice guards on.
INDUCTOR_REFUSES = {
    "glm5_next": pytest.mark.xfail(
        strict=True,
        raises=torch._inductor.exc.InductorError,
        reason="Inductor guards on GLM5-next's data-dependent indexer size (Max(1, u0) >= u0)",
    )
}
# The C++ runner's flat-state steps: the two models the runner's contract names.
RUNNER_MODELS = ["qwen3_5", "kimi_linear"]
DECODE_STEPS = 8

pytestmark = pytest.mark.slow
CPU_PACKAGES = pytest.mark.skipif(
    torch.torch_version.TorchVersion(torch.__version__) < aoti.OLDEST_TORCH,
    reason=f"CPU packages need torch >= {aoti.OLDEST_TORCH}",
)


def _packages(net, name, directory):
    batch = torch.export.Dim("batch", min=1, max=64)
    length = torch.export.Dim("length", min=min_prefill_length(name), max=4096)
    kv_length = torch.export.Dim("kv_length", min=2, max=4096)
    prompt = torch.randint(3, VOCAB, (3, 9), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(prompt)
    prefill = torch.export.export(
        PrefillStep(net), (prompt, mask),
        dynamic_shapes={"input_ids": {0: batch, 1: length},
                        "attention_mask": {0: batch, 1: length}},
    )  # fmt: skip
    _, states = PrefillStep(net)(prompt)
    layer_dims = [({0: batch, 2: kv_length},) * 2 if t != "linear_attention" else ({0: batch},) * 2
                  for t in layer_types(net)]  # fmt: skip
    step_mask = torch.ones(3, states[-1][0].shape[2] + 1, dtype=torch.long)
    decode = torch.export.export(
        DecodeStep(net), (torch.full((3, 1), 5), states, step_mask),
        dynamic_shapes={"input_ids": {0: batch}, "states": layer_dims,
                        "attention_mask": {0: batch, 1: kv_length + 1}},
    )  # fmt: skip
    return (aoti.package(prefill, directory / "prefill.pt2"),
            aoti.package(decode, directory / "decode.pt2"))  # fmt: skip


def _greedy(prefill, decode, prompt, mask):
    logits, states = prefill(prompt, mask)
    steps = [logits[:, -1]]
    for _ in range(DECODE_STEPS):
        token = steps[-1].argmax(-1, keepdim=True)
        mask = torch.cat([mask, torch.ones_like(token)], dim=1)
        # A package reads its inputs with the strides it was traced with.
        states = [tuple(t.contiguous() for t in layer) for layer in states]
        logits, states = decode(token, states, mask)
        steps.append(logits[:, -1])
    return torch.stack(steps, dim=1)


@CPU_PACKAGES
@pytest.mark.parametrize(
    "name", [pytest.param(name, marks=INDUCTOR_REFUSES.get(name, ())) for name in SIZES]
)
@torch.no_grad()
def test_cpu_packages_of_prefill_and_decode_equal_eager(name, tmp_path):
    net = BUILDERS[name](**SIZES[name])
    integrations.enable([name])
    try:
        prefill_path, decode_path = _packages(net, name, tmp_path)
        prompt = torch.randint(3, VOCAB, (2, 13), generator=torch.Generator().manual_seed(1))
        mask = torch.ones_like(prompt)
        mask[0, :3] = 0  # left padding
        expected = _greedy(PrefillStep(net), DecodeStep(net), prompt, mask)
        load = torch._inductor.aoti_load_package
        actual = _greedy(load(prefill_path), load(decode_path), prompt, mask)
    finally:
        integrations.disable()
    torch.testing.assert_close(actual, expected)
    assert torch.equal(actual.argmax(-1), expected.argmax(-1))


ROOT = pathlib.Path(__file__).resolve().parents[3]
MAX_LENGTH = 32


def _eager_greedy(net, prompt):
    """The model's own greedy run with a DynamicCache: per step the last logits, tokens."""
    from transformers import DynamicCache

    cache = DynamicCache(config=net.config)
    logits = net(prompt, cache=cache, use_cache=True).logits[:, -1]
    steps = [(logits, logits.argmax(-1))]
    for _ in range(DECODE_STEPS):
        logits = net(steps[-1][1][:, None], cache=cache, use_cache=True).logits[:, -1]
        steps.append((logits, logits.argmax(-1)))
    return steps


DEVICES = [pytest.param("cpu", marks=CPU_PACKAGES), pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", RUNNER_MODELS)
@torch.no_grad()
def test_cpp_runner_gives_eager_tokens_for_prefill_and_decode(name, device, runner, tmp_path):
    """The flat-state packages (fixed-size KV buffers) run by the C++ runner: a prefill of
    2 prompts and 8 greedy decode steps, eager's logits and tokens; the runner refuses a
    run longer than the buffers. On CUDA the packages launch the kda Triton kernels (no
    ``kda`` op left in their code) on the tensors the runner puts on the GPU."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    net = BUILDERS[name](**SIZES[name]).to(device)
    integrations.enable([name])
    try:
        paths = package_flat_state_steps(net, tmp_path, MAX_LENGTH)
        prompt = torch.randint(3, VOCAB, (2, 11), generator=torch.Generator().manual_seed(2))
        expected = _eager_greedy(net, prompt.to(device))
    finally:
        integrations.disable()
    actual = runner_steps(runner, tmp_path, prompt, DECODE_STEPS)
    assert len(actual) == len(expected) == DECODE_STEPS + 1
    for (logits, tokens), (want_logits, want_tokens) in zip(actual, expected):
        torch.testing.assert_close(logits, want_logits.cpu())
        assert torch.equal(tokens, want_tokens.cpu())
    if device == "cuda":
        _assert_kernels_and_no_op(paths)
    libraries = subprocess.run(["ldd", str(runner)], capture_output=True, text=True).stdout
    assert "libpython" not in libraries
    too_long = [str(runner), str(tmp_path), str(MAX_LENGTH - 10), "3," * 10 + "3"]
    refused = subprocess.run(too_long, capture_output=True, text=True)
    assert refused.returncode == 1 and "max_length 32" in refused.stderr, refused.stderr


def _assert_kernels_and_no_op(paths: dict[str, str]) -> None:
    """A CUDA package's generated code launches the kda Triton kernels and calls no op."""
    import zipfile

    launched = {"prefill": ("chunk_recurrence", "causal_conv1d"), "decode": ("recurrent_kda",)}
    for step, kernels in launched.items():
        with zipfile.ZipFile(paths[step]) as archive:
            code = "".join(archive.read(name).decode(errors="ignore")
                           for name in archive.namelist() if name.endswith(".cpp"))  # fmt: skip
        assert "kda::" not in code and "torch.ops.kda" not in code, step
        for kernel in kernels:
            assert kernel in code, (step, kernel)
