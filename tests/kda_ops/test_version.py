"""One version number: ``kda_ops.__version__`` is the one ``pyproject.toml`` declares."""

import pathlib
import re

import kda_ops

PYPROJECT = pathlib.Path(__file__).resolve().parents[2] / "pyproject.toml"


def test_version_matches_pyproject():
    declared = re.search(r'^version = "([^"]+)"$', PYPROJECT.read_text(), re.M).group(1)
    assert kda_ops.__version__ == declared
