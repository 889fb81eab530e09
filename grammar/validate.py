"""Post-generation checks: the keywords a token grammar does not enforce, checked on text.

`FinalValidator.errors(text)` returns human-readable problems (empty list = valid). JSON
outputs are checked with `jsonschema` against the user's original schema (format checking
on, for the formats jsonschema knows), so anything the report lists as post-checked is
verified here.

A client's regex (a regex spec, a schema's `pattern` or `patternProperties`) must not be
able to stall the engine thread that runs this check: a backtracking engine takes time
exponential in the text on patterns like `(a+)+b`. So, on a matcher's own output
(`complete=` given), what the token grammar enforced exactly (`proven`: its automaton
accepted the text token by token, and reached its end) is not matched again; every other
match runs on the `regex` package with a time budget per check (`MAX_REGEX_SECONDS` in
all), and a match that does not finish in it is reported as not checked.

A client's schema must not stall it either: jsonschema's cost can double per nesting level
(an `anyOf` of two `$ref`s to the same array schema evaluates each level twice). So a JSON
check runs on an instance of at most `MAX_INSTANCE_DEPTH` levels and `MAX_INSTANCE_NODES`
values, every keyword checks the call's deadline (`MAX_CHECK_SECONDS`) before it runs, and
`uniqueItems` (pairwise on unhashable items) checks at most `MAX_UNIQUE_ITEMS` items. What
exceeds a bound is reported as not checked (`FinalCheck.checked` is False), never run on.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass
from typing import Any

import regex

from .formats import format_checker
from .spec import GrammarSpec
from .tools import tool_calls_schema

_MAX_ERRORS = 8
# What one `errors()` call may spend matching client regexes, all matches together.
MAX_REGEX_SECONDS = 0.05
# What one `errors()` call may spend evaluating a JSON schema, regex matches included.
MAX_CHECK_SECONDS = 0.1
# The largest JSON instance checked: nesting levels, and values in all.
MAX_INSTANCE_DEPTH = 64
MAX_INSTANCE_NODES = 20_000
# The longest array `uniqueItems` compares (pairwise when items are objects or arrays).
MAX_UNIQUE_ITEMS = 2_000
# Keywords a grammar can prove (`proven`): the regex of a regex spec, JSON schemas' pattern.
PROVABLE = frozenset({"regex", "pattern"})


@dataclass(frozen=True, slots=True)
class FinalCheck:
    """A final check's verdict. `errors`: problems found (empty = valid); `checked`: False
    when a bound stopped the check (a deadline, an instance too deep or too large), so the
    output is neither proven valid nor invalid (`errors` then says why)."""

    errors: list[str]
    checked: bool = True


class FinalValidator:
    """The final check of one spec. `proven`: keywords of `PROVABLE` the compiled grammar
    enforces exactly (a matcher that accepted the text and reached its end proved them)."""

    def __init__(self, spec: GrammarSpec, *, proven: frozenset[str] = frozenset()) -> None:
        self.kind = spec.kind
        self.proven = proven & PROVABLE
        self._schema_validator: Any = None
        self._proven_validator: Any = None  # the same, without the `pattern` keyword
        self._regex: regex.Pattern[str] | None = None
        self._choices: frozenset[str] = frozenset()
        self._text_allowed = spec.option_dict.get("tool_choice") == "auto"
        self._spec = spec
        self._budget = threading.local()  # .deadline of the errors() call on this thread
        if spec.kind in ("json_schema", "tools"):
            self._schema_validator = _LAZY  # built on first use: most outputs need no check
        elif spec.kind == "regex":
            try:
                self._regex = regex.compile(spec.text)
            except (regex.error, ValueError, OverflowError):
                self._regex = None  # a backend-only regex dialect: the grammar is the check
        elif spec.kind == "choice":
            self._choices = frozenset(spec.json_value())

    def errors(self, text: str, *, complete: bool | None = None) -> list[str]:
        """Problems with `text` (empty = valid). `complete`: given when `text` is a matcher's
        own output, whether its grammar reached an accepting end; then what it `proven` is
        not matched again."""
        return self.check(text, complete=complete).errors

    def check(self, text: str, *, complete: bool | None = None) -> FinalCheck:
        """`errors`, and whether the check ran to its end (see `FinalCheck`)."""
        self._budget.deadline = time.monotonic() + MAX_REGEX_SECONDS
        if self._schema_validator is not None:
            if self.kind == "tools" and not text.lstrip().startswith(("{", "[")):
                return FinalCheck([] if self._text_allowed else ["expected a tool call, got text"])
            try:
                value = json.loads(text)
            except json.JSONDecodeError as exc:
                return FinalCheck([f"output is not valid JSON: {exc}"])
            except RecursionError:
                return FinalCheck([_too_large("nested too deeply to parse")], checked=False)
            too_large = _instance_too_large(value)
            if too_large:
                return FinalCheck([_too_large(too_large)], checked=False)
            # A string in parsed JSON was closed through the grammar, which matched its
            # pattern on the way: proven whether or not the whole output is complete.
            skip = complete is not None and "pattern" in self.proven
            validator = self._validator(skip_pattern=skip)  # built on first use, not timed
            self._budget.check_deadline = time.monotonic() + MAX_CHECK_SECONDS
            return _schema_errors(validator, value)
        if self._regex is not None:
            if complete is not None and "regex" in self.proven:
                if complete:
                    return FinalCheck([])
                pattern = self._regex.pattern
                return FinalCheck([f"output does not match the regex {pattern!r}: it ended early"])
            match = self._bounded(self._regex.fullmatch, text)
            if match is _TIMED_OUT:
                return FinalCheck([_not_checked(self._regex.pattern)], checked=False)
            if match is None:
                return FinalCheck([f"output does not match the regex {self._regex.pattern!r}"])
        if self._choices and text not in self._choices:
            n = len(self._choices)
            return FinalCheck([f"output {text[:80]!r} is not one of the {n} choices"])
        return FinalCheck([])

    def _validator(self, *, skip_pattern: bool) -> Any:
        if self._schema_validator is _LAZY:
            schema = self._json_schema()
            keywords = {"patternProperties": self._pattern_props}
            self._schema_validator = _json_validator(
                schema, {**keywords, "pattern": self._pattern}, self._on_time
            )
            self._proven_validator = _json_validator(
                schema, {**keywords, "pattern": _proven}, self._on_time
            )
        return self._proven_validator if skip_pattern else self._schema_validator

    def _bounded(self, method: Any, text: str) -> Any:
        """method(text) within what is left of this call's regex budget, else _TIMED_OUT."""
        left = self._budget.deadline - time.monotonic()
        if left <= 0:
            return _TIMED_OUT
        try:
            return method(text, timeout=left)
        except TimeoutError:
            return _TIMED_OUT

    def _on_time(self) -> None:
        """Raise _NotChecked once this call's schema deadline has passed."""
        if time.monotonic() > self._budget.check_deadline:
            raise _NotChecked(
                f"the output could not be checked against the schema within "
                f"{MAX_CHECK_SECONDS:g} s (a schema whose cost grows with nesting); simplify it"
            )

    def _search(self, pattern: str, text: str) -> Any:
        try:
            compiled = regex.compile(pattern)
        except (regex.error, ValueError, OverflowError):
            return True  # not a regex this engine reads: the grammar is the check
        return self._bounded(compiled.search, text)

    def _pattern(self, validator: Any, pattern: str, instance: Any, schema: Any) -> Any:
        """jsonschema's `pattern` keyword, on the bounded engine."""
        if not validator.is_type(instance, "string"):
            return
        import jsonschema

        found = self._search(pattern, instance)
        if found is _TIMED_OUT:
            yield jsonschema.ValidationError(_not_checked(pattern))
        elif found is None:
            yield jsonschema.ValidationError(f"{instance[:80]!r} does not match {pattern!r}")

    def _pattern_props(self, validator: Any, properties: Any, instance: Any, schema: Any) -> Any:
        """jsonschema's `patternProperties` keyword, on the bounded engine."""
        if not validator.is_type(instance, "object"):
            return
        import jsonschema

        for pattern, subschema in properties.items():
            for key, value in instance.items():
                found = self._search(pattern, key)
                if found is _TIMED_OUT:
                    yield jsonschema.ValidationError(_not_checked(pattern))
                    return
                if found is not None:
                    yield from validator.descend(value, subschema, path=key, schema_path=pattern)

    def _json_schema(self) -> Any:
        if self._spec.kind == "json_schema":
            return self._spec.json_value()
        return tool_calls_schema(
            self._spec.json_value(),
            self._spec.option_dict["tool_choice"],
            parallel=self._spec.parallel_tool_calls,
        )


