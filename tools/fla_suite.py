"""Run flash-linear-attention's own KDA and Gated DeltaNet op tests against kda_ops.

FLA's ``tests/ops/test_kda.py`` and ``tests/ops/test_gdn.py`` and FLA's
``tests/conftest.py`` are read from ``--tests DIR``, an extraction at the FLA commit named
in ``DIR/COMMIT`` (the tests are measured, never vendored). The conftest fills with NaN
every ``torch.empty`` made by code whose call stack reaches a module named ``*fla*``
before the test file: FLA's, and kda_ops' own when it runs under a wrapper of
``kda_ops.integrations.fla``. The tests import the functions under test by name
(``from fla.ops.kda import chunk_kda``). With ``--backend kda`` a pytest plugin calls
``kda_ops.integrations.enable(["fla"])`` once the test modules are imported: that swaps
FLA's functions in every loaded module that holds them, the test modules included, for
kda_ops' FLA-compatible ones. FLA's naive references (``naive_*``) stay FLA's: they are
the oracles. ``--backend fla`` runs the same tests on FLA itself, the baseline.

Before FLA is imported, the switches that soften or skip FLA's cases are removed
(``FLA_CI_ENV`` turns tolerance failures into warnings; ``FLA_CACHE_MODE`` and
``SKIP_TEST_CHUNK_VARLEN`` skip cases) and ``FLA_DISABLE_BACKEND_DISPATCH=1`` is set: FLA's
functions are then its Triton ones rather than FlashKDA / FlashQLA / TileLang dispatchers,
and the GQA cases FLA skips for TileLang run. Test functions that measure FLA itself (its
other backends and internal helpers) are deselected unless ``--include-excluded`` is
given. ``--device cpu`` makes the tests' tensors on the CPU, a quick check of kda_ops'
CPU path on a machine without a GPU.

Every test's outcome goes to the ``--json`` file, rewritten after each test: per test
function the passed / failed / skipped counts and, for each failure, the exception type
and the first line of its message; a table of the same goes to stdout. ``--isolate`` runs
every test function's cases in a subprocess of their own, and re-runs them one per
subprocess from the first CUDA fault (or crash) on, so a fault that poisons a process
cannot hide the other results. ``--jobs N`` runs the selected cases in N subprocesses
at once (each function's cases dealt round-robin over them, so every process compiles a
share of the slow chunk cases) and merges their results; on a GPU machine the cases are
bound by kernel compilation on the CPU, so N up to the core count pays.

Usage, from the repository root, with fla-core and einops on ``PYTHONPATH``::

    python tools/fla_suite.py --tests .scratch/fla_suite --backend kda \
        --json fla_kda.json [--isolate | --jobs N] [-- PYTEST_ARGS...]
"""

from __future__ import annotations

import argparse
import contextlib
import fnmatch
import inspect
import json
import os
import platform
import re
import signal
import subprocess
import sys
import tempfile
import time
import types
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Optional

import pytest
from pytest_reports import (
    FailureCapture,
    first_line,
    last_error_line,
    skip_reason,
    split_at_dashes,
)

REPO = Path(__file__).resolve().parents[1]
TEST_FILES = ("test_kda.py", "test_gdn.py")
FORMAT = "kda-ops/fla_suite/1"

# Test functions (node-id patterns, rootdir-relative) that measure FLA rather than the
# functions kda_ops swaps in; deselected by default.
EXCLUDED: dict[str, str] = {
    "tests/ops/test_kda.py::test_naive_chunk": (
        "FLA's naive chunk reference against its naive recurrent one (no swapped function)"
    ),
    "tests/ops/test_kda.py::test_flash_kda_*": "FLA's FlashKDA backend (flash_kda package)",
    "tests/ops/test_kda.py::test_triton_ascend_*": "FLA's Triton-Ascend (NPU) backend routing",
    "tests/ops/test_gdn.py::test_chunk_gated_delta_rule_fwd_h_blackwell_*": (
        "autotune configs of an FLA-internal kernel"
    ),
    "tests/ops/test_gdn.py::test_prepare_wy_repr_bwd_no_g": "FLA-internal WY helpers",
    "tests/ops/test_gdn.py::test_flash_qla_*": "FLA's FlashQLA backend (flash_qla package)",
}

