"""`GrammarCompiler`: specs -> `Grammar`s for one tokenizer, cached and time-bounded.

Compilation runs on a worker thread (workers.py) with a time budget. A spec that does not compile in
time fails with `GrammarCompileTimeout` for its own request; the caller (the engine thread)
is never blocked longer than the budget.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import replace
from typing import Any

from .backend import BackendGrammar, GrammarBackend, TokenizerData, digit_tables
from .budget import finish_tables
from .cache import DiskCache, GrammarCache
from .errors import (
    GrammarCompileError,
    GrammarCompileTimeout,
    GrammarError,
    GrammarSpecError,
    SchemaLimitError,
)
from .limits import GenerationBounds, RunLimits, SchemaLimits
from .matcher import Grammar
from .pipeline import Runner, build, compile_spec, report_of, run_inline, with_runner
from .reasoning import single_token_id, think_lark
from .reasoning_matcher import ReasoningGrammar
from .report import GrammarReport
from .spec import GrammarSpec, ReasoningPlan
from .validate import FinalValidator
from .workers import CompileWorkers, settle

BACKENDS = ("llguidance", "xgrammar", "outlines")
_JSON_KINDS = ("json_schema", "tools")
# A spec nested past what a backend's recursive parser can read (a regex of 400 groups).
_TOO_DEEP = "the grammar is nested too deeply for a backend to compile; flatten it"


class GrammarCompiler:
    """Compiles `GrammarSpec`s for one tokenizer.

    hf_tokenizer: a fast HF tokenizer, or a tokenizer with `to_transformers()` that gives one
    (the engine's GGUF tokenizer: xgrammar and llguidance read only transformers' own).
    vocab_size: logits width when padded (ids at or above the tokenizer's vocabulary are
    always masked). backend: "auto" (llguidance, then xgrammar), or one backend name to use
    only that one. timeout_s: default time budget.
    bounds: caps for JSON schemas that leave strings, arrays or objects unbounded, so that
    generation always ends (`GenerationBounds`; reported as "bounded"). None (default)
    compiles each schema's exact language, as validators and MaskBench need; an inference
    engine passes `GenerationBounds()`.
    """

    def __init__(
        self,
        hf_tokenizer: Any,
        vocab_size: int | None = None,
        *,
        stop_token_ids: list[int] | None = None,
        backend: str = "auto",
        timeout_s: float = 10.0,
        cache_bytes: int = 512 << 20,
        disk_cache_dir: str | None = None,
        schema_limits: SchemaLimits | None = None,
        run_limits: RunLimits | None = None,
        bounds: GenerationBounds | None = None,
    ) -> None:
        if backend != "auto" and backend not in BACKENDS:
            raise GrammarSpecError(f"backend must be 'auto' or one of {BACKENDS}, got {backend!r}")
        if timeout_s <= 0:
            raise GrammarSpecError(f"timeout_s must be > 0, got {timeout_s}")
        to_transformers = getattr(hf_tokenizer, "to_transformers", None)
        if to_transformers is not None:
            hf_tokenizer = to_transformers()
        self.tok = _tokenizer_data(hf_tokenizer, vocab_size, stop_token_ids)
        self.order = ("llguidance", "xgrammar") if backend == "auto" else (backend,)
        self.timeout_s = timeout_s
        self.schema_limits = schema_limits or SchemaLimits()
        self.run_limits = run_limits or RunLimits()
        self.bounds = bounds
        self.cache = GrammarCache(cache_bytes)
        self.disk_cache = DiskCache(disk_cache_dir) if disk_cache_dir else None
        self._backends: dict[str, GrammarBackend] = {}
        self._backend_lock = threading.Lock()
        self._workers = CompileWorkers()

    @property
    def vocab_size(self) -> int:
        return self.tok.vocab_size

    def warm(self) -> None:
        """Build the first backend's tokenizer state now (llguidance's: ~1 s for a 49k
        vocabulary), so that the first grammar's time budget is spent on the grammar. A
        backend that cannot be built is left to fail (or be passed over) at compile time."""
        try:
            self._backend(self.order[0])
        except GrammarError:
            pass

    def compile(self, spec: GrammarSpec, *, timeout_s: float | None = None) -> Grammar:
        """Compile in the calling thread (or fetch from cache); raises GrammarCompileError.

        Normalization (bounded by SchemaLimits) and llguidance builds (bounded by its own
        fuel limits, well under a second) run inline; xgrammar builds, which can take
        seconds and cannot be interrupted, run on a worker under the remaining budget, and
        the whole call raises GrammarCompileTimeout once the budget is spent. The engine
        thread uses `compile_async` instead, which never blocks.
        """
        if not isinstance(spec, GrammarSpec):
            raise GrammarSpecError(f"expected a GrammarSpec, got {type(spec).__name__}")
        key = self._key(spec)
        cached = self.cache.get(key)
        if cached is not None:
            return cached
        budget = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + budget

        def runner(name: str, fn: Callable[[], BackendGrammar]) -> BackendGrammar:
            left = deadline - time.monotonic()
            if left <= 0:
                raise _timeout(spec, budget)
            if name == "llguidance":
                return fn()
            future: Future = Future()
            self._workers.submit(lambda: _run_into(fn, future), future, left, lambda: None)
            try:
                return future.result(timeout=left)
            except FutureTimeout:
                settle(future, exc=_timeout(spec, budget))
                raise _timeout(spec, budget) from None

        try:
            grammar = self._compile_now(spec, key, runner)
        except GrammarError:
            raise
        except RecursionError:
            raise SchemaLimitError(_TOO_DEEP) from None
        except Exception as exc:  # a backend bug fails this spec, with its cause attached
            raise GrammarCompileError(f"internal: {exc!r}", reason="backend") from exc
        self.cache.put(key, grammar, grammar.memory_bytes)  # a retry may reuse it
        if time.monotonic() > deadline:
            raise _timeout(spec, budget)
        return grammar

    def compile_async(self, spec: GrammarSpec, *, timeout_s: float | None = None) -> Future:
        """Start compiling on a worker thread; the Future fails after the time budget.

        Returns a `concurrent.futures.Future[Grammar]` (already done on a cache hit). Past
        the budget the worker's slot goes to the next compile (workers.py) and no further
        backend build of this spec starts.
        """
        if not isinstance(spec, GrammarSpec):
            raise GrammarSpecError(f"expected a GrammarSpec, got {type(spec).__name__}")
        future: Future = Future()
        key = self._key(spec)
        cached = self.cache.get(key)
        if cached is not None:
            future.set_result(cached)
            return future
        budget = self.timeout_s if timeout_s is None else timeout_s

        def stage(name: str, fn: Callable[[], BackendGrammar]) -> BackendGrammar:
            if future.done():  # past the budget: start no further backend build
                raise _timeout(spec, budget)
            return fn()

        def work() -> None:
            try:
                grammar = self._compile_now(spec, key, stage)
            except GrammarCompileError as exc:
                settle(future, exc=exc)
            except RecursionError:
                settle(future, exc=SchemaLimitError(_TOO_DEEP))
            except Exception as exc:  # a backend bug must fail the request, not the engine
                settle(future, exc=GrammarCompileError(f"internal: {exc!r}", reason="backend"))
            else:
                self.cache.put(key, grammar, grammar.memory_bytes)
                settle(future, result=grammar)

        self._workers.submit(work, future, budget, lambda: _timeout(spec, budget))
        return future

    def _compile_now(self, spec: GrammarSpec, key: str, runner: Runner = run_inline) -> Grammar:
        if spec.reasoning is not None:
            return self._compile_reasoning(spec, spec.reasoning, runner)
        start = time.perf_counter()
        routed = self.disk_cache.get(key) if self.disk_cache else None
        if routed is not None:
            backend_grammar = build(routed, with_runner(self._backend, runner), self.run_limits)
        else:
            routed, backend_grammar = compile_spec(
                spec,
                self.order,
                self._backend,
                self.schema_limits,
                self.run_limits,
                runner,
                self._bounds_for(spec),
            )
            if self.disk_cache:
                self.disk_cache.put(key, routed)
        report = report_of(routed)
        return Grammar(
            spec=spec,
            report=report,
            backend_grammar=backend_grammar,
            validator=FinalValidator(spec, proven=_proven(spec, report)),
            gate_eos=routed.gate_eos,
            max_digit_run=self.run_limits.max_digit_run if spec.kind in _JSON_KINDS else 0,
            tok=self.tok,
            compile_seconds=time.perf_counter() - start,
        )

    def _compile_reasoning(self, spec: GrammarSpec, plan: ReasoningPlan, runner: Runner) -> Any:
        """A reasoning block, then the answer's grammar (reasoning.py); each part is compiled
        (and cached) as a spec of its own."""
        hf = self.tok.hf_tokenizer
        start_id, end_id = single_token_id(hf, plan.start), single_token_id(hf, plan.end)
        if plan.optional and start_id is None:
            raise GrammarSpecError(
                f"an optional reasoning block needs {plan.start!r} to be one token of the "
                "tokenizer; force it (reasoning=True) or leave it out"
            )
        think_spec = GrammarSpec.from_ebnf(
            think_lark(plan, start_id is not None, end_id is not None)
        )
        parts = []
        for part in (think_spec, replace(spec, reasoning=None)):
            key = self._key(part)
            grammar = self.cache.get(key)
            if grammar is None:
                grammar = self._compile_now(part, key, runner)
                self.cache.put(key, grammar, grammar.memory_bytes)
            parts.append(grammar)
        end_ids = (
            (end_id,)
            if end_id is not None
            else tuple(hf.encode(plan.end, add_special_tokens=False))
        )
        if plan.opened:
            num_start = 0
        else:
            num_start = (
                1 if start_id is not None else len(hf.encode(plan.start, add_special_tokens=False))
            )
        return ReasoningGrammar(
            spec, parts[0], parts[1], plan, end_ids, start_id if plan.optional else None, num_start
        )

    def _bounds_for(self, spec: GrammarSpec) -> GenerationBounds | None:
        """The spec's own bounds (GrammarSpec.with_bounds), else the compiler's."""
        text = spec.option_dict.get("bounds")
        return self.bounds if text is None else GenerationBounds.from_option(text)

    def _backend(self, name: str) -> GrammarBackend:
        with self._backend_lock:
            if name not in self._backends:
                self._backends[name] = _make_backend(name, self.tok)
            return self._backends[name]

    def _key(self, spec: GrammarSpec) -> str:
        h = hashlib.sha256(spec.cache_key().encode())
        h.update(f"{self.tok.fingerprint}|{self.order}|{self.run_limits}|{self.bounds}".encode())
        return h.hexdigest()


def _proven(spec: GrammarSpec, report: GrammarReport) -> frozenset[str]:
    """What a matcher reaching its end proves (validate.py): every backend compiles a regex
    spec into an exact automaton. A JSON schema's patterns are proven only by an exact
    llguidance grammar (xgrammar's are always post-checked), and only where a pattern held
    true cannot make the schema reject more: not under `not`, an `if`, oneOf's exclusivity
    or a maxContains, whose checks need each pattern's real verdict."""
    if spec.kind == "regex":
        return frozenset({"regex"})
    if spec.kind not in _JSON_KINDS or report.backend != "llguidance" or not report.exact:
        return frozenset()
    return frozenset() if _has_keys(spec.json_value(), _NOT_MONOTONE) else frozenset({"pattern"})


_NOT_MONOTONE = frozenset({"not", "if", "oneOf", "maxContains"})


def _has_keys(node: Any, keys: frozenset[str]) -> bool:
    """Whether any object in a JSON value has one of `keys` (a property named so counts
    too: a false alarm only costs the shortcut)."""
    stack = [node]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if keys & node.keys():
                return True
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return False


def _timeout(spec: GrammarSpec, budget: float) -> GrammarCompileTimeout:
    return GrammarCompileTimeout(
        f"{spec.kind} spec did not compile within {budget:g} s; simplify it "
        "(fewer/shallower anyOf, smaller enums) or raise the time budget"
    )


def _run_into(fn: Callable[[], Any], future: Future) -> None:
    try:
        settle(future, result=fn())
    except BaseException as exc:  # delivered to the waiting caller, who re-raises it
        settle(future, exc=exc)


def _make_backend(name: str, tok: TokenizerData) -> GrammarBackend:
    if name == "llguidance":
        from .backend_llguidance import LLGuidanceBackend

        return LLGuidanceBackend(tok)
    if name == "xgrammar":
        from .backend_xgrammar import XGrammarBackend

        return XGrammarBackend(tok)
    from .backend_outlines import OutlinesBackend

    return OutlinesBackend(tok)


def _tokenizer_data(hf: Any, vocab_size: int | None, stop_ids: list[int] | None) -> TokenizerData:
    import xgrammar as xg

    n = len(hf)
    width = n if vocab_size is None else vocab_size
    if width < n:
        raise GrammarSpecError(
            f"vocab_size {width} is smaller than the tokenizer's {n} tokens; pass the logits "
            "width (>= tokenizer size) or None"
        )
    if stop_ids is None:
        stop_ids = [hf.eos_token_id] if hf.eos_token_id is not None else []
    if not stop_ids:
        raise GrammarSpecError("the tokenizer has no eos_token_id; pass stop_token_ids")
    info = xg.TokenizerInfo.from_huggingface(hf, vocab_size=width, stop_token_ids=stop_ids)
    token_bytes = tuple(bytes(b) for b in info.decoded_vocab)
    token_bytes = token_bytes + (b"",) * (width - len(token_bytes))
    digest = hashlib.sha256(b"\0".join(token_bytes[:n]))
    digest.update(f"{width}|{sorted(stop_ids)}".encode())
    starts, only, tail = digit_tables(token_bytes)
    rank, openers, closing_openers = finish_tables(token_bytes, tuple(stop_ids))
    fingerprint = digest.hexdigest()[:16]
    return TokenizerData(
        hf,
        width,
        n,
        tuple(stop_ids),
        token_bytes,
        fingerprint,
        starts,
        only,
        tail,
        rank,
        openers,
        closing_openers,
    )
