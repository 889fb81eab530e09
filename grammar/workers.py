"""Worker threads for compilation, and one watchdog that enforces time budgets.

Threads are started once and reused (starting a thread per compile costs milliseconds on
a loaded machine). Native compilation cannot be interrupted, so a slow schema must not be
able to occupy the workers: at a job's deadline the watchdog fails its Future (with the
caller's typed error) and, if the job is still running, gives its slot away: the worker is
abandoned (it ends once the native call returns, and its result is dropped) and a fresh
worker takes the queue. A job whose Future is already done when a worker reaches it is
not run at all. Abandoned workers are capped (`max_abandoned`): past the cap no fresh
worker replaces them, so a flood of slow schemas cannot start threads without end (the
compiles they then hold up fail at their own deadlines, and the pool recovers as the
stuck calls return). Their CPU time is not given back before that: only a process could
be ended.

Invariant: `_num_workers` counts the live workers (idle or running a job within its
budget), at most `max_workers`; `_num_abandoned` those still running a job past it.
"""

from __future__ import annotations

import atexit
import heapq
import itertools
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from typing import Any


def settle(future: Future, *, result: Any = None, exc: BaseException | None = None) -> None:
    """Set a Future's outcome unless the other side (worker or watchdog) already did."""
    try:
        if exc is not None:
            future.set_exception(exc)
        else:
            future.set_result(result)
    except InvalidStateError:
        pass


class _Job:
    __slots__ = ("run", "future", "abandoned")

    def __init__(self, run: Callable[[], None], future: Future) -> None:
        self.run = run
        self.future = future
        self.abandoned = False  # past its deadline while running: its worker left the pool


class CompileWorkers:
    def __init__(self, max_workers: int = 8, max_abandoned: int | None = None) -> None:
        self.max_workers = max_workers
        self.max_abandoned = 2 * max_workers if max_abandoned is None else max_abandoned
        self._jobs: queue.SimpleQueue[_Job] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._num_workers = 0
        self._num_idle = 0
        self._num_queued = 0
        self._num_abandoned = 0
        self._deadlines: list[tuple[float, int, _Job, Callable[[], BaseException | None]]] = []
        self._running: set[_Job] = set()
        self._counter = itertools.count()
        self._wake = threading.Condition(self._lock)
        self._watchdog: threading.Thread | None = None
        self._idle = threading.Condition(self._lock)
        # A native compile still running when the interpreter tears down its threads aborts
        # the process; let in-flight jobs finish first (bounded).
        atexit.register(self.wait_idle, 60.0)

    @property
    def num_abandoned(self) -> int:
        """Workers still running a job past its deadline (out of the pool)."""
        with self._lock:
            return self._num_abandoned

    def submit(
        self, run: Callable[[], None], future: Future, budget_s: float,
        on_timeout: Callable[[], BaseException | None],
    ) -> None:  # fmt: skip
        """Run `run` on a worker; fail `future` with on_timeout() after budget_s seconds.

        on_timeout may return None when the caller enforces the deadline itself (its slot
        is given away all the same). `run` must settle `future` itself.
        """
        job = _Job(run, future)
        with self._lock:
            heapq.heappush(
                self._deadlines,
                (time.monotonic() + budget_s, next(self._counter), job, on_timeout),
            )
            if self._watchdog is None:
                self._watchdog = threading.Thread(
                    target=self._watch, name="grammar-watchdog", daemon=True
                )
                self._watchdog.start()
            if self._deadlines[0][2] is job:
                self._wake.notify()  # the new deadline is the earliest: re-arm the watchdog
            self._num_queued += 1
            self._start_worker_if_needed()
        self._jobs.put(job)

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait until no job runs (abandoned ones included); False on timeout."""
        with self._lock:
            return self._idle.wait_for(lambda: not self._running, timeout_s)

    def _start_worker_if_needed(self) -> None:
        """With the lock held: a fresh worker when queued jobs outnumber idle workers."""
        busy = self._num_queued > self._num_idle and self._num_workers < self.max_workers
        # Threads in all: at most max_workers live ones and max_abandoned stuck ones.
        room = self._num_workers + self._num_abandoned < self.max_workers + self.max_abandoned
        if busy and room:
            self._num_workers += 1
            self._num_idle += 1  # counted idle until it takes a job
            threading.Thread(target=self._work, name="grammar-compile", daemon=True).start()

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            with self._lock:
                self._num_queued -= 1
                if job.future.done():  # failed by its deadline while queued: never run
                    continue
                self._num_idle -= 1
                self._running.add(job)
            try:
                job.run()
            except Exception:  # noqa: BLE001 - `run` settles its Future; keep the worker
                pass
            with self._lock:
                self._running.discard(job)
                self._idle.notify_all()
                if job.abandoned:
                    self._num_abandoned -= 1
                    return  # its slot went to another worker at the deadline
                self._num_idle += 1

    def _watch(self) -> None:
        with self._lock:
            while True:
                now = time.monotonic()
                while self._deadlines and (
                    self._deadlines[0][0] <= now
                    or (
                        self._deadlines[0][2].future.done()
                        and self._deadlines[0][2] not in self._running
                    )
                ):
                    deadline, _, job, on_timeout = heapq.heappop(self._deadlines)
                    if deadline <= now:
                        if not job.future.done():
                            exc = on_timeout()
                            if exc is not None:
                                settle(job.future, exc=exc)
                        if job in self._running and not job.abandoned:
                            job.abandoned = True
                            self._num_abandoned += 1
                            self._num_workers -= 1
                            self._start_worker_if_needed()
                timeout = self._deadlines[0][0] - now if self._deadlines else None
                self._wake.wait(timeout)
