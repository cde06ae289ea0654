"""Run transformers' own model tests with and without ``kda_ops.integrations.enable()``.

For each model, its test file (``tests/models/<model>/test_modeling_<model>.py``) runs
twice, each run in a pytest process of its own: unpatched (transformers as installed) and
patched (a plugin calls ``kda_ops.integrations.enable()`` before the test modules are
imported, so every model file that holds a delta rule is swapped as it loads). The
contract is that no test fails patched where it passes unpatched; the JSON lists, per
model, the counts of both runs (passed / failed / skipped / errors), every failure with its
exception type and first message line, the swaps in force during the patched run, and the
tests that fail in one run only.

``--tests DIR`` is an assembly of transformers' test files (measured, never vendored here);
the tests are run from ``DIR`` as transformers' CI runs them from its repository root:

- ``DIR/tests/``: ``test_modeling_common.py`` and the other ``tests/*.py`` (the sdist of
  the installed release holds them: ``pip download --no-binary :all: --no-deps
  transformers==X``), ``causal_lm_tester.py``, ``generation/test_utils.py``,
  ``exporters/``, ``utils/test_configuration_utils.py`` and ``utils/tiny_model_summary.json``,
  ``models/__init__.py`` and ``models/<model>/{__init__.py, test_modeling_<model>.py}``;
- ``DIR/utils/test_module/`` (``tests/utils/test_configuration_utils.py`` imports it);
- ``DIR/src/transformers``: a link to the installed package (``test_pipeline_mixin.py``
  reads the source tree there);
- ``DIR/SOURCES.json`` (optional): where each file came from; copied into the results.

The test modules import ``parameterized`` (and, for ``--test-timeout``, pytest-timeout is
used when installed); put them on ``PYTHONPATH``. Tests that need a GPU, the network or
packages that are not installed skip or fail in both runs alike and are counted as they
fall.

Usage, from the repository root::

    python tools/transformers_suite.py --tests /path/to/assembly \
        --json benchmarks/results/transformers_suite.json [--model qwen3_5 ...] [-- PYTEST_ARGS]
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.metadata
import importlib.util
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional

import pytest
from pytest_reports import FailureCapture, last_error_line, skip_reason, split_at_dashes

REPO = Path(__file__).resolve().parents[1]
FORMAT = "kda-ops/transformers_suite/1"
MODES = ("unpatched", "patched")
# The models kda-ops is tested with whose transformers test files the suite runs by default.
MODELS = ("qwen3_5", "qwen3_5_moe", "olmo_hybrid", "qwen3_next", "kimi_linear")
OUTCOMES = ("passed", "failed", "skipped", "errors")
SWITCHES = ("RUN_SLOW", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")


def test_file(model: str) -> str:
    """The test file of ``model``, relative to the assembly."""
    return f"tests/models/{model}/test_modeling_{model}.py"


def check_assembly(tests: Path, models: Sequence[str]) -> None:
    """Raise ``SystemExit`` naming what the assembly lacks."""
    needed = ["tests/__init__.py", "tests/test_modeling_common.py", "tests/causal_lm_tester.py",
              "tests/generation/test_utils.py", "src/transformers/__init__.py",
              *(test_file(model) for model in models)]  # fmt: skip
    missing = [path for path in needed if not (tests / path).is_file()]
    if missing:
        raise SystemExit(f"transformers_suite: {tests} lacks {', '.join(missing)}")


# ---------------------------------------------------------------------------
# one pytest process (the child)


class ChildResult:
    """What one pytest process reports, rewritten after every test (atomically), so that a
    process killed for overrunning ``--timeout`` leaves its results so far and the test it
    was running."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.doc: dict[str, Any] = {"exit_code": None, "seconds": None, "collected": None,
                                    "running": None, "nodes": {}, "collect_errors": []}  # fmt: skip
        self.sources: list[Any] = []  # callables returning more keys (the patched run's)

    def flush(self) -> None:
        for source in self.sources:
            self.doc.update(source())
        scratch = self.path.with_name(self.path.name + ".tmp")
        scratch.write_text(json.dumps(self.doc) + "\n")
        os.replace(scratch, self.path)


