"""Excluded argument objects -> a parameters schema that cannot produce them.

`exclude_arguments(parameters, excluded)` is an object schema minus the argument objects in
`excluded` (an agent's calls already answered), written only with keywords every grammar
backend enforces while the model writes: anyOf, const, enum, minimum/maximum,
min/maxLength, min/maxItems and an anchored pattern. An excluded call is thus unreachable
by the grammar itself. JSON Schema's `not` would say it in one line, but no backend
compiles `not`: it would only be post-checked, after the model has written the call.

Objects: a trie over the properties in schema order. Each branch fixes the first k
properties to values some excluded objects share and makes property k+1 differ from all of
theirs. Values compare as JSON (1 == 1.0, true != 1, key order irrelevant); an omitted
property counts as its default.

Guarantees:

- Never wider: no excluded object is ever produced. None is returned when no object is
  left (the caller stops offering the tool).
- Exact for enums, consts, booleans, null, integers, and strings without a pattern or
  format (but for the two string cases below): every other value stays reachable.
- Elsewhere narrower than needed, never wider: where "differs from v" has no exact schema a
  few other objects are cut too - numbers within about 1e-14 (relative) of an excluded one;
  strings with a pattern or format, and arrays, of an excluded one's length; strings that
  differ from an excluded one first by a control character or only past its first
  _MAX_PREFIX characters; in the branches that fix a property's value, other spellings of
  it (7.0 for 7), or its omission where the excluded objects omit it and it has no default;
  and objects that differ first at a property whose schema has no known narrowing (one
  with no type, say).
- Linear size in the number of answered calls: one branch per trie node, each with a
  "differs" schema linear in its node's values, where negating each call on its own and
  intersecting would multiply branches.

Local `$defs` stay at the parameters' root and `$ref`s into them are followed. Pure: no
input is modified.
"""

from __future__ import annotations

import decimal
import itertools
import json
from typing import Any

_MISSING = object()
_END, _CUT = 0, 1  # trie markers (not strings, so never a character)
_MAX_PREFIX = 100  # characters: each is one nested group in the pattern
_REGEX_META = set("\\.+*?()|[]{}^$#&-~")  # escaped the same way in Rust and Python regexes


def exclude_arguments(parameters: dict[str, Any], excluded: list[dict]) -> dict[str, Any] | None:
    """`parameters` (an object schema) without the objects in `excluded`; None when nothing
    is left. Local `$defs` stay at the root and references into them are followed."""
    if not excluded:
        return parameters
    defs = {**parameters.get("definitions", {}), **parameters.get("$defs", {})}
    narrowed = _exclude(parameters, excluded, _Refs(defs))
    if narrowed is None:
        return None
    return {**{k: v for k, v in parameters.items() if k in ("$defs", "definitions")}, **narrowed}


class _Refs:
    def __init__(self, defs: dict[str, Any]) -> None:
        self.defs = defs

    def resolve(self, node: dict[str, Any]) -> dict[str, Any]:
        """`node` with local `$ref`s replaced by their targets (siblings kept)."""
        seen = set()
        while isinstance(ref := node.get("$ref"), str) and ref not in seen:
            seen.add(ref)
            name = ref.removeprefix("#/$defs/").removeprefix("#/definitions/")
            if name == ref or name not in self.defs:
                break
            node = {**self.defs[name], **{k: v for k, v in node.items() if k != "$ref"}}
        return node


