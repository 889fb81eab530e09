"""What a reply must look like: `schema=` of `Session.generate` resolved into an `OutputFormat`
that both constrains decoding (the engine's `StructuredOutputsParams`, or a remote
`response_format`) and parses + validates the finished text."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

import jsonschema
import pydantic

from agentrt.engine.sampling_params import StructuredOutputsParams
from agentrt.errors import OutputValidationError, SchemaError
from agentrt.grammar import GrammarSpec, GrammarSpecError
from agentrt.grammar.tools import tool_call_spec_text
from agentrt.tool_calls import ToolCall, hermes_spec, parse_tool_calls


@dataclass(frozen=True, slots=True)
class Regex:
    """Constrain the reply to a full match of `pattern`; the result is the text."""

    pattern: str


@dataclass(frozen=True, slots=True, init=False)
class Choice:
    """Constrain the reply to exactly one of `options`; the result is the chosen string."""

    options: tuple[str, ...]

    def __init__(self, options) -> None:
        options = tuple(options)
        if not options or not all(isinstance(o, str) for o in options):
            raise SchemaError(f"Choice needs a non-empty list of strings, got {options!r}.")
        object.__setattr__(self, "options", options)


@dataclass(frozen=True, slots=True)
class OutputFormat:
    """One of: plain text (`kind="text"`), JSON for a schema (`json_schema`, parsed by
    `adapter` when it came from a Python type), a regex, a choice, or tool calls (`tools` in
    OpenAI format; the reply parses to a list of `ToolCall`, or text under "auto")."""

    kind: str
    json_schema: dict | None = None
    adapter: pydantic.TypeAdapter | None = None
    python_type: Any = None
    regex: str | None = None
    choices: tuple[str, ...] | None = None
    name: str = "output"
    tools: tuple[dict, ...] | None = None
    tool_choice: str | dict = "auto"
    parallel_tool_calls: bool = True
    tool_style: str = "json"  # or "hermes" (see agentrt.tool_calls)

    def structured_outputs(self) -> StructuredOutputsParams | None:
        """The engine's constraint for this format (None for plain text)."""
        if self.kind == "json":
            if self.python_type is not None:
                return StructuredOutputsParams(json=self.python_type)
            return StructuredOutputsParams(json=self.json_schema)
        if self.kind == "regex":
            return StructuredOutputsParams(regex=self.regex)
        if self.kind == "choice":
            return StructuredOutputsParams(choice=self.choices)
        if self.kind == "tools":
            try:
                if self.tool_style == "hermes":
                    spec = hermes_spec(
                        list(self.tools), self.tool_choice, parallel=self.parallel_tool_calls
                    )
                else:
                    spec = GrammarSpec.from_tools(
                        list(self.tools),
                        self.tool_choice,
                        parallel_tool_calls=self.parallel_tool_calls,
                    )
            except GrammarSpecError as exc:
                raise SchemaError(f"the tools are invalid: {exc}") from None
            return None if spec.kind == "text" else StructuredOutputsParams(spec=spec)
        return None

    def parse(self, text: str) -> Any:
        """The value of a finished reply; raises `OutputValidationError` when it does not
        satisfy the format (a keyword only post-validation checks)."""
        if self.kind == "text":
            return text
        if self.kind == "tools":
            return self._parse_tool_calls(text)
        if self.kind == "regex":
            if re.fullmatch(self.regex, text) is None:
                raise OutputValidationError(
                    f"output {text!r} does not match {self.regex!r}", text=text, errors=[]
                )
            return text
        if self.kind == "choice":
            if text not in self.choices:
                raise OutputValidationError(
                    f"output {text!r} is not one of {list(self.choices)}", text=text, errors=[]
                )
            return text
        if self.adapter is not None:
            try:
                return self.adapter.validate_json(text)
            except pydantic.ValidationError as exc:
                raise OutputValidationError(
                    f"output does not validate as {self.name}: {exc}",
                    text=text,
                    errors=exc.errors(include_url=False),
                ) from None
        try:
            value = json.loads(text)
            jsonschema.validate(value, self.json_schema)
        except (json.JSONDecodeError, jsonschema.ValidationError) as exc:
            message = getattr(exc, "message", str(exc))
            raise OutputValidationError(
                f"output does not validate against the schema: {message}",
                text=text,
                errors=[message],
            ) from None
        return value

    def _parse_tool_calls(self, text: str) -> list[ToolCall] | str:
        calls = parse_tool_calls(text)
        if calls is None:
            if self.tool_choice == "auto" or self.tool_choice == "none":
                return text
            raise OutputValidationError(
                f"expected tool calls, got {text!r}", text=text, errors=["not a tool call"]
            )
        canonical, _ = tool_call_spec_text(list(self.tools), "auto")  # [{name, parameters}]
        known = {t["name"]: t for t in canonical}
        errors = []
        for call in calls:
            if call.name not in known:
                errors.append(f"unknown tool {call.name!r}")
                continue
            params = known[call.name]["parameters"]
            try:
                jsonschema.validate(call.arguments, params)
            except jsonschema.ValidationError as exc:
                errors.append(f"{call.name}: {exc.message}")
        if errors:
            raise OutputValidationError(
                f"tool call arguments are invalid: {'; '.join(errors)}", text=text, errors=errors
            )
        return calls


TEXT = OutputFormat("text")


def tools_format(
    tools: list[dict], tool_choice: str | dict = "auto", *, parallel_tool_calls: bool = True
) -> OutputFormat:
    """Replies constrained to calls of `tools` (OpenAI format) per `tool_choice`."""
    return OutputFormat(
        "tools",
        tools=tuple(tools),
        tool_choice=tool_choice,
        parallel_tool_calls=parallel_tool_calls,
    )


def resolve_format(schema: Any) -> OutputFormat:
    """`None` (text), a Pydantic model or any type pydantic's TypeAdapter accepts
    (`list[Model]`, `Literal[...]`, an Enum, a union), a JSON-schema dict, `Regex(...)` or
    `Choice([...])`. Raises `SchemaError` for anything else."""
    if schema is None:
        return TEXT
    if isinstance(schema, OutputFormat):
        return schema
    if isinstance(schema, Regex):
        try:
            re.compile(schema.pattern)
        except re.error as exc:
            raise SchemaError(f"Regex {schema.pattern!r} is invalid: {exc}") from None
        return OutputFormat("regex", regex=schema.pattern)
    if isinstance(schema, Choice):
        return OutputFormat("choice", choices=schema.options)
    if isinstance(schema, dict):
        try:
            jsonschema.validators.validator_for(schema).check_schema(schema)
        except jsonschema.SchemaError as exc:
            raise SchemaError(f"the JSON schema is invalid: {exc.message}") from None
        return OutputFormat("json", json_schema=schema, name=str(schema.get("title", "output")))
    if isinstance(schema, str | bytes | int | float | list | tuple):
        raise SchemaError(
            f"schema={schema!r} is not a schema: pass a Pydantic model or type, a JSON-schema "
            "dict, agentrt.Regex(...) or agentrt.Choice([...])."
        )
    try:
        adapter = pydantic.TypeAdapter(schema)
        json_schema = adapter.json_schema()
    except (pydantic.PydanticSchemaGenerationError, pydantic.PydanticUserError, TypeError) as exc:
        raise SchemaError(f"cannot build a JSON schema for {schema!r}: {exc}") from None
    name = getattr(schema, "__name__", None) or str(json_schema.get("title", "output"))
    return OutputFormat(
        "json", json_schema=json_schema, adapter=adapter, python_type=schema, name=name
    )
