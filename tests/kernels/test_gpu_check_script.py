"""benchmarks/gpu_check.sh, the first-GPU check, on a machine without a GPU: its budget fits
one device command, it refuses to run without CUDA (exit 2, nothing written), a stage that
overruns is killed and the summary still comes, and its dry run passes every stage here
(random checkpoints, the install into a temp site, the stage plumbing, the summary)."""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).parents[2]
SCRIPT = REPO / "benchmarks" / "gpu_check.sh"
DRIVER = REPO / "benchmarks" / "gpu_check"
MAX_OUTPUT_FILES = 8  # what the device tool brings back from $OUT


@pytest.fixture
def driver(monkeypatch):
    """benchmarks/gpu_check/run.py imported (its folder on sys.path), removed afterwards."""
    monkeypatch.syspath_prepend(str(DRIVER))
    import run

    yield run
    for name in ("run", "summary", "common"):
        sys.modules.pop(name, None)


def run_script(tmp_path, *args, **env) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(SCRIPT), *args],
        env=os.environ | env,
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
    )


def test_script_parses():
    done = subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_budget_fits_one_device_command(driver):
    text = SCRIPT.read_text()
    shell = {
        name: int(re.search(rf"^{name}_s=(\d+)", text, re.M)[1]) for name in driver.SHELL_LIMITS_S
    }
    assert shell == driver.SHELL_LIMITS_S
    assert int(re.search(r"^budget_s=(\d+)", text, re.M)[1]) == driver.TOTAL_BUDGET_S
    assert f"budget_s * {driver.DRY_RUN_SLACK}" in text  # the dry run's slack, in both
    assert driver.total_limit_s() <= driver.TOTAL_BUDGET_S <= 420
    names = [s.name for s in driver.STAGES]
    assert all(s.needs is None or names.index(s.needs) < names.index(s.name) for s in driver.STAGES)
    # The documented device command leaves the script's whole budget inside its timeout.
    timeout = int(re.search(r'carry=\["\.gpu_check"\], timeout_s=(\d+)', text)[1])
    assert driver.TOTAL_BUDGET_S + 30 <= timeout <= 600


def test_without_a_cuda_device_it_fails_clearly(tmp_path):
    # An empty CUDA_VISIBLE_DEVICES hides any GPU, so this holds on GPU machines too.
    done = run_script(
        tmp_path, str(tmp_path / "results"), PYTHON=sys.executable, CUDA_VISIBLE_DEVICES=""
    )
    assert done.returncode == 2
    assert "gpu_check: no CUDA device" in done.stderr
    assert "Run it on a machine with one CUDA GPU" in done.stderr
    assert not (tmp_path / "results").exists()


def test_without_python_it_says_so(tmp_path):
    done = run_script(tmp_path, PYTHON=str(tmp_path / "no-python"))
    assert done.returncode == 2
    assert "no Python at" in done.stderr


SLEEPY_STAGE = """
import time

def run(ctx):
    print("started", flush=True)
    ctx.save_partial({"measured": 1})
    time.sleep(60)
    return {"ok": True}
"""


def test_a_stage_past_its_limit_is_killed_and_summarised(driver, tmp_path, monkeypatch):
    (tmp_path / "mods").mkdir()
    (tmp_path / "mods" / "sleepy_stage.py").write_text(SLEEPY_STAGE)
    (tmp_path / "mods" / "failing_stage.py").write_text(
        "def run(ctx):\n    ctx.save_partial({'done': 2})\n    raise OSError('disk')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path / "mods"))
    stages = (
        driver.Stage("sleepy", "sleepy_stage", 1),
        driver.Stage("failing", "failing_stage", 10),
        driver.Stage("after", "failing_stage", 10, needs="sleepy"),
    )
    monkeypatch.setattr(driver, "STAGES", stages)
    ctx = driver.Context(tmp_path / "work", tmp_path / "out", REPO, tmp_path, dry_run=False)
    driver.run_stages(ctx, deadline=1e12, only=set(), spawn=False)
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    status = {row["stage"]: (row["status"], row.get("error")) for row in summary["stages"]}
    assert status == {
        "sleepy": ("timed out", "over 1s"),
        "failing": ("failed", "OSError: disk"),
        "after": ("skipped", "sleepy failed"),
    }
    assert summary["stages"][0]["partial"] == {"measured": 1}  # kept from the killed stage
    assert summary["stages"][1]["partial"] == {"done": 2}  # and from the failed one
    assert not summary["ok"]
    assert "=> FAILED: sleepy, failing, after" in summary["line"]
    log = (tmp_path / "out" / "gpu_check.log").read_text()
    assert "started" in log and "OSError: disk" in log and summary["line"] in log


@pytest.mark.slow
def test_dry_run_passes_every_stage(tmp_path):
    # No carried folder: the tokenizer is exported from the embedded model, no wheels.
    out = tmp_path / "results"
    done = run_script(
        tmp_path,
        "--dry-run",
        str(out),
        PYTHON=sys.executable,
        GPU_CHECK_CARRY=str(tmp_path / "none"),
    )
    lines = done.stdout.strip().splitlines()
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert lines[-1].startswith("gpu_check summary (dry run): preflight ok")
    assert "=> all passed" in lines[-1]
    files = [p for p in out.rglob("*") if p.is_file()]
    assert len(files) <= MAX_OUTPUT_FILES
    summary = json.loads((out / "summary.json").read_text())
    stages = {row["stage"]: row for row in summary["stages"]}
    assert list(stages)[:2] == ["preflight", "install"] and summary["ok"] and summary["dry_run"]
    assert all(row["status"] == "ok" for row in stages.values())
    # agentrt ran from the temp site the install stage built, not from this checkout.
    log = (out / "gpu_check.log").read_text()
    site = re.search(r"agentrt from (\S+)/agentrt/__init__\.py", log)[1]
    assert site.endswith("/site/project") and not site.startswith(str(REPO))
    assert stages["kernel-sweep"]["result"]["cases"] > 0
    assert stages["kernel-tests"]["result"]["counts"]["deselected"] >= 3
    tiny = stages["tiny-engine"]["result"]
    assert tiny["greedy_llama"]["auto"]["backend"] == "cpu"  # vs torch: both paths compared
    assert tiny["chunked_prefill_prefix_hit"]["cached_tokens"][1] >= 256
    assert tiny["ngram_drafting"]["drafted"] > 0
    quality = stages["big-vs-hf"]["result"]
    assert quality["fp32_greedy_vs_hf"]["ok"]
    assert 0 < quality["bf16_teacher_forced"]["agentrt"]["top1_agreement"] <= 1
    split = stages["throughput"]["result"]["profile_single"]["median_ms_per_step"]
    assert {"scheduling", "input_preparation", "forward", "sampling", "step"} <= set(split)
    assert split["forward"] > 0
