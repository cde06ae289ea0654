"""What the suite tools (``fla_suite.py``, ``transformers_suite.py``) share about the pytest
processes they run: their command lines' pytest part, and what they read off pytest's
reports (a failure's exception type and first message line, a skip's reason, a collection
error's last line)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import pytest

MESSAGE_CHARS = 300  # of a failure's or a skip's message


def split_at_dashes(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """(the tool's arguments, pytest's: those after ``--``)."""
    argv = list(argv)
    if "--" not in argv:
        return argv, []
    split = argv.index("--")
    return argv[:split], argv[split + 1 :]


def first_line(text: str) -> str:
    """The first non-blank line of ``text``, stripped, at most ``MESSAGE_CHARS``."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[0][:MESSAGE_CHARS] if lines else ""


def exception_name(kind: type) -> str:
    """An exception type's name, with its module unless builtin or pytest's / unittest's."""
    module = kind.__module__
    if module in ("builtins", "__main__") or module.startswith(("_pytest", "unittest")):
        return kind.__qualname__
    return f"{module}.{kind.__qualname__}"


def skip_reason(report: pytest.TestReport) -> str:
    """Why a test was skipped (or xfailed)."""
    if hasattr(report, "wasxfail"):
        return f"xfail: {report.wasxfail}"[:MESSAGE_CHARS]
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
    return first_line(str(reason).removeprefix("Skipped: "))


def last_error_line(longreprtext: str) -> str:
    """The last ``E`` line of a failure's text (the exception pytest shows), else its first
    line."""
    lines = [line for line in longreprtext.splitlines() if line.startswith("E ")]
    return first_line(lines[-1][1:] if lines else longreprtext)


class FailureCapture:
    """A pytest plugin's base: a report that failed on an exception carries
    ``suite_failure`` = (its type's name, its message's first line); a subtest's report has
    no exception of its own and carries none."""

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item: pytest.Item, call: pytest.CallInfo) -> Iterator:
        outcome = yield
        report = outcome.get_result()
        if report.failed and call.excinfo is not None:
            report.suite_failure = (
                exception_name(call.excinfo.type),
                first_line(str(call.excinfo.value)),
            )