_LAZY = object()
_TIMED_OUT = object()


def _not_checked(pattern: str) -> str:
    return (
        f"the regex {pattern[:80]!r} could not be checked within {MAX_REGEX_SECONDS:g} s "
        "(a pattern that backtracks); simplify it"
    )


class _NotChecked(Exception):
    """A bound stopped the check; the message says which."""


def _json_validator(schema: Any, keywords: dict[str, Any], on_time: Any) -> Any:
    """jsonschema's validator for `schema` with `keywords` replaced, each keyword checking
    the deadline (`on_time()` raises _NotChecked) before it runs."""
    import jsonschema

    # No check_schema here: it costs milliseconds per compile, and the backends already
    # refused malformed schemas.
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    functions = {**cls.VALIDATORS, **keywords}
    if "uniqueItems" in functions:
        functions["uniqueItems"] = _bounded_unique(functions["uniqueItems"])
    timed = {name: _timed(fn, on_time) for name, fn in functions.items()}
    bounded = jsonschema.validators.extend(cls, timed)
    return bounded(schema, format_checker=format_checker(cls.FORMAT_CHECKER))


def _timed(function: Any, on_time: Any) -> Any:
    def keyword(validator: Any, value: Any, instance: Any, schema: Any) -> Any:
        on_time()
        return function(validator, value, instance, schema)

    return keyword


