"""What a reply must look like: `schema=` of `Session.generate` resolved into an `OutputFormat`
that constrains decoding (the engine's `StructuredOutputsParams`, or a remote
`response_format`) and turns the finished text into its value.

Which check lives where (each is done once):
1. `resolve_format`: the schema itself (a JSON schema is checked against its metaschema, a
   regex compiles, a Python type has a JSON schema) -> `SchemaError` before any request.
2. The grammar (engine): every token, so the output can only be valid; a dead end finishes
   the request with `error_code` STRUCTURED_OUTPUT_FAILED.
3. The final check (`agentrt.grammar`'s FinalValidator, on the finished text): the keywords
   the grammar does not enforce, against the original schema (formats included). The engine
   runs it for every constrained request and reports `structured_errors`; a remote backend,
   whose server does not send them, runs the same validator on the text it got
   (`OutputFormat.final_errors`). Session raises `OutputValidationError` for any problem.
4. `OutputFormat.parse`: conversion only - JSON text to a dict/list, tool-call payloads to
   `ToolCall`s - with no second schema check that could disagree with 2 and 3. The one
   exception is a Python type: building its value is Pydantic's validation, which also runs
   what no JSON schema can say (validators, custom types); its errors are the SDK's own.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

import jsonschema
import pydantic

from agentrt.engine.sampling_params import StructuredOutputsParams, to_grammar_spec
from agentrt.errors import OutputValidationError, SchemaError
from agentrt.grammar import GrammarSpecError
from agentrt.grammar.tools import allows_many, tool_call_spec_text
from agentrt.grammar.validate import FinalValidator
from agentrt.reply import ReplyShape, read_reply
from agentrt.tool_calls import MAX_PARALLEL_TOOL_CALLS, ToolCall, read_call_blocks
from agentrt.tool_formats import call_format, calls_spec


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
    max_parallel_tool_calls: int | None = MAX_PARALLEL_TOOL_CALLS  # None: no cap
    tool_style: str = "json"  # the served model's (agentrt.tool_formats: "hermes_tokens"...)

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
            return self._tools_constraint()
        return None

    def _tools_constraint(self) -> StructuredOutputsParams | None:
        tools = list(self.tools)
        try:  # the tools alone first, so the error names the field at fault
            tool_call_spec_text(tools, "auto")
        except GrammarSpecError as exc:
            raise SchemaError(f"the tools are invalid: {exc}", field="tools") from None
        try:
            spec = calls_spec(
                tools,
                self.tool_choice,
                self.tool_style,
                parallel=self.parallel_tool_calls,
                max_calls=self.max_parallel_tool_calls,
            )
        except GrammarSpecError as exc:
            raise SchemaError(f"tool_choice is invalid: {exc}", field="tool_choice") from None
        return None if spec.kind == "text" else StructuredOutputsParams(spec=spec)

    def final_errors(self, text: str) -> list[str] | None:
        """The engine's final check of a finished output (problems; empty = valid), for a
        backend whose engine does not report it; None for plain text."""
        structured = self.structured_outputs()
        if structured is None:
            return None
        return FinalValidator(to_grammar_spec(structured)).errors(text)

    def parse(self, text: str, calls: list[str] | None = None) -> Any:
        """The value of a finished reply that passed the final check; raises
        `OutputValidationError` when the text cannot be converted (or a Python type's
        validation rejects it). A tools reply whose calls were read apart (from token ids,
        or received as calls) passes their JSON texts as `calls`; else they are parsed
        from `text`."""
        if self.kind in ("text", "regex", "choice"):
            return text
        if self.kind == "tools":
            return self._parse_tool_calls(text, calls)
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
            return json.loads(text)
        except json.JSONDecodeError as exc:
            raise OutputValidationError(
                f"output is not JSON: {exc}", text=text, errors=[str(exc)]
            ) from None

    def is_plain_text(self, text: str, calls: list[str] | None = None) -> bool:
        """Whether a reply is plain text, which may end anywhere (at max_tokens too): always
        for "text" and under tool_choice "none"; under "auto" when it opens no call (`calls`
        as in `parse`)."""
        if self.kind != "tools":
            return self.kind == "text"
        if self.tool_choice in ("none", "auto") and calls is not None:
            return self.tool_choice == "none" or not calls
        if self.tool_choice != "auto":
            return self.tool_choice == "none"
        tag = call_format(self.tool_style).open
        if tag is not None:
            return tag not in text  # text may come before the first call
        return not text.lstrip().startswith(("{", "["))

    @property
    def allows_many_calls(self) -> bool:
        """Whether a tool reply may hold several calls (a named tool_choice: exactly one)."""
        _, choice = tool_call_spec_text(list(self.tools or ()), self.tool_choice)
        return allows_many(
            choice, self.parallel_tool_calls and call_format(self.tool_style).parallel
        )

    def _parse_tool_calls(self, text: str, blocks: list[str] | None) -> list[ToolCall] | str:
        if self.tool_choice == "none":
            return text
        if blocks is None:  # a reply given as text: read as the reader reads it
            shape = ReplyShape(tool_style=self.tool_style, max_calls=self.max_parallel_tool_calls)
            read = read_reply(None, shape, text, ()).calls
            calls = read.calls if read is not None else None
        elif blocks:
            reply_calls = read_call_blocks(blocks, max_calls=self.max_parallel_tool_calls)
            if reply_calls.invalid:
                raise OutputValidationError(
                    f"expected tool calls, got {blocks!r}", text=text, errors=["not a tool call"]
                )
            calls = reply_calls.calls
        else:
            calls = None
        if calls:
            return calls
        if self.tool_choice == "auto":
            return text
        raise OutputValidationError(
            f"expected tool calls, got {text!r}", text=text, errors=["not a tool call"]
        )


TEXT = OutputFormat("text")


def tools_format(
    tools: list[dict],
    tool_choice: str | dict = "auto",
    *,
    parallel_tool_calls: bool = True,
    max_parallel_tool_calls: int | None = MAX_PARALLEL_TOOL_CALLS,
) -> OutputFormat:
    """Replies constrained to calls of `tools` (OpenAI format) per `tool_choice`, at most
    `max_parallel_tool_calls` of them in one reply (None: no cap)."""
    if max_parallel_tool_calls is not None and max_parallel_tool_calls < 1:
        raise SchemaError(
            f"max_parallel_tool_calls={max_parallel_tool_calls} is invalid: expected >= 1 "
            "(or None: no cap).",
            field="max_parallel_tool_calls",
        )
    return OutputFormat(
        "tools",
        tools=tuple(tools),
        tool_choice=tool_choice,
        parallel_tool_calls=parallel_tool_calls,
        max_parallel_tool_calls=max_parallel_tool_calls,
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
