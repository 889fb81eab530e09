"""The README's Python blocks and the examples run as written."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README_BLOCKS = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)


def _run(args: list[str]) -> subprocess.CompletedProcess:
    result = subprocess.run(args, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


# What a block's output must contain, by block index (blocks not listed just have to run).
EXPECTED = {0: ["Paris"], 1: ["name='John Smith'", "age=42"]}


@pytest.mark.parametrize("index", range(len(README_BLOCKS)))
def test_readme_python_blocks_run(smollm2_dir, index):
    out = _run([sys.executable, "-c", README_BLOCKS[index]]).stdout
    for fragment in EXPECTED.get(index, []):
        assert fragment in out


def test_demo(smollm2_dir):
    out = _run([sys.executable, "examples/demo.py"]).stdout
    assert "tokens/s" in out and "Paris" in out
    assert out.count("-> Person(") == 3
