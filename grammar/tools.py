"""OpenAI-style tool definitions -> the language of tool calls.

Output format (what a constrained model writes):

    one call:        {"name": "<tool>", "arguments": {...}}
    parallel calls:  [{"name": ..., "arguments": {...}}, ...]        (at least one call)

tool_choice: "required" = some call; {"type": "function", "function": {"name": N}} (or just
N) = exactly one call, to N (never a list, as OpenAI and vLLM answer a named choice); "auto" =
either plain text (not starting with "{" or "[") or a call; "none" = plain text only (no
constraint).

Tagged calls (`tagged_calls_lark`, the format of Qwen 2.5 / 3 and Hermes templates): one
`<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>` block per call. Where the
tokenizer has a tag as one special token, the grammar names that token (llguidance's
`<tool_call>` syntax), which only that token matches: the model writes its own call token,
not the tag spelled out in ordinary tokens.

A function definition may carry `"excluded_arguments": [{...}, ...]`: argument objects the
grammar must not produce (an agent's calls already answered). They are compiled into the
tool's parameters schema by `exclude.exclude_arguments`; a tool with no call left is not
offered.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from .errors import GrammarSpecError
from .exclude import exclude_arguments

_NAME_RE = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")
EXCLUDED_ARGUMENTS = "excluded_arguments"


def tool_call_spec_text(
    tools: list[dict[str, Any]], tool_choice: str | dict[str, Any]
) -> tuple[list[dict[str, Any]], str]:
    """Validate tools and tool_choice; return canonical [{name, parameters}] and the choice.

    The returned choice is "auto", "required", "none" or "name:<tool>". Parameters have
    their `excluded_arguments` compiled in; a tool with no call left is dropped, and with
    none left "auto" becomes "none" (a choice that needs a call raises GrammarSpecError).
    """
    if not isinstance(tools, (list, tuple)) or not tools:
        raise GrammarSpecError("tools must be a non-empty list of tool definitions")
    canonical: list[dict[str, Any]] = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict):
            raise GrammarSpecError(f"tools[{i}] must be a dict, got {type(tool).__name__}")
        fn = tool.get("function", tool) if tool.get("type", "function") == "function" else None
        if not isinstance(fn, dict):
            raise GrammarSpecError(f"tools[{i}]: only type 'function' tools are supported")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME_RE.match(name):
            raise GrammarSpecError(
                f"tools[{i}]: function name {name!r} must match {_NAME_RE.pattern}"
            )
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise GrammarSpecError(f"tools[{i}] ({name}): parameters must be a JSON schema dict")
        excluded = fn.get(EXCLUDED_ARGUMENTS) or []
        if not isinstance(excluded, list) or not all(isinstance(a, dict) for a in excluded):
            raise GrammarSpecError(
                f"tools[{i}] ({name}): {EXCLUDED_ARGUMENTS} must be a list of argument objects"
            )
        canonical.append({"name": name, "parameters": exclude_arguments(params, excluded)})
    names = [t["name"] for t in canonical]
    if len(set(names)) != len(names):
        raise GrammarSpecError(f"tool names must be unique, got {names}")
    choice = _choice(tool_choice, names)
    exhausted = [t["name"] for t in canonical if t["parameters"] is None]
    canonical = [t for t in canonical if t["parameters"] is not None]
    named_exhausted = choice.startswith("name:") and choice[5:] in exhausted
    if named_exhausted or (not canonical and choice == "required"):
        raise GrammarSpecError(
            f"tool_choice={tool_choice!r} asks for a call, but every call of {exhausted} is "
            f"excluded ({EXCLUDED_ARGUMENTS}); ask for the answer instead"
        )
    return canonical, choice if canonical else "none"


def _choice(tool_choice: str | dict[str, Any], names: list[str]) -> str:
    if isinstance(tool_choice, dict):
        fn = tool_choice.get("function", {})
        name = fn.get("name") if isinstance(fn, dict) else None
    elif tool_choice in ("auto", "required", "none"):
        return tool_choice
    else:
        name = tool_choice
    if name not in names:
        raise GrammarSpecError(
            f"tool_choice names {name!r}, which is not one of the tools {names}; "
            "use 'auto', 'required', 'none' or an existing tool name"
        )
    return f"name:{name}"


def tool_calls_schema(
    tools: list[dict[str, Any]], choice: str, *, parallel: bool
) -> dict[str, Any]:
    """The JSON schema of the tool-call payload for a canonical tools list and choice."""
    if choice.startswith("name:"):
        tools = [t for t in tools if t["name"] == choice[5:]]
    parallel = allows_many(choice, parallel)
    defs: dict[str, Any] = {}
    calls = [
        {
            "type": "object",
            "properties": {
                "name": {"const": t["name"]},
                "arguments": _hoist_defs(t["name"], t["parameters"], defs),
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for t in tools
    ]
    one = calls[0] if len(calls) == 1 else {"anyOf": calls}
    schema = {"type": "array", "items": one, "minItems": 1} if parallel else dict(one)
    if defs:
        schema["$defs"] = defs
    return schema


def allows_many(choice: str, parallel: bool) -> bool:
    """Whether a reply may hold several calls: with parallel calls on, unless tool_choice
    names a tool (then exactly one call of it)."""
    return parallel and not choice.startswith("name:")


def _hoist_defs(tool: str, parameters: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    """A tool's parameters nest inside the payload schema, so their local `$defs` (Pydantic
    puts nested models there) move to the payload's root as `<tool>__<name>`, and the
    `#/$defs/...` references in them are rewritten to match."""
    local = {**parameters.get("definitions", {}), **parameters.get("$defs", {})}
    if not local:
        return parameters

    def rewrite(node: Any) -> Any:
        if isinstance(node, dict):
            out = {k: rewrite(v) for k, v in node.items() if k not in ("$defs", "definitions")}
            ref = node.get("$ref")
            for prefix in ("#/$defs/", "#/definitions/"):
                if isinstance(ref, str) and ref.startswith(prefix):
                    out["$ref"] = f"#/$defs/{tool}__{ref[len(prefix) :]}"
            return out
        if isinstance(node, list):
            return [rewrite(v) for v in node]
        return node

    for name, definition in local.items():
        defs[f"{tool}__{name}"] = rewrite(definition)
    return rewrite(parameters)


# Inside Lark, `%json` has llguidance's default free whitespace, which lets a weak model
# emit whitespace forever; tool calls are written compactly instead.
COMPACT_JSON = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def compact(schema: dict[str, Any]) -> dict[str, Any]:
    """`schema` for a Lark `%json` embedding, with compact separators."""
    return {**schema, "x-guidance": COMPACT_JSON}


def tool_calls_lark(schema: dict[str, Any]) -> str:
    """Lark grammar (llguidance dialect) for "auto": plain text or a tool-call payload."""
    return (
        "start: text | calls\n"
        f"calls: %json {json.dumps(compact(schema), ensure_ascii=False)}\n"
        # Plain text must not start like a payload, so the two branches never overlap.
        "text: /([^\\[{ \\t\\r\\n][\\s\\S]*)?/\n"
    )


@dataclass(frozen=True, slots=True)
class CallTags:
    """The text around each tagged call, and whether the tokenizer has each tag as one
    special token (then the grammar names the token; else it spells the text)."""

    open: str = "<tool_call>"
    close: str = "</tool_call>"
    open_special: bool = False
    close_special: bool = False
    pad: str = "\n"  # between a tag and the call's JSON, and between calls

    def __post_init__(self) -> None:
        for tag in (self.open, self.close):
            if not _TAG_RE.match(tag):
                raise GrammarSpecError(f"call tag {tag!r} must look like <name> or </name>")


_TAG_RE = re.compile(r"^</?[A-Za-z0-9_|./\-]{1,64}>$")  # Phi's <|/tool_call|> too


def tagged_calls_lark(
    tools: list[dict[str, Any]],
    choice: str,
    *,
    parallel: bool,
    tags: CallTags,
    max_calls: int | None = None,
) -> str:
    """Lark grammar (llguidance dialect) of tagged calls for canonical `tools` and `choice`
    ("auto", "required" or "name:<tool>"): `<open><pad><call JSON><pad><close>` per call,
    several (`pad` apart, at most `max_calls`; None: no cap) when `allows_many`.

    Under "auto" the reply is plain text, calls, or text then calls (Qwen writes "Let me
    check.\n<tool_call>..."), and the text may hold anything, a leading `<` too:
    - a special opening token cannot occur in text at all, so the text ends where that
      token comes; text does not start, after spaces, with the opening's characters either
      (a reply that looks like a call is one);
    - an opening spelled in ordinary tokens cannot occur in text: the first one opens the
      first call (a lazy lexeme ends at it), as parsing the text reads it back."""
    call_schema = compact(tool_calls_schema(tools, choice, parallel=False))
    many = allows_many(choice, parallel)
    call_json = f"%json {json.dumps(call_schema, ensure_ascii=False)}"
    pad = f"{json.dumps(tags.pad)} " if tags.pad else ""  # a Lark literal has some text
    if tags.pad:
        call_json = f"{pad}{call_json} {json.dumps(tags.pad)}"
    close = _tag(tags.close, tags.close_special)
    more = ""
    if many and max_calls != 1:
        times = "*" if max_calls is None else f"{{0,{max_calls - 1}}}"
        more = f" ({pad}call){times}"
    calls = f"call{more}"
    lines = [
        f"calls: {calls}",
        f"call: {_tag(tags.open, tags.open_special)} {call_json} {close}",
    ]
    if choice != "auto":
        return "\n".join(["start: calls", *lines]) + "\n"
    opening = re.escape(tags.open).replace("/", "\\/")
    if tags.open_special:
        lines.insert(0, "start: calls | text | text calls")
        lines += ["text: TEXT", f"TEXT: /(?s:.*)/ & ~/[ \\t\\r\\n]*{opening}(?s:.*)/"]
    else:
        lines = [f"start: text | lead {call_json} {close}{more}", lines[1]]
        lines += [
            f"lead[suffix={json.dumps(tags.open)}]: /(?s:.*)/",
            "text: TEXT",
            f"TEXT: /(?s:.*)/ & ~/(?s:.*){opening}(?s:.*)/",
        ]
    return "\n".join(lines) + "\n"


def _tag(tag: str, special: bool) -> str:
    return tag if special else json.dumps(tag)