# Failures after which the rest of a process's CUDA context cannot be trusted.
CUDA_FAULT = re.compile(
    r"AcceleratorError|CUDA error|illegal memory access|device-side assert|"
    r"unspecified launch failure|misaligned address|illegal instruction|"
    r"CUDA driver error|cudaError|CUBLAS_STATUS_EXECUTION_FAILED",
    re.IGNORECASE,
)
# FLA switches that soften failures into warnings (FLA_CI_ENV) or skip cases
# (FLA_CACHE_MODE=default/full/always skips varlen D=64/256, SKIP_TEST_CHUNK_VARLEN).
SKIPPING_SWITCHES = ("FLA_CI_ENV", "FLA_CACHE_MODE", "SKIP_TEST_CHUNK_VARLEN")


def function_key(nodeid: str) -> str:
    """``tests/ops/test_kda.py::test_chunk`` for any of its parametrized node ids."""
    return nodeid.split("[", 1)[0]


def excluded_reason(nodeid: str) -> Optional[str]:
    key = function_key(nodeid)
    for pattern, reason in EXCLUDED.items():
        if fnmatch.fnmatchcase(key, pattern):
            return reason
    return None


def prepare_environment() -> None:
    """FLA's switches, set before FLA is imported (children inherit them); kda_ops
    importable from this checkout."""
    if "fla" in sys.modules:
        raise RuntimeError("fla was imported before its environment was set")
    for name in SKIPPING_SWITCHES:
        os.environ.pop(name, None)
    os.environ["FLA_DISABLE_BACKEND_DISPATCH"] = "1"
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if str(REPO) not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([*paths, str(REPO)])


# ---------------------------------------------------------------------------
# results


