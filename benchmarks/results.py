"""Benchmark results as data: every script writes its rows to ``benchmarks/results/<name>.json``
(``--out``) with the environment they were measured in.

A file is ``{"benchmark": name, "environment": {...}, "rows": [...]}``. A row is a plain dict:
``case``, ``library``, ``metric``, ``units``, ``median`` / ``min`` / ``max`` over ``rounds``
values (and the values themselves), plus whatever the script adds (bytes moved, options).
The file is rewritten after every ``add``, so a run cut short keeps the rows it finished.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path

RESULTS_DIR = Path(__file__).resolve().parent / "results"
ROOT = RESULTS_DIR.parents[1]
ENV_RECORDED = ("FLA_DISABLE_BACKEND_DISPATCH", "FLA_FLASH_KDA", "CUDA_VISIBLE_DEVICES")


def default_out(name: str) -> str:
    return str(RESULTS_DIR / f"{name}.json")


def add_arguments(parser: argparse.ArgumentParser, name: str) -> None:
    """``--out`` (default ``benchmarks/results/<name>.json``) and ``--shared-machine``."""
    parser.add_argument("--out", default=default_out(name),
                        help="where the rows go as JSON (default: %(default)s)")  # fmt: skip
    parser.add_argument(
        "--shared-machine", action=argparse.BooleanOptionalAction, default=None,
        help="say whether anything else (tests, another benchmark, another GPU's work) ran "
        "on this machine during the run; recorded in the file's environment (null if unsaid)",
    )  # fmt: skip


def _version(distribution: str, module: str) -> str | None:
    """The installed distribution's version, else the module's ``__version__``, where the
    module can be found; None where it cannot."""
    if importlib.util.find_spec(module) is None:
        return None
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        pass
    try:
        return getattr(importlib.import_module(module), "__version__", "unknown")
    except Exception as error:  # an importable spec that fails to import
        return f"import fails: {error!r}"


def _flash_kda() -> dict | None:
    """FlashKDA's version where ``flash_kda`` is importable: an installed distribution's, or
    (a source tree built in place, as FlashKDA's README builds it) the commit recorded in a
    ``SOURCES.json`` beside the tree or the tree's git commit."""
    spec = importlib.util.find_spec("flash_kda")
    if spec is None or not spec.origin:
        return None
    package = Path(spec.origin).resolve().parent
    info = {"path": str(package), "version": None}
    for name in ("flash_kda", "flash-kda"):
        try:
            info["version"] = importlib.metadata.version(name)
            return info
        except importlib.metadata.PackageNotFoundError:
            pass
    tree = package.parent
    sources = tree.parent / "SOURCES.json"
    if sources.is_file():
        try:
            info["version"] = json.loads(sources.read_text())["flashkda"]["commit"][:7]
            return info
        except (KeyError, TypeError, ValueError):
            pass
    info["version"] = _git_commit(tree)
    return info


def _git_commit(directory: Path) -> str | None:
    try:
        result = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=directory,
                                capture_output=True, text=True, timeout=10)  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    if result.returncode != 0:
        return None
    return result.stdout.strip() or None


def _kda_ops_source() -> tuple[str | None, str | None]:
    """(the directory ``kda_ops`` imports from, this checkout's commit where that is this
    checkout's package). A tree put first on ``PYTHONPATH`` (an A/B run's branch) gets no
    commit: the checkout's would not be its."""
    spec = importlib.util.find_spec("kda_ops")
    if spec is None or not spec.origin:
        return None, None
    package = Path(spec.origin).resolve().parent
    return str(package), _git_commit(ROOT) if package == ROOT / "kda_ops" else None


def environment(shared_machine: bool | None = None) -> dict:
    """Where and with what the rows were measured."""
    import torch

    gpu = None
    if torch.cuda.is_available():
        properties = torch.cuda.get_device_properties(torch.cuda.current_device())
        gpu = {"name": properties.name, "count": torch.cuda.device_count(),
               "memory_gib": round(properties.total_memory / 2**30, 1),
               "sms": properties.multi_processor_count,
               "capability": list(torch.cuda.get_device_capability())}  # fmt: skip
    kda_ops_path, kda_ops_commit = _kda_ops_source()
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gpu": gpu,
        "shared_machine": shared_machine,
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "triton": _version("triton", "triton"),
            "fla-core": _version("fla-core", "fla"),
            "flash_kda": _flash_kda(),
            "kda-ops": _version("kda-ops", "kda_ops"),
            "kda-ops_path": kda_ops_path,
            "kda-ops_commit": kda_ops_commit,
        },
        "env": {name: os.environ.get(name) for name in ENV_RECORDED},
        "argv": sys.argv,
    }


def row(case: str, library: str, metric: str, values: Sequence[float], units: str,
        **extra) -> dict:  # fmt: skip
    """One measured quantity: its median, min and max over ``values`` (one per round)."""
    values = [float(value) for value in values]
    if not values:
        raise ValueError(f"row {case!r} / {library!r} / {metric!r} has no values")
    return {
        "case": case, "library": library, "metric": metric, "units": units,
        "median": statistics.median(values), "min": min(values), "max": max(values),
        "rounds": len(values), "values": values, **extra,
    }  # fmt: skip


class Results:
    """The rows of one run, written to ``path`` (with the environment) after each ``add``."""

    def __init__(self, name: str, path: str | os.PathLike,
                 shared_machine: bool | None = None) -> None:  # fmt: skip
        self.name, self.path = name, Path(path)
        self.environment = environment(shared_machine)
        self.rows: list[dict] = []

    @classmethod
    def from_args(cls, name: str, args: argparse.Namespace) -> Results:
        """From the ``--out`` and ``--shared-machine`` of :func:`add_arguments`."""
        return cls(name, args.out, args.shared_machine)

    def add(self, rows: dict | Iterable[dict]) -> None:
        self.rows.extend([rows] if isinstance(rows, dict) else rows)
        self.write()

    def write(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        data = {"benchmark": self.name, "environment": self.environment, "rows": self.rows}
        partial = self.path.with_name(self.path.name + ".partial")
        partial.write_text(json.dumps(data, indent=1, default=str) + "\n")
        partial.replace(self.path)


def load(path: str | os.PathLike) -> dict:
    """A results file as written by :class:`Results`."""
    data = json.loads(Path(path).read_text())
    if not isinstance(data, dict) or "rows" not in data:
        raise ValueError(f"{path} is not a benchmark results file (no 'rows')")
    return data
