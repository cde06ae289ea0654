"""Rewrites the delta-rule support matrix in the documents that show it (the README and
docs/api.md) from ``kda_ops.plan.render_support_matrix()``: the text between the
``<!-- support-matrix:begin -->`` and ``<!-- support-matrix:end -->`` lines. A change of the
rules in ``kda_ops/plan.py`` needs only this run (tests/kda_ops/test_plan.py fails until
then).

Usage (from the repository root)::

    python tools/support_matrix.py           # rewrite the blocks
    python tools/support_matrix.py --check   # exit 1, naming the stale documents, if any
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script: import the checkout's kda_ops
    sys.path.insert(0, str(REPO))

from kda_ops.plan import render_support_matrix  # noqa: E402

BEGIN = "<!-- support-matrix:begin -->\n"
END = "<!-- support-matrix:end -->\n"
DOCUMENTS = (REPO / "README.md", REPO / "docs" / "api.md")


def _bounds(text: str, name: str) -> tuple[int, int]:
    """Where the block's text starts and ends in ``text`` (between the marker lines)."""
    if text.count(BEGIN) != 1 or text.count(END) != 1 or text.index(BEGIN) > text.index(END):
        raise ValueError(f"{name}: needs one {BEGIN.strip()} line, then one {END.strip()} line")
    return text.index(BEGIN) + len(BEGIN), text.index(END)


def block(text: str, name: str = "document") -> str:
    """The text between the markers of ``text`` (``name`` for the error)."""
    start, end = _bounds(text, name)
    return text[start:end]


def rewritten(text: str, name: str = "document") -> str:
    """``text`` with the rendered matrix between its markers."""
    start, end = _bounds(text, name)
    return text[:start] + render_support_matrix() + text[end:]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="only report stale documents")
    args = parser.parse_args(argv)
    stale = []
    for path in DOCUMENTS:
        text = path.read_text()
        new = rewritten(text, str(path.relative_to(REPO)))
        if new != text:
            stale.append(str(path.relative_to(REPO)))
            if not args.check:
                path.write_text(new)
    verb = "stale" if args.check else "rewritten"
    print(f"{verb}: {', '.join(stale)}" if stale else "up to date")
    return 1 if args.check and stale else 0


if __name__ == "__main__":
    sys.exit(main())
