"""benchmarks/gpu_check.sh, the first-GPU check, on a machine without a GPU: it parses, and
it stops at once with a clear message and exit status 2, writing nothing."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

SCRIPT = pathlib.Path(__file__).parents[2] / "benchmarks" / "gpu_check.sh"


def run_script(tmp_path, **env) -> subprocess.CompletedProcess:
    out = tmp_path / "results"
    return subprocess.run(
        ["bash", str(SCRIPT), str(out)],
        env=os.environ | env,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )


def test_script_parses():
    done = subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_without_a_cuda_device_it_fails_clearly(tmp_path):
    # An empty CUDA_VISIBLE_DEVICES hides any GPU, so this holds on GPU machines too.
    done = run_script(tmp_path, PYTHON=sys.executable, CUDA_VISIBLE_DEVICES="")
    assert done.returncode == 2
    assert "gpu_check: no CUDA device" in done.stderr
    assert "Run it on a machine with one CUDA GPU" in done.stderr
    assert not (tmp_path / "results").exists()


def test_without_setup_it_says_so(tmp_path):
    done = run_script(tmp_path, PYTHON=str(tmp_path / "no-python"))
    assert done.returncode == 2
    assert "run `make setup` first" in done.stderr
