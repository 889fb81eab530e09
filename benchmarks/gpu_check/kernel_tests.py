"""tests/kernels' Triton kernel tests and GPU tests through pytest: with CUDA present they run
the compiled kernels on the GPU (on a CPU-only machine, Triton's interpreter). The tests
that need the embedded model (its 98 MB GGUF does not travel) are deselected: the
tiny-engine and big-vs-hf stages cover what they check. JUnit XML goes to the output
folder. The dry run only collects them, which proves the selection names real tests.
"""

from __future__ import annotations

from common import Context, require

FILES = (
    "tests/kernels/test_triton_paged_attention.py",
    "tests/kernels/test_triton_ops.py",
    "tests/kernels/test_kernels_gpu.py",
)
# Tests that load the embedded model (directly or through the tiny_checkpoint fixture).
NEEDS_EMBEDDED_MODEL = (
    "test_model_cuda_path_matches_cpu_fp32",
    "test_embedded_model_cuda_fp32_matches_cpu_and_bf16_runs",
    "test_structured_and_seeded_sampling_on_cuda",
)
JUNIT = "kernel-tests.xml"
STOP_BEFORE_S = 8


def arguments(ctx: Context) -> list[str]:
    deselect = " and ".join(f"not {name}" for name in NEEDS_EMBEDDED_MODEL)
    # importlib mode: the test root does not go onto sys.path, so agentrt is the installed
    # copy (a checkout's agentrt/ has no engine/ inside).
    args = ["-q", "-rfE", "-p", "no:cacheprovider", "--import-mode=importlib"]
    args += [str(ctx.repo / f) for f in FILES] + ["-k", deselect, f"--rootdir={ctx.repo}"]
    if ctx.dry_run:
        return [*args, "--collect-only"]
    return [*args, f"--junitxml={ctx.out / JUNIT}"]


class Tail:
    """A pytest plugin: tests that would start within STOP_BEFORE_S of the stage's end are
    skipped (so pytest ends, and writes its XML, before the stage is killed); keeps the
    terminal summary's counts."""

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self.counts: dict[str, int] = {}

    def pytest_runtest_setup(self, item) -> None:
        import pytest

        if self.ctx.seconds_left() < STOP_BEFORE_S:
            pytest.skip("the GPU check's kernel-tests stage ran out of time")

    def pytest_terminal_summary(self, terminalreporter) -> None:
        self.counts = {k: len(v) for k, v in terminalreporter.stats.items() if k}


def run(ctx: Context) -> dict:
    """pytest in this (forked) process: its imports are already paid for."""
    import pytest

    tail = Tail(ctx)
    code = int(pytest.main(arguments(ctx), plugins=[tail]))
    counts = {
        k: n
        for k, n in tail.counts.items()
        if k in ("passed", "failed", "error", "skipped", "deselected")
    }
    if ctx.dry_run:
        collected = counts.get("deselected", 0)
        # Every deselected name is a real test (each at least once, parametrised or not).
        require(collected >= len(NEEDS_EMBEDDED_MODEL), f"deselected only {collected}")
        return {"ok": code == 0, "counts": counts}
    result = {"ok": code == 0, "counts": counts}
    if code != 0:
        result["error"] = f"pytest exit {code}: {counts}"
    return result
