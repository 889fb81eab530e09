"""The Python stages of the GPU check (benchmarks/gpu_check.sh runs preflight and install
first, then this), each under its own time limit, in the order of issue 32:

    kernel-sweep   Triton paged attention vs its reference: head dims, GQA, block sizes, splits
    kernel-tests   tests/kernels' Triton and GPU tests through pytest (JUnit XML comes back)
    checkpoints    tiny and ~1B-shaped random checkpoints from the carried tokenizer
    tiny-engine    CUDA vs CPU fp32 greedy, JSON schema, chunked prefill + prefix hit, n-gram
    big-vs-hf      ~1B model: fp32 greedy vs HF, bf16 teacher-forced logprobs vs HF
    throughput     ~1B model: agentrt vs HF generate, batch and batch-1, step time split

Each stage runs in a child process forked from this one (the heavy imports are paid once;
this process never touches CUDA, and torch is told to check for it through NVML so that no
CUDA state exists before the fork). A child that overruns its limit, or the run's deadline,
is killed with its process group. `--spawn` starts each child as a fresh interpreter
instead; a forked child that finds CUDA unusable switches the rest of the run to that.

    python run.py --work DIR --out DIR [--dry-run] [--deadline EPOCH_S] [--only NAME ...]
    python run.py --export-tokenizer DIR     # here: the carried tokenizer folder
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import summary
from common import CheckFailed, Context

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
FIRST_INDEX = 3  # the shell script's stages are 01 preflight and 02 install
MIN_STAGE_S = 5  # a stage with less time left than this is skipped


@dataclass(frozen=True, slots=True)
class Stage:
    name: str
    module: str  # a module of this folder with `run(ctx) -> dict`
    limit_s: int
    needs: str | None = None  # a stage that must have passed first


STAGES = (
    Stage("kernel-sweep", "kernel_sweep", 55),
    Stage("kernel-tests", "kernel_tests", 45),
    Stage("checkpoints", "checkpoints", 40),
    Stage("tiny-engine", "engine_checks", 50, needs="checkpoints"),
    Stage("big-vs-hf", "hf_checks", 60, needs="checkpoints"),
    Stage("throughput", "speed", 100, needs="checkpoints"),
)
# The shell script's own stages (preflight, install): their limits, kept here so that one
# table holds the whole budget (tests check it against the script).
SHELL_LIMITS_S = {"preflight": 20, "install": 40}
TOTAL_BUDGET_S = 420
DRY_RUN_SLACK = 3  # the dry run's limits are these times the GPU run's


def total_limit_s() -> int:
    return sum(SHELL_LIMITS_S.values()) + sum(s.limit_s for s in STAGES)


def run_in_child(stage: Stage, ctx: Context, index: int, limit_s: float) -> None:
    """Body of a stage's process: output into its log, its record written, then exit."""
    ctx = dataclasses.replace(ctx, stage=stage.name, stage_deadline=time.time() + limit_s)
    start = time.perf_counter()
    status, fields = "ok", {}
    try:
        module = __import__(stage.module)
        result = module.run(ctx)
        fields["result"] = result
        if not result.get("ok", True):
            status, fields["error"] = "failed", result.get("error", "a check failed")
    except CheckFailed as exc:
        status, fields["error"] = "failed", str(exc)
    except BaseException as exc:  # any failure is this stage's, never the driver's
        traceback.print_exc()
        status, fields["error"] = "failed", f"{type(exc).__name__}: {exc}"
        partial = ctx.work / "partial" / f"{stage.name}.json"
        if partial.is_file():
            fields["partial"] = json.loads(partial.read_text())
    print(f"{stage.name}: {status} {fields.get('error', '')}", flush=True)
    # What the stage imported beyond the standard library: each must be in the GPU image
    # or among the carried wheels (checked by reading a dry run's summary).
    fields["imported"] = sorted(
        {name.split(".")[0] for name in sys.modules if not name.startswith("_")}
        - set(sys.stdlib_module_names)
    )
    summary.record(ctx.work, index, stage.name, status, time.perf_counter() - start, **fields)


def fork_stage(stage: Stage, ctx: Context, index: int, limit_s: float) -> int:
    log = summary.log_path(ctx.work, index, stage.name)
    pid = os.fork()
    if pid == 0:  # the child
        code = 1
        try:
            os.setpgid(0, 0)
            fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            sys.stdout = os.fdopen(1, "w", buffering=1, closefd=False)
            sys.stderr = os.fdopen(2, "w", buffering=1, closefd=False)
            run_in_child(stage, ctx, index, limit_s)
            code = 0
        finally:
            os._exit(code)
    return pid


def spawn_stage(stage: Stage, ctx: Context, index: int, limit_s: float) -> int:
    log = summary.log_path(ctx.work, index, stage.name)
    args = [sys.executable, str(HERE / "run.py"), *context_args(ctx), "--child", stage.name]
    args += ["--deadline", str(time.time() + limit_s)]
    with open(log, "ab") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=out, start_new_session=True)
    return proc.pid


def wait(pid: int, limit_s: float) -> tuple[int | None, float]:
    """The child's exit status (None after killing its process group at the limit) and the
    CPU seconds it used."""
    deadline = time.monotonic() + limit_s
    while True:
        done, status, usage = os.wait4(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status), usage.ru_utime + usage.ru_stime
        if time.monotonic() >= deadline:
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            _, _, usage = os.wait4(pid, 0)
            return None, usage.ru_utime + usage.ru_stime
        time.sleep(0.1)