class Recorder(FailureCapture):
    """Every test's outcome, merged over its reports (setup, call with its subtests,
    teardown): an error in setup or teardown is an error, a failed call or subtest a
    failure, a skip a skip."""

    def __init__(self, result: ChildResult) -> None:
        self.result = result
        self.nodes: dict[str, dict[str, Any]] = result.doc["nodes"]
        self.collect_errors: list[dict[str, str]] = result.doc["collect_errors"]

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        self.result.doc["collected"] = len(session.items)
        self.result.flush()

    def pytest_runtest_logstart(self, nodeid: str, location: Any) -> None:
        self.result.doc["running"] = nodeid
        self.result.flush()

    def pytest_runtest_logfinish(self, nodeid: str, location: Any) -> None:
        self.result.doc["running"] = None
        self.result.flush()

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        node = self.nodes.setdefault(report.nodeid, {"outcome": "passed", "duration": 0.0})
        node["duration"] = round(node["duration"] + report.duration, 3)
        if node["outcome"] in ("failed", "errors"):
            return
        if report.failed:
            kind, message = getattr(report, "suite_failure", (None, ""))
            if kind is None:  # a subtest's report carries no exception of its own
                kind, message = "Error", last_error_line(report.longreprtext)
            outcome = "failed" if report.when == "call" else "errors"
            node.update(outcome=outcome, type=kind, message=message, phase=report.when)
            node.pop("reason", None)
        elif report.skipped and node["outcome"] == "passed":
            node.update(outcome="skipped", reason=skip_reason(report))

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        if report.failed:
            error = last_error_line(report.longreprtext)
            self.collect_errors.append({"node": report.nodeid, "error": error})


class Patch:
    """``kda_ops.integrations.enable()`` at configure time, before any test module (and so
    any transformers model file it imports) is loaded; the swaps in force are read at the
    end of the session.

    The ``kda_ops`` functions the swapped-in code calls are wrapped to count their eager
    calls, the evidence that the patched run ran kda-ops (calls traced by
    ``torch.compile`` are not counted: the count is skipped while compiling, so the traced
    graph is the unwrapped one's)."""

    COUNTED = ("chunk_kda", "fused_recurrent_kda", "causal_conv1d", "causal_conv1d_update",
               "gated_rms_norm")  # fmt: skip

    def __init__(self) -> None:
        self.calls: Counter = Counter()

    def pytest_configure(self, config: pytest.Config) -> None:
        import kda_ops
        import kda_ops.integrations

        for name in self.COUNTED:
            setattr(kda_ops, name, self.counting(name, getattr(kda_ops, name)))
        kda_ops.integrations.enable()

    def counting(self, name: str, function: Any) -> Any:
        import torch

        @functools.wraps(function)
        def counted(*args: Any, **kwargs: Any) -> Any:
            if not torch.compiler.is_compiling():
                self.calls[name] += 1
            return function(*args, **kwargs)

        return counted

    @pytest.hookimpl(tryfirst=True)
    def pytest_collection_finish(self, session: pytest.Session) -> None:
        # The calls so far are enable()'s probes of the model files the test modules
        # imported; only the tests' own calls count.
        self.calls.clear()

    def snapshot(self) -> dict[str, Any]:
        """The swaps in force, the files left alone, the calls counted, kda_ops' origin."""
        import kda_ops
        import kda_ops.integrations

        return {
            "swaps": [swap.__dict__ for swap in kda_ops.integrations.patched()],
            "unrecognised": kda_ops.integrations.unrecognised(),
            "kda_calls": dict(sorted(self.calls.items())),
            "kda_ops": {"path": str(Path(kda_ops.__file__).resolve().parent),
                        "version": getattr(kda_ops, "__version__", None)},
        }  # fmt: skip


