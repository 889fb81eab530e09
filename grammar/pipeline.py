"""Spec -> (routing decision, backend grammar). Pure compilation, no caching, no threads.

For JSON schemas: limits check -> normalize -> (generation bounds, when asked for) -> for
each backend in preference order, relax to what it enforces and try it; the first that
compiles wins. Other kinds map to a regex or grammar text and go to the first backend that
reads it.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from typing import Any

from .backend import BackendGrammar, GrammarBackend
from .bounds import bound_schema
from .cache import RoutedSource
from .errors import BackendUnavailableError, GrammarCompileError, GrammarCompileTimeout
from .limits import GenerationBounds, RunLimits, SchemaLimits
from .normalize import normalize_schema
from .report import GrammarReport, KeywordStatus, ReportBuilder
from .router import keys_to_drop, relax_for
from .spec import GrammarSpec
from .tools import tool_calls_lark, tool_calls_schema

GetBackend = Callable[[str], GrammarBackend]
# Runs one backend build: (backend name, thunk) -> result. Lets the caller put slow,
# uninterruptible builds (xgrammar) under a time budget.
Runner = Callable[[str, Callable[[], BackendGrammar]], BackendGrammar]


def run_inline(name: str, fn: Callable[[], BackendGrammar]) -> BackendGrammar:
    return fn()


def compile_spec(
    spec: GrammarSpec,
    order: tuple[str, ...],
    get_backend: GetBackend,
    limits: SchemaLimits,
    runs: RunLimits,
    runner: Runner = run_inline,
    bounds: GenerationBounds | None = None,
) -> tuple[RoutedSource, BackendGrammar]:
    get_backend = with_runner(get_backend, runner)
    if spec.kind == "json_schema":
        value = spec.json_value()
        return _compile_json(value, spec.text, order, get_backend, limits, runs, bounds)
    if spec.kind == "tools":
        tool_choice = spec.option_dict["tool_choice"]
        schema = tool_calls_schema(
            spec.json_value(), tool_choice, parallel=spec.parallel_tool_calls
        )
        if tool_choice != "auto":
            text = json.dumps(schema)
            return _compile_json(schema, text, order, get_backend, limits, runs, bounds)
        # Text-or-call needs llguidance's %json embedding inside a Lark grammar.
        source = RoutedSource("llguidance", "lark", tool_calls_lark(schema), [], True)
        return source, build(source, get_backend, runs)
    errors: list[str] = []
    for name, kind, text in _sources(spec, order):
        # No EOS gate: a regex is compiled exactly, so the matcher's end proves the match.
        source = RoutedSource(name, kind, text, [], False)
        try:
            return source, build(source, get_backend, runs)
        except BackendUnavailableError as exc:
            errors.append(exc.detail)
        except GrammarCompileTimeout:
            raise
        except GrammarCompileError as exc:
            errors.append(exc.detail)
    if not errors:
        errors.append(
            f"no backend among {order} reads it (Lark grammars need llguidance; GBNF needs "
            "xgrammar or llguidance; choices and regexes work on every backend)"
        )
    raise GrammarCompileError(
        f"cannot compile {spec.kind} spec: " + "; ".join(errors), reason="unsupported"
    )


def build(source: RoutedSource, get_backend: GetBackend, runs: RunLimits) -> BackendGrammar:
    backend = get_backend(source.backend)
    if source.kind == "json":
        return backend.compile_json(source.source, runs)  # JSON text: no extra round trip
    if source.kind == "regex":
        return backend.compile_regex(source.source)
    return backend.compile_grammar(source.source, source.kind)


def with_runner(get_backend: GetBackend, runner: Runner) -> Any:
    """get_backend whose builds go through `runner` (via `build`)."""
    if runner is run_inline:
        return get_backend

    def get(name: str) -> Any:
        return _RunnerBackend(get_backend(name), runner)

    return get


class _RunnerBackend:
    def __init__(self, backend: GrammarBackend, runner: Runner) -> None:
        self._b, self._run, self.name = backend, runner, backend.name

    def compile_json(self, schema: Any, runs: RunLimits) -> BackendGrammar:
        return self._run(self.name, lambda: self._b.compile_json(schema, runs))

    def compile_regex(self, pattern: str) -> BackendGrammar:
        return self._run(self.name, lambda: self._b.compile_regex(pattern))

    def compile_grammar(self, text: str, syntax: str) -> BackendGrammar:
        return self._run(self.name, lambda: self._b.compile_grammar(text, syntax))


def report_of(source: RoutedSource) -> GrammarReport:
    return GrammarReport(source.backend, tuple(KeywordStatus(*e) for e in source.report))


def _sources(spec: GrammarSpec, order: tuple[str, ...]) -> list[tuple[str, str, str]]:
    """(backend, source kind, source text) candidates in preference order."""
    if spec.kind in ("regex", "text"):
        pattern = spec.text if spec.kind == "regex" else r"(?s:.*)"
        return [(b, "regex", pattern) for b in order if b != "outlines" or spec.kind == "regex"]
    if spec.kind == "choice":
        alts = " | ".join(json.dumps(c, ensure_ascii=False) for c in spec.json_value())
        escaped = "|".join(_regex_escape(c) for c in spec.json_value())
        by_backend = {
            "outlines": ("regex", f"({escaped})"),
            "llguidance": ("lark", f"start: {alts}\n"),
            "xgrammar": ("gbnf", f"root ::= {alts}\n"),
        }
        return [(b, *by_backend[b]) for b in order if b in by_backend]
    syntax = spec.option_dict.get("syntax", "lark")
    readers = ("llguidance",) if syntax == "lark" else ("xgrammar", "llguidance")
    return [(b, syntax, spec.text) for b in readers if b in order]


def _regex_escape(text: str) -> str:
    """Escape only regex metacharacters (portable across Rust, C++ and Python dialects)."""
    return "".join("\\" + ch if ch in r"\.^$|?*+()[]{}" else ch for ch in text)


def _compile_json(
    schema: Any,
    text: str,
    order: tuple[str, ...],
    get_backend: GetBackend,
    limits: SchemaLimits,
    runs: RunLimits,
    bounds: GenerationBounds | None,
) -> tuple[RoutedSource, BackendGrammar]:
    limits.check(schema, text)
    base = ReportBuilder()
    normalized = normalize_schema(schema, base)
    errors: list[str] = []
    candidates = [(normalized.schema, base)]
    if bounds is not None:
        bounded = base.copy()
        target = bound_schema(normalized.schema, bounds, bounded)
        # A cap the schema cannot meet (a pattern longer than max_string_length) makes the
        # bounded schema fail: then this backend compiles it as written, and says so.
        base.add("bounds", "annotation", "#", "not applied: the bounded schema did not compile")
        candidates.insert(0, (target, bounded))
    for name in order:
        for target, report in candidates:
            found = _route(target, name, get_backend, runs, report, errors)
            if found is not None:
                return found
    raise GrammarCompileError(_explain(schema, errors), reason="invalid_schema")


def _route(
    schema: Any,
    name: str,
    get_backend: GetBackend,
    runs: RunLimits,
    base: ReportBuilder,
    errors: list[str],
) -> tuple[RoutedSource, BackendGrammar] | None:
    """Backend `name`'s grammar for `schema` relaxed for it; None if it cannot compile it
    (the error is appended to `errors`)."""
    drop: frozenset[str] = frozenset()
    for _attempt in range(5):
        report = base.copy()
        relaxed = relax_for(name, schema, report, drop)
        # xgrammar and outlines approximate some keywords they claim: always check.
        built = report.build(name)
        gate = bool(built.post_checked) or name != "llguidance"
        entries = [list(dataclasses.astuple(e)) for e in built.entries]
        source = RoutedSource(name, "json", json.dumps(relaxed), entries, gate)
        try:
            return source, build(source, get_backend, runs)
        except BackendUnavailableError as exc:
            errors.append(exc.detail)
            return None
        except GrammarCompileTimeout:
            raise
        except GrammarCompileError as exc:
            more = keys_to_drop(exc.detail, drop)
            if not more:
                errors.append(exc.detail)
                return None
            drop |= more  # retry without the constructs the backend named
    return None


def _explain(schema: Any, errors: list[str]) -> str:
    """Name the problem: a metaschema violation if there is one, else the backends' errors."""
    import jsonschema

    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    problem = jsonschema.exceptions.best_match(cls(cls.META_SCHEMA).iter_errors(schema))
    if problem is not None:
        where = "/".join(str(p) for p in problem.absolute_path) or "(root)"
        return f"invalid JSON schema at {where}: {problem.message}"
    return "no backend could compile the schema: " + " | ".join(e[:300] for e in errors)
