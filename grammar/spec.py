"""`GrammarSpec`: the canonical, hashable description of what constrains one request.

A spec is pure data (a kind, a canonical text and a few options) so it can be used as a
cache key, sent across processes and compared. Building a spec never compiles anything.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, replace
from typing import Any

from .errors import GrammarSpecError
from .limits import GenerationBounds
from .tools import tool_call_spec_text

KINDS = ("json_schema", "regex", "choice", "ebnf", "tools", "text")

# Maps of names to subschemas: their key order is meaningful (property order is the order of
# generation) or irrelevant but user-visible, so canonicalisation keeps it.
_NAME_MAPS = frozenset(
    {"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"}
)
# Keywords whose value is data, not schema: kept verbatim.
_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples", "example"})


@dataclass(frozen=True, slots=True)
class ReasoningPlan:
    """How one request reasons before its answer (grammar/reasoning.py): the markers;
    `opened` by the template; `optional`: the model may skip the block (a single-token start
    marker); `max_tokens` of reasoning text (None: only max_tokens bounds it)."""

    start: str
    end: str
    opened: bool
    optional: bool
    max_tokens: int | None


@dataclass(frozen=True, slots=True)
class GrammarSpec:
    """What constrains a request's output.

    kind: one of `KINDS`. text: canonical source (compact JSON for schemas, choices and
    tools; the pattern for regex; the grammar for EBNF/Lark). options: sorted key/value
    pairs of text that change the language (syntax, tool_choice, bounds).
    parallel_tool_calls: a tools spec allows more than one call (other kinds ignore it).
    reasoning: a reasoning block precedes this language (None: none). Equal specs compile
    to the same grammar for a given tokenizer.
    """

    kind: str
    text: str
    options: tuple[tuple[str, str], ...] = ()
    parallel_tool_calls: bool = True
    reasoning: ReasoningPlan | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise GrammarSpecError(f"unknown grammar kind {self.kind!r}; expected one of {KINDS}")

    # ---- constructors -------------------------------------------------------------------

    @classmethod
    def from_json_schema(cls, schema: dict[str, Any] | bool | str) -> GrammarSpec:
        """From a JSON-schema dict (or its JSON text, or `true`)."""
        try:
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except json.JSONDecodeError as exc:
                    raise GrammarSpecError(f"JSON schema text is not valid JSON: {exc}") from None
            if schema is True:
                schema = {}
            if not isinstance(schema, dict):
                raise GrammarSpecError(
                    f"a JSON schema must be an object (dict), got {type(schema).__name__}"
                )
            return cls("json_schema", _dumps(canonical_schema(schema)))
        except RecursionError:
            raise GrammarSpecError(_TOO_DEEP.format(what="JSON schema")) from None

    @classmethod
    def from_type(cls, tp: Any) -> GrammarSpec:
        """From a Pydantic model class or any type `pydantic.TypeAdapter` accepts."""
        try:
            import pydantic
        except ImportError:  # pragma: no cover - pydantic is a core dependency
            raise GrammarSpecError("from_type needs pydantic: `pip install pydantic`") from None
        try:
            if isinstance(tp, type) and issubclass(tp, pydantic.BaseModel):
                schema = tp.model_json_schema()
            else:
                schema = pydantic.TypeAdapter(tp).json_schema()
        except (pydantic.PydanticUserError, pydantic.PydanticSchemaGenerationError) as exc:
            raise GrammarSpecError(f"cannot derive a JSON schema from {tp!r}: {exc}") from None
        return cls.from_json_schema(_close_objects(schema))

    @classmethod
    def from_regex(cls, pattern: str) -> GrammarSpec:
        if not isinstance(pattern, str) or not pattern:
            raise GrammarSpecError("a regex spec needs a non-empty pattern string")
        try:
            re.compile(pattern)
        except re.error as exc:
            raise GrammarSpecError(f"invalid regex {pattern[:200]!r}: {exc}") from None
        except (RecursionError, OverflowError):
            raise GrammarSpecError(_TOO_DEEP.format(what="regex")) from None
        return cls("regex", pattern)

    @classmethod
    def from_choice(cls, choices: list[str] | tuple[str, ...]) -> GrammarSpec:
        if isinstance(choices, str) or not choices:
            raise GrammarSpecError("a choice spec needs a non-empty list of strings")
        if not all(isinstance(c, str) and c for c in choices):
            raise GrammarSpecError("every choice must be a non-empty string")
        # Order does not change the language; deduplicate and sort so equal sets hash equal.
        return cls("choice", _dumps(sorted(set(choices))))

    @classmethod
    def from_ebnf(cls, grammar: str, *, syntax: str = "lark") -> GrammarSpec:
        """From a Lark grammar (`syntax="lark"`) or a GBNF/xgrammar EBNF (`"gbnf"`)."""
        if syntax not in ("lark", "gbnf"):
            raise GrammarSpecError(f"syntax must be 'lark' or 'gbnf', got {syntax!r}")
        if not isinstance(grammar, str) or not grammar.strip():
            raise GrammarSpecError("an EBNF spec needs a non-empty grammar string")
        return cls("ebnf", grammar.strip() + "\n", (("syntax", syntax),))

    @classmethod
    def from_tools(
        cls,
        tools: list[dict[str, Any]],
        tool_choice: str | dict[str, Any] = "auto",
        *,
        parallel_tool_calls: bool = True,
    ) -> GrammarSpec:
        """From OpenAI-style tool definitions; see `tools.tool_call_spec_text`.

        tool_choice "none" gives an unconstrained `text` spec.
        """
        canonical_tools, choice = tool_call_spec_text(tools, tool_choice)
        if choice == "none":
            return cls.any_text()
        options = (("tool_choice", choice),)
        return cls("tools", _dumps(canonical_tools), options, parallel_tool_calls)

    @classmethod
    def any_text(cls) -> GrammarSpec:
        """Any text at all (no constraint); useful as the neutral element."""
        return cls("text", "")

    def with_bounds(self, bounds: GenerationBounds | None) -> GrammarSpec:
        """This spec with its own generation bounds, used instead of the compiler's (None:
        the schema's exact language, no bounds). Only JSON-schema and tool-call specs."""
        if self.kind not in ("json_schema", "tools"):
            raise GrammarSpecError(f"generation bounds apply to JSON specs, not {self.kind!r}")
        if bounds is not None and not isinstance(bounds, GenerationBounds):
            raise GrammarSpecError(
                f"bounds must be a GenerationBounds or None, got {type(bounds).__name__}"
            )
        text = "off" if bounds is None else bounds.to_option()
        options = dict(self.options)
        options["bounds"] = text
        return replace(self, options=tuple(sorted(options.items())))

    # ---- accessors ----------------------------------------------------------------------

    @property
    def option_dict(self) -> dict[str, str]:
        return dict(self.options)

    def json_value(self) -> Any:
        """The parsed JSON payload of json_schema / choice / tools specs."""
        return json.loads(self.text)

    def cache_key(self) -> str:
        """Stable hex digest of the spec (same across processes and runs)."""
        h = hashlib.sha256(self.kind.encode())
        h.update(b"\0" + self.text.encode())
        for k, v in self.options:
            h.update(f"\0{k}={v}".encode())
        if self.kind == "tools":
            h.update(f"\0parallel={int(self.parallel_tool_calls)}".encode())
        if self.reasoning is not None:
            r = self.reasoning
            h.update(
                b"\0reasoning="
                + _dumps([r.start, r.end, r.opened, r.optional, r.max_tokens]).encode()
            )
        return h.hexdigest()