def run_child(args: argparse.Namespace, extra: Sequence[str]) -> int:
    """Run one model's test file in this process, writing ``args.child_json`` as it goes."""
    result = ChildResult(args.child_json)
    plugins: list[object] = [Recorder(result)]
    if args.mode == "patched":
        patch = Patch()
        plugins.append(patch)
        result.sources.append(patch.snapshot)
    arguments = ["-p", "no:cacheprovider", "-q", "--rootdir", str(args.tests), "-c", os.devnull]
    if args.test_timeout and importlib.util.find_spec("pytest_timeout") is not None:
        arguments += ["--timeout", str(args.test_timeout)]
    start = time.monotonic()
    os.chdir(args.tests)
    code = int(pytest.main([*arguments, *extra, test_file(args.model[0])], plugins=plugins))
    result.doc.update(exit_code=code, seconds=round(time.monotonic() - start, 1))
    result.flush()
    return code


# ---------------------------------------------------------------------------
# the parent: two processes per model, the comparison, the report


def environment() -> dict[str, Any]:
    """Versions and machine; kda_ops' own origin is filled in from a patched run."""
    versions = {"python": platform.python_version()}
    for package in ("torch", "transformers", "parameterized", "pytest"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            versions[package] = importlib.metadata.version(package)
    versions["machine"] = f"{platform.machine()}, {os.cpu_count()} CPUs"
    return versions


def kda_ops_origin(run: dict[str, Any]) -> Optional[dict[str, Any]]:
    """Where the patched run imported kda_ops from, with this checkout's commit when it
    is this checkout's package (a tree put first on ``PYTHONPATH`` is not)."""
    origin = run.get("kda_ops")
    if origin is None:
        return None
    commit = None
    if Path(origin["path"]) == REPO / "kda_ops":
        head = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=REPO,
                              capture_output=True, text=True)  # fmt: skip
        commit = head.stdout.strip() if head.returncode == 0 else None
    return {**origin, "commit": commit}


def summarize(run: dict[str, Any]) -> dict[str, Any]:
    """Counts, failures and errors by node id, skip reasons by count."""
    counts = Counter({outcome: 0 for outcome in OUTCOMES})
    failures: dict[str, dict[str, Any]] = {}
    skips: Counter = Counter()
    for nodeid, node in run["nodes"].items():
        counts[node["outcome"]] += 1
        if node["outcome"] in ("failed", "errors"):
            failures[nodeid] = {key: node.get(key) for key in ("outcome", "type", "message",
                                                               "phase")}  # fmt: skip
        elif node["outcome"] == "skipped":
            skips[node.get("reason", "")] += 1
    summary = {
        "counts": dict(counts),
        "exit_code": run["exit_code"],
        "seconds": run["seconds"],
        "collect_errors": run["collect_errors"],
        "failures": dict(sorted(failures.items())),
        "skip_reasons": dict(skips.most_common()),
    }
    for key in ("collected", "swaps", "unrecognised", "kda_calls", "kda_ops", "note"):
        if key in run:
            summary[key] = run[key]
    return summary


def compare(runs: dict[str, dict[str, Any]]) -> dict[str, list[str]]:
    """The node ids that fail (or error) in one run and pass or skip in the other, those
    that fail in one run and have no result in the other (a killed process), and every
    outcome that differs."""
    unpatched, patched = runs["unpatched"]["nodes"], runs["patched"]["nodes"]
    bad = {"failed", "errors"}

    def outcome(nodes: dict[str, Any], nodeid: str) -> Optional[str]:
        return nodes[nodeid]["outcome"] if nodeid in nodes else None

    both = sorted(set(unpatched) | set(patched))
    return {
        "patched_only_failures": [
            n for n in both
            if outcome(patched, n) in bad and outcome(unpatched, n) in ("passed", "skipped")
        ],
        "unpatched_only_failures": [
            n for n in both
            if outcome(unpatched, n) in bad and outcome(patched, n) in ("passed", "skipped")
        ],
        "failures_without_counterpart": [
            n for n in both
            if None in (outcome(patched, n), outcome(unpatched, n))
            and bad & {outcome(patched, n), outcome(unpatched, n)}
        ],
        "outcome_changes": [
            f"{n}: {outcome(unpatched, n)} -> {outcome(patched, n)}" for n in both
            if outcome(unpatched, n) != outcome(patched, n)
        ],
    }  # fmt: skip


