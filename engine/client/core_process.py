"""The engine core in its own process: the messages it exchanges with the front end, and the
loop it runs (`run_engine_core`, the target of a spawned process).

Transport: ZMQ (pyzmq) over `ipc://` sockets, one PUSH -> PULL pair per direction. Chosen
over multiprocessing pipes because a ZMQ send never blocks the sender on a busy peer (its IO
thread queues the message, where a pipe blocks once its 64 KiB buffer is full and the core is
in the middle of a step), because one poller waits on every replica's outputs and on the
processes' sentinels at once (data parallelism, and noticing a dead core), and because it is
what vLLM uses for the same boundary. Every message is a msgspec Struct encoded as msgpack:
plain data only, so nothing with live state (a tensor, a lock, a pickled callable) crosses.

Protocol (per replica): the front end resolves the engine config once and spawns each core
with it; the core connects to the front end's sockets, loads the model and sends `CoreReady`
(or `CoreLoadFailed`, naming the error type, which the front end raises as the same type). Then it receives `AddCoreRequest` / `AbortCoreRequests` / `UtilityCall` /
`ShutdownCore` and sends `CoreStepOutputs` after every step (with its queue lengths, which the
data-parallel router reads as load), `CoreRequestFailed` for a request it could not take and
`UtilityResult` for each utility call. It exits on `ShutdownCore` or when its parent dies.
"""

from __future__ import annotations

import dataclasses
import os
import signal
from typing import TYPE_CHECKING

import msgspec

from agentrt.engine.core.scheduler import SchedulerStats
from agentrt.engine.records import EngineCoreOutput, EngineCoreRequest

if TYPE_CHECKING:
    from agentrt.engine.args import EngineArgs
    from agentrt.engine.config import EngineConfig

_IDLE_POLL_MS = 1000  # how often an idle core checks that its parent is still alive


# -- front end -> core -------------------------------------------------------------------------
# Wire messages are msgspec Structs (not dataclasses) so that a tagged union can tell them
# apart on decoding; the records they carry are the engine's dataclasses.


class AddCoreRequest(msgspec.Struct, tag=True, frozen=True):
    request: EngineCoreRequest


class AbortCoreRequests(msgspec.Struct, tag=True, frozen=True):
    req_ids: list[str]


class UtilityCall(msgspec.Struct, tag=True, frozen=True):
    """Call the engine method `name` ("stats" or "reset_prefix_cache") between steps."""

    call_id: int
    name: str


class ShutdownCore(msgspec.Struct, tag=True, frozen=True):
    pass


CoreInput = AddCoreRequest | AbortCoreRequests | UtilityCall | ShutdownCore
UTILITIES = frozenset({"stats", "reset_prefix_cache"})


# -- core -> front end -------------------------------------------------------------------------


class CoreReady(msgspec.Struct, tag=True, frozen=True):
    replica: int


class CoreLoadFailed(msgspec.Struct, tag=True, frozen=True):
    """The core could not be built: `error_type` names the class in `agentrt.engine.errors`
    (e.g. "ModelLoadError", "ConfigError"), else "" for an unexpected exception."""

    replica: int
    error_type: str
    message: str


class CoreStepOutputs(msgspec.Struct, tag=True, frozen=True):
    """One step's outputs, and the queue lengths after it (the router's load figures)."""

    replica: int
    outputs: list[EngineCoreOutput]
    num_waiting: int
    num_running: int


class CoreRequestFailed(msgspec.Struct, tag=True, frozen=True):
    """A request the core could not take (it fails alone; the core goes on)."""

    replica: int
    req_id: str
    message: str


class UtilityResult(msgspec.Struct, tag=True, frozen=True):
    replica: int
    call_id: int
    stats: SchedulerStats | None = None  # the result of "stats"
    error: str | None = None


CoreOutput = CoreReady | CoreLoadFailed | CoreStepOutputs | CoreRequestFailed | UtilityResult


# -- the core process --------------------------------------------------------------------------


