"""Generation bounds: caps a schema does not set, added so that every constrained output ends.

A JSON string, array or open object may be arbitrarily long, and a small model that starts
to repeat itself inside one (`"mike-mike-mike-..."`, the same array item again and again,
invented keys nested ever deeper) runs until max_tokens: the output is then cut, not valid.
`bound_schema` rewrites a normalized schema into a stricter one (every instance of the
result is an instance of the original, so the final check against the user's schema still
passes) whose instances, for a schema without recursion (and keys that only the schema's
own `patternProperties` constrain), have a finite maximum length:

  - a string without maxLength, enum, const, a fixed-length format or an unanchored
    pattern gets `maxLength = max_string_length`;
  - an array without maxItems gets `maxItems = max_items`;
  - an object that declares `properties` and does not mention `additionalProperties`
    gets `additionalProperties: false` (close_objects); keys it requires, and keys its
    anyOf/oneOf/allOf branches declare, are declared too;
  - an object that takes undeclared keys gets at most max_items of them (llguidance
    counts keys only when every declared key is required) and, when it declares no key at
    all (a map), keys of at most max_string_length characters (a `patternProperties`
    regex; keys matched by the schema's own patterns keep those patterns' lengths);
  - where the schema leaves a value unconstrained (`{}`, a map's values, an array without
    `items`), the value is a JSON value nested at most max_any_depth containers deep;
  - a oneOf whose branches all declare a property with pairwise disjoint values (a
    discriminator) that they do not require gets it required in every branch, which makes
    the branches exclusive: oneOf is then enforced as anyOf instead of checked after
    generation, where the model could end on an output matching two branches (a dead end).

Caps bound each value, not their product: a nested schema may still need more tokens than
max_tokens allows; the matcher closes such an output near the budget's end (budget.py).

Subschemas that are intersected with others (allOf branches, anyOf/oneOf branches of a node
that shapes objects or arrays itself, and everything beneath them) only get the caps that
shrink strings and arrays: closing such an object could forbid a key a sibling needs.
Nothing under `not`, `if`/`then`/`else`, `contains` and the like is touched (a stricter
subschema under `not` would make the whole looser). Each cap is recorded in the report with
status "bounded".
"""

from __future__ import annotations

from typing import Any

from .combinators import disjoint
from .limits import GenerationBounds
from .refs import DEF_KEYS, lookup_def
from .report import ReportBuilder

ANY_DEF = "agentrt_any_{}"  # $defs entry: any JSON value nested at most {} containers deep
_ALL_TYPES = ("null", "boolean", "number", "string", "array", "object")  # number ⊇ integer
_SCALARS = ("null", "boolean", "number", "string")
# Formats whose values have a small fixed maximum length already.
_SHORT_FORMATS = frozenset({"date", "time", "date-time", "uuid", "ipv4", "ipv6"})
# Keywords that shape an object or array: anyOf/oneOf branches next to them are fragments
# intersected with them, not alternatives that stand alone.
_SHAPE_KEYS = frozenset(
    {
        "properties", "patternProperties", "additionalProperties", "required",
        "minProperties", "maxProperties", "propertyNames", "dependentRequired",
        "dependentSchemas", "dependencies", "unevaluatedProperties", "items", "prefixItems",
        "contains", "unevaluatedItems",
    }
)  # fmt: skip
# Keywords next to which undeclared keys are left alone (they may need or name them).
_MAP_KEEP = frozenset(
    {
        "unevaluatedProperties", "dependentRequired", "dependencies", "dependentSchemas",
        "if", "then", "else", "not", "$ref",
    }
)  # fmt: skip
# Keywords that may need (or name) undeclared keys: an object holding them stays open.
_OPEN_KEYS = _MAP_KEEP | {"patternProperties", "propertyNames", "minProperties"}
_BRANCH_KEYS = ("anyOf", "oneOf", "allOf")


def bound_schema(schema: Any, bounds: GenerationBounds, report: ReportBuilder) -> Any:
    """A stricter copy of the normalized `schema` (not modified); each cap goes to `report`.

    Definitions reached from an intersected position are fragments too: the walk repeats
    until that set stops growing (once per newly found definition at most).
    """
    fragment_refs: frozenset[str] = frozenset()
    while True:
        walker = _Bounder(schema, bounds, fragment_refs)
        out = walker.run()
        if walker.found_refs <= fragment_refs:
            break
        fragment_refs |= walker.found_refs
    for keyword, path, note in walker.entries:
        report.add(keyword, "bounded", path, note)
    return out


