"""Limits that keep compilation and generation bounded.

`SchemaLimits` caps what a schema may contain before any backend sees it (size, nesting
depth, enum sizes), so a hostile or accidental giant schema fails fast with a clear error.
`RunLimits` bounds whitespace runs and digit runs in generated JSON so that constrained
output always terminates (a model cannot pad forever with spaces or digits).
"""

from __future__ import annotations

import json
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


def schema_text(schema: Any) -> str:
    return json.dumps(schema, separators=(",", ":"), ensure_ascii=False)
