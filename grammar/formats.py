"""Format checks for post-generation validation, beyond what `jsonschema` checks alone.

jsonschema checks some formats only when optional packages are installed (rfc3339-validator,
rfc3987, isoduration, fqdn, ...). The regexes here follow the RFCs closely enough to reject
what a model typically gets wrong, and are used only where jsonschema has no checker.
"""

from __future__ import annotations

import re
from typing import Any

_DATE = r"\d{4}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])"
_TIME = r"([01]\d|2[0-3]):[0-5]\d:([0-5]\d|60)(\.\d+)?([Zz]|[+-]([01]\d|2[0-3]):[0-5]\d)"
_PATTERNS = {
    "date-time": re.compile(rf"{_DATE}[Tt ]{_TIME}"),
    "time": re.compile(_TIME),
    "duration": re.compile(
        r"P(?!$)(\d+Y)?(\d+M)?(\d+W)?(\d+D)?(T(?=\d)(\d+H)?(\d+M)?(\d+(\.\d+)?S)?)?"
    ),
    "uri": re.compile(r"[A-Za-z][A-Za-z0-9+.\-]*:[^\s<>\"{}|\\^`]*"),
    "uri-reference": re.compile(r"([A-Za-z][A-Za-z0-9+.\-]*:)?[^\s<>\"{}|\\^`]*"),
    "iri": re.compile(r"[A-Za-z][A-Za-z0-9+.\-]*:[^\s<>\"{}|\\^`]*"),
    "iri-reference": re.compile(r"([A-Za-z][A-Za-z0-9+.\-]*:)?[^\s<>\"{}|\\^`]*"),
    "hostname": re.compile(
        r"(?=.{1,253}$)[A-Za-z0-9]([A-Za-z0-9\-]{0,61}[A-Za-z0-9])?"
        r"(\.[A-Za-z0-9]([A-Za-z0-9\-]{0,61}[A-Za-z0-9])?)*"
    ),
    "json-pointer": re.compile(r"(/([^~/]|~[01])*)*"),
}


_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]*:")


def _uri_reference(value: Any) -> bool:
    """RFC 3986 relative refs may not have ':' in the first path segment ("://" is bad)."""
    if not isinstance(value, str):
        return True
    if not _PATTERNS["uri-reference"].fullmatch(value):
        return False
    if _SCHEME.match(value):
        return True
    first = re.split(r"[/?#]", value, maxsplit=1)[0]
    return ":" not in first


def format_checker(base: Any) -> Any:
    """A copy of jsonschema FormatChecker `base` with the missing checks added."""
    import jsonschema

    checker = jsonschema.FormatChecker(formats=())
    checker.checkers = dict(base.checkers)
    for name, pattern in _PATTERNS.items():
        if name not in checker.checkers:
            check = _uri_reference if name in ("uri-reference", "iri-reference") else None
            checker.checks(name)(check or _matcher(pattern))
    return checker


def _matcher(pattern: re.Pattern[str]) -> Any:
    def check(value: Any) -> bool:
        return not isinstance(value, str) or pattern.fullmatch(value) is not None

    return check