class _Bounder:
    def __init__(self, root: Any, bounds: GenerationBounds, fragment_refs: frozenset[str]) -> None:
        self.root = root
        self.b = bounds
        self.fragment_refs = fragment_refs
        self.found_refs: set[str] = set()
        self.entries: list[tuple[str, str, str]] = []
        self.any_defs: dict[str, Any] = {}
        self.key_pattern = f"^.{{0,{bounds.max_string_length}}}$"

    def run(self) -> Any:
        root = {} if self.root is True else self.root
        if not isinstance(root, dict):
            return root  # `false`: nothing to bound
        out = self.node(root, "#", "#" in self.fragment_refs)
        for key in DEF_KEYS:
            table = root.get(key)
            if isinstance(table, dict):
                out[key] = {
                    name: self.node(sub, f"#/{key}/{name}", f"#/{key}/{name}" in self.fragment_refs)
                    for name, sub in table.items()
                }
        if self.any_defs:
            out["$defs"] = {**out.get("$defs", {}), **self.any_defs}
        return out

    def add(self, keyword: str, path: str, note: str) -> None:
        self.entries.append((keyword, path, note))

    def any_ref(self, depth: int) -> dict[str, Any]:
        """A reference to "any JSON value nested at most `depth` containers deep"."""
        name = ANY_DEF.format(depth)
        if name not in self.any_defs:
            if depth == 0:
                self.any_defs[name] = {
                    "type": list(_SCALARS),
                    "maxLength": self.b.max_string_length,
                }
            else:
                child = self.any_ref(depth - 1)
                self.any_defs[name] = {
                    "type": list(_ALL_TYPES),
                    "maxLength": self.b.max_string_length,
                    "maxItems": self.b.max_items,
                    "items": child,
                    "patternProperties": {self.key_pattern: child},
                    "additionalProperties": False,
                    "maxProperties": self.b.max_items,
                }
        return {"$ref": f"#/$defs/{name}"}

    def node(self, node: Any, path: str, fragment: bool) -> Any:
        if node is True:
            node = {}
        if not isinstance(node, dict):
            return node
        if "$ref" in node:
            if fragment:
                self.found_refs.add(node["$ref"])
            return dict(node)
        if "enum" in node or "const" in node:
            return dict(node)  # finitely many values: nothing to bound
        out = dict(node)
        has_branches = any(isinstance(node.get(k), list) for k in _BRANCH_KEYS)
        shaping = fragment or bool(_SHAPE_KEYS & node.keys())
        # Children are intersected with what the branches say about the same keys.
        kids = fragment or (shaping and has_branches)
        for key in ("properties", "patternProperties"):
            if isinstance(node.get(key), dict):
                out[key] = {
                    k: self.node(v, f"{path}/{key}/{k}", kids) for k, v in node[key].items()
                }
        for key in ("additionalProperties", "items"):
            if isinstance(node.get(key), dict):
                out[key] = self.node(node[key], f"{path}/{key}", kids)
        if isinstance(node.get("prefixItems"), list):
            out["prefixItems"] = [
                self.node(v, f"{path}/prefixItems/{i}", kids)
                for i, v in enumerate(node["prefixItems"])
            ]
        for key in _BRANCH_KEYS:
            if isinstance(node.get(key), list):
                sub = shaping or key == "allOf"
                out[key] = [self.node(v, f"{path}/{key}/{i}", sub) for i, v in enumerate(node[key])]
        types = _types(node)
        if "string" in types:
            self._cap_string(node, out, path)
        if "array" in types:
            self._cap_array(node, out, path, fragment)
        if "object" in types and not fragment:
            closed = self.b.close_objects and self._close(node, out, path)
            if not closed and not has_branches:
                self._cap_map(node, out, path)
        if isinstance(node.get("oneOf"), list):
            self._discriminate(node, out, path, types)
        return out

    def _cap_string(self, node: dict[str, Any], out: dict[str, Any], path: str) -> None:
        if "maxLength" in node or node.get("format") in _SHORT_FORMATS:
            return
        pattern = node.get("pattern")
        if isinstance(pattern, str) and not _anchored(pattern):
            return  # llguidance cannot intersect a searched regex with a length cap in time
        out["maxLength"] = max(self.b.max_string_length, _int(node.get("minLength")))
        self.add("maxLength", path, f"strings capped at {out['maxLength']} characters")

    def _cap_array(self, node: dict[str, Any], out: dict[str, Any], path: str, frag: bool) -> None:
        if "maxItems" not in node:
            out["maxItems"] = max(self.b.max_items, _int(node.get("minItems")))
            self.add("maxItems", path, f"arrays capped at {out['maxItems']} items")
        if not frag and "items" not in node and not any(k in node for k in _BRANCH_KEYS):
            out["items"] = self.any_ref(self.b.max_any_depth)
            self.add("items", path, f"unconstrained items nest at most {self.b.max_any_depth} deep")

    def _close(self, node: dict[str, Any], out: dict[str, Any], path: str) -> bool:
        """Declared properties and no `additionalProperties`: no undeclared keys. True if
        the object was closed."""
        props = node.get("properties")
        if not isinstance(props, dict) or not props or _OPEN_KEYS & node.keys():
            return False
        if "additionalProperties" in node:  # `true` included: the schema asks for extras
            return False
        names = _branch_names(node, self.root, 0)
        if names is None:
            return False
        declared = dict(out["properties"])
        for name in node.get("required", []):
            if isinstance(name, str) and name not in declared:
                declared[name] = self.any_ref(self.b.max_any_depth)
        for name in names:
            declared.setdefault(name, {})  # the branch that declares it constrains it
        out["properties"] = declared
        out["additionalProperties"] = False
        self.add("additionalProperties", path, "undeclared keys are not generated")
        return True

    def _cap_map(self, node: dict[str, Any], out: dict[str, Any], path: str) -> None:
        """An object that takes undeclared keys: bound their number, their length (when no
        key is declared) and how deep their values nest, as far as the backend can."""
        extra = node.get("additionalProperties", True)
        if (extra is False and "patternProperties" not in node) or _MAP_KEEP & node.keys():
            return
        props = node.get("properties") if isinstance(node.get("properties"), dict) else {}
        required = {r for r in node.get("required", []) if isinstance(r, str)}
        value = self.any_ref(self.b.max_any_depth) if extra is True else out["additionalProperties"]
        notes = []
        if (
            not props
            and "patternProperties" not in node
            and extra is not False
            and all(len(r) <= self.b.max_string_length for r in required)
        ):
            out.pop("properties", None)
            out["patternProperties"] = {self.key_pattern: value}
            out["additionalProperties"] = False
            notes.append(f"keys of at most {self.b.max_string_length} characters")
        elif extra is True:
            out["additionalProperties"] = value
        if extra is True:
            notes.append(f"values nested at most {self.b.max_any_depth} deep")
        # llguidance counts keys only when every declared key is required.
        if "maxProperties" not in node and set(props) <= required:
            out["maxProperties"] = max(
                len(props) + self.b.max_items, _int(node.get("minProperties")), len(required)
            )
            notes.append(f"at most {out['maxProperties'] - len(props)} undeclared keys")
        if notes:
            self.add("maxProperties", path, "objects with undeclared keys: " + ", ".join(notes))

    def _discriminate(
        self, node: dict[str, Any], out: dict[str, Any], path: str, types: set[str]
    ) -> None:
        """Require a discriminating property in every oneOf branch, then enforce as anyOf.

        Exact for the stricter schema: an output of branch i has key k with a value in
        S_i; every other branch j asks k's value to be in S_j, disjoint from S_i, so
        exactly one branch matches.
        """
        branches = node["oneOf"]
        if len(branches) < 2 or not all(
            isinstance(b, dict) and isinstance(b.get("properties"), dict) and "$ref" not in b
            for b in branches
        ):
            return
        if types != {"object"} and not all(b.get("type") == "object" for b in branches):
            return  # a non-object instance would satisfy every `required`
        common = [
            k for k in branches[0]["properties"] if all(k in b["properties"] for b in branches)
        ]
        for key in common:
            values = [b["properties"][key] for b in branches]
            if all(
                disjoint(a, b, self.root) for i, a in enumerate(values) for b in values[i + 1 :]
            ):
                walked = out.pop("oneOf")
                alts = [
                    {**b, "required": list(dict.fromkeys([*b.get("required", []), key]))}
                    for b in walked
                ]
                if "anyOf" in out:
                    out["allOf"] = [*out.get("allOf", []), {"anyOf": alts}]
                else:
                    out["anyOf"] = alts
                self.add("required", path, f"oneOf discriminator {key!r} required in each branch")
                return