def summarize(nodes: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per test function: counts, failures ``{id, type, message}``, skip reasons."""
    functions: dict[str, dict[str, Any]] = {}
    for nodeid, node in nodes.items():
        entry = functions.setdefault(
            function_key(nodeid),
            {"passed": 0, "failed": 0, "skipped": 0, "failures": [], "skip_reasons": {}},
        )
        outcome = node["outcome"]
        entry[outcome] += 1
        if outcome == "failed":
            entry["failures"].append(
                {
                    "id": nodeid[len(function_key(nodeid)) :],
                    "type": node.get("type"),
                    "message": node.get("message"),
                    "phase": node.get("phase"),
                }
            )
        elif outcome == "skipped":
            reason = node.get("reason") or ""
            entry["skip_reasons"][reason] = entry["skip_reasons"].get(reason, 0) + 1
    return functions


class ResultStore:
    """The JSON document; written atomically after every test when it has a path, merged
    into what the file holds when appending (the subprocesses of ``--isolate``)."""

    def __init__(self, path: Optional[Path], header: dict[str, Any], append: bool) -> None:
        self.path = path
        self.doc: dict[str, Any] = {
            "format": FORMAT,
            **header,
            "environment": {},
            "rebinding": {},
            "calls": {},
            "collected": {},
            "excluded": {},
            "collect_errors": [],
            "nodes": {},
        }
        if append and path is not None and path.exists():
            self.doc.update(json.loads(path.read_text()))

    def reload(self) -> None:
        if self.path is not None and self.path.exists():
            self.doc = json.loads(self.path.read_text())

    @property
    def nodes(self) -> dict[str, dict[str, Any]]:
        return self.doc["nodes"]

    def record(self, nodeid: str, node: dict[str, Any]) -> None:
        self.nodes[nodeid] = node
        self.flush()

    def flush(self) -> None:
        self.doc["functions"] = summarize(self.nodes)
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        scratch = self.path.with_name(self.path.name + f".{os.getpid()}.tmp")
        scratch.write_text(json.dumps(self.doc, indent=1, sort_keys=False) + "\n")
        os.replace(scratch, self.path)


def is_cuda_fault(node: dict[str, Any]) -> bool:
    return node.get("outcome") == "failed" and bool(
        CUDA_FAULT.search(f"{node.get('type')}: {node.get('message')}")
    )


class Recorder(FailureCapture):
    """Records every test's outcome (``pytest_runtest_logreport``) into the store."""

    def __init__(self, store: ResultStore) -> None:
        self.store = store
        self.pending: dict[str, dict[str, Any]] = {}

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        node = self.pending.setdefault(report.nodeid, {"outcome": "passed", "duration": 0.0})
        node["duration"] = round(node["duration"] + report.duration, 4)
        if node["outcome"] != "failed":
            if report.failed:
                kind, message = getattr(report, "suite_failure", ("Error", ""))
                if not message and report.longreprtext:
                    message = first_line(report.longreprtext.splitlines()[-1])
                node.update(outcome="failed", type=kind, message=message, phase=report.when)
                node.pop("reason", None)
            elif report.skipped:
                node.update(outcome="skipped", reason=skip_reason(report))
        if report.when == "teardown":
            self.store.record(report.nodeid, self.pending.pop(report.nodeid))

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        if report.failed:
            error = {"node": report.nodeid, "error": last_error_line(report.longreprtext)}
            if error not in self.store.doc["collect_errors"]:  # each subprocess collects
                self.store.doc["collect_errors"].append(error)
                self.store.flush()

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        self.store.doc["environment"] = environment()
        self.store.flush()


def environment() -> dict[str, Any]:
    """Versions and device of this run (FLA, torch are imported by now)."""
    info: dict[str, Any] = {"python": platform.python_version()}
    for name in ("torch", "triton", "fla", "kda_ops"):
        module = sys.modules.get(name)
        info[name] = getattr(module, "__version__", None) if module else None
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        info["device"] = torch.cuda.get_device_name()
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        head = subprocess.run(
            ["git", "-C", str(REPO), "describe", "--always", "--dirty"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        )
        info["kda_ops_commit"] = head.stdout.strip()
    return info


# ---------------------------------------------------------------------------
# selection and rebinding


class Selection:
    """Deselects the excluded test functions (and, in a subprocess of ``--isolate``, every
    node not asked for); writes the selected node ids to ``list_to``."""

    def __init__(
        self,
        store: ResultStore,
        include_excluded: bool,
        only: Optional[set[str]],
        list_to: Optional[Path],
    ) -> None:
        self.store = store
        self.include_excluded = include_excluded
        self.only = only
        self.list_to = list_to

    def pytest_collection_modifyitems(self, config: pytest.Config, items: list) -> None:
        keep, drop = [], []
        excluded: dict[str, dict[str, Any]] = {}
        for item in items:
            reason = None if self.include_excluded else excluded_reason(item.nodeid)
            if reason is not None:
                entry = excluded.setdefault(
                    function_key(item.nodeid), {"reason": reason, "cases": 0}
                )
                entry["cases"] += 1
            if reason is not None or (self.only is not None and item.nodeid not in self.only):
                drop.append(item)
            else:
                keep.append(item)
        self.store.doc["excluded"].update(excluded)
        if drop:
            config.hook.pytest_deselected(items=drop)
            items[:] = keep

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        if self.only is None:  # after -k / -m too
            counts = Counter(function_key(item.nodeid) for item in session.items)
            self.store.doc["collected"] = dict(counts)
            self.store.flush()
        if self.list_to is not None:
            self.list_to.write_text("".join(f"{item.nodeid}\n" for item in session.items))


def fla_callable(value: object) -> bool:
    module = getattr(value, "__module__", None) or ""
    return callable(value) and module.startswith(("fla.ops.", "fla.modules."))


def referenced_names(function: types.FunctionType, module: types.ModuleType) -> set[str]:
    """Global names a test function uses, through nested functions and lambdas and the
    module's own helper functions (``_flash_kda_run`` and the like)."""
    names: set[str] = set()
    seen: set[int] = set()
    work = [inspect.unwrap(function).__code__]
    while work:
        code = work.pop()
        if id(code) in seen:
            continue
        seen.add(id(code))
        names.update(code.co_names)
        work.extend(c for c in code.co_consts if isinstance(c, types.CodeType))
        for name in code.co_names:
            helper = vars(module).get(name)
            if isinstance(helper, types.FunctionType) and helper.__module__ == module.__name__:
                work.append(helper.__code__)
    return names


def describe(value: object) -> str:
    return f"{getattr(value, '__module__', '?')}.{getattr(value, '__qualname__', value)}"


def test_modules(tests_dir: Path) -> list[types.ModuleType]:
    """The loaded modules (test files, conftest) from ``tests_dir/tests``."""
    root = (tests_dir / "tests").resolve()
    found = []
    for module in list(sys.modules.values()):
        path = getattr(module, "__file__", None)
        if path and Path(path).resolve().is_relative_to(root):
            found.append(module)
    return found


class KdaBackend:
    """``--backend kda``: swaps FLA's functions for kda_ops' once the test modules are
    imported, keeps FLA's ``naive_*`` oracles, reports what each test now calls."""

    def __init__(self, store: ResultStore, tests_dir: Path) -> None:
        self.store = store
        self.tests_dir = tests_dir

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        from kda_ops import integrations

        modules = test_modules(self.tests_dir)
        before = {module.__name__: dict(vars(module)) for module in modules}
        integrations.enable(["fla"])
        report: dict[str, Any] = {}
        for module in modules:
            old, now = before[module.__name__], vars(module)
            rebound = sorted(n for n, v in old.items() if n in now and now[n] is not v)
            restored = [n for n in rebound if n.startswith("naive_")]
            for name in restored:  # an oracle must stay FLA's
                setattr(module, name, old[name])
            rebound = [n for n in rebound if n not in restored]
            if not rebound and not restored:
                continue
            report[module.__name__] = {
                "rebound": {n: describe(now[n]) for n in rebound},
                "restored_oracles": restored,
                "still_fla": sorted(n for n, v in now.items() if fla_callable(v)),
            }
        self.store.doc["rebinding"].update(report)
        self.store.doc["calls"].update(self.calls(session.items, report))
        self.store.flush()
        writer = session.config.pluginmanager.get_plugin("terminalreporter")
        lines = [] if report else ["fla_suite: WARNING: nothing rebound in the test modules"]
        for name, entry in report.items():
            lines += [f"fla_suite: {name}.{n} -> {to}" for n, to in entry["rebound"].items()]
            lines.append(f"fla_suite: {name}: FLA's own: {', '.join(entry['still_fla'])}")
            lines += [
                f"fla_suite: {name}: kept FLA's oracle {n}" for n in entry["restored_oracles"]
            ]
        for line in lines:
            if writer is not None:
                writer.write_line(line)
            else:
                print(line)

    @staticmethod
    def calls(items: Iterable[pytest.Item], report: dict[str, Any]) -> dict[str, Any]:
        """Per test function: the FLA-facing names it uses, swapped or still FLA's."""
        calls: dict[str, Any] = {}
        for item in items:
            key = function_key(item.nodeid)
            function, module = getattr(item, "function", None), getattr(item, "module", None)
            if key in calls or function is None or module is None:
                continue
            names = referenced_names(function, module)
            rebound = report.get(module.__name__, {}).get("rebound", {})
            used = sorted(n for n in names if n in rebound or fla_callable(vars(module).get(n)))
            calls[key] = {
                "kda_ops": [n for n in used if n in rebound],
                "fla_oracles": [n for n in used if n not in rebound and n.startswith("naive_")],
                "fla": [n for n in used if n not in rebound and not n.startswith("naive_")],
            }
        return calls

    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        from kda_ops import integrations

        integrations.disable(["fla"])


class CpuDevice:
    """``--device cpu``: the tests make their tensors on the CPU (the ``device`` global of
    the test modules, the conftest's synchronize), to try kda_ops' CPU path on a machine
    without a GPU. FLA's own kernels (``--backend fla``) need a GPU; tests that pin CUDA
    themselves still skip or fail."""

    def __init__(self, tests_dir: Path) -> None:
        self.tests_dir = tests_dir

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        import torch

        for module in test_modules(self.tests_dir):
            if isinstance(vars(module).get("device"), str):
                module.device = "cpu"
            if "device_torch_lib" in vars(module):
                module.device_torch_lib = torch.cpu


# ---------------------------------------------------------------------------
# running


def pytest_arguments(tests_dir: Path, files: Sequence[str], extra: Sequence[str]) -> list[str]:
    """FLA's test files under ``tests_dir`` as rootdir; no project or FLA ini file (FLA's
    ``pythonpath = ["."]`` would import FLA's sources instead of the installed wheel)."""
    paths = []
    for name in files:
        path = tests_dir / "tests" / "ops" / name
        if not path.is_file():
            raise SystemExit(f"fla_suite: {path} not found (extract FLA's tests first)")
        paths.append(str(path))
    return [
        "-c",
        os.devnull,
        "--rootdir",
        str(tests_dir),
        "--confcutdir",
        str(tests_dir),
        "-o",
        "log_level=INFO",
        "-p",
        "no:cacheprovider",
        "-p",
        "no:xdist",
        *paths,
        *extra,
    ]


def header(args: argparse.Namespace) -> dict[str, Any]:
    commit_file = args.tests / "COMMIT"
    commit = commit_file.read_text().strip() if commit_file.is_file() else None
    return {
        "backend": args.backend,
        "device": args.device or "FLA's default",
        "tests_dir": str(args.tests),
        "fla_commit": commit,
    }


def run_in_process(args: argparse.Namespace, extra: Sequence[str]) -> int:
    only = None
    if args.only_nodes is not None:
        only = {line for line in args.only_nodes.read_text().splitlines() if line}
    store = ResultStore(args.json, header(args), append=args.append)
    store.flush()
    plugins: list[object] = [
        Recorder(store),
        Selection(store, args.include_excluded, only, args.list_nodes),
    ]
    if args.backend == "kda":
        plugins.append(KdaBackend(store, args.tests))
    if args.device == "cpu":
        plugins.append(CpuDevice(args.tests))
    code = int(pytest.main(pytest_arguments(args.tests, args.file, extra), plugins=plugins))
    if not args.append:
        print_table(store.doc)
    return code


def child_command(
    args: argparse.Namespace, json_path: Path, options: Sequence[str], extra: Sequence[str]
) -> list[str]:
    command = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--tests",
        str(args.tests),
        "--backend",
        args.backend,
        "--json",
        str(json_path),
        "--append",
    ]
    for name in args.file:
        command += ["--file", name]
    if args.include_excluded:
        command.append("--include-excluded")
    if args.device is not None:
        command += ["--device", args.device]
    return [*command, *options, "--", *extra]


def run_child(command: list[str], timeout: Optional[float]) -> tuple[int, bool]:
    """Runs a subprocess in its own process group; on timeout kills that group."""
    with subprocess.Popen(command, start_new_session=True) as process:
        try:
            return process.wait(timeout=timeout), False
        except subprocess.TimeoutExpired:
            kill_group(process.pid)
            process.wait()
            return process.returncode, True
        except BaseException:
            kill_group(process.pid)
            raise


def kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)


