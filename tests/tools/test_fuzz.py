"""``tools/fuzz.py``: its cases are reproducible and supported, and a case runs and checks
itself (CPU: the reference against float64, a check of the plumbing; the GPU run is the
campaign)."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SPEC = importlib.util.spec_from_file_location("fuzz", ROOT / "tools" / "fuzz.py")
fuzz = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(fuzz)


def test_cases_are_reproducible_and_cover_the_space():
    cases = [fuzz.draw(3, index) for index in range(200)]
    assert cases == [fuzz.draw(3, index) for index in range(200)]
    assert {case["entry"] for case in cases} == set(fuzz.ENTRIES)
    assert {case["gate"] for case in cases} == set(fuzz.GATES)
    assert any(case["K"] != case["V"] for case in cases)
    assert any(case["HV"] > case["H"] for case in cases)
    assert any(1 in case.get("lengths", ()) for case in cases)
    for case in cases:
        assert case["K"] in fuzz.DIMS and case["V"] in fuzz.DIMS
        if case["entry"] == "segmented":
            assert case["length"] % (64 * case["segments"]) == 0


def test_a_case_in_its_own_process_reports_one_json_line(tmp_path):
    out = tmp_path / "fuzz.jsonl"
    done = subprocess.run([sys.executable, "tools/fuzz.py", "--seed", "0", "--cases", "2",
                           "--out", str(out)], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [line["index"] for line in lines] == [0, 1]
    assert all(line["status"] == "pass" for line in lines), lines
    assert lines[0]["command"] == "python tools/fuzz.py --seed 0 --index 0"
    assert json.loads(done.stdout.splitlines()[-1])["counts"] == {"pass": 2}


def test_a_wrong_result_is_reported_with_its_errors(monkeypatch):
    monkeypatch.setattr(fuzz, "tolerance", lambda dtype, name: 0.0)  # nothing passes
    result = fuzz.run(fuzz.draw(0, 2), "cpu")
    assert result["status"] == "wrong" and set(result["over"]) == {"o", "state"}


def test_selections_keep_the_matching_draws_and_name_unknown_keys():
    cases = [fuzz.draw(0, index) for index in range(200)]
    chosen = [c for c in cases if fuzz.selected(c, ["dtype=bfloat16", "K=192,256"])]
    assert chosen and all(c["dtype"] == "bfloat16" and c["K"] in (192, 256) for c in chosen)
    assert len(chosen) == sum(c["dtype"] == "bfloat16" and c["K"] in (192, 256) for c in cases)
    with pytest.raises(ValueError, match="'width'"):
        fuzz.selected(cases[0], ["width=3"])


def test_an_error_names_the_kernel_launch_it_came_from():
    class Launcher:  # the shape of Triton's JITFunction.run frame: self.fn and kwargs
        def __init__(self):
            def some_kernel():
                pass

            self.fn = some_kernel

        def run(self, *args, **kwargs):
            raise RuntimeError("out of resources")

    try:
        Launcher().run(BK=256, num_warps=8, x=object())
    except RuntimeError as error:
        site = fuzz.failure_site(error)
    assert site == {"kernel": "some_kernel", "launch": {"BK": 256, "num_warps": 8}}