def run_engine_core(
    args: EngineArgs,
    config: EngineConfig,
    replica: int,
    num_replicas: int,
    input_addr: str,
    output_addr: str,
) -> None:
    """Entry point of a spawned core process: the options and the config the front end
    resolved from them (`core_config`: one in-process engine each), so a core reads nothing
    the front end already decided."""
    import torch
    import zmq

    from agentrt.engine import envs
    from agentrt.engine.client.llm_engine import LLMEngine
    from agentrt.engine.errors import EngineError

    # The parent owns this process's lifetime: ^C or SIGTERM sent to the process group goes
    # to the front end, which drains and shuts the cores down (or they notice it died).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if envs.num_threads() is None:  # the replicas share the machine's cores
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // num_replicas))
    context = zmq.Context(1)
    inputs = context.socket(zmq.PULL)
    inputs.connect(input_addr)
    outputs = context.socket(zmq.PUSH)
    outputs.setsockopt(zmq.SNDHWM, 0)
    outputs.setsockopt(zmq.SNDTIMEO, _IDLE_POLL_MS)
    outputs.connect(output_addr)
    encoder = msgspec.msgpack.Encoder()

    def send(message: CoreOutput) -> None:
        """Send to the front end; a send can only wait while it is not connected, which
        after the handshake means it died, and then this process ends."""
        while True:
            try:
                outputs.send(encoder.encode(message))
                return
            except zmq.Again:
                if not _parent_alive():
                    raise SystemExit(0) from None

    try:
        try:
            engine = LLMEngine.from_engine_config(args, config)
        except Exception as exc:
            error_type = type(exc).__name__ if isinstance(exc, EngineError) else ""
            send(CoreLoadFailed(replica, error_type, str(exc)))
            return
        send(CoreReady(replica))
        try:
            _serve(engine, replica, inputs, send)
        finally:
            engine.shutdown()  # its tensor-parallel workers, if any
    finally:
        inputs.close(linger=0)
        outputs.close(linger=1000)  # the last messages still go out
        context.term()


def _parent_alive() -> bool:
    import multiprocessing

    parent = multiprocessing.parent_process()
    return parent is None or parent.is_alive()


def _serve(engine, replica: int, inputs, send) -> None:
    """Apply queued inputs (waiting for one when idle), step, send the step's outputs."""
    import multiprocessing

    import zmq

    decoder = msgspec.msgpack.Decoder(CoreInput)
    core, scheduler = engine.engine_core, engine.scheduler
    poller = zmq.Poller()
    poller.register(inputs, zmq.POLLIN)
    parent = multiprocessing.parent_process()
    if parent is not None:
        poller.register(parent.sentinel, zmq.POLLIN)  # readable once the parent has died
    last_load = (0, 0)  # (waiting, running) as last sent
    while True:
        if not core.has_unfinished_requests():
            events = dict(poller.poll(_IDLE_POLL_MS))
            if parent is not None and parent.sentinel in events:
                return
        while True:  # every input queued now, without waiting
            try:
                message = decoder.decode(inputs.recv(zmq.NOBLOCK))
            except zmq.Again:
                break
            match message:
                case AddCoreRequest(request):
                    try:
                        core.add_request(request)
                    except Exception as exc:  # this request is bad, not the core
                        core.abort_requests([request.req_id])
                        failed = CoreRequestFailed(replica, request.req_id, repr(exc))
                        send(failed)
                case AbortCoreRequests(req_ids):
                    core.abort_requests(req_ids)
                    if not core.has_unfinished_requests():  # idle now: report the load
                        last_load = (0, 0)
                        send(CoreStepOutputs(replica, [], *last_load))
                case UtilityCall(call_id, name):
                    send(_utility(engine, replica, call_id, name))
                case ShutdownCore():
                    return
        if core.has_unfinished_requests():
            outputs = core.step()
            load = (len(scheduler.waiting), len(scheduler.running))
            # An empty step (only grammars compiling) that changed nothing sends nothing: the
            # front end would wake up ~1000 times a second for it.
            if outputs or load != last_load:
                send(CoreStepOutputs(replica, outputs, *load))
                last_load = load


def _utility(engine, replica: int, call_id: int, name: str) -> UtilityResult:
    try:
        if name == "stats":
            return UtilityResult(replica, call_id, stats=engine.stats())
        if name == "reset_prefix_cache":
            engine.reset_prefix_cache()
            return UtilityResult(replica, call_id)
        return UtilityResult(replica, call_id, error=f"unknown utility {name!r}")
    except Exception as exc:
        return UtilityResult(replica, call_id, error=repr(exc))


def core_config(args: EngineArgs, config: EngineConfig) -> tuple[EngineArgs, EngineConfig]:
    """What one core process builds its engine from: a plain in-process engine (the core is
    not itself a client), tensor parallelism passed through."""
    one = {"engine_process": False, "data_parallel_size": 1}
    return dataclasses.replace(args, **one), dataclasses.replace(
        config, parallel=dataclasses.replace(config.parallel, **one)
    )
