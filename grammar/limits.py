"""Limits that keep compilation and generation bounded.

`SchemaLimits` caps what a schema may contain before any backend sees it (size, nesting
depth, enum sizes), so a hostile or accidental giant schema fails fast with a clear error.
`RunLimits` bounds whitespace runs and digit runs in generated JSON so that constrained
output always terminates (a model cannot pad forever with spaces or digits).
`GenerationBounds` caps the strings, arrays and objects a schema leaves unbounded (see
bounds.py), so that a small model looping inside one cannot run to max_tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .errors import SchemaLimitError


@dataclass(frozen=True, slots=True)
class SchemaLimits:
    max_schema_bytes: int = 2_000_000
    max_depth: int = 128
    max_nodes: int = 200_000
    max_enum_values: int = 20_000

    def __post_init__(self) -> None:
        for name in ("max_schema_bytes", "max_depth", "max_nodes", "max_enum_values"):
            if getattr(self, name) <= 0:
                raise ValueError(f"SchemaLimits.{name} must be > 0, got {getattr(self, name)}")

    def check(self, schema: Any, text: str) -> None:
        """Raise SchemaLimitError naming the first exceeded limit; `text` is the JSON text."""
        size = len(text.encode())
        if size > self.max_schema_bytes:
            raise SchemaLimitError(
                f"schema is {size} bytes, over the limit of {self.max_schema_bytes}; "
                "split it or raise SchemaLimits.max_schema_bytes"
            )
        num_nodes = 0
        stack: list[tuple[Any, int, str]] = [(schema, 1, "#")]
        while stack:
            node, depth, path = stack.pop()
            num_nodes += 1
            if depth > self.max_depth:
                raise SchemaLimitError(
                    f"schema nesting depth exceeds {self.max_depth} at {path[:200]}; "
                    "flatten it with $defs/$ref or raise SchemaLimits.max_depth"
                )
            if num_nodes > self.max_nodes:
                raise SchemaLimitError(
                    f"schema has more than {self.max_nodes} nodes; "
                    "simplify it or raise SchemaLimits.max_nodes"
                )
            if isinstance(node, dict):
                enum = node.get("enum")
                if isinstance(enum, list) and len(enum) > self.max_enum_values:
                    raise SchemaLimitError(
                        f"enum at {path} has {len(enum)} values, over the limit of "
                        f"{self.max_enum_values}; use a pattern or raise "
                        "SchemaLimits.max_enum_values"
                    )
                items = node.items()
            elif isinstance(node, list):
                items = ((str(i), v) for i, v in enumerate(node))
            else:
                continue
            for key, value in items:
                if isinstance(value, (dict, list)):
                    stack.append((value, depth + 1, f"{path}/{key}"))


@dataclass(frozen=True, slots=True)
class RunLimits:
    """How much whitespace generated JSON may hold, so a model cannot pad forever.

    json_whitespace: "compact" (default) = exactly the separators ", " and ": " and no other
    whitespace, i.e. `json.dumps` output; it also makes jump-forward effective (keys and
    punctuation are forced). "bounded" = any JSON whitespace, in runs of at most
    `max_whitespace` characters (pretty-printed output).
    max_digit_run: longest run of consecutive digits in JSON output (numbers, and digits
    inside strings too: the matcher cannot tell them apart cheaply); 0 disables the cap.
    """

    json_whitespace: str = "compact"
    max_whitespace: int = 12
    max_digit_run: int = 64

    def __post_init__(self) -> None:
        if self.json_whitespace not in ("compact", "bounded"):
            raise ValueError(
                f"RunLimits.json_whitespace must be 'compact' or 'bounded', "
                f"got {self.json_whitespace!r}"
            )
        if self.max_digit_run < 0:
            raise ValueError(f"RunLimits.max_digit_run must be >= 0, got {self.max_digit_run}")
        if self.max_whitespace < 0:
            raise ValueError(f"RunLimits.max_whitespace must be >= 0, got {self.max_whitespace}")


@dataclass(frozen=True, slots=True)
class GenerationBounds:
    """Caps added to a JSON schema's grammar where the schema sets none (bounds.py).

    The bounded grammar is stricter than the schema: every output it allows is valid for
    the schema, and for a schema without recursion every output has a finite maximum
    length. Each cap is listed in the grammar's report with status "bounded". A schema that
    needs more sets its own `maxLength` / `maxItems` (Pydantic: `Field(max_length=...)`),
    which always wins.

    max_string_length: characters in a string without maxLength, enum, const or a
    fixed-length format (also the longest key of an object whose keys are not declared).
    max_items: items of an array without maxItems; entries of an object whose keys are not
    declared (a map) without maxProperties.
    max_any_depth: how deep values the schema leaves unconstrained (`{}`, a map's values,
    an array without `items`) may nest containers.
    close_objects: objects that declare `properties` and do not mention
    `additionalProperties` get no undeclared keys (as xgrammar's and OpenAI's strict modes
    do); without it such objects stay open, and unbounded.

    `GrammarCompiler` applies no bounds unless given some (its language is then exactly the
    schema's, as the MaskBench protocol requires); the engine's StructuredOutputManager
    applies `GenerationBounds()` to every request. One request can choose its own with
    `GrammarSpec.with_bounds(...)` (None: the schema's exact language).
    """

    max_string_length: int = 512
    max_items: int = 64
    max_any_depth: int = 3
    close_objects: bool = True

    def __post_init__(self) -> None:
        for name in ("max_string_length", "max_items", "max_any_depth"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"GenerationBounds.{name} must be an int >= 1, got {value!r}")

    def to_option(self) -> str:
        """The compact text a `GrammarSpec` option carries (see GrammarSpec.with_bounds)."""
        return (
            f"{self.max_string_length},{self.max_items},{self.max_any_depth},"
            f"{int(self.close_objects)}"
        )

    @classmethod
    def from_option(cls, text: str) -> GenerationBounds | None:
        """Inverse of `to_option`; "off" is None (no bounds)."""
        if text == "off":
            return None
        length, items, depth, close = (int(x) for x in text.split(","))
        return cls(length, items, depth, bool(close))