def run_mode(
    args: argparse.Namespace, model: str, mode: str, scratch: Path, extra: Sequence[str]
) -> dict[str, Any]:
    """One pytest process for ``model`` in ``mode``; a process that dies or overruns
    ``--timeout`` keeps what it reported before (nothing: the child writes at the end) and
    says so in ``note``."""
    child_json = scratch / f"{model}.{mode}.json"
    command = [sys.executable, str(Path(__file__).resolve()), "--tests", str(args.tests),
               "--model", model, "--child-mode", mode, "--child-json", str(child_json),
               "--test-timeout", str(args.test_timeout), "--", *extra]  # fmt: skip
    log_path = (
        scratch / f"{model}.{mode}.log"
        if args.logs is None
        else args.logs / (f"{model}.{mode}.log")
    )
    print(f"transformers_suite: {model} {mode} ...", flush=True)
    start = time.monotonic()
    with (
        log_path.open("w") as log,
        subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=child_env()
        ) as process,
    ):
        try:
            code, timed_out = process.wait(timeout=args.timeout), False
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            code, timed_out = process.wait(), True
    seconds = round(time.monotonic() - start, 1)
    print(f"transformers_suite: {model} {mode}: exit {code} in {seconds} s (log {log_path})",
          flush=True)  # fmt: skip
    run: dict[str, Any] = {"exit_code": code, "seconds": seconds, "collected": None,
                           "running": None, "nodes": {}, "collect_errors": []}  # fmt: skip
    if child_json.is_file():
        run.update(json.loads(child_json.read_text()))
    if run["exit_code"] is None or timed_out:  # killed or crashed before the end
        why = (f"killed after {args.timeout:.0f} s (--timeout)" if timed_out
               else f"exited with code {code}")  # fmt: skip
        if run["running"] is not None:
            run["nodes"][run["running"]] = {
                "outcome": "failed", "type": "Timeout" if timed_out else "ProcessCrash",
                "message": f"the process was {why} while this test ran", "phase": "call",
            }  # fmt: skip
        not_run = (run["collected"] or 0) - len(run["nodes"])
        note = f"the process was {why}; {not_run} collected test(s) did not run"
        run.update(exit_code=code, seconds=seconds, note=note)
    return run


def child_env() -> dict[str, str]:
    """kda_ops importable from this checkout, after the assembly's own ``tests`` package
    (pytest puts the assembly first on ``sys.path``; kda-ops has a ``tests`` package too)."""
    env = dict(os.environ)
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if str(REPO) not in paths:
        env["PYTHONPATH"] = os.pathsep.join([*paths, str(REPO)])
    return env


