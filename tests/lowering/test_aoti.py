"""lowering.aoti: the kda ops' aten formulations equal the ops, keep batch and T dynamic
from 1, refuse what a package cannot run; the hybrid model's packages, run from the C++
runner with no Python, give eager's logits for a prefill and 8 decode steps."""

import pathlib
import subprocess
import sys
from typing import NamedTuple

import pytest
import torch
from torch.export import Dim

import kda_ops
from examples import export_aoti
from examples.hybrid_model import HybridConfig
from lowering import aoti, export
from tests.examples.cases import tiny_model
from tests.kda_ops.inputs import delta_rule_inputs

ROOT = pathlib.Path(__file__).resolve().parents[2]
kda = torch.ops.kda


class ChunkGated(torch.nn.Module):
    """``chunk_kda`` with the gate computed in the op (A_log, dt_bias as inputs)."""

    def __init__(self, scalar_gate: bool) -> None:
        super().__init__()
        self.scalar_gate = scalar_gate

    def forward(self, q, k, v, g, beta, A_log, dt_bias, state):
        return kda_ops.chunk_kda(
            q, k, v, g, beta, initial_state=state, output_final_state=True,
            use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
            use_beta_sigmoid_in_kernel=True, A_log=A_log, dt_bias=dt_bias,
        )  # fmt: skip


def _delta_rule_args(batch, length, scalar_gate):
    x = delta_rule_inputs(batch, length, heads=2, value_heads=4, head_k=8, head_v=4,
                          scalar_gate=scalar_gate, raw_gate=True, dtype=torch.float32)  # fmt: skip
    return x.q, x.k, x.v, x.g, x.beta, x.A_log, x.dt_bias, x.initial_state


@pytest.mark.parametrize("scalar_gate", [False, True], ids=["kda", "gdn"])
def test_decomposed_chunk_keeps_batch_and_length_dynamic_from_one(scalar_gate):
    module = ChunkGated(scalar_gate)
    batch, length = Dim("batch", min=1, max=8), Dim("length", min=1, max=256)
    tokens = {0: batch, 1: length}
    shapes = (tokens,) * 5 + (None, None, {0: batch})
    program = torch.export.export(module, _delta_rule_args(3, 70, scalar_gate),
                                  dynamic_shapes=shapes)  # fmt: skip
    decomposed = aoti.decompose(program).module()
    for b, t in [(1, 1), (2, 5), (3, 64), (1, 65), (2, 200)]:
        args = _delta_rule_args(b, t, scalar_gate)
        for got, expected in zip(decomposed(*args), module(*args), strict=True):
            torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


def test_programs_decompose_one_after_another():
    """A decomposition leaves no state behind that breaks the next program's (the scan's
    compile wrapper did: a tensor constant missing from the second program)."""
    aoti.decompose(torch.export.export(ChunkGated(False), _delta_rule_args(2, 9, False)))
    model = tiny_model(HybridConfig(num_layers=2, full_attention_interval=2))
    decomposed = aoti.decompose(export.export_step(model, "decode"))
    ids = torch.randint(model.config.vocab_size, (2, 1))
    states = export.flatten_cache(model.new_cache(2))
    expected = export.ExplicitStateStep(model, "decode")(ids, *states)
    for got, want in zip(decomposed.module()(ids, *states), expected, strict=True):
        torch.testing.assert_close(got, want)


def test_every_table_entry_equals_its_op():
    """Each formulation, run eagerly, against the op it replaces."""
    q, k, v, g, beta, A_log, dt_bias, state = _delta_rule_args(2, 9, scalar_gate=False)
    delta_rule = (q, k, v, g, beta, A_log, dt_bias, state, None, 0.3, None, True, True)
    x, weight, bias = torch.randn(2, 9, 6), torch.randn(6, 4), torch.randn(6)
    gate = torch.randn(2, 9, 4, 8)
    cases = {
        kda.chunk.default: delta_rule,
        kda.recurrent.default: delta_rule,
        kda.causal_conv1d.default: (x, weight, bias, torch.randn(2, 6, 3), None, "silu"),
        kda.gated_rms_norm.default: (x, torch.randn(2, 9, 6), torch.randn(6), 1e-6, "sigmoid"),
        kda.gate.default: (gate, torch.randn(4), torch.randn(32), -5.0),
    }
    table = aoti.decompositions()
    assert set(table) == set(cases)
    for op, args in cases.items():
        got, expected = table[op](*args), op(*args)
        for a, b in zip(
            *(r if isinstance(r, tuple) else (r,) for r in (got, expected)), strict=True
        ):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=str(op))


class PackedChunk(torch.nn.Module):
    def forward(self, q, k, v, g, beta, cu_seqlens):
        return kda_ops.chunk_kda(q, k, v, g, beta, cu_seqlens=cu_seqlens)[0]


class ChunkWithStates(torch.nn.Module):
    def forward(self, q, k, v, g, beta):
        return kda_ops.chunk_kda(q, k, v, g, beta, return_intermediate_states=True)


def test_packed_sequences_are_refused_naming_cu_seqlens():
    q, k, v, g, beta, *_ = _delta_rule_args(1, 12, scalar_gate=False)
    g = -torch.rand_like(g)
    cu_seqlens = torch.tensor([0, 5, 12])
    program = torch.export.export(PackedChunk(), (q, k, v, g, torch.sigmoid(beta), cu_seqlens))
    with pytest.raises(ValueError, match="cu_seqlens"):
        aoti.decompose(program)


