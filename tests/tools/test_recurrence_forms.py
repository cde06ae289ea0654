"""tools/recurrence_forms.py: the transposed form of the recurrence computes what the
production kernel does, where the interpreter runs both (fp32)."""

import importlib.util
import pathlib

import pytest
import torch

TOOL = pathlib.Path(__file__).resolve().parents[2] / "tools" / "recurrence_forms.py"


def load_tool():
    spec = importlib.util.spec_from_file_location("recurrence_forms", TOOL)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    return tool


@pytest.mark.parametrize(("batch", "value_heads", "dim"), [(1, 2, 16), (2, 1, 32)])
def test_transposed_form_matches_the_production_kernel(batch, value_heads, dim):
    tool = load_tool()
    inputs = tool.intermediates(batch, 48, value_heads, dim, torch.float32, "cpu")
    run, _ = tool.production(inputs, batch, 48)
    o_ref, state_ref = (x.clone() for x in run())
    assert o_ref.abs().max() > 0.1 and state_ref.abs().max() > 0.01
    for columns in (16, 32):
        if columns <= dim:
            o, state = tool.transposed(inputs, batch, 48, columns, columns // 16)()
            assert tool.difference(o, o_ref) < 1e-5
            assert tool.difference(state, state_ref) < 1e-5


def test_measure_lists_every_form():
    tool = load_tool()
    lines = tool.measure(32, 1, dim=32, dtype=torch.float32, timed=False)
    narrow = [columns for columns, _ in tool.TRANSPOSED_LAUNCHES if columns <= 32]
    assert [line["form"] for line in lines] == ["production"] + ["transposed"] * len(narrow)
    assert all(line["o_vs_production"] < 1e-5 for line in lines)
