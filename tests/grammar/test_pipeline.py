"""Compilation pipeline (pipeline.py): which backend gets a spec, in what form, and what
happens when one refuses; backends are fakes that record what they were handed."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest

from agentrt.grammar import (
    BackendUnavailableError,
    GenerationBounds,
    GrammarCompileError,
    GrammarCompileTimeout,
    GrammarSpec,
    RunLimits,
    SchemaLimits,
)
from agentrt.grammar.pipeline import compile_spec, report_of

from .helpers import TOOLS

Refusal = Callable[[str], Exception | None]  # source text -> the error to raise, or None


class FakeBackend:
    def __init__(self, name: str, refuse: Refusal = lambda source: None) -> None:
        self.name, self.refuse, self.seen = name, refuse, []

    def _build(self, kind: str, source: str) -> Any:
        self.seen.append((kind, source))
        error = self.refuse(source)
        if error is not None:
            raise error
        return f"{self.name}:{kind}"  # stands in for the backend grammar

    def compile_json(self, schema: str, runs: RunLimits) -> Any:
        return self._build("json", schema)

    def compile_regex(self, pattern: str) -> Any:
        return self._build("regex", pattern)

    def compile_grammar(self, text: str, syntax: str) -> Any:
        return self._build(syntax, text)


def run(spec: GrammarSpec, *backends: FakeBackend, **kwargs: Any) -> tuple[Any, Any]:
    by_name = {b.name: b for b in backends}
    order = tuple(by_name)
    return compile_spec(spec, order, by_name.__getitem__, SchemaLimits(), RunLimits(), **kwargs)


def refuse_if(text: str, error: str) -> Refusal:
    return lambda source: GrammarCompileError(error) if text in source else None


SCHEMA = {"type": "array", "items": {"type": "integer", "multipleOf": 3}}


def test_a_refused_keyword_is_relaxed_and_retried_on_the_same_backend() -> None:
    llg = FakeBackend("llguidance", refuse_if("multipleOf", 'Unimplemented keys: ["multipleOf"]'))
    xgr = FakeBackend("xgrammar")
    source, grammar = run(GrammarSpec.from_json_schema(SCHEMA), llg, xgr)
    assert grammar == "llguidance:json" and source.backend == "llguidance" and not xgr.seen
    first, retry = (json.loads(source) for _, source in llg.seen)
    assert first == SCHEMA and retry == {"type": "array", "items": {"type": "integer"}}
    report = report_of(source)
    assert report.post_checked == {"multipleOf"} and source.gate_eos
    assert {"type", "items"} <= report.enforced


def test_an_unavailable_backend_passes_the_schema_to_the_next() -> None:
    llg = FakeBackend("llguidance", lambda _: BackendUnavailableError("llguidance", "llg"))
    xgr = FakeBackend("xgrammar")
    source, _ = run(GrammarSpec.from_json_schema({"type": "integer"}), llg, xgr)
    assert source.backend == "xgrammar" and report_of(source).exact
    assert source.gate_eos  # xgrammar's grammars are always post-checked


def test_when_no_backend_compiles_the_error_names_why() -> None:
    llg = FakeBackend("llguidance", refuse_if("", "llg: too hard"))
    xgr = FakeBackend("xgrammar", refuse_if("", "xgr: also too hard"))
    with pytest.raises(GrammarCompileError, match="llg: too hard.*xgr: also too hard"):
        run(GrammarSpec.from_json_schema({"type": "integer"}), llg, xgr)
    with pytest.raises(GrammarCompileError, match="invalid JSON schema at type: 'strng'"):
        run(GrammarSpec.from_json_schema({"type": "strng"}), llg, xgr)


def test_a_timeout_is_not_retried_elsewhere() -> None:
    llg = FakeBackend("llguidance", lambda _: GrammarCompileTimeout("over budget"))
    xgr = FakeBackend("xgrammar")
    with pytest.raises(GrammarCompileTimeout):
        run(GrammarSpec.from_json_schema({"type": "integer"}), llg, xgr)
    assert not xgr.seen


def test_bounds_the_schema_cannot_meet_are_dropped_and_reported() -> None:
    llg = FakeBackend("llguidance", refuse_if("maxLength", "pattern longer than maxLength"))
    spec = GrammarSpec.from_json_schema({"type": "string"})
    source, _ = run(spec, llg, bounds=GenerationBounds())
    bounded, as_written = (json.loads(source) for _, source in llg.seen)
    assert bounded == {"type": "string", "maxLength": 512} and as_written == {"type": "string"}
    assert "bounds" in report_of(source).annotations and not report_of(source).bounded


def test_other_kinds_go_to_the_first_backend_that_reads_them() -> None:
    choice = GrammarSpec.from_choice(["b", "a"])
    source, _ = run(choice, FakeBackend("llguidance"), FakeBackend("xgrammar"))
    assert (source.backend, source.kind) == ("llguidance", "lark")
    assert source.source == 'start: "a" | "b"\n'
    source, _ = run(choice, FakeBackend("outlines"))
    assert (source.kind, source.source) == ("regex", "(a|b)")
    gbnf = GrammarSpec.from_ebnf('root ::= "x"', syntax="gbnf")
    assert run(gbnf, FakeBackend("llguidance"), FakeBackend("xgrammar"))[0].backend == "xgrammar"
    with pytest.raises(GrammarCompileError, match="Lark grammars need llguidance"):
        run(GrammarSpec.from_ebnf('start: "x"'), FakeBackend("xgrammar"))
    regex, _ = run(GrammarSpec.from_regex("a+"), FakeBackend("outlines"))
    assert not regex.gate_eos and (regex.kind, regex.source) == ("regex", "a+")


def test_text_or_tool_call_needs_llguidance() -> None:
    spec = GrammarSpec.from_tools(TOOLS, "auto")
    source, _ = run(spec, FakeBackend("llguidance"), FakeBackend("xgrammar"))
    assert (source.backend, source.kind) == ("llguidance", "lark") and source.gate_eos
    named = GrammarSpec.from_tools(TOOLS, {"type": "function", "function": {"name": "add"}})
    source, _ = run(named, FakeBackend("xgrammar"))
    call = json.loads(source.source)
    assert source.kind == "json" and call["properties"]["name"] == {"const": "add"}


def test_every_build_goes_through_the_runner() -> None:
    calls: list[str] = []

    def runner(name: str, build: Callable[[], Any]) -> Any:
        calls.append(name)
        return build()

    llg = FakeBackend("llguidance", lambda _: BackendUnavailableError("llguidance", "llg"))
    spec = GrammarSpec.from_json_schema({"type": "integer"})
    run(spec, llg, FakeBackend("xgrammar"), runner=runner)
    assert calls == ["llguidance", "xgrammar"]
