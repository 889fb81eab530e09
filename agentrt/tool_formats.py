"""Each model family's tool-call format, as its chat template writes calls: one table entry
per family (`CALL_FORMATS`), read by the grammar of the calls (`calls_spec`), the reply
reader (agentrt.reply) and the prompt (agentrt.tool_calls.render_messages).

- "hermes" (Qwen 2.5 / 3, Hermes): `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`
  per call;
- "phi4" (Phi-4-mini): `<|tool_call|>{"name": ..., "arguments": {...}}<|/tool_call|>` per call;
- "llama3" (Llama 3.1 / 3.2 / 3.3): `{"name": ..., "parameters": {...}}`, one call a turn;
- "json" (any other: Gemma 3, SmolLM2...): `{"name": ..., "arguments": {...}}`, or a JSON
  list of them.

A tagged style whose tags are both single tokens of the tokenizer gets the suffix "_tokens"
("hermes_tokens": Qwen's 151657 / 151658; "phi4_tokens"): the grammar then names those
tokens, the ones the model was trained to write, and the reader splits the reply at their
ids. Gemma 3's template renders no tools and no tool turns: its calls are "json", the tools
described in the system message (which the template folds into the first user turn).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from agentrt.grammar import GrammarSpec
from agentrt.grammar.reasoning import single_token_id
from agentrt.grammar.tools import (
    CallTags,
    tagged_calls_lark,
    tool_call_spec_text,
    tool_calls_lark,
    tool_calls_schema,
)

TOKENS = "_tokens"  # the suffix of a tagged style whose tags are single tokens


@dataclass(frozen=True, slots=True)
class CallFormat:
    """A family's calls: each call's JSON `{"name": ..., <arguments_key>: {...}}` between
    `open` and `close` (None: bare JSON), `pad` between a tag and the JSON and between
    calls; `parallel`: the template renders several calls in one turn (Llama 3's raises)."""

    open: str | None = None
    close: str | None = None
    arguments_key: str = "arguments"
    pad: str = "\n"
    parallel: bool = True

    @property
    def tagged(self) -> bool:
        return self.open is not None


CALL_FORMATS: dict[str, CallFormat] = {
    "json": CallFormat(),
    "hermes": CallFormat("<tool_call>", "</tool_call>"),
    "phi4": CallFormat("<|tool_call|>", "<|/tool_call|>", pad=""),
    "llama3": CallFormat(arguments_key="parameters", parallel=False),
}


def call_format(style: str) -> CallFormat:
    """The table entry of a style ("hermes_tokens" is "hermes"'s)."""
    return CALL_FORMATS[style.removesuffix(TOKENS)]


def tool_call_style(tokenizer: Any) -> str:
    """The style of this tokenizer's chat template (the table above), with the "_tokens"
    suffix where a tagged style's tags are single tokens."""
    template = getattr(tokenizer, "chat_template", None) or ""
    if not isinstance(template, str):
        return "json"
    if "<|tool_call|>" in template or "<|tool|>" in template:
        style = "phi4"
    elif "<tool_call>" in template:
        style = "hermes"
    elif '"parameters": ' in template and "<|start_header_id|>" in template:
        style = "llama3"
    else:
        return "json"
    fmt = CALL_FORMATS[style]
    if fmt.tagged and all(single_token_id(tokenizer, t) is not None for t in (fmt.open, fmt.close)):
        return style + TOKENS
    return style


def calls_schema(
    tools: list[dict[str, Any]], choice: str, style: str, *, parallel: bool
) -> dict[str, Any]:
    """`grammar.tools.tool_calls_schema` with the style's arguments key (a canonical tools
    list and choice)."""
    fmt = call_format(style)
    schema = tool_calls_schema(tools, choice, parallel=parallel and fmt.parallel)
    if fmt.arguments_key == "arguments":
        return schema
    if schema.get("type") == "array":
        raise AssertionError(f"{style!r} calls are one a turn, not a list")

    def keyed(call: dict[str, Any]) -> dict[str, Any]:
        properties = {k: v for k, v in call["properties"].items() if k != "arguments"}
        properties[fmt.arguments_key] = call["properties"]["arguments"]
        return {**call, "properties": properties, "required": ["name", fmt.arguments_key]}

    if "anyOf" in schema:
        return {**schema, "anyOf": [keyed(call) for call in schema["anyOf"]]}
    return keyed(schema)


def calls_spec(
    tools: list[dict[str, Any]],
    tool_choice: Any,
    style: str,
    *,
    parallel: bool,
    max_calls: int | None,
) -> GrammarSpec:
    """The grammar of calls of `tools` in `style` (at most `max_calls` tagged blocks, None:
    no cap); under "auto", plain text is the alternative (text that does not start like a
    call). Raises the grammar layer's GrammarSpecError for bad tools or tool_choice."""
    fmt = call_format(style)
    if not fmt.tagged and fmt.arguments_key == "arguments":
        return GrammarSpec.from_tools(tools, tool_choice, parallel_tool_calls=parallel)
    canonical, choice = tool_call_spec_text(tools, tool_choice)
    if choice == "none":
        return GrammarSpec.any_text()
    if not fmt.tagged:
        schema = calls_schema(canonical, choice, style, parallel=parallel)
        if choice == "auto":
            return GrammarSpec.from_ebnf(tool_calls_lark(schema))
        return GrammarSpec.from_json_schema(schema)
    special = style.endswith(TOKENS)
    tags = CallTags(fmt.open, fmt.close, special, special, fmt.pad)
    lark = tagged_calls_lark(
        canonical, choice, parallel=parallel and fmt.parallel, tags=tags, max_calls=max_calls
    )
    return GrammarSpec.from_ebnf(lark)
