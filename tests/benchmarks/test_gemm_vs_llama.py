"""benchmarks/gemm_vs_llama.py without llama.cpp: a pass streams small weights from memory
(copies up to --stream-mib) but stops copying where a pass's work would pass PASS_FLOP, and
always calls the weight at least once."""

from __future__ import annotations

import importlib.util
import pathlib
import sys

import pytest

SCRIPT = pathlib.Path(__file__).parents[2] / "benchmarks" / "gemm_vs_llama.py"


@pytest.fixture(scope="module")
def bench():
    folder = str(SCRIPT.parent)
    sys.path.insert(0, folder)  # its `ggml_kernels` import (which takes benchmarks/ off again)
    spec = importlib.util.spec_from_file_location("gemm_vs_llama", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop("ggml_kernels", None)
        if folder in sys.path:
            sys.path.remove(folder)


def test_small_weights_stream_until_the_pass_is_compute_bound(bench):
    mib = 2**20
    # A 2 MiB weight, one row: 128 copies pass 256 MiB, far under PASS_FLOP.
    assert bench.copies_for(2 * mib, 1e7, 256) == 128
    # 512 rows of the same: each call is 1e10 FLOP, past PASS_FLOP alone: one call a pass.
    assert bench.copies_for(2 * mib, 1e10, 256) == 1
    # In between, the FLOP cap binds before the streaming target.
    assert bench.copies_for(2 * mib, bench.PASS_FLOP / 10, 256) == 10


def test_large_or_cached_weights_are_called_once(bench):
    assert bench.copies_for(300 * 2**20, 1e6, 256) == 1  # one copy already passes 256 MiB
    assert bench.copies_for(2**20, 1e6, 0) == 1  # --stream-mib 0: the weight stays in cache
