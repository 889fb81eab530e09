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


def _compile_threads() -> int:
    return sum(t.name == "grammar-compile" for t in threading.enumerate())


def test_slow_jobs_give_their_slots_away_at_their_deadline() -> None:
    workers, release = CompileWorkers(max_workers=2, max_abandoned=4), threading.Event()
    timeout = lambda: GrammarCompileTimeout("did not compile within 0.2 s")  # noqa: E731
    slow = [_submit(workers, lambda: release.wait(30), 0.2, timeout) for _ in range(4)]
    start = time.monotonic()
    for future in slow:  # twice the workers: the last two wait for a slot, then time out
        with pytest.raises(GrammarCompileTimeout):
            future.result(timeout=5)
    # The stuck jobs left the pool: a normal one runs at once on a fresh worker.
    assert _submit(workers, lambda: 42, 10).result(timeout=5) == 42
    assert time.monotonic() - start < 3
    assert 2 <= workers.num_abandoned <= 4  # those that started (some never ran)
    release.set()
    assert workers.wait_idle(5) and workers.num_abandoned == 0


def test_abandoned_workers_are_capped_and_the_pool_recovers() -> None:
    before = _compile_threads()
    workers, release = CompileWorkers(max_workers=2, max_abandoned=2), threading.Event()
    timeout = lambda: GrammarCompileTimeout("did not compile within 0.2 s")  # noqa: E731
    for _ in range(8):  # one after the other: each starts if a thread may, and sticks
        with pytest.raises(GrammarCompileTimeout):
            _submit(workers, lambda: release.wait(30), 0.2, timeout).result(timeout=10)
    assert workers.num_abandoned == 4  # max_workers + max_abandoned threads, then no more
    assert _compile_threads() - before <= 4
    blocked = _submit(workers, lambda: 42, 0.5, timeout)  # every thread is stuck: it waits
    with pytest.raises(GrammarCompileTimeout):
        blocked.result(timeout=5)
    release.set()  # the stuck calls return: their threads end and fresh ones take the queue
    assert workers.wait_idle(5)
    assert _submit(workers, lambda: 43, 10).result(timeout=5) == 43
    assert workers.num_abandoned == 0