def _exclude(schema: Any, values: list[Any], refs: _Refs, kind: str | None = None) -> Any:
    """The schema of the values of `schema` that are none of `values` (None: no value)."""
    if not values:
        return schema
    if schema is True or schema == {}:
        schema = {}
    if not isinstance(schema, dict):
        return None
    schema = {k: v for k, v in refs.resolve(schema).items() if k not in ("$defs", "definitions")}
    keys = {_key(v) for v in values}
    if "const" in schema:
        return None if _key(schema["const"]) in keys else schema
    if "enum" in schema:
        left = [e for e in schema["enum"] if _key(e) not in keys]
        return {**schema, "enum": left} if left else None
    kind = schema.get("type", kind)
    for union in ("anyOf", "oneOf"):
        if union in schema:
            branches = [_exclude(b, values, refs, kind) for b in schema[union]]
            kept = [b for b in branches if b is not None]
            return {**schema, union: kept} if kept else None
    if isinstance(kind, list):
        typed = [_exclude({**schema, "type": t}, values, refs) for t in kind]
        kept = [b for b in typed if b is not None]
        return _union(kept)
    if kind == "null":
        return None if None in values else schema
    if kind == "boolean":
        left = [b for b in (False, True) if _key(b) not in keys]
        return {**schema, "enum": left} if left else None
    if kind in ("integer", "number"):
        numbers = sorted({v for v in values if _is_number(v)})
        return _union(_number_ranges(schema, numbers, integer=kind == "integer"))
    if kind == "string":
        words = sorted({v for v in values if isinstance(v, str)})
        if not words:
            return schema
        if "pattern" in schema or "format" in schema:
            lengths = [len(w) for w in words]
            return _union(_length_ranges(schema, lengths, "minLength", "maxLength"))
        pattern = _not_words_regex(words)
        return None if pattern is None else {**schema, "pattern": pattern}
    if kind == "array" or "items" in schema or "prefixItems" in schema:
        lengths = [len(v) for v in values if isinstance(v, list)]
        return _union(_length_ranges(schema, lengths, "minItems", "maxItems"))
    if kind == "object" or "properties" in schema:
        objects = [v for v in values if isinstance(v, dict)]
        if not objects:
            return schema
        return _union(_object_branches(schema, objects, refs))
    return None  # no narrowing known: nothing is offered rather than an excluded value


def _object_branches(schema: dict, objects: list[dict], refs: _Refs) -> list[dict]:
    properties = schema.get("properties", {})
    names = list(properties)
    required = list(schema.get("required", []))

    def build(overrides: dict[str, tuple[Any, bool]]) -> dict:
        props = {**properties, **{p: s for p, (s, _) in overrides.items()}}
        needed = required + [p for p, (_, req) in overrides.items() if req and p not in required]
        return {**schema, "properties": props, "required": needed}

    def walk(index: int, group: list[dict], fixed: dict[str, tuple[Any, bool]]) -> list[dict]:
        if index == len(names):
            return []  # equal to the group on every property: excluded
        name = names[index]
        prop = refs.resolve(properties[name]) if isinstance(properties[name], dict) else {}
        has_default = "default" in prop
        by_value: dict[str, tuple[Any, list[dict]]] = {}
        for obj in group:
            value = obj.get(name, prop["default"] if has_default else _MISSING)
            key = "<missing>" if value is _MISSING else _key(value)
            by_value.setdefault(key, (value, []))[1].append(obj)
        present = [v for v, _ in by_value.values() if v is not _MISSING]
        # Omitting the property means its default: allowed wherever the default is.
        default_differs = has_default and _key(prop["default"]) not in by_value
        out = []
        differs = _exclude(properties[name], present, refs)
        if differs is not None:
            out.append(build({**fixed, name: (differs, not default_differs)}))
        for value, members in by_value.values():
            if value is _MISSING:
                continue  # "omitted" has no enforced keyword: those branches are dropped
            is_default = has_default and _key(prop["default"]) == _key(value)
            out += walk(index + 1, members, {**fixed, name: ({"const": value}, not is_default)})
        return out

    return walk(0, objects, {})


def _number_ranges(schema: dict, numbers: list[Any], *, integer: bool) -> list[dict]:
    """`schema` split around `numbers` by closed bounds: v - 1 and v + 1 for integers, for
    numbers the nearest decimals of 15 significant digits beyond v's neighbouring floats.
    Not exclusive bounds at v: the grammar compares decimals exactly, so it would take
    7.00000000000000005, which parses to the excluded 7.0. Not the neighbouring floats
    themselves: llguidance reads a 16-digit bound inexactly (0.9999999999999999 as 1); 15
    digits round-trip. Ranges outside the schema's own bounds are left out."""
    if integer:
        values: list[Any] = sorted({int(v) for v in numbers if float(v).is_integer()})
    else:
        values = sorted({float(v) for v in numbers})
    floor = _bound(schema, ("minimum", "exclusiveMinimum"), max)
    ceiling = _bound(schema, ("maximum", "exclusiveMaximum"), min)
    out = []
    for left, right in itertools.pairwise([None, *values, None]):
        low = None if left is None else left + 1 if integer else _beyond(left, 1)
        high = None if right is None else right - 1 if integer else _beyond(right, -1)
        if low is not None and high is not None and low > high:
            continue
        if (low is not None and ceiling is not None and low > ceiling) or (
            high is not None and floor is not None and high < floor
        ):
            continue
        branch = dict(schema)
        for key, value, tighter in (("minimum", low, max), ("maximum", high, min)):
            if value is not None:
                branch[key] = tighter(value, branch[key]) if _is_number(branch.get(key)) else value
        out.append(branch)
    return out


