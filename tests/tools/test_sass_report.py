"""``tools/sass_report.py``: the static sm_90 report of a kernel as launched (CPU)."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SPEC = importlib.util.spec_from_file_location("sass_report", ROOT / "tools" / "sass_report.py")
sass_report = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(sass_report)


@pytest.mark.parametrize(
    "opcode, modifiers, expected",
    [("LDSM", ".16.M88.4", 16), ("STSM", ".16.M88.2", 8), ("LDSM", ".16.MT88", 4),
     ("LDS", ".128", 16), ("STS", ".64", 8), ("LDS", "", 4), ("LDS", ".U16", 4)],
)  # fmt: skip
def test_shared_bytes(opcode, modifiers, expected):
    assert sass_report.shared_bytes(opcode, modifiers) == expected


def test_resource_usage():
    """Spills are read from the stack frame (ptxas's), not from cuobjdump's LOCAL, which
    stays 0 for them (this line is the recurrence's at 128 value columns, sm_90)."""
    line = ("Function chunk_recurrence_kernel:\n  REG:255 STACK:192 SHARED:1024 LOCAL:0 "
            "CONSTANT[0]:672 TEXTURE:0 SURFACE:0 SAMPLER:0")  # fmt: skip
    assert sass_report.resource_usage(line) == {"reg": 255, "stack": 192}


def test_report_of_the_forward_prepare():
    """The forward's prepare kernel as launched, compiled in a process without the
    interpreter: its counts add up, and its layout conversions show by source line; it
    does not spill."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = (
        "import json, sys; sys.path.insert(0, 'tools'); import sass_report as s; "
        "print(json.dumps(s.report(*s.compile_cubin(*s.variants()['chunk_prepare_kernel/all']))))"
    )
    result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=300)  # fmt: skip
    assert result.returncode == 0, result.stderr
    found = json.loads(result.stdout.splitlines()[-1])
    assert 0 < found["registers"] <= 255
    assert found["stack_bytes"] == 0 and found["spill_instructions"] == 0
    assert found["instructions"] == sum(found["opcodes"].values())
    assert found["barriers"] == found["opcodes"]["BAR"] > 0
    lines = found["by_line"].values()
    assert found["shared_bytes_a_thread"] == sum(line["shared_bytes"] for line in lines) > 0
    assert found["barriers"] == sum(line["barriers"] for line in lines)
    assert any(where.startswith("prepare.py:") for where in found["by_line"])