def run_parent(args: argparse.Namespace, extra: Sequence[str]) -> int:
    check_assembly(args.tests, args.model)
    sources = args.tests / "SOURCES.json"
    doc: dict[str, Any] = {
        "format": FORMAT,
        "tests_dir": str(args.tests),
        "sources": json.loads(sources.read_text()) if sources.is_file() else None,
        "pytest_args": list(extra),
        "test_timeout_s": args.test_timeout,
        # transformers' switches that decide which tests run (RUN_SLOW) and whether the hub
        # is tried (offline: tests that download fail at once instead of timing out).
        "switches": {name: os.environ.get(name) for name in SWITCHES},
        "environment": environment(),
        "models": {},
    }
    if args.json is not None and args.json.is_file() and args.append:
        doc["models"] = json.loads(args.json.read_text()).get("models", {})
    with tempfile.TemporaryDirectory(prefix="transformers_suite_") as scratch_dir:
        scratch = Path(scratch_dir)
        for model in args.model:
            runs = {mode: run_mode(args, model, mode, scratch, extra) for mode in MODES}
            if doc["environment"].get("kda_ops") is None:
                doc["environment"]["kda_ops"] = kda_ops_origin(runs["patched"])
            entry = {"file": test_file(model)}
            entry.update({mode: summarize(run) for mode, run in runs.items()})
            entry.update(compare(runs))
            doc["models"][model] = entry
            if args.json is not None:
                args.json.parent.mkdir(parents=True, exist_ok=True)
                args.json.write_text(json.dumps(doc, indent=1) + "\n")
    print_table(doc)
    return 1 if any(entry["patched_only_failures"] for entry in doc["models"].values()) else 0


def print_table(doc: dict[str, Any]) -> None:
    """Per model and run: the counts (and, patched, the swaps in force and the eager calls
    of kda_ops they made); then the tests that fail in one run only."""
    header = " ".join(f"{o:>7}" for o in OUTCOMES)
    print(f"\n{'model':<13} {'run':<10} {header}  swaps  kda calls")
    for model, entry in doc["models"].items():
        for mode in MODES:
            run = entry[mode]
            counts = " ".join(f"{run['counts'][o]:>7}" for o in OUTCOMES)
            patched = ""
            if mode == "patched":
                patched = (
                    f"{len(run.get('swaps', [])):>5}  {sum(run.get('kda_calls', {}).values())}"
                )
            print(f"{model:<13} {mode:<10} {counts}  {patched}")
        for key in ("patched_only_failures", "unpatched_only_failures"):
            for nodeid in entry[key]:
                mode = "patched" if key.startswith("patched") else "unpatched"
                failure = entry[mode]["failures"][nodeid]
                print(f"  {key[:-1]}: {nodeid.split('::', 1)[1]}: {failure['type']}: "
                      f"{failure['message']}"[:170])  # fmt: skip


def parse_arguments(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    argv, extra = split_at_dashes(argv)
    parser = argparse.ArgumentParser(
        description="Run transformers' model tests unpatched and with kda_ops.integrations.",
        epilog="Arguments after `--` go to pytest (e.g. -k generate).",
    )
    parser.add_argument(
        "--tests",
        type=Path,
        required=True,
        help="the assembly of transformers' test files (see the module doc)",
    )
    parser.add_argument(
        "--model",
        action="append",
        choices=None,
        help=f"a model's directory name (repeatable; default: {', '.join(MODELS)})",
    )
    parser.add_argument("--json", type=Path, help="where to write the results")
    parser.add_argument(
        "--append", action="store_true", help="keep the other models already in --json"
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=900.0,
        help="seconds before a pytest process is killed (default 900)",
    )
    parser.add_argument(
        "--test-timeout",
        type=int,
        default=300,
        help="seconds per test with pytest-timeout installed (0: none)",
    )
    parser.add_argument("--logs", type=Path, help="folder for each pytest process's output")
    parser.add_argument("--child-mode", choices=MODES, dest="mode", help=argparse.SUPPRESS)
    parser.add_argument("--child-json", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)  # fmt: skip
    args.tests = args.tests.resolve()
    args.model = args.model or list(MODELS)
    for model in args.model:
        if not model.isidentifier():
            parser.error(f"--model {model!r} is not a transformers model directory name")
    if args.json is not None:
        args.json = args.json.resolve()
    if args.logs is not None:
        args.logs = args.logs.resolve()
        args.logs.mkdir(parents=True, exist_ok=True)
    return args, extra


def main(argv: Optional[Sequence[str]] = None) -> int:
    args, extra = parse_arguments(sys.argv[1:] if argv is None else argv)
    if args.mode is not None:
        return run_child(args, extra)
    return run_parent(args, extra)


if __name__ == "__main__":
    sys.exit(main())
