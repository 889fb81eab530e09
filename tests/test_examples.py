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
EXPECTED = {
    0: ["Person(name='John Smith', age=42)", "cached_tokens="],
    1: ["Paris"],
    2: ["name='John Smith'", "age=42"],
    3: ["SpecDecodeStats(num_drafts="],
}


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(README_BLOCKS)))
def test_readme_python_blocks_run(smollm2_dir, index):
    out = _run([sys.executable, "-c", README_BLOCKS[index]]).stdout
    for fragment in EXPECTED.get(index, []):
        assert fragment in out


@pytest.mark.slow
def test_demo(smollm2_dir):
    """`make demo`: chat, the extraction pipeline and the agent (examples/extraction.py and
    examples/agent.py) on one Runtime."""
    result = _run([sys.executable, "examples/demo.py"])
    out = result.stdout
    assert "tokens/s" in out and "Paris" in out
    assert out.count("-> Invoice(") == 4  # every document extracted and validated
    assert "steered" not in result.stderr  # each reply had room to end on its own
    assert "step 1: lookup_product({'name': 'espresso machine', 'quantity': 3})" in out
    assert "answer: Quote(product='espresso machine', quantity=3, total_eur=747.0)" in out


def test_chat_session_example(smollm2_dir):
    out = _run([sys.executable, "examples/chat_session.py"]).stdout
    assert "trip: Trip(city=" in out and "fork: " in out
    # Turns after the first are served from the prefix cache.
    cached = [int(m) for m in re.findall(r"cached_tokens=(\d+)", out)]
    assert cached[0] == 0 and all(c > 0 for c in cached[1:4])
