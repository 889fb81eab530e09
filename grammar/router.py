"""Route a normalized schema to a backend that enforces every keyword it keeps.

For each backend a capability table says which keywords its token grammar enforces.
`relax_for` removes every other assertion keyword from a copy of the schema (removing an
assertion only ever widens the language, so the grammar stays a superset of the schema)
and records it as post-checked; the finished output is then checked with `jsonschema`.
Order of preference: llguidance (exact, refuses what it cannot do), then xgrammar (whose
grammars are always post-checked as a whole: it is known to approximate some keywords).
"""

from __future__ import annotations

import re
from typing import Any

from .normalize import SUB_LIST, SUB_MAP, SUB_ONE
from .report import ReportBuilder

_STRUCTURAL = frozenset({"$ref", "$defs", "definitions"})
_COMMON = frozenset(
    {
        "type", "properties", "required", "additionalProperties", "items", "prefixItems",
        "enum", "const", "anyOf", "minItems", "maxItems", "minLength", "maxLength",
        "pattern", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "format",
    }
)  # fmt: skip
CAPABILITIES: dict[str, frozenset[str]] = {
    "llguidance": _COMMON
    | {"allOf", "patternProperties", "multipleOf", "minProperties", "maxProperties"},
    "xgrammar": _COMMON,
    "outlines": _COMMON - {"pattern", "format"} | {"allOf"},
}
FORMATS: dict[str, frozenset[str]] = {
    "llguidance": frozenset(
        {
            "date-time",
            "time",
            "date",
            "duration",
            "email",
            "hostname",
            "ipv4",
            "ipv6",
            "uri",
            "uuid",
        }
    ),  # fmt: skip
    "xgrammar": frozenset(
        {"date-time", "time", "date", "duration", "email", "ipv4", "ipv6", "uuid"}
    ),
    "outlines": frozenset(),
}
# Every keyword with a meaning for validation; anything else is an annotation (JSON Schema
# ignores unknown keywords), so it is reported as such and never post-checked.
ASSERTIONS = frozenset(
    {
        "type", "enum", "const", "multipleOf", "maximum", "exclusiveMaximum", "minimum",
        "exclusiveMinimum", "maxLength", "minLength", "pattern", "maxItems", "minItems",
        "uniqueItems", "maxContains", "minContains", "contains", "maxProperties",
        "minProperties", "required", "dependentRequired", "dependencies", "properties",
        "patternProperties", "additionalProperties", "propertyNames", "items", "prefixItems",
        "unevaluatedItems", "unevaluatedProperties", "allOf", "anyOf", "oneOf", "not", "if",
        "then", "else", "dependentSchemas", "format", "$dynamicRef", "$recursiveRef",
    }
)  # fmt: skip
# Regex features the backends' lexers lack: look-around, back-references, and anchors
# anywhere but at the very start or end.
_UNSUPPORTED_REGEX = re.compile(r"\(\?<?[=!]|\\[1-9]|\\k<|(?<!\\)\$(?!$)|(?<=[^\\\[(|])\^")
# Pseudo-keyword for `extra_drop`: assertions next to an anyOf/oneOf that has $ref branches
# (llguidance must intersect them with each branch, which fails for recursive refs).
SIBLINGS_OF_REF_UNIONS = "<siblings of $ref unions>"
# llguidance errors that name a construct it cannot build, and what to drop on retry.
_RETRY_DROPS = (
    ("circular references with sibling keys", SIBLINGS_OF_REF_UNIONS),
    ("circular references with sibling keys", "patternProperties"),
    ("circular references with sibling keys", "allOf"),
    ("intersection stack level exceeded", "allOf"),
    ("patternProperty regexes", "patternProperties"),
)
_UNIMPLEMENTED = re.compile(r"Unimplemented keys: \[([^\]]*)\]")


