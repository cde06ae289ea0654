"""The README's quickstart block runs as written (CPU here, the reference kernels)."""

import pathlib
import re

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def test_quickstart_block_runs():
    text = README.read_text()
    section = text[text.index("## Quickstart") :]
    block = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    namespace = {}
    exec(compile(block, str(README), "exec"), namespace)
    assert namespace["o"].shape == (1, 200, 4, 64)
    assert namespace["state"].shape == (1, 4, 64, 64)