def _bounded_unique(function: Any) -> Any:
    def unique_items(validator: Any, value: Any, instance: Any, schema: Any) -> Any:
        if value and validator.is_type(instance, "array") and len(instance) > MAX_UNIQUE_ITEMS:
            raise _NotChecked(
                f"uniqueItems could not be checked on {len(instance)} items "
                f"(at most {MAX_UNIQUE_ITEMS} are compared)"
            )
        return function(validator, value, instance, schema)

    return unique_items


def _instance_too_large(value: Any) -> str | None:
    """Why a parsed JSON value is beyond the bounds of a check, or None. Iterative: the
    value may be nested deeper than Python's recursion limit allows to walk recursively."""
    stack = [(value, 1)]
    num_nodes = 0
    while stack:
        node, depth = stack.pop()
        num_nodes += 1
        if num_nodes > MAX_INSTANCE_NODES:
            return f"it has more than {MAX_INSTANCE_NODES} values"
        if depth > MAX_INSTANCE_DEPTH:
            return f"it is nested deeper than {MAX_INSTANCE_DEPTH} levels"
        if isinstance(node, dict):
            stack.extend((child, depth + 1) for child in node.values())
        elif isinstance(node, list):
            stack.extend((child, depth + 1) for child in node)
    return None


def _too_large(why: str) -> str:
    return f"the output could not be checked against the schema: {why}"


def _proven(validator: Any, pattern: str, instance: Any, schema: Any) -> Any:
    return iter(())


def _schema_errors(validator: Any, value: Any) -> FinalCheck:
    from referencing.exceptions import Unresolvable

    out: list[str] = []
    try:
        for err in validator.iter_errors(value):
            where = "/".join(str(p) for p in err.absolute_path) or "(root)"
            out.append(f"{where}: {err.message[:200]}")
            if len(out) >= _MAX_ERRORS:
                break
    except _NotChecked as exc:
        return FinalCheck([str(exc)], checked=False)
    except (Unresolvable, RecursionError, ValueError) as exc:
        out.append(f"schema could not be evaluated: {str(exc)[:200]}")
    return FinalCheck(out)
