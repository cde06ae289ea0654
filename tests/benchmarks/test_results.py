"""``benchmarks/results.py``: what a results file records of the code it timed (CPU)."""

import importlib.util
import subprocess
import sys
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import results  # noqa: E402


def test_this_checkouts_package_records_its_commit():
    head = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=ROOT,
                          capture_output=True, text=True)  # fmt: skip
    versions = results.environment()["versions"]
    assert versions["kda-ops_path"] == str((ROOT / "kda_ops").resolve())
    assert versions["kda-ops_commit"] == (head.stdout.strip() if head.returncode == 0 else None)


def test_a_tree_from_elsewhere_records_its_path_and_no_commit(tmp_path, monkeypatch):
    """An A/B run's branch put first on PYTHONPATH: the checkout's commit is not its."""
    origin = tmp_path / "trees" / "branch" / "kda_ops" / "__init__.py"
    real_find_spec = importlib.util.find_spec

    def find_spec(name, *args):
        if name == "kda_ops":
            return types.SimpleNamespace(origin=str(origin))
        return real_find_spec(name, *args)

    monkeypatch.setattr(results.importlib.util, "find_spec", find_spec)
    versions = results.environment()["versions"]
    assert versions["kda-ops_path"] == str(origin.parent.resolve())
    assert versions["kda-ops_commit"] is None
