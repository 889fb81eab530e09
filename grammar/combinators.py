"""Exact rewrites of `allOf` and `oneOf` (see normalize.py).

`merge_all_of` folds branches into their parent only when the result has exactly the same
instances; anything it cannot merge exactly stays in a (shorter) `allOf` for the backend.
`one_of_is_disjoint` proves that no instance can match two branches, in which case `oneOf`
means the same as `anyOf`.
"""

from __future__ import annotations

import json
from itertools import combinations
from typing import Any

from .refs import lookup_def

_MAX_KEYS = ("maximum", "exclusiveMaximum", "maxLength", "maxItems", "maxProperties")
_MIN_KEYS = ("minimum", "exclusiveMinimum", "minLength", "minItems", "minProperties")
_TYPES = ("null", "boolean", "object", "array", "number", "string", "integer")


def _deref(branch: Any, root: dict[str, Any]) -> Any:
    """A `{"$ref": X}`-only branch -> the definition it names (one level, no expansion)."""
    if isinstance(branch, dict) and set(branch) == {"$ref"}:
        target = lookup_def(root, branch["$ref"])
        if isinstance(target, dict) and "$ref" not in target:
            return target
    return branch


def merge_all_of(node: dict[str, Any], root: dict[str, Any]) -> dict[str, Any]:
    """Merge `node["allOf"]` into `node` where exact; leftovers stay in `allOf`."""
    own = {k: v for k, v in node.items() if k != "allOf"}
    merged: dict[str, Any] = {}
    rest: list[Any] = []
    for branch in [*node["allOf"], own]:
        branch = _deref(branch, root)
        if branch is True or branch == {}:
            continue
        result = _merge(merged, branch) if isinstance(branch, dict) else None
        if result is None:
            rest.append(branch)
        else:
            merged = result
    if rest:
        merged["allOf"] = rest
    return merged


def _merge(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any] | None:
    """The exact intersection of a and b as one schema, or None when not expressible."""
    if "$ref" in a or "$ref" in b:
        return {**a, **b} if not a or not b else None
    if _closes_out(a, b) or _closes_out(b, a):
        return None
    out = dict(a)
    for key, value in b.items():
        if key not in out:
            out[key] = value
        elif out[key] == value:
            continue
        elif key == "properties":
            props = dict(out[key])
            for name, sub in value.items():
                props[name] = sub if name not in props else {"allOf": [props[name], sub]}
            out[key] = props
        elif key == "required":
            out[key] = list(dict.fromkeys([*out[key], *value]))
        elif key in _MAX_KEYS and _both_numbers(out[key], value):
            out[key] = min(out[key], value)
        elif key in _MIN_KEYS and _both_numbers(out[key], value):
            out[key] = max(out[key], value)
        elif key == "type":
            types = _type_set(out[key]) & _type_set(value)
            if not types:
                return None
            out[key] = sorted(types)[0] if len(types) == 1 else sorted(types)
        elif key == "enum" and isinstance(value, list):
            keep = {_key(v) for v in value}
            out[key] = [v for v in out[key] if _key(v) in keep]
        else:
            return None
    # A merged property that itself holds allOf gets merged on its own walk; here only the
    # parent is folded, so sub-merges stay lazy and recursion-safe.
    return out


def _closes_out(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """True when a forbids extra properties that b declares (merging would allow them)."""
    if "additionalProperties" not in a and "patternProperties" not in a:
        return False
    return bool(set(b.get("properties", {})) - set(a.get("properties", {})))


def _both_numbers(x: Any, y: Any) -> bool:
    return all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (x, y))


def _type_set(t: Any) -> set[str]:
    types = set(t) if isinstance(t, list) else {t}
    if "number" in types:
        types.add("integer")
    return types


def _key(value: Any) -> str:
    return json.dumps(value, sort_keys=True)


def _value_type(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, int) or (isinstance(v, float) and v.is_integer()):
        return "integer"
    return {float: "number", str: "string", list: "array", dict: "object"}[type(v)]


def _types_of(branch: dict[str, Any]) -> set[str] | None:
    """Types an instance of `branch` can have, or None when unconstrained."""
    values = _values_of(branch)
    if values is not None:
        return {_value_type(v) for v in values}
    if "type" in branch:
        return _type_set(branch["type"])
    return None


def _values_of(branch: dict[str, Any]) -> list[Any] | None:
    if "const" in branch:
        return [branch["const"]]
    if isinstance(branch.get("enum"), list):
        return branch["enum"]
    return None


def disjoint(a: Any, b: Any, root: dict[str, Any], depth: int = 0) -> bool:
    """True when no instance can satisfy both subschemas (False = not proven)."""
    a, b = _deref(a, root), _deref(b, root)
    if a is False or b is False:
        return True
    if not isinstance(a, dict) or not isinstance(b, dict):
        return False
    ta, tb = _types_of(a), _types_of(b)
    if ta is not None and tb is not None and not (ta & tb):
        return True
    va, vb = _values_of(a), _values_of(b)
    if va is not None and vb is not None and not ({_key(v) for v in va} & {_key(v) for v in vb}):
        return True
    if ta != {"object"} or tb != {"object"}:
        return False
    # Discriminator: a property both require, with disjoint values (const/enum, types, or
    # a nested discriminator; the depth cap keeps recursive schemas finite).
    pa, pb = a.get("properties", {}), b.get("properties", {})
    common_required = set(a.get("required", [])) & set(b.get("required", []))
    if depth < 4 and isinstance(pa, dict) and isinstance(pb, dict):
        for name in common_required & set(pa) & set(pb):
            if disjoint(pa[name], pb[name], root, depth + 1):
                return True
    # Incompatible required keys: one requires a key the other (closed) cannot have.
    return _forbids(a, b.get("required", [])) or _forbids(b, a.get("required", []))


def _forbids(closed: dict[str, Any], keys: list[str]) -> bool:
    if closed.get("additionalProperties") is not False or "patternProperties" in closed:
        return False
    allowed = set(closed.get("properties", {}))
    return any(k not in allowed for k in keys)


def one_of_is_disjoint(branches: list[Any], root: dict[str, Any]) -> bool:
    """True when no instance can satisfy two branches (so oneOf == anyOf)."""
    if len(branches) > 64:
        return False  # quadratic check; large unions are left to post-checking
    return all(disjoint(a, b, root) for a, b in combinations(branches, 2))
