"""Post-generation checks: the keywords a token grammar does not enforce, checked on text.

`FinalValidator.errors(text)` returns human-readable problems (empty list = valid). JSON
outputs are checked with `jsonschema` against the user's original schema (format checking
on, for the formats jsonschema knows), so anything the report lists as post-checked is
verified here.
"""

from __future__ import annotations

import json
import re
from typing import Any

from .formats import format_checker
from .spec import GrammarSpec
from .tools import tool_calls_schema

_MAX_ERRORS = 8


class FinalValidator:
    def __init__(self, spec: GrammarSpec) -> None:
        self.kind = spec.kind
        self._schema_validator: Any = None
        self._regex: re.Pattern[str] | None = None
        self._choices: frozenset[str] = frozenset()
        self._text_allowed = spec.option_dict.get("tool_choice") == "auto"
        self._spec = spec
        if spec.kind in ("json_schema", "tools"):
            self._schema_validator = _LAZY  # built on first use: most outputs need no check
        elif spec.kind == "regex":
            try:
                self._regex = re.compile(spec.text)
            except re.error:
                self._regex = None  # a backend-only regex dialect: the grammar is the check
        elif spec.kind == "choice":
            self._choices = frozenset(spec.json_value())

    def errors(self, text: str) -> list[str]:
        if self._schema_validator is _LAZY:
            self._schema_validator = _json_validator(self._json_schema())
        if self._schema_validator is not None:
            if self.kind == "tools" and not text.lstrip().startswith(("{", "[")):
                return [] if self._text_allowed else ["expected a tool call, got text"]
            try:
                value = json.loads(text)
            except json.JSONDecodeError as exc:
                return [f"output is not valid JSON: {exc}"]
            return _schema_errors(self._schema_validator, value)
        if self._regex is not None and not self._regex.fullmatch(text):
            return [f"output does not match the regex {self._regex.pattern!r}"]
        if self._choices and text not in self._choices:
            return [f"output {text[:80]!r} is not one of the {len(self._choices)} choices"]
        return []

    def _json_schema(self) -> Any:
        if self._spec.kind == "json_schema":
            return self._spec.json_value()
        opts = self._spec.option_dict
        return tool_calls_schema(
            self._spec.json_value(), opts["tool_choice"], parallel=opts["parallel"] == "1"
        )


_LAZY = object()


def _json_validator(schema: Any) -> Any:
    import jsonschema

    # No check_schema here: it costs milliseconds per compile, and the backends already
    # refused malformed schemas.
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    return cls(schema, format_checker=format_checker(cls.FORMAT_CHECKER))


def _schema_errors(validator: Any, value: Any) -> list[str]:
    from referencing.exceptions import Unresolvable

    out: list[str] = []
    try:
        for err in validator.iter_errors(value):
            where = "/".join(str(p) for p in err.absolute_path) or "(root)"
            out.append(f"{where}: {err.message[:200]}")
            if len(out) >= _MAX_ERRORS:
                break
    except (Unresolvable, RecursionError, ValueError) as exc:
        out.append(f"schema could not be evaluated: {str(exc)[:200]}")
    return out