_TOO_DEEP = "the {what} is nested too deeply to be read (Python's recursion limit); flatten it"


def _dumps(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def canonical_schema(node: Any) -> Any:
    """Sort schema keywords (order-free) but keep name maps and data values verbatim."""
    if isinstance(node, list):
        return [canonical_schema(x) for x in node]
    if not isinstance(node, dict):
        return node
    out: dict[str, Any] = {}
    for key in sorted(node):
        value = node[key]
        if key in _DATA_KEYWORDS:
            out[key] = value
        elif key in _NAME_MAPS and isinstance(value, dict):
            out[key] = {k: canonical_schema(v) for k, v in value.items()}
        else:
            out[key] = canonical_schema(value)
    return out


def _close_objects(node: Any) -> Any:
    """Pydantic models ignore unknown keys but do not say so in their schema; generating
    them is wasted tokens (and a small model may never stop). Objects with `properties`
    and no explicit `additionalProperties` become closed (a model with extra="allow" emits
    `additionalProperties: true` itself and stays open) — as OpenAI's strict mode does."""
    if isinstance(node, dict):
        node = {k: _close_objects(v) for k, v in node.items()}
        if (
            node.get("type") == "object"
            and "properties" in node
            and "additionalProperties" not in node
        ):
            node["additionalProperties"] = False
        return node
    if isinstance(node, list):
        return [_close_objects(v) for v in node]
    return node