def test_an_op_without_a_formulation_is_named():
    q, k, v, g, beta, *_ = _delta_rule_args(1, 12, scalar_gate=False)
    program = torch.export.export(ChunkWithStates(), (q, k, v, -torch.rand_like(g), beta.sigmoid()))
    with pytest.raises(aoti.UnsupportedOpError, match=r"kda\.chunk_states"):
        aoti.decompose(program)


def test_an_older_torch_is_refused_a_cpu_package_before_compiling(monkeypatch):
    program = torch.export.export(ChunkGated(scalar_gate=False), _delta_rule_args(1, 12, False))
    monkeypatch.setattr(torch, "__version__", "2.11.0")
    with pytest.raises(RuntimeError, match=r"needs torch >= 2\.13 for a CPU package"):
        aoti.package(program, "unused.pt2")


def test_state_specs_describe_the_empty_cache():
    model = tiny_model()
    lines = aoti.state_specs(model).splitlines()
    states = export.flatten_cache(model.new_cache(5))
    assert len(lines) == len(states) == len(export.state_names(model))
    for line, state in zip(lines, states):
        dtype, *shape = line.split()
        assert getattr(torch, dtype) == state.dtype
        assert [int(d) for d in shape] == list(state.shape[1:])


class Packaged(NamedTuple):
    model: object
    directory: pathlib.Path
    paths: dict[str, str]
    prompts: torch.Tensor
    expected: export_aoti.Greedy


@pytest.fixture(scope="module", params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def packaged(request, tmp_path_factory) -> Packaged:
    """One KDA layer and one attention layer packaged for the device; eager's greedy run of
    2 prompts of 7 tokens, a prefill and 8 decode steps."""
    device = request.param
    if device == "cpu" and torch.torch_version.TorchVersion(torch.__version__) < aoti.OLDEST_TORCH:
        pytest.skip(f"CPU packages need torch >= {aoti.OLDEST_TORCH}")
    torch.manual_seed(0)
    model = tiny_model(HybridConfig(num_layers=2, full_attention_interval=2), device=device)
    directory = tmp_path_factory.mktemp(f"packages_{device}")
    paths = aoti.package_steps(model, directory)
    prompts = torch.randint(model.config.vocab_size, (2, 7))
    return Packaged(model, directory, paths, prompts, export_aoti.eager_steps(model, prompts, 8))


def _assert_greedy_equal(got: export_aoti.Greedy, expected: export_aoti.Greedy) -> None:
    assert len(got) == len(expected) == 9
    for (logits, tokens), (want_logits, want_tokens) in zip(got, expected):
        torch.testing.assert_close(logits.cpu(), want_logits.cpu(), rtol=1e-4, atol=1e-5)
        assert torch.equal(tokens.cpu(), want_tokens.cpu())


# A package of one Linear layer, loaded in a fresh process: whether this torch's Python
# loader runs packages of the device at all (on the H200, torch 2.11's crashed with a
# segfault in its device-string parsing on the hybrid model's CUDA packages, which C++
# loaded and ran).
PLAIN_PACKAGE = """
import sys, torch
path = sys.argv[2]
model = torch.nn.Linear(4, 4).to(sys.argv[1])
x = torch.randn(2, 4, device=sys.argv[1])
program = torch.export.export(model, (x,))
torch._inductor.aoti_compile_and_package(program, package_path=path)
torch.testing.assert_close(torch._inductor.aoti_load_package(path)(x), model(x))
"""


def _python_loads_packages(device: str, directory: pathlib.Path) -> bool:
    command = [sys.executable, "-c", PLAIN_PACKAGE, device, str(directory / "plain.pt2")]
    result = subprocess.run(command, capture_output=True, text=True)
    assert result.returncode <= 0, result.stderr  # an error fails; a crash (a signal) is a no
    return result.returncode == 0


@pytest.mark.slow  # the packages' compile: about 30 s of CPU
def test_packages_loaded_here_give_eager_logits(packaged):
    p = packaged
    device = next(p.model.parameters()).device.type
    if device == "cuda" and not _python_loads_packages(device, p.directory):
        pytest.skip("this torch's Python loader crashes on any CUDA package (one Linear too)")
    _assert_greedy_equal(export_aoti.package_steps_here(p.paths, p.model, p.prompts, 8), p.expected)


@pytest.mark.slow
def test_cpp_runner_gives_eager_logits_for_prefill_and_decode(packaged, runner):
    """The packages in a process that links libtorch and no Python."""
    _assert_greedy_equal(
        export_aoti.runner_steps(runner, packaged.directory, packaged.prompts, 8), packaged.expected
    )
    libraries = subprocess.run(["ldd", str(runner)], capture_output=True, text=True).stdout
    assert "libpython" not in libraries


@pytest.mark.gpu
def test_cuda_packages_launch_the_kda_kernels_and_no_op(packaged):
    """The CUDA packages' generated code launches the Triton kernels of every kda op."""
    if next(packaged.model.parameters()).device.type != "cuda":
        pytest.skip("a CPU package decomposes the ops")
    import zipfile

    launched = {
        "prefill": ("chunk_prepare", "chunk_recurrence", "causal_conv1d"),
        "decode": ("recurrent_kda", "conv_step", "gated_rms_norm"),
    }
    for step, kernels in launched.items():
        with zipfile.ZipFile(packaged.paths[step]) as archive:
            code = "".join(archive.read(name).decode(errors="ignore")
                           for name in archive.namelist() if name.endswith(".cpp"))  # fmt: skip
        assert "kda::" not in code and "torch.ops.kda" not in code
        for kernel in kernels:
            assert kernel in code, (step, kernel)