def exit_description(code: int, timed_out: bool, timeout: Optional[float]) -> tuple[str, str]:
    if timed_out:
        return "Timeout", f"no result within {timeout} s; the subprocess was killed"
    if code < 0:
        with contextlib.suppress(ValueError):
            return "ProcessCrash", f"subprocess killed by {signal.Signals(-code).name}"
    return "ProcessCrash", f"subprocess exited with code {code} before reporting"


def run_isolated(args: argparse.Namespace, extra: Sequence[str]) -> int:
    with tempfile.TemporaryDirectory(prefix="fla_suite_") as scratch_dir:
        scratch = Path(scratch_dir)
        json_path = args.json or scratch / "results.json"
        store = ResultStore(json_path, header(args), append=False)
        store.flush()
        batches: dict[str, list[str]] = {}
        for nodeid in collect_nodes(args, json_path, scratch, extra):
            name = nodeid if args.batch == "node" else function_key(nodeid)
            batches.setdefault(name, []).append(nodeid)
        total = len(batches)
        for index, (name, batch) in enumerate(batches.items(), 1):
            run_batch(args, json_path, scratch, store, f"[{index}/{total}] {name}", batch, extra)
        store.reload()
        print_table(store.doc)
        return 1 if any(n["outcome"] == "failed" for n in store.nodes.values()) else 0


