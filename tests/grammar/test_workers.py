"""Compile workers (workers.py): jobs run off the calling thread, time budgets fail the
Future with the caller's typed error, and a stuck job never holds up the next one."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future

import pytest

from agentrt.grammar import GrammarCompileTimeout
from agentrt.grammar.workers import CompileWorkers, settle


def _submit(workers: CompileWorkers, fn, budget_s: float, on_timeout=None) -> Future:
    future: Future = Future()

    def job() -> None:
        try:
            settle(future, result=fn())
        except Exception as exc:
            settle(future, exc=exc)

    workers.submit(job, future, budget_s, on_timeout or (lambda: None))
    return future


def test_a_job_runs_on_a_worker_thread() -> None:
    workers = CompileWorkers(max_workers=2)
    future = _submit(workers, lambda: threading.current_thread().name, budget_s=10)
    assert future.result(timeout=10) == "grammar-compile"


def test_a_job_past_its_budget_fails_with_the_typed_error() -> None:
    workers, release = CompileWorkers(max_workers=2), threading.Event()
    start = time.monotonic()
    stuck = _submit(
        workers, lambda: release.wait(10), budget_s=0.2,
        on_timeout=lambda: GrammarCompileTimeout("did not compile within 0.2 s"),
    )  # fmt: skip
    with pytest.raises(GrammarCompileTimeout, match="within 0.2 s"):
        stuck.result(timeout=5)
    assert time.monotonic() - start < 5  # the budget, not the job (up to 10 s)
    # Meanwhile another job runs on a second worker instead of queueing behind the stuck one.
    assert _submit(workers, lambda: 42, budget_s=10).result(timeout=5) == 42
    release.set()
    assert workers.wait_idle(5)  # the stuck job ends; its late result is dropped
    assert isinstance(stuck.exception(), GrammarCompileTimeout)


def test_a_caller_that_enforces_its_own_deadline_keeps_the_future() -> None:
    workers, release = CompileWorkers(max_workers=1), threading.Event()
    future = _submit(workers, lambda: release.wait(10) and "late", budget_s=0.05)
    time.sleep(0.3)  # past the budget: on_timeout returned None, so nothing failed it
    assert not future.done()
    release.set()
    assert future.result(timeout=5) == "late"


def test_settle_keeps_the_first_outcome() -> None:
    future: Future = Future()
    settle(future, exc=GrammarCompileTimeout("first"))
    settle(future, result="second")  # the worker finishing after the watchdog: ignored
    assert isinstance(future.exception(), GrammarCompileTimeout)
