"""MPClient: engine cores in their own processes (`data_parallel_size` of them), behind a
client thread of the front end's process.

The client thread owns every socket, the OutputProcessor (detokenizing, stop strings and
logprobs stay in the front end, as in vLLM) and the `DPRouter`. It waits on one poller for
the cores' outputs, a wake-up pipe written with each queued command, and each core process's
sentinel, so a core killed by a signal or crashed is noticed at once: the loop stops with
that error, the other cores are shut down, and `AsyncEngine` fails every pending request with
`EngineDeadError`. Core processes are spawned (a forked child would inherit torch's thread
pools and locks in whatever state they were) and not daemonic: a core may start
tensor-parallel workers of its own. Each exits on `ShutdownCore` or when the front end's
process dies.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import multiprocessing
import os
import queue
import shutil
import tempfile
from concurrent.futures import Future

import msgspec

from agentrt.engine import errors
from agentrt.engine.args import EngineArgs
from agentrt.engine.client.core_client import (
    AbortRequests,
    AddRequest,
    CallEngine,
    CallUtility,
    FrontEnd,
    RequestFailed,
    StopEngine,
    _ClientThread,
)
from agentrt.engine.client.core_process import (
    AbortCoreRequests,
    AddCoreRequest,
    CoreLoadFailed,
    CoreOutput,
    CoreReady,
    CoreRequestFailed,
    CoreStepOutputs,
    ShutdownCore,
    UtilityCall,
    UtilityResult,
    core_config,
    run_engine_core,
)
from agentrt.engine.client.dp_router import DPRouter
from agentrt.engine.client.outputs import OutputProcessor
from agentrt.engine.config import EngineConfig
from agentrt.engine.core.scheduler import SchedulerStats
from agentrt.engine.errors import ConfigError, EngineDeadError, EngineError, ModelLoadError
from agentrt.engine.loader.tokenizer import load_tokenizer

_SHUTDOWN_TIMEOUT_S = 10.0  # a core still running this long after ShutdownCore is killed


class CoreDiedError(EngineDeadError):
    """A core process ended without being asked to (killed by a signal, crashed)."""


@dataclasses.dataclass(slots=True)
class _PendingUtility:
    name: str
    future: Future
    per_replica: bool
    results: list[UtilityResult] = dataclasses.field(default_factory=list)


class MPClient(_ClientThread):
    engine = None  # no engine in this process

    def __init__(self, args: EngineArgs) -> None:
        super().__init__()
        self.args = args
        self.num_replicas = args.data_parallel_size
        self.processes: list[multiprocessing.process.BaseProcess] = []
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(CoreOutput)
        self._call_ids = itertools.count()
        self._utilities: dict[int, _PendingUtility] = {}
        self.router: DPRouter | None = None

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"\0")
        except BlockingIOError:  # the pipe is full: the thread is awake already
            pass
        except OSError:  # the loop has ended and closed the pipe's other end
            pass

    # -- client thread -----------------------------------------------------------------------

    def _main(self, built: Future) -> None:
        import zmq

        self._context = zmq.Context(1)
        self._dir = tempfile.mkdtemp(prefix="agentrt-core-")
        try:
            config = self.args.create_engine_config()  # resolved once, here, for every core
            self._start_cores(config)
            tokenizer = load_tokenizer(config.model.path)  # no weights: the cores hold them
            self.output_processor = OutputProcessor(copy.deepcopy(tokenizer))
            self.router = DPRouter(self.num_replicas, config.cache.block_size)
        except BaseException as exc:
            self._exit(None)
            self._close()  # no core outlives a failed start
            built.set_exception(exc)
            return
        built.set_result(FrontEnd(config, tokenizer))
        error: BaseException | None = None
        try:
            self._loop()
        except BaseException as exc:  # a fault or a dead core: every request fails
            error = exc
        finally:
            self._fail_utilities()
            self._exit(error)  # pending requests fail now, before the cores are stopped
            self._close()

    def _fail_utilities(self) -> None:
        for pending in self._utilities.values():
            pending.future.set_exception(EngineDeadError("the engine loop has stopped."))
        self._utilities.clear()

    def _close(self) -> None:
        """Stop the cores, free sockets and files."""
        self._stop_cores()
        os.close(self._wake_r)
        shutil.rmtree(self._dir, ignore_errors=True)

    def _start_cores(self, config: EngineConfig) -> None:
        """Spawn the cores (each builds its engine from `config`) and wait for each one's
        handshake; raises its load error."""
        import zmq

        self._outputs_socket = self._context.socket(zmq.PULL)
        output_addr = f"ipc://{self._dir}/outputs"
        self._outputs_socket.bind(output_addr)
        self._inputs: list = []
        spawn = multiprocessing.get_context("spawn")
        args, core = core_config(self.args, config)
        for replica in range(self.num_replicas):
            socket = self._context.socket(zmq.PUSH)
            socket.setsockopt(zmq.SNDHWM, 0)
            input_addr = f"ipc://{self._dir}/inputs-{replica}"
            socket.bind(input_addr)
            self._inputs.append(socket)
            process = spawn.Process(
                target=run_engine_core,
                args=(args, core, replica, self.num_replicas, input_addr, output_addr),
                name=f"agentrt-core-{replica}",
            )
            process.start()
            self.processes.append(process)
        self._poller = zmq.Poller()
        self._poller.register(self._outputs_socket, zmq.POLLIN)
        for process in self.processes:
            self._poller.register(process.sentinel, zmq.POLLIN)
        ready: set[int] = set()
        while len(ready) < self.num_replicas:
            events = dict(self._poller.poll())
            while (message := self._recv()) is not None:
                if isinstance(message, CoreReady):
                    ready.add(message.replica)
                elif isinstance(message, CoreLoadFailed):
                    raise _load_error(message)
            for replica, process in enumerate(self.processes):
                if process.sentinel in events and replica not in ready:
                    process.join()
                    raise ModelLoadError(
                        f"engine core process {replica} (pid {process.pid}) exited with code "
                        f"{process.exitcode} while loading the model; its output above says why."
                    )
        self._poller.register(self._wake_r, zmq.POLLIN)

    def _loop(self) -> None:
        """Until StopEngine: wait for outputs, commands or a dead core, then handle them."""
        while True:
            events = dict(self._poller.poll())
            if self._wake_r in events:
                _drain_pipe(self._wake_r)
            while (message := self._recv()) is not None:
                self._on_output(message)
            for replica, process in enumerate(self.processes):
                if process.sentinel in events:
                    process.join()
                    raise CoreDiedError(
                        f"engine core process {replica} (pid {process.pid}) died "
                        f"(exit code {process.exitcode}); start a new engine."
                    )
            if not self._handle_commands():
                return

    def _recv(self) -> CoreOutput | None:
        import zmq

        try:
            return self._decoder.decode(self._outputs_socket.recv(zmq.NOBLOCK))
        except zmq.Again:
            return None

    def _send(self, replica: int, message) -> None:
        """Queue a message for a core (never blocks: the input sockets have no high-water
        mark, and a core that is no longer connected is dead)."""
        import zmq

        try:
            self._inputs[replica].send(self._encoder.encode(message), zmq.NOBLOCK)
        except zmq.Again:
            raise CoreDiedError(
                f"engine core process {replica} is not connected; start a new engine."
            ) from None

    def _on_output(self, message: CoreOutput) -> None:
        match message:
            case CoreStepOutputs(replica, outputs, num_waiting, num_running):
                self.router.report(replica, num_waiting, num_running)
                deltas, to_abort = self.output_processor.process_outputs(outputs)
                if to_abort:  # ended by a stop string
                    self._send(replica, AbortCoreRequests(to_abort))
                for delta in deltas:
                    if delta.output is not None:
                        out = delta.output
                        self.router.finished(
                            delta.request_id, out.prompt_token_ids + out.outputs[0].token_ids
                        )
                if deltas:
                    self._outputs.put(deltas)
            case CoreRequestFailed(_, req_id, text):
                self.output_processor.abort([req_id])
                self.router.finished(req_id)
                self._outputs.put(RequestFailed(req_id, EngineError(text)))
            case UtilityResult(_, call_id):
                pending = self._utilities[call_id]
                pending.results.append(message)
                if len(pending.results) == self.num_replicas:
                    del self._utilities[call_id]
                    _resolve_utility(pending)
            case CoreReady() | CoreLoadFailed():
                raise AssertionError(f"a core sent a second handshake: {message}")

    def _handle_commands(self) -> bool:
        """Apply every queued command; False on stop."""
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return True
            match command:
                case AddRequest(request, prompt):
                    self.output_processor.add_request(
                        request.req_id, prompt, request.prompt_token_ids, request.sampling_params
                    )
                    replica = self.router.route(request.req_id, request.prompt_token_ids)
                    self._send(replica, AddCoreRequest(request))
                case AbortRequests(req_ids):
                    by_replica: dict[int, list[str]] = {}
                    for req_id in req_ids:
                        replica = self.router.owners.get(req_id)
                        if replica is not None:
                            by_replica.setdefault(replica, []).append(req_id)
                            self.router.finished(req_id)
                    for replica, ids in by_replica.items():
                        self._send(replica, AbortCoreRequests(ids))
                    deltas = self.output_processor.abort(req_ids)
                    if deltas:
                        self._outputs.put(deltas)
                case CallUtility(name, future, per_replica):
                    call_id = next(self._call_ids)
                    self._utilities[call_id] = _PendingUtility(name, future, per_replica)
                    for replica in range(self.num_replicas):
                        self._send(replica, UtilityCall(call_id, name))
                case CallEngine(_, future):
                    future.set_exception(
                        ConfigError("call(fn) needs an in-process engine (engine_process=False).")
                    )
                case StopEngine():
                    self.output_processor.abort(list(self.output_processor.states))
                    return False

    def _stop_cores(self) -> None:
        """Ask every live core to stop, wait for it, kill it past the timeout; close sockets."""
        for replica, process in enumerate(self.processes):
            if process.is_alive():
                try:
                    self._send(replica, ShutdownCore())
                except CoreDiedError:  # still loading, or gone: killed below
                    pass
        for process in self.processes:
            process.join(_SHUTDOWN_TIMEOUT_S)
            if process.is_alive():
                process.kill()
                process.join()
        for socket in getattr(self, "_inputs", []):
            socket.close(linger=0)
        if hasattr(self, "_outputs_socket"):
            self._outputs_socket.close(linger=0)
        self._context.term()


def _load_error(message: CoreLoadFailed) -> EngineError:
    """The core's load error as the same type (`ModelLoadError`, `ConfigError`, ...)."""
    error_type = getattr(errors, message.error_type, None) if message.error_type else None
    if isinstance(error_type, type) and issubclass(error_type, EngineError):
        try:
            return error_type(message.message)
        except TypeError:  # a constructor with other required arguments
            pass
    return EngineError(f"engine core {message.replica} failed to start: {message.message}")


