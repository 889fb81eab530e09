"""`GrammarReport`: per keyword, how a compiled grammar treats it.

status:
  "enforced"     - the token grammar allows only outputs that satisfy the keyword;
  "post_checked" - the token grammar is looser (a superset); the keyword is checked on the
                   finished output (`validate_final`, and before EOS is allowed);
  "annotation"   - has no effect on validity (title, description, unknown `format`, ...);
  "bounded"      - a cap the schema does not set, added so generation ends (GenerationBounds,
                   bounds.py): the grammar is stricter than the schema there. The cap's
                   keyword also counts as "enforced", since the grammar enforces it.
Nothing is removed from (or added to) a schema without an entry here.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

STATUSES = ("enforced", "post_checked", "annotation", "bounded")


@dataclass(frozen=True, slots=True)
class KeywordStatus:
    keyword: str
    status: str
    count: int
    example_path: str
    note: str = ""


@dataclass(slots=True)
class ReportBuilder:
    """Collects (keyword, status) observations while a schema is normalized and routed."""

    _counts: Counter[tuple[str, str]] = field(default_factory=Counter)
    _paths: dict[tuple[str, str], str] = field(default_factory=dict)
    _notes: dict[tuple[str, str], str] = field(default_factory=dict)

    def add(self, keyword: str, status: str, path: str, note: str = "") -> None:
        assert status in STATUSES, status
        key = (keyword, status)
        self._counts[key] += 1
        self._paths.setdefault(key, path or "#")
        if note:
            self._notes.setdefault(key, note)

    def copy(self) -> ReportBuilder:
        return ReportBuilder(self._counts.copy(), dict(self._paths), dict(self._notes))

    def build(self, backend: str) -> GrammarReport:
        entries = tuple(
            KeywordStatus(kw, st, n, self._paths[(kw, st)], self._notes.get((kw, st), ""))
            for (kw, st), n in sorted(self._counts.items())
        )
        return GrammarReport(backend, entries)


@dataclass(frozen=True, slots=True)
class GrammarReport:
    """What the compiled grammar enforces; `backend` is the backend that compiled it."""

    backend: str
    entries: tuple[KeywordStatus, ...] = ()

    def keywords(self, status: str) -> set[str]:
        return {e.keyword for e in self.entries if e.status == status}

    @property
    def enforced(self) -> set[str]:
        return self.keywords("enforced")

    @property
    def post_checked(self) -> set[str]:
        return self.keywords("post_checked")

    @property
    def annotations(self) -> set[str]:
        return self.keywords("annotation")

    @property
    def bounded(self) -> set[str]:
        return self.keywords("bounded")

    @property
    def exact(self) -> bool:
        """True when the token grammar alone enforces every assertion of the spec."""
        return not self.post_checked

    def __str__(self) -> str:
        lines = [f"grammar backend: {self.backend}"]
        for e in self.entries:
            note = f" ({e.note})" if e.note else ""
            lines.append(f"  {e.keyword:<22} {e.status:<13} x{e.count} at {e.example_path}{note}")
        return "\n".join(lines)
