"""``benchmarks/transformers_models.py`` on the CPU: its arguments, the messages when what it
needs is missing, every family built and timed through the kda-ops path at the tests' tiny
sizes (``--tiny --device cpu --backend aot_eager``), and the time budget."""

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "transformers_models.py"
sys.path.insert(0, str(ROOT / "benchmarks"))
import transformers_models  # noqa: E402

FAMILIES = list(transformers_models.FAMILIES)
FAST = "qwen3_5"  # the quickest tiny family to compile: the one the default run times


def run_script(*args: str, blocked: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """``python SCRIPT *args`` in a process of its own, where the ``blocked`` modules fail to
    import (a ``None`` in ``sys.modules``: Python's mark of a module that cannot be
    imported)."""
    code = (
        "import runpy, sys\n"
        f"for name in {list(blocked)!r}:\n"
        "    sys.modules[name] = None\n"
        f"sys.argv = [{str(SCRIPT)!r}, *{list(args)!r}]\n"
        f"sys.path.insert(0, {str(SCRIPT.parent)!r})\n"  # as `python SCRIPT` puts it
        f"runpy.run_path({str(SCRIPT)!r}, run_name='__main__')\n"
    )
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=900)  # fmt: skip


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--rounds", "0"], "--rounds: must be positive"),
        (["--budget-s", "-5"], "--budget-s: must be positive"),
        (["--batches", "1", "x"], "--batches: invalid"),
        (["--model", "mamba"], "--model: invalid choice"),
        (["--paths", "flashkda"], "--paths: invalid choice"),
        (["--quick", "--tiny"], "--quick and --tiny"),
        (["--mode", "max-autotune", "--backend", "aot_eager"], "--mode is for"),
    ],
)
def test_bad_arguments_name_the_argument(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        transformers_models.parse_args(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_defaults_time_three_paths_at_the_issue_sizes():
    s = transformers_models.settings(transformers_models.parse_args(["--device", "cuda"]))
    assert s.paths == ("fla", "torch.compile", "kda-ops")
    assert (s.hidden, s.batches, s.prefill_len, s.prompt_len) == (2048, (1, 64), 8192, 512)
    assert s.deadline is None


def test_cpu_drops_the_fla_paths_and_says_so(capsys):
    args = transformers_models.parse_args(["--device", "cpu", "--paths", "fla", "kda-ops"])
    assert transformers_models.settings(args).paths == ("kda-ops",)
    assert "not timed: fla" in capsys.readouterr().out
    only_fla = transformers_models.parse_args(["--device", "cpu", "--paths", "fla"])
    with pytest.raises(SystemExit, match="no path left"):
        transformers_models.settings(only_fla)


def test_missing_fla_and_family_are_named_in_one_message(tmp_path):
    """FLA and a family that do not import: the run stops before building anything, with
    one message naming both (and the GPU where there is none)."""
    out = tmp_path / "rows.json"
    result = run_script("--model", "qwen3_5", "olmo_hybrid", "--out", str(out),
                        blocked=("fla", "transformers.models.olmo_hybrid"))  # fmt: skip
    assert result.returncode == 1, result.stderr
    message = result.stderr.strip().splitlines()[-1]
    assert message.startswith("transformers_models.py needs ")
    assert "fla-core for the fla/torch.compile rows" in message
    assert "model family 'olmo_hybrid', which transformers 5.24.0 does not provide" in message
    assert "'qwen3_5'" not in message
    assert not out.exists()


@pytest.mark.parametrize(
    "family",
    [pytest.param(f, marks=() if f == FAST else pytest.mark.slow) for f in FAMILIES],
)
def test_tiny_family_on_cpu_writes_every_case(family, tmp_path):
    out = tmp_path / "rows.json"
    result = run_script("--tiny", "--device", "cpu", "--backend", "aot_eager", "--paths",
                        "kda-ops", "--model", family, "--batches", "1", "2",
                        "--out", str(out))  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    data = json.loads(out.read_text())
    environment = data["environment"]
    assert "errors" not in environment, environment["errors"]
    assert environment["settings"]["paths"] == ["kda-ops"]
    assert environment["settings"]["backend"] == "aot_eager"
    assert environment["versions"]["transformers"] == "5.24.0"
    # transformers' delta rules, bound to FLA or to its own PyTorch fallback where FLA is
    # not installed: the bindings say which.
    assert any("delta" in name for name in environment["bindings"][family])
    assert environment["configs"][family]["vocab_size"] == 128  # the tests' tiny config
    cases = {row["case"]: row for row in data["rows"]}
    assert set(cases) == {
        f"{family} prefill B=1 T=32", f"{family} decode B=1 after 8",
        f"{family} prefill B=2 T=8", f"{family} decode B=2 after 8",
    }  # fmt: skip
    for case, row in cases.items():
        assert row["library"] == "kda-ops"
        assert row["rounds"] == 1 and row["median"] > 0
        assert row["units"] == ("tokens/s" if "prefill" in case else "ms")
        assert "replaced by 'aot_eager'" in row["path"]
    assert f"| {family} decode B=2 after 8 | ms |" in result.stdout


def test_budget_stops_the_run_inside_it(tmp_path):
    """A budget far shorter than the run stops it inside the budget, and the file says where:
    the alarm wherever the run is (a compile, most likely), or, where a case ends between
    0.9 of the budget and the budget, the deadline before the next case. Without either this
    run takes a minute or more."""
    out = tmp_path / "rows.json"
    budget = 8.0
    start = time.monotonic()
    result = run_script("--tiny", "--device", "cpu", "--backend", "aot_eager", "--paths",
                        "kda-ops", "--model", "kimi_linear", "--budget-s", str(budget),
                        "--out", str(out))  # fmt: skip
    elapsed = time.monotonic() - start
    assert result.returncode == 0, result.stderr[-3000:]
    data = json.loads(out.read_text())
    stopped = data["environment"]["stopped"]
    assert stopped in result.stdout
    assert stopped in ("budget of 8.0 s spent during kimi_linear",
                       "budget of 8.0 s: no more cases of kimi_linear")  # fmt: skip
    assert data["environment"]["settings"]["budget_s"] == budget
    # The budget runs from the script's start; importing torch and transformers comes first.
    assert elapsed < budget + 20