def _resolve_utility(pending: _PendingUtility) -> None:
    failed = [r.error for r in pending.results if r.error is not None]
    if failed:
        pending.future.set_exception(EngineError(f"{pending.name} failed: {failed[0]}"))
    else:
        by_replica = sorted(pending.results, key=lambda r: r.replica)
        values = [r.stats for r in by_replica]  # None for calls without a result
        if pending.per_replica:
            pending.future.set_result(values)
        elif pending.name == "stats":
            pending.future.set_result(sum_stats(values))
        else:
            pending.future.set_result(None)


def sum_stats(per_replica: list[SchedulerStats]) -> SchedulerStats:
    """The replicas' stats as one engine's: counts summed, KV usage averaged (the replicas'
    pools are the same size)."""
    if len(per_replica) == 1:
        return per_replica[0]
    first = per_replica[0]

    def summed(name: str):
        parts = [getattr(s, name) for s in per_replica]
        if parts[0] is None:
            return None
        fields = dataclasses.fields(parts[0])
        return type(parts[0])(**{f.name: sum(getattr(p, f.name) for p in parts) for f in fields})

    return SchedulerStats(
        num_running=sum(s.num_running for s in per_replica),
        num_waiting=sum(s.num_waiting for s in per_replica),
        kv_cache_usage=sum(s.kv_cache_usage for s in per_replica) / len(per_replica),
        num_preemptions=sum(s.num_preemptions for s in per_replica),
        prefix_cache_queried_tokens=sum(s.prefix_cache_queried_tokens for s in per_replica),
        prefix_cache_hit_tokens=sum(s.prefix_cache_hit_tokens for s in per_replica),
        spec_decode_method=first.spec_decode_method,
        spec_decode=summed("spec_decode"),
        kv_connector=first.kv_connector,
        kv_transfer=summed("kv_transfer"),
    )


def _drain_pipe(fd: int) -> None:
    try:
        while os.read(fd, 4096):
            pass
    except BlockingIOError:
        pass
