"""``tools/support_matrix.py``: it rewrites only the text between the markers, refuses a
document without them, and ``--check`` reports a stale document without touching it."""

import importlib.util
from pathlib import Path

import pytest

from kda_ops.plan import render_support_matrix

ROOT = Path(__file__).resolve().parents[2]
SPEC = importlib.util.spec_from_file_location(
    "support_matrix", ROOT / "tools" / "support_matrix.py"
)
tool = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(tool)

STALE = f"# Title\n\nBefore.\n\n{tool.BEGIN}| an old | table |\n{tool.END}\nAfter.\n"


def test_rewrites_the_block_and_nothing_else():
    text = tool.rewritten(STALE)
    assert text == STALE.replace("| an old | table |\n", render_support_matrix())
    assert tool.block(text) == render_support_matrix()
    assert tool.rewritten(text) == text


@pytest.mark.parametrize(
    "text",
    ["no markers\n", f"{tool.END}{tool.BEGIN}", f"{tool.BEGIN}{tool.END}{tool.BEGIN}{tool.END}"],
)
def test_a_document_without_one_block_is_refused(text):
    with pytest.raises(ValueError, match="support-matrix:begin"):
        tool.rewritten(text, "page.md")


def test_check_reports_a_stale_document_and_the_run_fixes_it(tmp_path, monkeypatch, capsys):
    page = tmp_path / "page.md"
    page.write_text(STALE)
    monkeypatch.setattr(tool, "REPO", tmp_path)
    monkeypatch.setattr(tool, "DOCUMENTS", (page,))
    assert tool.main(["--check"]) == 1
    assert page.read_text() == STALE and "stale: page.md" in capsys.readouterr().out
    assert tool.main([]) == 0
    assert tool.main(["--check"]) == 0
    assert tool.block(page.read_text()) == render_support_matrix()
