"""How ``enable()`` finds what to swap: by the functions a transformers model file holds
and their conventions, in files loaded before and imported after; ``patched()``;
unrecognised conventions left alone with a warning; ``disable()`` restoring everything."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import inspect
import sys
import warnings

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

pytest.importorskip("transformers")

import kda_ops.integrations as integrations
from kda_ops.integrations import _conventions, _discovery
from tests.kda_ops.integrations.models import MODEL_FILES

PACKAGE = "transformers.models.fake_hybrid"
HEADER = """
import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN
from transformers.utils import is_torchdynamo_exporting
"""


def _copied(model: str, *names: str) -> str:
    """The source of ``names`` as transformers' ``model`` file defines them (the PyTorch
    functions, without the kernel-hub decorator): what a new model file copies."""
    module = importlib.import_module(MODEL_FILES[model])
    parts = []
    for name in names:
        lines = inspect.getsource(_conventions.torch_function(getattr(module, name))).splitlines()
        parts.append("\n".join(line for line in lines if not line.startswith("@")))
    return HEADER + "\n\n".join(parts) + "\n"


class _SourceLoader(importlib.abc.Loader):
    def __init__(self, source: str) -> None:
        self.source = source

    def create_module(self, spec):
        return None

    def exec_module(self, module) -> None:
        exec(compile(self.source, module.__name__, "exec"), vars(module))


class _SourceFinder(importlib.abc.MetaPathFinder):
    """Serves modules from source strings, as an installed file would be found: behind
    every other finder on ``sys.meta_path``."""

    def __init__(self, sources: dict[str, str]) -> None:
        self.sources = sources

    def find_spec(self, fullname, path, target=None):
        if fullname == PACKAGE:
            return importlib.util.spec_from_loader(fullname, _SourceLoader(""), is_package=True)
        if fullname in self.sources:
            return importlib.util.spec_from_loader(fullname, _SourceLoader(self.sources[fullname]))
        return None


@pytest.fixture
def new_model_files():
    """Register model files (``{name: source}``) under ``transformers.models.fake_hybrid``;
    they are imported by the test, with whatever finders ``sys.meta_path`` holds then."""
    finder = _SourceFinder({})
    sys.meta_path.append(finder)

    def add(name: str, source: str) -> str:
        full = f"{PACKAGE}.{name}"
        finder.sources[full] = source
        return full

    yield add
    integrations.disable()
    sys.meta_path.remove(finder)
    for name in [n for n in sys.modules if n == PACKAGE or n.startswith(PACKAGE + ".")]:
        del sys.modules[name]


class OpRecorder(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.add(func._schema.name)
        return func(*args, **(kwargs or {}))


def _gdn_inputs(value_heads: int = 2):
    generator = torch.Generator().manual_seed(3)
    q, k = (torch.randn(2, 70, 1, 16, generator=generator) for _ in range(2))
    v = torch.randn(2, 70, value_heads, 8, generator=generator)
    g = -torch.nn.functional.softplus(torch.randn(2, 70, value_heads, generator=generator))
    beta = torch.rand(2, 70, value_heads, generator=generator)
    return (q, k, v), dict(g=g, beta=beta, output_final_state=True, use_qk_l2norm_in_kernel=True)


def test_a_model_file_imported_later_that_copies_the_functions_is_swapped(new_model_files):
    source = _copied(
        "qwen3_5", "l2norm", "torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule",
        "causal_conv1d_fn", "causal_conv1d_update")  # fmt: skip
    keep = "_original_chunk = torch_chunk_gated_delta_rule\n"  # not a role name: never swapped
    name = new_model_files("modeling_fake_hybrid", source + keep)
    integrations.enable()
    module = importlib.import_module(name)  # after enable(): the import finder swaps it

    assert "fake_hybrid" in integrations.enabled()
    swaps = [s for s in integrations.patched() if s.target == "fake_hybrid"]
    ours = "kda_ops.integrations._transformers."
    assert {(s.module, s.attribute, s.replacement) for s in swaps} == {
        (name, "torch_chunk_gated_delta_rule", ours + "chunk_delta_rule"),
        (name, "torch_recurrent_gated_delta_rule", ours + "recurrent_delta_rule"),
        (name, "causal_conv1d_fn", ours + "causal_conv1d_fn"),
        (name, "causal_conv1d_update", ours + "causal_conv1d_update"),
    }
    # The copy's own function is the reference the kda op must match.
    original = _conventions.torch_function(vars(module)["_original_chunk"])
    args, kwargs = _gdn_inputs()
    with torch.no_grad(), OpRecorder() as recorder:
        actual = module.torch_chunk_gated_delta_rule(*args, **kwargs)
    assert "kda::chunk" in recorder.ops
    torch.testing.assert_close(actual, original(*args, **kwargs))

    # Executed again, the module is swapped again (its recorded swaps were stale).
    module = importlib.reload(module)
    assert module.torch_chunk_gated_delta_rule.__module__ == "kda_ops.integrations._transformers"
    original = vars(module)["_original_chunk"]

    integrations.disable()
    assert module.torch_chunk_gated_delta_rule is original
    assert integrations.patched() == []
    assert not any(isinstance(f, _discovery.ModelingFinder) for f in sys.meta_path)


ODD_OUTPUT_LAYOUT = """
def torch_chunk_gated_delta_rule(query, key, value, g, beta, chunk_size=64, initial_state=None,
                                 output_final_state=False, use_qk_l2norm_in_kernel=False, **kwargs):
    out, state = _reference(query, key, value, g=g, beta=beta, initial_state=initial_state,
                            output_final_state=output_final_state,
                            use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
    return out.transpose(1, 2), state  # [B, HV, T, V]: not the convention kda_ops implements
"""
ODD_SIGNATURE = """
def torch_chunk_gated_delta_rule(query, key, value, beta, g, chunk_size=64, initial_state=None,
                                 output_final_state=False, use_qk_l2norm_in_kernel=False):
    return _reference(query, key, value, g=g, beta=beta, initial_state=initial_state,
                      output_final_state=output_final_state,
                      use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
"""


@pytest.mark.parametrize(
    ("body", "reason"),
    [(ODD_OUTPUT_LAYOUT, "returns shape"), (ODD_SIGNATURE, "do not start with")],
    ids=["output_layout", "parameter_order"],
)
def test_an_unrecognised_convention_leaves_the_whole_file_alone(new_model_files, body, reason):
    reference = "_reference = torch_chunk_gated_delta_rule\n"
    source = _copied("qwen3_5", "l2norm", "torch_chunk_gated_delta_rule", "causal_conv1d_fn")
    name = new_model_files("modeling_odd_hybrid", source + reference + body)
    integrations.enable()
    with pytest.warns(_discovery.UnrecognisedModuleWarning, match=f"{name} alone: .*{reason}"):
        module = importlib.import_module(name)
    # Never half-patched: the conv function, recognised on its own, is not swapped either.
    assert module.causal_conv1d_fn.__module__ == name
    assert module.torch_chunk_gated_delta_rule.__module__ == name
    assert not [s for s in integrations.patched() if s.module == name]
    assert "torch_chunk_gated_delta_rule" in integrations.unrecognised()[name]


def test_a_file_placed_in_sys_modules_is_found_by_the_next_enable(new_model_files):
    """A module that never went through an import (built by hand, or loaded before the
    finder was installed and swapped back by disable()) is found by scanning sys.modules."""
    source = _copied("olmo_hybrid", "l2norm", "torch_recurrent_gated_delta_rule")
    name = f"{PACKAGE}.modeling_by_hand"
    module = type(sys)(name)
    exec(compile(source, name, "exec"), vars(module))
    sys.modules[name] = module
    integrations.enable()
    assert (
        module.torch_recurrent_gated_delta_rule.__module__ == "kda_ops.integrations._transformers"
    )
    integrations.disable()
    assert module.torch_recurrent_gated_delta_rule.__module__ == name


def test_named_targets_swap_only_their_files():
    qwen3_next = importlib.import_module(MODEL_FILES["qwen3_next"])
    before = qwen3_next.torch_chunk_gated_delta_rule
    try:
        assert integrations.enable(["qwen3_5"]) == ("qwen3_5",)
        assert qwen3_next.torch_chunk_gated_delta_rule is before
        swaps = integrations.patched()
        assert {s.target for s in swaps} == {"qwen3_5"}
        assert {s.module for s in swaps} == {MODEL_FILES["qwen3_5"]}
        assert "Qwen3_5RMSNormGated.forward" in {s.attribute for s in swaps}
        # Named targets install no import finder.
        assert not any(isinstance(f, _discovery.ModelingFinder) for f in sys.meta_path)
    finally:
        integrations.disable()
    assert integrations.patched() == []


def test_files_without_a_delta_rule_are_not_touched():
    """Mamba-family files share the conv function names; without a delta rule they are not
    integrated, and no warning is raised for them."""
    integrations.enable()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", _discovery.UnrecognisedModuleWarning)
            bamba = importlib.import_module("transformers.models.bamba.modeling_bamba")
        assert bamba.causal_conv1d_fn.__module__ == bamba.__name__
        assert "bamba" not in integrations.enabled()
    finally:
        integrations.disable()


def test_the_probe_leaves_the_rng_alone_and_ignores_a_meta_default_device():
    module = importlib.import_module(MODEL_FILES["qwen3_5"])
    function = module.torch_chunk_gated_delta_rule
    rng = torch.get_rng_state()
    with torch.device("meta"):
        _conventions.check_function(_conventions.CHUNK_GATED_DELTA_RULE, function)
        _conventions.check_gated_norm(module.Qwen3_5RMSNormGated)
    assert torch.equal(torch.get_rng_state(), rng)
    with pytest.raises(_conventions.ConventionMismatch, match="fails on a probe call"):
        # A scalar-gate (GDN) function is not a per-channel-gate (KDA) one: its own code
        # cannot take a [B, T, HV, K] gate.
        _conventions.check_function(_conventions.CHUNK_KDA, function)
