"""Structured outputs in the engine: the grammar compiler (the tokenizer's analysis: seconds)
is built on a background thread from engine start, and each request's grammar compiles off
the engine thread once it is ready (the request waits in WAITING_FOR_GRAMMAR, through both,
without blocking others), the batch bitmask is
filled on the CPU for the sampled rows, matchers advance with every accepted token (and,
with jump-forward, take the tokens the grammar forces next), and a finished output is
validated against everything the token grammar did not enforce."""

from __future__ import annotations

import atexit
import dataclasses
import importlib
import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future

import torch

from agentrt.engine.core.request import Request
from agentrt.engine.errors import ErrorCode
from agentrt.engine.records import EngineCoreOutput, GrammarBitmask, SamplerStepOutput
from agentrt.grammar import (
    GenerationBounds,
    GrammarCompileError,
    GrammarCompiler,
    GrammarError,
    GrammarMatcher,
    GrammarSpec,
    allocate_bitmask,
)

DEFAULT_BOUNDS = GenerationBounds()
logger = logging.getLogger(__name__)


class CompilerUnavailableError(GrammarCompileError):
    """The grammar compiler could not be built for the model's tokenizer: no grammar can
    compile, whatever the request (the request fails with ErrorCode.INTERNAL)."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(
            "structured outputs are unavailable on this engine: building the grammar compiler "
            f"for the model's tokenizer failed ({type(cause).__name__}: {cause}); requests "
            "without a grammar are served as usual",
            reason="unavailable",
        )


class StructuredRequest:
    """One request's grammar: a compile future, then a matcher (or the compile error and
    the code the request fails with)."""

    __slots__ = ("future", "matcher", "error", "error_code")

    def __init__(self, future: Future) -> None:
        self.future = future
        self.matcher: GrammarMatcher | None = None
        self.error: str | None = None
        self.error_code = ErrorCode.INVALID_SCHEMA

    def poll(self) -> bool:
        """True once compilation finished, successfully (`matcher`) or not (`error`)."""
        if self.matcher is not None or self.error is not None:
            return True
        if not self.future.done():
            return False
        try:
            self.matcher = self.future.result().matcher()
        except CompilerUnavailableError as exc:  # not the request's fault
            self.error, self.error_code = str(exc), ErrorCode.INTERNAL
        except GrammarError as exc:  # the request fails with ErrorCode.INVALID_SCHEMA
            self.error = str(exc)
        return True


class StructuredOutputManager:
    """Owns the grammar compiler and every request's matcher.

    A constrained output ends valid rather than cut by max_tokens: `bounds` caps what a
    schema leaves unbounded (`GenerationBounds`, listed in each grammar's report as
    "bounded"; None generates each schema's exact language), and with `steer_to_budget`
    the last tokens of the budget are steered to close what is open (matcher.fill_bitmask
    with tokens_left; the matcher's `num_steered` counts the steered steps).
    With `jump_forward`, the tokens a grammar forces after a sampled one are appended
    without sampling them (not for requests that ask for logprobs).

    The compiler (xgrammar's tokenizer info, the token tables, the first backend: 5 s for
    the embedded model's 49k tokens, 12-22 s on a loaded machine) is built once, on a
    background thread at the lowest CPU priority, started by the first grammar (or
    `prepare()`). Not at engine start: an engine that never sees a grammar never imports
    transformers, xgrammar or llguidance (start-up and memory, issue 39). Never on the engine
    thread: a grammar that arrives before it is ready waits with its request in
    WAITING_FOR_GRAMMAR while the others decode, and a failed build fails each grammar
    request (CompilerUnavailableError).
    `compiler_factory` builds it (tests slow it down to watch the wait).
    """

    def __init__(
        self,
        tokenizer,
        vocab_size: int,
        stop_token_ids: list[int],
        timeout_s: float,
        bounds: GenerationBounds | None = DEFAULT_BOUNDS,
        steer_to_budget: bool = True,
        jump_forward: bool = False,
        compiler_factory: Callable[[], GrammarCompiler] | None = None,
    ):
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._stop_token_ids = stop_token_ids
        self._timeout_s = timeout_s
        self.bounds = bounds
        self.steer_to_budget = steer_to_budget
        self.jump_forward = jump_forward
        self._compiler_factory = compiler_factory or self._make_compiler
        self._compiler_ready: Future | None = None  # Future[GrammarCompiler], once started
        self._lock = threading.Lock()

    def prepare(self) -> Future:
        """Start building the compiler on a background thread (once; later calls return the
        same Future[GrammarCompiler]). Never blocks."""
        with self._lock:
            if self._compiler_ready is None:
                self._compiler_ready = Future()
                thread = threading.Thread(
                    target=self._build, name="agentrt-grammar-ready", daemon=True
                )
                _BUILDERS.add(thread)
                thread.start()
            return self._compiler_ready

    @property
    def compiler(self) -> GrammarCompiler:
        """The compiler, waiting for its build (not for the engine thread: `start` never
        waits); raises CompilerUnavailableError if the build failed."""
        return self.prepare().result()

    def start(self, request: Request, spec: GrammarSpec) -> None:
        """Start compiling the request's grammar; never blocks. Before the compiler is
        ready, the compile starts on the builder's thread as soon as it is."""
        ready = self.prepare()
        if ready.done():
            future = _compile_with(ready, spec)
        else:
            future = Future()
            ready.add_done_callback(lambda done: _chain(_compile_with(done, spec), future))
        request.structured = StructuredRequest(future)

    def _make_compiler(self) -> GrammarCompiler:
        _import_transformers()
        _check_not_exiting()
        compiler = GrammarCompiler(
            self._tokenizer,
            vocab_size=self.vocab_size,
            stop_token_ids=self._stop_token_ids,
            timeout_s=self._timeout_s,
            bounds=self.bounds,
        )
        _check_not_exiting()
        compiler.warm()  # the first backend's tokenizer state, outside any grammar's budget
        return compiler

    def _build(self) -> None:
        """Builds the compiler on a thread of its own at the lowest CPU priority, so that on
        a machine with few cores the engine's steps (the first token at start-up too) keep
        the CPU; then hands it over from this thread, at the process's priority. The
        handover runs the compiles that waited for it, and a thread inherits its creator's
        priority: compile workers started from the niced thread would stay niced for the
        process's life, and on a busy engine every grammar would run out of its time budget
        (a plain schema answered invalid_schema)."""
        built: list = []

        def build() -> None:
            try:
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
            except (AttributeError, OSError):  # not Linux: a thread has no priority of its own
                pass
            try:
                built.append(self._compiler_factory())
            except BaseException as exc:  # every grammar request fails with it; others run
                built.append(exc)

        try:
            builder = threading.Thread(target=build, name="agentrt-grammar-init", daemon=True)
            builder.start()
            builder.join()
            (outcome,) = built
            if isinstance(outcome, BaseException):
                if not _EXITING.is_set():
                    logger.error("building the grammar compiler failed", exc_info=outcome)
                self._compiler_ready.set_exception(CompilerUnavailableError(outcome))
            else:
                self._compiler_ready.set_result(outcome)
        finally:
            _BUILDERS.discard(threading.current_thread())

    def bitmask(
        self, requests: list[Request], drafts: list[list[int]] | None = None
    ) -> GrammarBitmask | None:
        """The bitmask of one step's sampled rows, or None when no request is constrained.
        Request i has 1 + len(drafts[i]) consecutive rows (no drafts: one row): row j holds
        what may follow its tokens and its first j drafts (`fill_draft_bitmasks`: the
        matcher and its steering end where they started).

        A dead end happens when the token grammar accepted an output that the final check
        rejects (a keyword it does not enforce): nothing may follow, and the request must
        fail rather than sample an arbitrary token. Only a request's first row can be one;
        an empty later row (after a stop token drafted, say) is left unapplied: its token
        counts only if every draft before it is accepted, and the matcher checks it then.
        So are the rows after a draft the grammar refuses (drafts are cut before that)."""
        drafts = drafts or [[] for _ in requests]
        if all(r.structured is None for r in requests):
            return None
        mask = allocate_bitmask(sum(1 + len(d) for d in drafts), self.vocab_size)
        live, dead = [], set()
        row = 0
        for request, draft in zip(requests, drafts, strict=True):
            if request.structured is None:
                row += 1 + len(draft)
                continue
            left = _tokens_left(request) if self.steer_to_budget else None
            matcher = request.structured.matcher
            num_rows = matcher.fill_draft_bitmasks(mask, row, draft, tokens_left=left)
            if not mask[row].any():
                dead.add(request.req_id)
            live.extend(r for r in range(row, row + num_rows) if mask[r].any())
            row += 1 + len(draft)
        return GrammarBitmask(
            torch.from_numpy(mask), torch.tensor(live, dtype=torch.int64), frozenset(dead)
        )

    def accept(
        self, requests: list[Request], sampled: SamplerStepOutput, max_model_len: int
    ) -> SamplerStepOutput:
        """Advance each constrained request's matcher by its sampled tokens (accepted drafts,
        then one more), up to the one that finishes the request; then, with jump-forward,
        by the tokens its grammar forces next (`forced_token_ids`, up to where the request
        would finish). A token the grammar refuses (only possible after an accepted draft,
        whose row was not masked) cuts the tokens before it and makes the request a dead
        end. Returns what the scheduler appends; unconstrained requests pass unchanged."""
        if all(r.structured is None for r in requests):
            return sampled
        tokens = dict(sampled.tokens)
        dead = set(sampled.grammar_dead_end_req_ids)
        forced: dict[str, list[int]] = {}
        for request in requests:
            if request.structured is None or request.req_id not in tokens:
                continue
            matcher = request.structured.matcher
            token_ids = [t.token_id for t in tokens[request.req_id]]
            stop = request.stop_index(token_ids, max_model_len)
            if stop is not None:
                del token_ids[stop + 1 :]
            num_accepted = _accept(matcher, token_ids)
            tokens[request.req_id] = tokens[request.req_id][:num_accepted]
            if num_accepted < len(token_ids):
                dead.add(request.req_id)
            elif stop is None and self._jumps_forward(request):
                more = matcher.forced_tokens()
                stop = request.stop_index(token_ids + more, max_model_len)
                if stop is not None:
                    del more[stop + 1 - len(token_ids) :]
                forced[request.req_id] = more[: _accept(matcher, more)]
        return SamplerStepOutput(tokens, frozenset(dead), forced)

    def _jumps_forward(self, request: Request) -> bool:
        return self.jump_forward and request.sampling_params.logprobs is None

    def finish(
        self, requests: list[Request], outputs: list[EngineCoreOutput]
    ) -> list[EngineCoreOutput]:
        """Outputs of finished constrained requests with the final check of what the token
        grammar did not enforce (`structured_errors`, empty when valid) and the tokens
        steered to close the output before max_tokens; a dead end's error says why the
        output cannot be completed."""
        constrained = {r.req_id: r.structured for r in requests if r.structured is not None}
        if not constrained:
            return outputs
        finished = []
        for output in outputs:
            structured = constrained.get(output.req_id)
            if structured is not None and output.finished:
                problems = structured.matcher.validate_final()
                output = dataclasses.replace(
                    output,
                    structured_errors=problems,
                    num_steered_tokens=structured.matcher.num_steered,
                )
                if output.error_code == ErrorCode.STRUCTURED_OUTPUT_FAILED:
                    why = "the output cannot be completed into a valid instance: "
                    output = dataclasses.replace(output, error=why + "; ".join(problems))
            finished.append(output)
        return finished


_IMPORT_LOCK = threading.Lock()
# Builders still running, and whether the interpreter is exiting. A daemon thread still in
# C++ (xgrammar's tokenizer info, llguidance's) when Python finalizes aborts the process
# ("terminate called without an active exception", exit status 134): at exit the builders
# stop at their next stage and are waited for (one stage: seconds).
_BUILDERS: set[threading.Thread] = set()
_EXITING = threading.Event()


def _check_not_exiting() -> None:
    if _EXITING.is_set():
        raise RuntimeError("the process is exiting")


@atexit.register
def _wait_for_builders() -> None:
    _EXITING.set()
    for thread in list(_BUILDERS):
        thread.join(timeout=120)


def _import_transformers(attempts: int = 5) -> None:
    """Import what xgrammar and llguidance read a tokenizer with (transformers: ~5 s). Two
    threads importing it for the first time at once can fail one of them ("cannot import
    name ..." from its lazy modules, circular across threads): builders take turns, and
    one that raced another thread tries again once that import has gone further."""
    with _IMPORT_LOCK:
        for attempt in range(attempts):
            try:
                importlib.import_module("transformers.tokenization_utils_fast")
                return
            except ImportError:
                if attempt == attempts - 1:
                    raise
                time.sleep(0.5 * (attempt + 1))


def _compile_with(ready: Future, spec: GrammarSpec) -> Future:
    """The compile Future of `spec` on the compiler `ready` holds (done), or one failed
    with the build's error."""
    try:
        return ready.result().compile_async(spec)
    except GrammarError as exc:
        failed: Future = Future()
        failed.set_exception(exc)
        return failed


def _chain(source: Future, target: Future) -> None:
    """Settle `target` as `source` settles."""

    def copy(done: Future) -> None:
        exc = done.exception()
        if exc is not None:
            target.set_exception(exc)
        else:
            target.set_result(done.result())

    source.add_done_callback(copy)


def _accept(matcher: GrammarMatcher, token_ids: list[int]) -> int:
    """Advance the matcher by the tokens until one is refused; returns how many it took."""
    for i, token_id in enumerate(token_ids):
        if not matcher.accept_token(token_id):
            return i
    return len(token_ids)


def _tokens_left(request: Request) -> int | None:
    """Tokens the output may still have, the stop token included; None when a stop token
    could not end it now (ignore_eos, or min_tokens not reached)."""
    params = request.sampling_params
    if params.ignore_eos or request.num_output_tokens < params.min_tokens:
        return None
    return request.max_tokens - request.num_output_tokens