def cuda_lost_in_fork(ctx: Context, index: int, name: str) -> bool:
    text = summary.log_path(ctx.work, index, name).read_text(errors="replace")
    signs = ("forked subprocess", "CUDA driver initialization failed", "initialization error")
    return any(sign in text for sign in signs)


def run_stages(ctx: Context, deadline: float, only: set[str], spawn: bool) -> None:
    passed: set[str] = set()
    for offset, stage in enumerate(STAGES):
        index = FIRST_INDEX + offset
        if only and stage.name not in only:
            continue
        left = deadline - time.time()
        if stage.needs is not None and stage.needs not in passed:
            summary.record(ctx.work, index, stage.name, "skipped", 0, error=f"{stage.needs} failed")
        elif left < MIN_STAGE_S:
            summary.record(ctx.work, index, stage.name, "skipped", 0, error="no time left")
        else:
            limit = min(stage.limit_s * (DRY_RUN_SLACK if ctx.dry_run else 1), left)
            print(f"gpu_check: {stage.name} (at most {limit:.0f}s) ...", flush=True)
            start = time.perf_counter()
            pid = (spawn_stage if spawn else fork_stage)(stage, ctx, index, limit)
            code, cpu_s = wait(pid, limit)
            if code is not None and not spawn and cuda_lost_in_fork(ctx, index, stage.name):
                print("gpu_check: CUDA unusable in a forked child: spawning from now on")
                spawn = True
                limit = max(MIN_STAGE_S, min(stage.limit_s, deadline - time.time()))
                code, cpu_s = wait(spawn_stage(stage, ctx, index, limit), limit)
            seconds = time.perf_counter() - start
            if code is None:
                partial = ctx.work / "partial" / f"{stage.name}.json"
                summary.record(
                    ctx.work, index, stage.name, "timed out", seconds, error=f"over {limit:.0f}s",
                    partial=json.loads(partial.read_text()) if partial.is_file() else None,
                )  # fmt: skip
            elif not (ctx.work / "stages" / f"{index:02d}-{stage.name}.json").exists():
                summary.record(ctx.work, index, stage.name, "failed", seconds, error=f"exit {code}")
            summary.amend(ctx.work, index, stage.name, cpu_s=round(cpu_s, 1))
        rows = {r["stage"]: r for r in summary.records(ctx.work)}
        row = rows[stage.name]
        if row["status"] == "ok":
            passed.add(stage.name)
        print(
            f"gpu_check: {stage.name} {row['status']} {row['seconds']:.0f}s {row.get('error', '')}"
        )
        summary.write(ctx.work, ctx.out, ctx.dry_run)


def context_args(ctx: Context) -> list[str]:
    args = ["--work", str(ctx.work), "--out", str(ctx.out), "--tokenizer", str(ctx.tokenizer)]
    return args + (["--dry-run"] if ctx.dry_run else [])


def preload() -> bool:
    """The imports every stage needs, paid once before the children are forked. Returns
    whether forking stays safe: none of them may have initialised CUDA."""
    import torch
    import transformers  # noqa: F401
    from transformers import AutoModelForCausalLM  # noqa: F401

    import agentrt.engine.client.llm  # noqa: F401
    import agentrt.engine.model.tiny  # noqa: F401

    return not torch.cuda.is_initialized()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--tokenizer", type=Path, default=REPO / ".gpu_check" / "tokenizer")
    parser.add_argument("--dry-run", action="store_true", help="no CUDA: tiny, on the CPU")
    parser.add_argument("--deadline", type=float, help="epoch seconds by which all must end")
    parser.add_argument("--only", action="append", default=[], help="run only this stage")
    parser.add_argument("--spawn", action="store_true", help="a fresh interpreter per stage")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--export-tokenizer", type=Path, metavar="DIR")
    parser.add_argument("--budget", action="store_true", help="print the stage limits")
    args = parser.parse_args()
    if args.budget:
        print({**SHELL_LIMITS_S, **{s.name: s.limit_s for s in STAGES}, "total": total_limit_s()})
        return 0
    if args.export_tokenizer:
        from checkpoints import export_tokenizer

        print(f"tokenizer files in {export_tokenizer(args.export_tokenizer)}")
        return 0
    if args.work is None or args.out is None:
        parser.error("--work and --out are required")
    ctx = Context(args.work, args.out, REPO, args.tokenizer, args.dry_run)
    if args.child:
        index = FIRST_INDEX + [s.name for s in STAGES].index(args.child)
        stage = next(s for s in STAGES if s.name == args.child)
        run_in_child(
            stage, ctx, index, (args.deadline or time.time() + stage.limit_s) - time.time()
        )
        return 0
    deadline = args.deadline or time.time() + TOTAL_BUDGET_S * (
        DRY_RUN_SLACK if args.dry_run else 1
    )
    # torch then asks NVML whether CUDA is there: no CUDA state exists before the forks.
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    spawn = args.spawn or not preload()
    if spawn and not args.spawn:
        print("gpu_check: CUDA initialised by an import: a fresh interpreter per stage")
    run_stages(ctx, deadline, set(args.only), spawn)
    return 0


if __name__ == "__main__":
    sys.exit(main())
