"""Engine-core clients: where `AsyncEngine`'s requests run. One interface, two places:

- `InprocClient`: the `LLMEngine` on a thread of this process (scheduler, model, sampler and
  the OutputProcessor all on that thread).
- `MPClient`: one or more engine cores (`data_parallel_size`), each in its own spawned
  process (`engine/client/core_process.py`), behind a client thread of this process that owns the
  OutputProcessor (detokenizing, stop strings and logprobs stay in the front end, as in
  vLLM), the data-parallel router, and every socket. It turns a dead core process into a
  stopped loop, which `AsyncEngine` turns into `EngineDeadError` for every pending request.

Both take the same commands (`put`, thread-safe) and hand back the same items (`get`): lists
of `RequestDelta`, `RequestFailed` for a request that failed alone, and `LoopStopped` last.
"""

from __future__ import annotations

import copy
import dataclasses
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Protocol

from agentrt.engine.args import EngineArgs
from agentrt.engine.client.llm_engine import LLMEngine
from agentrt.engine.config import EngineConfig
from agentrt.engine.errors import EngineDeadError
from agentrt.engine.records import EngineCoreRequest

_MAX_QUEUED_STEPS = 64  # steps waiting for the pump before the client thread blocks

# Commands from the event loop to the client thread.


@dataclass(frozen=True, slots=True)
class AddRequest:
    request: EngineCoreRequest
    prompt: str | None  # the prompt's text, when it had one


@dataclass(frozen=True, slots=True)
class AbortRequests:
    req_ids: list[str]


@dataclass(frozen=True, slots=True)
class CallUtility:
    """Call the engine method `name` ("stats", "reset_prefix_cache") between steps, on every
    core; the combined result goes to `future` (with `per_replica`, one result per core)."""

    name: str
    future: Future
    per_replica: bool = False


@dataclass(frozen=True, slots=True)
class CallEngine:
    """Run `fn(llm_engine)` between steps (in-process engines only)."""

    fn: Callable[[LLMEngine], Any]
    future: Future


@dataclass(frozen=True, slots=True)
class StopEngine:
    """Abort every request and end the loop."""


EngineCommand = AddRequest | AbortRequests | CallUtility | CallEngine | StopEngine

# What the client thread hands the pump besides each step's deltas.


@dataclass(frozen=True, slots=True)
class RequestFailed:
    """One request could not be added; the engine goes on."""

    request_id: str
    error: Exception


@dataclass(frozen=True, slots=True)
class LoopStopped:
    """The loop ended; `error` is the fault that ended it, if any."""

    error: BaseException | None


@dataclass(frozen=True, slots=True)
class FrontEnd:
    """What the front end validates requests with: the engine's resolved config (of all its
    replicas) and its own copy of the tokenizer (never shared with the client thread)."""

    config: EngineConfig
    tokenizer: Any


class EngineCoreClient(Protocol):
    engine: LLMEngine | None  # the engine, when it runs in this process

    def start(self) -> Future:
        """Start the client thread, which builds or spawns the engine; the future resolves
        to a `FrontEnd`, or raises the build error (`ModelLoadError`, `ConfigError`, ...)."""

    def put(self, command: EngineCommand) -> None:
        """Queue a command (any thread). A `CallUtility`/`CallEngine` queued after the loop
        ended fails with `EngineDeadError`, never hangs."""

    def get(self) -> list | RequestFailed | LoopStopped:
        """The next item for the pump (blocking); `LoopStopped` is the last."""

    def join(self) -> None:
        """Wait for the client thread (and any core process) to end."""