def collect_nodes(
    args: argparse.Namespace, json_path: Path, scratch: Path, extra: Sequence[str]
) -> list[str]:
    """The selected node ids, from a collecting subprocess that records the collection
    (counts per function, exclusions) into ``json_path``."""
    listing = scratch / "nodes.txt"
    code, _ = run_child(
        child_command(
            args, json_path, ["--list-nodes", str(listing)],
            ["--collect-only", "-q", *extra],
        ),
        args.batch_timeout,
    )  # fmt: skip
    if not listing.is_file():
        raise SystemExit(f"fla_suite: collection failed (exit code {code})")
    return [n for n in listing.read_text().splitlines() if n]


def run_parallel(args: argparse.Namespace, extra: Sequence[str]) -> int:
    """``--jobs``: the selected cases dealt over that many subprocesses, run at once, each
    writing its own results; merged into one document (a case no process reported is
    recorded as its process's timeout or crash)."""
    with tempfile.TemporaryDirectory(prefix="fla_suite_") as scratch_dir:
        scratch = Path(scratch_dir)
        results = args.json or scratch / "results.json"
        store = ResultStore(results, header(args), append=False)
        store.flush()
        nodes = collect_nodes(args, results, scratch, extra)
        store.reload()
        by_function: dict[str, list[str]] = {}
        for nodeid in nodes:
            by_function.setdefault(function_key(nodeid), []).append(nodeid)
        shards: list[list[str]] = [[] for _ in range(min(args.jobs, len(nodes)) or 1)]
        dealt = 0
        for cases in by_function.values():
            for nodeid in cases:
                shards[dealt % len(shards)].append(nodeid)
                dealt += 1
        processes = []
        for index, shard in enumerate(shards):
            selection = scratch / f"shard{index}.txt"
            selection.write_text("".join(f"{n}\n" for n in shard))
            json_path = scratch / f"shard{index}.json"
            command = child_command(args, json_path, ["--only-nodes", str(selection)], extra)
            log = (scratch / f"shard{index}.log").open("w")
            processes.append(
                (shard, json_path, log, subprocess.Popen(command, stdout=log, stderr=log,
                                                         start_new_session=True))
            )  # fmt: skip
        print(f"fla_suite: {len(nodes)} case(s) in {len(shards)} processes", flush=True)
        deadline = None if args.batch_timeout is None else time.monotonic() + args.batch_timeout
        for shard, json_path, log, process in processes:
            timed_out = False
            try:
                left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
                process.wait(timeout=left)
            except subprocess.TimeoutExpired:
                kill_group(process.pid)
                process.wait()
                timed_out = True
            log.close()
            if json_path.exists():
                part = json.loads(json_path.read_text())
                for key in ("environment", "rebinding", "calls", "excluded"):
                    store.doc[key].update(part.get(key, {}))
                store.nodes.update(part["nodes"])
            for nodeid in shard:
                if nodeid not in store.nodes:
                    note_missing(store, nodeid, process.returncode, timed_out, args.batch_timeout)
        store.flush()
        print_table(store.doc)
        return 1 if any(n["outcome"] == "failed" for n in store.nodes.values()) else 0


