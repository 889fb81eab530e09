"""Worker threads for compilation, and one watchdog that enforces time budgets.

Threads are started once and reused (starting a thread per compile costs milliseconds on
a loaded machine). Native compilation cannot be interrupted: a job past its deadline has
its Future failed by the watchdog, keeps its worker until the native call returns, and
its result is dropped. A replacement worker is started when every worker is busy, so stuck
jobs never queue others behind them (up to `max_workers`).
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


class CompileWorkers:
    def __init__(self, max_workers: int = 8) -> None:
        self.max_workers = max_workers
        self._jobs: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._num_workers = 0
        self._num_idle = 0
        self._deadlines: list[tuple[float, int, Future, Callable[[], BaseException | None]]] = []
        self._counter = itertools.count()
        self._wake = threading.Condition(self._lock)
        self._watchdog: threading.Thread | None = None
        self._num_running = 0
        self._idle = threading.Condition(self._lock)
        # A native compile still running when the interpreter tears down its threads aborts
        # the process; let in-flight jobs finish first (bounded).
        atexit.register(self.wait_idle, 60.0)

    def submit(
        self, job: Callable[[], None], future: Future, budget_s: float,
        on_timeout: Callable[[], BaseException | None],
    ) -> None:  # fmt: skip
        """Run `job` on a worker; fail `future` with on_timeout() after budget_s seconds.

        on_timeout may return None when the caller enforces the deadline itself.
        """
        with self._lock:
            heapq.heappush(
                self._deadlines,
                (time.monotonic() + budget_s, next(self._counter), future, on_timeout),
            )
            if self._watchdog is None:
                self._watchdog = threading.Thread(
                    target=self._watch, name="grammar-watchdog", daemon=True
                )
                self._watchdog.start()
            if self._deadlines[0][2] is future:
                self._wake.notify()  # the new deadline is the earliest: re-arm the watchdog
            if self._num_idle == 0 and self._num_workers < self.max_workers:
                self._num_workers += 1
                threading.Thread(target=self._work, name="grammar-compile", daemon=True).start()
        self._jobs.put(job)

    def _work(self) -> None:
        while True:
            with self._lock:
                self._num_idle += 1
            job = self._jobs.get()
            with self._lock:
                self._num_idle -= 1
                self._num_running += 1
            try:
                job()
            finally:
                with self._lock:
                    self._num_running -= 1
                    self._idle.notify_all()

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait until no job runs (abandoned ones included); False on timeout."""
        with self._lock:
            return self._idle.wait_for(lambda: self._num_running == 0, timeout_s)

    def _watch(self) -> None:
        with self._lock:
            while True:
                now = time.monotonic()
                while self._deadlines and (
                    self._deadlines[0][2].done() or self._deadlines[0][0] <= now
                ):
                    _, _, future, on_timeout = heapq.heappop(self._deadlines)
                    if not future.done():
                        exc = on_timeout()
                        if exc is not None:
                            settle(future, exc=exc)
                timeout = self._deadlines[0][0] - now if self._deadlines else None
                self._wake.wait(timeout)