class _ClientThread:
    """The command queue, the output queue and the thread, shared by both clients."""

    def __init__(self) -> None:
        self._commands: queue.SimpleQueue[EngineCommand] = queue.SimpleQueue()
        self._outputs: queue.Queue = queue.Queue(maxsize=_MAX_QUEUED_STEPS)
        self._thread: threading.Thread | None = None
        # A call queued after the loop exited would never be answered, so the exiting loop
        # fails queued calls under this lock and later ones fail at once.
        self._exit_lock = threading.Lock()
        self._exited = False

    def start(self) -> Future:
        built: Future = Future()
        self._thread = threading.Thread(
            target=self._main, args=(built,), name="agentrt-engine", daemon=True
        )
        self._thread.start()
        return built

    def put(self, command: EngineCommand) -> None:
        with self._exit_lock:
            if self._exited:
                if isinstance(command, CallUtility | CallEngine):
                    command.future.set_exception(EngineDeadError("the engine loop has stopped."))
                return
            self._commands.put(command)
        self._wake()

    def get(self) -> list | RequestFailed | LoopStopped:
        return self._outputs.get()

    def join(self) -> None:
        if self._thread is not None:
            self._thread.join()

    @property
    def thread(self) -> threading.Thread | None:
        return self._thread

    def _wake(self) -> None:
        """Tell a thread that waits on something besides the command queue."""

    def _main(self, built: Future) -> None:
        raise NotImplementedError

    def _exit(self, error: BaseException | None) -> None:
        with self._exit_lock:
            self._exited = True
            while True:
                try:
                    command = self._commands.get_nowait()
                except queue.Empty:
                    break
                if isinstance(command, CallUtility | CallEngine):
                    command.future.set_exception(EngineDeadError("the engine loop has stopped."))
        self._outputs.put(LoopStopped(error))


class InprocClient(_ClientThread):
    """The `LLMEngine` on the client thread itself (built there unless `engine=` is given).

    It is built on that thread: torch's OpenMP runtime keeps a team of worker threads per
    thread that ran parallel work, and with more of them alive than cores it stops
    spin-waiting between parallel regions, which made every step ~15% slower."""

    def __init__(self, args: EngineArgs, engine: LLMEngine | None = None) -> None:
        super().__init__()
        self.args = args
        self.engine = engine

    def _main(self, built: Future) -> None:
        owned = self.engine is None  # built here: its workers stop with the loop
        try:
            if owned:
                self.engine = LLMEngine(**dataclasses.asdict(self.args))
            built.set_result(FrontEnd(self.engine.config, copy.deepcopy(self.engine.tokenizer)))
        except BaseException as exc:
            built.set_exception(exc)
            return
        engine = self.engine
        error: BaseException | None = None
        try:
            while self._handle_commands(block=not engine.has_unfinished_requests()):
                if engine.has_unfinished_requests():
                    deltas = engine.step()
                    if deltas:
                        self._outputs.put(deltas)
        except BaseException as exc:  # a fault: the pump fails every pending request
            error = exc
        finally:
            if owned:
                engine.shutdown()
            self._exit(error)

    def _handle_commands(self, block: bool) -> bool:
        """Apply queued commands (waiting for one when the engine is idle); False on stop."""
        engine = self.engine
        while True:
            try:
                command = self._commands.get(block=block)
            except queue.Empty:
                return True
            block = False
            match command:
                case AddRequest(request, prompt):
                    try:
                        engine.add_request(request, prompt)
                    except Exception as exc:  # this request is bad, not the engine
                        engine.abort_requests([request.req_id])
                        self._outputs.put(RequestFailed(request.req_id, exc))
                case AbortRequests(req_ids):
                    deltas = engine.abort_requests(req_ids)
                    if deltas:
                        self._outputs.put(deltas)
                case CallUtility(name, future, per_replica):
                    _answer(future, _call_utility, engine, name, per_replica)
                case CallEngine(fn, future):
                    _answer(future, fn, engine)
                case StopEngine():
                    engine.abort_all()
                    return False


def _answer(future: Future, fn: Callable[..., Any], *args: Any) -> None:
    try:
        future.set_result(fn(*args))
    except Exception as exc:
        future.set_exception(exc)


def _call_utility(engine: LLMEngine, name: str, per_replica: bool) -> Any:
    result = getattr(engine, name)()
    return [result] if per_replica else result