def run_batch(
    args: argparse.Namespace,
    json_path: Path,
    scratch: Path,
    store: ResultStore,
    label: str,
    batch: list[str],
    extra: Sequence[str],
) -> None:
    """One subprocess for the batch; then one per node from the first CUDA fault on and
    for every node the batch's process did not report."""
    code, timed_out = run_once(args, json_path, scratch, batch, extra, label)
    store.reload()
    if len(batch) > 1:
        faults = [
            i for i, n in enumerate(batch) if n in store.nodes and is_cuda_fault(store.nodes[n])
        ]
        again = batch[faults[0] :] if faults else []
        again += [n for n in batch if n not in store.nodes and n not in again]
        for number, nodeid in enumerate(again, 1):
            store.nodes.pop(nodeid, None)  # a missing result now means this run's crash
            store.flush()
            code, timed_out = run_once(
                args, json_path, scratch, [nodeid], extra, f"{label} re-run {number}/{len(again)}"
            )
            store.reload()
            if nodeid not in store.nodes:
                note_missing(store, nodeid, code, timed_out, args.batch_timeout)
    else:
        for nodeid in batch:
            if nodeid not in store.nodes:
                note_missing(store, nodeid, code, timed_out, args.batch_timeout)


def run_once(
    args: argparse.Namespace,
    json_path: Path,
    scratch: Path,
    nodes: list[str],
    extra: Sequence[str],
    label: str,
) -> tuple[int, bool]:
    selection = scratch / "selection.txt"
    selection.write_text("".join(f"{n}\n" for n in nodes))
    start = time.monotonic()
    print(f"fla_suite: {label}: {len(nodes)} case(s)", flush=True)
    command = child_command(args, json_path, ["--only-nodes", str(selection)], extra)
    code, timed_out = run_child(command, args.batch_timeout)
    print(f"fla_suite: {label}: exit {code} in {time.monotonic() - start:.1f} s", flush=True)
    return code, timed_out


