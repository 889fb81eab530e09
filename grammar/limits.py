"""Limits that keep compilation and generation bounded.

`SchemaLimits` caps what a schema may contain before any backend sees it (size, nesting
depth, enum sizes), so a hostile or accidental giant schema fails fast with a clear error.
`RunLimits` bounds whitespace and number runs in generated JSON so that constrained output
always terminates (a model cannot pad forever with spaces or digits).
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
    """Caps on runs the model could otherwise extend forever.

    max_whitespace: longest whitespace run between JSON tokens.
    max_number_digits: longest run of digits in a JSON number (outside strings).
    """

    max_whitespace: int = 12
    max_number_digits: int = 48

    def __post_init__(self) -> None:
        if self.max_whitespace < 0 or self.max_number_digits < 1:
            raise ValueError(
                "RunLimits needs max_whitespace >= 0 and max_number_digits >= 1, got "
                f"{self.max_whitespace} and {self.max_number_digits}"
            )


def schema_text(schema: Any) -> str:
    return json.dumps(schema, separators=(",", ":"), ensure_ascii=False)