def _beyond(value: float, side: int) -> float:
    """A decimal of 15 significant digits past `value`'s neighbouring float on `side` (+1
    above, -1 below): every decimal beyond it parses to a float other than `value`."""
    exact = decimal.Decimal(repr(value))
    unit = decimal.Decimal(1).scaleb(exact.adjusted() - 14)
    rounding = decimal.ROUND_CEILING if side > 0 else decimal.ROUND_FLOOR
    return float(exact.quantize(unit, rounding=rounding) + side * unit)


def _length_ranges(schema: dict, lengths: list[int], min_key: str, max_key: str) -> list[dict]:
    """`schema` restricted to lengths other than `lengths`: a narrowing that also drops the
    values of those lengths that differ (used where "differs" has no exact schema)."""
    lowest, highest = schema.get(min_key, 0), schema.get(max_key)
    edges = [lowest - 1, *sorted(set(lengths)), None]
    out = []
    for below, above in itertools.pairwise(edges):
        low = max(below + 1, lowest)
        high = None if above is None else above - 1
        if highest is not None:
            high = highest if high is None else min(high, highest)
        if high is not None and low > high:
            continue
        branch = {**schema, min_key: low}
        if high is not None:
            branch[max_key] = high
        out.append(branch)
    return out


def _not_words_regex(words: list[str]) -> str | None:
    """An anchored pattern for every string but `words`, from their trie: at each node,
    stop (unless a word ends there), or take a character no word continues with and then
    anything, or follow a child. Control characters are left out of "other character"
    classes: llguidance widens a class holding the range \\x10-\\x1f to every JSON escape
    (`\\"` included), which would let an excluded word through. Past _MAX_PREFIX characters
    a word excludes everything that starts with its prefix (nested groups are limited)."""
    trie: dict[Any, Any] = {}  # char -> child; _END: a word ends here; _CUT: cut off here
    for word in words:
        node = trie
        for ch in word[:_MAX_PREFIX]:
            node = node.setdefault(ch, {})
        node[_END if len(word) <= _MAX_PREFIX else _CUT] = True

    def rest(node: dict[Any, Any]) -> str | None:
        if _CUT in node:
            return None  # every continuation starts like an excluded word
        children = [ch for ch in node if isinstance(ch, str)]
        others = "".join(_class_char(ch) for ch in children if ord(ch) >= 0x20)
        alternatives = [f"[^\\x00-\\x1f{others}][\\s\\S]*"]
        for ch in children:
            tail = rest(node[ch])
            if tail is not None:
                alternatives.append(_literal_char(ch) + tail)
        group = "(?:" + "|".join(alternatives) + ")"
        return group if _END in node else group + "?"

    body = rest(trie)
    return None if body is None else f"^{body}$"


def _literal_char(ch: str) -> str:
    if ord(ch) < 0x20:
        return f"\\x{ord(ch):02x}"
    return "\\" + ch if ch in _REGEX_META else ch


def _class_char(ch: str) -> str:
    return "\\" + ch if ch in _REGEX_META else ch


def _bound(schema: dict, keys: tuple[str, str], pick: Any) -> Any:
    found = [schema[k] for k in keys if _is_number(schema.get(k))]
    return pick(found) if found else None


def _union(branches: list[Any]) -> Any:
    if not branches:
        return None
    return branches[0] if len(branches) == 1 else {"anyOf": branches}


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _key(value: Any) -> str:
    """JSON equality as JSON Schema has it: 1 == 1.0, true != 1, key order irrelevant."""

    def canon(v: Any) -> Any:
        if isinstance(v, float) and v.is_integer():
            return int(v)
        if isinstance(v, dict):
            return {k: canon(x) for k, x in v.items()}
        if isinstance(v, list):
            return [canon(x) for x in v]
        return v

    return json.dumps(canon(value), sort_keys=True)
