"""tools/triton_repro_32cols.py: its kernel and its PyTorch expectation agree where the
interpreter runs them (fp32), with a partial last step, in both loops."""

import importlib.util
import pathlib

import pytest

TOOL = pathlib.Path(__file__).resolve().parents[2] / "tools" / "triton_repro_32cols.py"


@pytest.mark.parametrize("unmasked", [False, True])
def test_kernel_matches_its_expectation_in_the_interpreter(unmasked):
    spec = importlib.util.spec_from_file_location("triton_repro_32cols", TOOL)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    result = tool.run_case(K=20, V=24, BV=16, length=150, step=64, unmasked=unmasked,
                           dtype="float32", device="cpu")  # fmt: skip
    assert result["ok"], result
    assert result["errors"]["state"] < 1e-5


def test_grid_leaves_out_the_launches_past_shared_memory():
    spec = importlib.util.spec_from_file_location("triton_repro_32cols", TOOL)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    cases = tool.grid()
    assert {(c["K"], c["BV"], c["stages"]) for c in cases if c["K"] > 128 and c["stages"] > 1} == {
        (K, BV, 2) for K in (192, 256) for BV in (16, 32)
    }
    assert len(tool.grid(keys=(128,), steps=(16, 64))) == 3 * 2 * 3 * 2 * 2