def note_missing(
    store: ResultStore, nodeid: str, code: int, timed_out: bool, timeout: Optional[float]
) -> None:
    kind, message = exit_description(code, timed_out, timeout)
    store.record(
        nodeid,
        {
            "outcome": "failed",
            "duration": 0.0,
            "type": kind,
            "message": message,
            "phase": "process",
        },
    )


# ---------------------------------------------------------------------------
# report


def print_table(doc: dict[str, Any]) -> None:
    """Per test function: cases collected and passed / failed / skipped, the test's FLA
    callees that are not swapped, failures grouped by type and first message line."""
    functions = doc.get("functions") or summarize(doc.get("nodes", {}))
    collected = doc.get("collected", {})
    calls = doc.get("calls", {})
    commit = (doc.get("fla_commit") or "?")[:12]
    print(f"\nFLA op tests (commit {commit}) on backend {doc.get('backend')}")
    print(f"{'cases':>5} {'pass':>5} {'fail':>5} {'skip':>5}  test function")
    totals: Counter = Counter()
    empty = {"passed": 0, "failed": 0, "skipped": 0, "failures": [], "skip_reasons": {}}
    for key in dict.fromkeys([*collected, *functions]):
        entry = functions.get(key, empty)
        cases = collected.get(key, entry["passed"] + entry["failed"] + entry["skipped"])
        counts = [cases, entry["passed"], entry["failed"], entry["skipped"]]
        totals.update(dict(zip(("cases", "passed", "failed", "skipped"), counts)))
        own = calls.get(key, {}).get("fla", [])
        note = f"   [FLA's own: {', '.join(own)}]" if doc.get("backend") == "kda" and own else ""
        name = key.removeprefix("tests/ops/")
        print(" ".join(f"{n:>5}" for n in counts) + f"  {name}{note}")
        kinds = Counter(f"{f['type']}: {f['message']}" for f in entry["failures"])
        for text, count in kinds.most_common():
            print(f"{'':>25}{count}x {text}"[:170])
        if entry["skipped"] and not entry["passed"] and not entry["failed"]:
            reason = max(entry["skip_reasons"].items(), key=lambda kv: kv[1])[0]
            print(f"{'':>25}skipped: {reason}"[:170])
    names = ("cases", "passed", "failed", "skipped")
    print(" ".join(f"{totals[n]:>5}" for n in names) + "  total")
    for key, entry in doc.get("excluded", {}).items():
        name = key.removeprefix("tests/ops/")
        print(f"{'':>25}excluded {name} ({entry['cases']}): {entry['reason']}"[:170])
    for error in doc.get("collect_errors", []):
        print(f"collection error in {error['node']}: {error['error']}")