def _types(node: dict[str, Any]) -> set[str]:
    """JSON types an instance of `node` may have (ignoring its branches)."""
    declared = node.get("type")
    if declared is None:
        return set(_ALL_TYPES)
    types = set(declared) if isinstance(declared, list) else {declared}
    return types | ({"number"} if "integer" in types else set())


def _anchored(pattern: str) -> bool:
    """The regex must match the whole string (`^...$`), not just somewhere in it."""
    return pattern.startswith("^") and pattern.endswith("$") and not pattern.endswith("\\$")


def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _branch_names(node: dict[str, Any], root: Any, depth: int) -> set[str] | None:
    """Keys that the anyOf/oneOf/allOf branches of `node` declare or require; None when a
    branch may need keys nobody declares (then the object must stay open)."""
    names: set[str] = set()
    for key in _BRANCH_KEYS:
        for branch in node.get(key) or []:
            if isinstance(branch, dict) and set(branch) == {"$ref"} and isinstance(root, dict):
                branch = lookup_def(root, branch["$ref"])
                if branch is None or depth >= 3:
                    return None  # the root itself, or a deep chain: not worth proving
            if isinstance(branch, bool):
                continue
            if not isinstance(branch, dict) or _OPEN_KEYS & branch.keys():
                return None
            names.update(branch.get("properties") or {})
            names.update(r for r in branch.get("required", []) if isinstance(r, str))
            inner = _branch_names(branch, root, depth + 1)
            if inner is None:
                return None
            names |= inner
    return names
