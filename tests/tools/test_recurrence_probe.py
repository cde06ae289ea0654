"""``tools/recurrence_probe.py``: a case runs the forward's two kernels with its launch
overrides and reports its errors against float64 (CPU: the interpreter in fp32, where the
kernels are exact; the GPU run in bf16 is the probe)."""

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SPEC = importlib.util.spec_from_file_location(
    "recurrence_probe", ROOT / "tools" / "recurrence_probe.py"
)
probe = sys.modules["recurrence_probe"] = importlib.util.module_from_spec(SPEC)  # dataclasses
SPEC.loader.exec_module(probe)


@pytest.mark.parametrize("gate", ["kda", "gdn"])
def test_a_case_with_overrides_reports_its_launches_and_errors(gate):
    case = probe.Case(K=32, V=32, T=100, varlen=True, gate=gate, chunk=64, dtype="float32",
                      source="fp32_prepare", BV=16, STAGES=1)  # fmt: skip
    result = probe.run_case(case)
    assert [launch["BV"] for launch in result["launches"]] == [16]
    assert {launch["STEP"] for launch in result["launches"]} == {64}
    assert result["ok"] and result["o"] < 1e-5 and result["state"] < 1e-5, result


def test_the_default_set_covers_both_questions():
    cases = probe.default_cases()
    assert any(case.K > 128 and case.dtype == "bfloat16" for case in cases)
    assert any(case.chunk == 64 and case.UNMASKED_FULL_STEPS for case in cases)
    assert len(set(cases)) == len(cases)
