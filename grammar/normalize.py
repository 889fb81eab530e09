"""Schema normalization: one canonical JSON-schema shape before any backend sees it.

Steps, in order: localize `$ref`s (refs.py); then one walk over every subschema that
  - drops pure annotations (title, description, examples, ...) and unknown `format` values
    (JSON Schema says unknown formats are annotations), recording each in the report;
  - rewrites draft-4/7 spellings to 2020-12 (tuple `items` -> `prefixItems`, boolean
    `exclusiveMinimum`, single-element `type` lists);
  - merges `allOf` where the merge is exact (combinators.merge_all_of), keeping property
    order as written;
  - turns `oneOf` into `anyOf` when its branches are provably disjoint;
  - rewrites a subschema holding `not: {}` (nothing matches) as `false`, which every
    backend enforces (not at the root: an unsatisfiable root stays a post-check).
Recursion stays recursion: refs are never expanded except one level when merging.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .combinators import merge_all_of, one_of_is_disjoint
from .errors import GrammarCompileError
from .refs import DEF_KEYS, localize_refs
from .report import ReportBuilder

ANNOTATIONS = frozenset(
    {
        "title", "description", "$comment", "examples", "example", "default", "deprecated",
        "readOnly", "writeOnly", "$schema", "$id", "id", "contentMediaType",
        "contentEncoding", "contentSchema", "markdownDescription", "discriminator",
        "$anchor", "$vocabulary", "nullable", "xml", "externalDocs", "errorMessage",
    }
)  # fmt: skip
# Formats defined by the JSON Schema specification; any other value is an annotation.
SPEC_FORMATS = frozenset(
    {
        "date-time", "date", "time", "duration", "email", "idn-email", "hostname",
        "idn-hostname", "ipv4", "ipv6", "uri", "uri-reference", "iri", "iri-reference",
        "uuid", "uri-template", "json-pointer", "relative-json-pointer", "regex",
    }
)  # fmt: skip
# Keyword -> how its value holds subschemas.
SUB_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
SUB_ONE = (
    "additionalProperties", "items", "additionalItems", "contains", "not", "if", "then",
    "else", "propertyNames", "unevaluatedProperties", "unevaluatedItems",
)  # fmt: skip
SUB_LIST = ("anyOf", "oneOf", "allOf", "prefixItems")


@dataclass(frozen=True, slots=True)
class NormalizedSchema:
    schema: dict[str, Any] | bool
    has_recursion: bool


def normalize_schema(schema: dict[str, Any], report: ReportBuilder) -> NormalizedSchema:
    """Normalize `schema` (not modified); annotations dropped are recorded in `report`."""
    root = localize_refs(schema)
    defs = {key: root.get(key) for key in DEF_KEYS if isinstance(root.get(key), dict)}
    walker = _Walker(root, report)
    out = walker.node(root, "#")
    if isinstance(out, dict):
        # Definitions are normalized once each (refs keep pointing at them).
        for key, table in defs.items():
            out[key] = {name: walker.node(sub, f"#/{key}/{name}") for name, sub in table.items()}
    return NormalizedSchema(out, walker.has_recursion)


class _Walker:
    def __init__(self, root: dict[str, Any], report: ReportBuilder) -> None:
        self.root = root
        self.report = report
        self.has_recursion = False
        draft = str(root.get("$schema", ""))
        # Up to draft 7, keywords next to $ref are ignored; from 2019-09 they also apply.
        self.ref_overrides = any(f"draft-0{n}" in draft for n in (3, 4, 6, 7))

    def _ref_siblings(self, node: dict[str, Any], path: str) -> dict[str, Any]:
        ref = {"$ref": node.pop("$ref")}
        if self.ref_overrides:
            for key in node:
                self.report.add(key, "annotation", path, "ignored next to $ref (draft <= 7)")
            return ref
        return {"allOf": [ref, node]}  # folded by merge_all_of below where exact

    def node(self, node: Any, path: str) -> Any:
        if isinstance(node, bool):
            return node
        if not isinstance(node, dict):
            raise GrammarCompileError(
                f"schema at {path} must be an object or a boolean, got "
                f"{type(node).__name__}: {str(node)[:60]}"
            )
        out: dict[str, Any] = {}
        for key, value in node.items():
            if key in DEF_KEYS and path == "#":
                continue  # normalized separately by normalize_schema
            if key in ANNOTATIONS or key.startswith("x-"):
                self.report.add(key, "annotation", path)
            elif key == "format" and value not in SPEC_FORMATS:
                self.report.add("format", "annotation", path, f"unknown format {value!r}")
            elif key == "$ref":
                self.has_recursion = True  # conservative: any ref may recurse
                out[key] = value
            elif key in SUB_MAP and isinstance(value, dict):
                out[key] = {k: self.node(v, f"{path}/{key}/{k}") for k, v in value.items()}
            elif key in SUB_LIST and isinstance(value, list):
                out[key] = [self.node(v, f"{path}/{key}/{i}") for i, v in enumerate(value)]
            elif key == "items" and isinstance(value, list):
                # Draft 4-2019 tuple form -> prefixItems (+ additionalItems -> items).
                out["prefixItems"] = [
                    self.node(v, f"{path}/items/{i}") for i, v in enumerate(value)
                ]
                if "additionalItems" in node:
                    out["items"] = self.node(node["additionalItems"], f"{path}/additionalItems")
            elif key == "additionalItems":
                if not isinstance(node.get("items"), list):
                    self.report.add(key, "annotation", path, "no tuple items: no effect")
            elif key in SUB_ONE:
                out[key] = self.node(value, f"{path}/{key}")
            elif key == "dependencies" and isinstance(value, dict):
                out[key] = {
                    k: v if isinstance(v, list) else self.node(v, f"{path}/{key}/{k}")
                    for k, v in value.items()
                }
            else:
                out[key] = value
        if "not" in out and isinstance(out["not"], bool | dict) and path != "#":
            negated = out.pop("not")
            if negated is True or negated == {}:  # nothing satisfies this subschema
                self.report.add("not", "enforced", path, "not {} matches nothing: false")
                return False
            if negated is not False:  # `not false` constrains nothing: dropped
                out["not"] = negated
        if "$ref" in out and len(out) > 1:
            out = self._ref_siblings(out, path)
        _draft4_bounds(out)
        if isinstance(out.get("type"), list) and len(out["type"]) == 1:
            out["type"] = out["type"][0]
        if "allOf" in out:
            out = merge_all_of(out, self.root)
        if "oneOf" in out and one_of_is_disjoint(out["oneOf"], self.root):
            branches = out.pop("oneOf")
            self.report.add("oneOf", "enforced", path, "disjoint branches: rewritten as anyOf")
            if "anyOf" in out:
                out["allOf"] = [{"anyOf": out.pop("anyOf")}, {"anyOf": branches}]
            else:
                out["anyOf"] = branches
        return out


def _draft4_bounds(node: dict[str, Any]) -> None:
    """Draft-4 boolean exclusiveMinimum/Maximum -> 2020-12 numeric form."""
    for excl, bound in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
        flag = node.get(excl)
        if isinstance(flag, bool):
            del node[excl]
            if flag and bound in node:
                node[excl] = node.pop(bound)