def parse_arguments(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    argv, extra = split_at_dashes(argv)
    parser = argparse.ArgumentParser(
        description="Run FLA's test_kda.py / test_gdn.py against kda_ops (or FLA).",
        epilog="Arguments after `--` go to pytest (e.g. -k test_chunk -x -q).",
    )
    parser.add_argument(
        "--tests",
        type=Path,
        default=REPO / ".scratch" / "fla_suite",
        help="folder holding FLA's tests/ (default: .scratch/fla_suite)",
    )
    parser.add_argument(
        "--backend",
        choices=("kda", "fla"),
        default="kda",
        help="kda: FLA's functions swapped for kda_ops'; fla: FLA itself",
    )
    parser.add_argument("--json", type=Path, help="where to write the results")
    parser.add_argument(
        "--file",
        action="append",
        choices=TEST_FILES,
        help="run only this file (repeatable; default: both)",
    )
    parser.add_argument(
        "--include-excluded",
        action="store_true",
        help="also run the tests of FLA's other backends and internals",
    )
    parser.add_argument(
        "--isolate",
        action="store_true",
        help="one subprocess per test function; per case after a CUDA fault",
    )
    parser.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="run the cases in this many subprocesses at once (results merged)",
    )
    parser.add_argument(
        "--batch",
        choices=("function", "node"),
        default="function",
        help="with --isolate: what one subprocess runs (default: function)",
    )
    parser.add_argument(
        "--batch-timeout",
        type=float,
        default=None,
        help="with --isolate: seconds before a subprocess is killed; with --jobs: for all",
    )
    parser.add_argument(
        "--device",
        choices=("cpu",),
        help="cpu: make the tests' tensors on the CPU (kda_ops' CPU path, for a quick check)",
    )
    parser.add_argument("--append", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--only-nodes", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--list-nodes", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.tests = args.tests.resolve()
    args.file = args.file or list(TEST_FILES)
    if args.json is not None:
        args.json = args.json.resolve()
    return args, extra


def main(argv: Optional[Sequence[str]] = None) -> int:
    args, extra = parse_arguments(sys.argv[1:] if argv is None else argv)
    prepare_environment()
    if args.isolate and args.jobs > 1:
        raise SystemExit("fla_suite: --isolate and --jobs do not combine")
    if args.isolate and not args.append:
        return run_isolated(args, extra)
    if args.jobs > 1 and not args.append:
        return run_parallel(args, extra)
    return run_in_process(args, extra)


if __name__ == "__main__":
    sys.exit(main())
