"""``tools/transformers_suite.py``: a model's test file runs unpatched and with
``kda_ops.integrations.enable()``, each in its own pytest process, and the JSON counts
both runs and names the tests that fail in one of them only (CPU; an assembly of one test
file that reads transformers' Qwen3.5 model file, no network)."""

import importlib.util
import json
import sys
import textwrap
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))  # the tool's sibling module, as when it runs
SPEC = importlib.util.spec_from_file_location(
    "transformers_suite", ROOT / "tools" / "transformers_suite.py"
)
suite = sys.modules["transformers_suite"] = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(suite)

MODEL_TESTS = """
import pytest
import torch

from transformers.models.qwen3_5 import modeling_qwen3_5 as modeling


def test_chunk_delta_rule_keeps_its_shapes():
    q, k = torch.randn(1, 5, 2, 8), torch.randn(1, 5, 2, 8)
    v, g, beta = torch.randn(1, 5, 2, 4), -torch.rand(1, 5, 2), torch.rand(1, 5, 2)
    o, state = modeling.torch_chunk_gated_delta_rule(
        q, k, v, g=g, beta=beta, output_final_state=True, use_qk_l2norm_in_kernel=True
    )
    assert o.shape == (1, 5, 2, 4) and state.shape == (1, 2, 8, 4)


def test_runs_transformers_own_delta_rule():
    assert modeling.torch_chunk_gated_delta_rule.__module__ == modeling.__name__


def test_runs_kda_ops_delta_rule():
    assert modeling.torch_chunk_gated_delta_rule.__module__.startswith("kda_ops.")


def test_needs_a_gpu():
    pytest.skip("no GPU")


@pytest.fixture
def broken():
    raise RuntimeError("setup fails")


def test_with_a_broken_fixture(broken):
    pass
"""


def assembly(root: Path, model_tests: str = MODEL_TESTS) -> Path:
    """The layout the tool checks, with one model test file."""
    for path in ("tests/__init__.py", "tests/test_modeling_common.py",
                 "tests/causal_lm_tester.py", "tests/generation/test_utils.py",
                 "tests/models/__init__.py", "tests/models/qwen3_5/__init__.py"):  # fmt: skip
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).touch()
    (root / "src").mkdir()
    (root / "src" / "transformers").symlink_to(Path(transformers.__file__).parent)
    path = root / "tests/models/qwen3_5/test_modeling_qwen3_5.py"
    path.write_text(textwrap.dedent(model_tests))
    return root


@pytest.mark.slow  # two pytest processes
def test_both_runs_are_counted_and_one_run_failures_named(tmp_path):
    tests, results = assembly(tmp_path / "assembly"), tmp_path / "results.json"
    code = suite.main(["--tests", str(tests), "--model", "qwen3_5", "--json", str(results)])
    entry = json.loads(results.read_text())["models"]["qwen3_5"]
    prefix = "tests/models/qwen3_5/test_modeling_qwen3_5.py::"
    assert entry["unpatched"]["counts"] == {"passed": 2, "failed": 1, "skipped": 1, "errors": 1}
    assert entry["patched"]["counts"] == {"passed": 2, "failed": 1, "skipped": 1, "errors": 1}
    assert entry["patched_only_failures"] == [prefix + "test_runs_transformers_own_delta_rule"]
    assert entry["unpatched_only_failures"] == [prefix + "test_runs_kda_ops_delta_rule"]
    assert entry["unpatched"]["failures"][prefix + "test_with_a_broken_fixture"]["phase"] == "setup"
    swapped = {(s["module"], s["attribute"]) for s in entry["patched"]["swaps"]}
    assert ("transformers.models.qwen3_5.modeling_qwen3_5", "torch_chunk_gated_delta_rule") in (
        swapped
    )
    assert entry["patched"]["kda_calls"] == {"chunk_kda": 1}  # the one test that calls it
    assert "swaps" not in entry["unpatched"] and "kda_calls" not in entry["unpatched"]
    assert code == 1  # a patched-only failure breaks the contract


def test_an_incomplete_assembly_is_refused_by_name(tmp_path):
    with pytest.raises(SystemExit, match=r"test_modeling_kimi_linear\.py"):
        suite.main(["--tests", str(assembly(tmp_path)), "--model", "kimi_linear"])


@pytest.mark.slow  # a pytest process left to its timeout
def test_a_killed_process_keeps_its_results_and_names_the_running_test(tmp_path):
    """A process that overruns ``--timeout``: the tests before count, the running one is a
    timeout, the rest did not run and are no one-run failures."""
    tests = assembly(tmp_path / "assembly", model_tests="""
        import time

        def test_first():
            pass

        def test_hangs():
            time.sleep(600)

        def test_never_reached():
            pass
    """)  # fmt: skip
    results = tmp_path / "results.json"
    suite.main(["--tests", str(tests), "--model", "qwen3_5", "--json", str(results),
                "--timeout", "20"])  # fmt: skip
    entry = json.loads(results.read_text())["models"]["qwen3_5"]
    hangs = "tests/models/qwen3_5/test_modeling_qwen3_5.py::test_hangs"
    for mode in ("unpatched", "patched"):
        run = entry[mode]
        assert run["counts"] == {"passed": 1, "failed": 1, "skipped": 0, "errors": 0}, run
        assert run["failures"][hangs]["type"] == "Timeout"
        assert run["note"].endswith("1 collected test(s) did not run")
    assert entry["patched_only_failures"] == entry["failures_without_counterpart"] == []