def relax_for(
    backend: str, schema: Any, report: ReportBuilder, extra_drop: frozenset[str] = frozenset()
) -> Any:
    """Copy of `schema` with only what `backend` enforces; the rest goes to the report."""
    caps = CAPABILITIES[backend] - extra_drop
    formats = FORMATS[backend]

    def walk(node: Any, path: str) -> Any:
        if not isinstance(node, dict):
            return node
        out: dict[str, Any] = {}
        ref_union = SIBLINGS_OF_REF_UNIONS in extra_drop and _has_ref_branch(node)
        for key, value in node.items():
            if key in _STRUCTURAL:
                out[key] = (
                    {k: walk(v, f"{path}/{key}/{k}") for k, v in value.items()}
                    if isinstance(value, dict) else value
                )  # fmt: skip
                continue
            if key == "oneOf":
                # Not provably disjoint (normalize.py rewrote those): anyOf is a superset.
                report.add("oneOf", "post_checked", path, "checked as anyOf, exclusivity after")
                branches = [walk(v, f"{path}/oneOf/{i}") for i, v in enumerate(value)]
                if "anyOf" in out or "anyOf" in node:
                    out.setdefault("allOf", []).append({"anyOf": branches})
                else:
                    out["anyOf"] = branches
                continue
            if key not in ASSERTIONS:
                report.add(key, "annotation", path, "unknown keyword")
                continue
            if ref_union and key in ASSERTIONS and key not in ("anyOf", "oneOf"):
                report.add(key, "post_checked", path, "next to a recursive union")
                continue
            if key not in caps or not _keeps(backend, key, value, node, formats):
                report.add(key, "post_checked", path)
                if key == "patternProperties" and "additionalProperties" in node:
                    # Without its patterns, additionalProperties would wrongly forbid keys.
                    out.pop("additionalProperties", None)
                    report.add("additionalProperties", "post_checked", path)
                continue
            if (
                key == "additionalProperties"
                and "patternProperties" in node
                and ("patternProperties" not in caps)
            ):
                report.add(key, "post_checked", path)
                continue
            report.add(key, "enforced", path)
            if key in SUB_MAP and isinstance(value, dict):
                out[key] = {k: walk(v, f"{path}/{key}/{k}") for k, v in value.items()}
            elif key in SUB_LIST and isinstance(value, list):
                merged = [walk(v, f"{path}/{key}/{i}") for i, v in enumerate(value)]
                out[key] = [*out.get(key, []), *merged] if key == "allOf" else merged
            elif key in SUB_ONE:
                out[key] = walk(value, f"{path}/{key}")
            else:
                out[key] = value
        return out

    return walk(schema, "#")


def _has_ref_branch(node: dict[str, Any]) -> bool:
    return any(
        isinstance(b, dict) and "$ref" in b
        for key in ("anyOf", "oneOf")
        for b in (node.get(key) or [])
    )


def _keeps(backend: str, key: str, value: Any, node: dict[str, Any], formats: frozenset) -> bool:
    """Keyword-value checks beyond the capability table."""
    if key == "format":
        return value in formats
    if key == "pattern":
        return isinstance(value, str) and not _UNSUPPORTED_REGEX.search(value)
    if key in ("minProperties", "maxProperties"):
        # llguidance enforces these only when every listed property is required.
        return set(node.get("properties", {})) <= set(node.get("required", []))
    if key == "patternProperties" and isinstance(value, dict):
        return not any(_UNSUPPORTED_REGEX.search(p) for p in value)
    if key == "multipleOf":
        return isinstance(value, int) or (isinstance(value, float) and value.is_integer())
    return True


def keys_to_drop(error: str, dropped: frozenset[str]) -> frozenset[str]:
    """Keywords to relax next after a backend error naming a construct it cannot build."""
    match = _UNIMPLEMENTED.search(error)
    if match:
        keys = frozenset(k.strip().strip('"') for k in match.group(1).split(",") if k.strip())
        return keys - dropped
    for text, key in _RETRY_DROPS:
        if text in error and key not in dropped:
            return frozenset({key})
    return frozenset()
