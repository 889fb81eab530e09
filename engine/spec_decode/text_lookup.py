"""Prompt lookup by text, for values copied from the prompt into a structured output.

Token n-grams miss the start of a copied value: in a JSON string a word loses the leading
space it has in the document, so its first tokens differ (`"Ken` + `ji` in the output,
` Kenji` in the document) and a token lookup finds nothing until the value is half written.
The text does not change: the output's last characters are found in the prompt's text, and
the text that follows them there, tokenized, is the draft (`"Ken` -> `ji Haddad", ...`).

A draft is only a guess that the model verifies, so a continuation tokenized differently
from what the model writes costs one rejected draft, never a different output.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from agentrt.engine.spec_decode.base import DraftContext

# The output's tail that is looked up: the text of its last TAIL_TOKENS tokens, matched from
# its longest suffix (at most MAX_MATCH_CHARS) down to MIN_MATCH_CHARS. Shorter matches (one
# or two letters) occur all over a document and predict nothing.
TAIL_TOKENS = 8
MAX_MATCH_CHARS = 32
MIN_MATCH_CHARS = 3
# Characters of continuation tokenized per draft token wanted (SmolLM2's tokens average
# ~4 characters of English; the surplus is cut off with the last, maybe partial, token).
CHARS_PER_TOKEN = 6
# Where a value copied into a structured output ends in the document's text.
VALUE_ENDS = ("\n", "\t", "  ", ", ", "; ")
# A JSON string value's first characters (fewer than MIN_MATCH_CHARS), after `: "` or `["`.
_VALUE_START = re.compile(r'[:\[,]\s*"(\w{1,2})$')


class TextLookup:
    """Keeps each running request's prompt text (decoded once) until `drop`."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._prompts: dict[str, tuple[Sequence[int], str]] = {}  # req_id -> (ids, text)

    def propose(self, context: DraftContext, max_tokens: int) -> list[int]:
        """Up to `max_tokens` tokens that follow, in the prompt's text, the longest tail of
        the output's text found there (its most recent occurrence); [] without a match."""
        num_output = context.num_tokens - context.num_prompt_tokens
        if max_tokens <= 0 or num_output <= 0:
            return []
        prompt = self._prompt_text(context)
        tail = self.tokenizer.decode(context.last_tokens(min(TAIL_TOKENS, num_output)))
        begin = self._continuation(prompt, tail, context.structured)
        if begin < 0:
            return []
        text = prompt[begin : begin + CHARS_PER_TOKEN * max_tokens]
        ends = VALUE_ENDS if context.structured else ("\n",)
        end = min((i for i in (text.find(sep) for sep in ends) if i >= 0), default=-1)
        if end >= 0:
            # A value copied from the document ends at its line's end or, in a structured
            # output, at a separator between fields of the document ("  ", ", "). There the
            # structured output's JSON string closes and the comma before the next field
            # follows: one token (`",`), as the model writes them. Where the grammar refuses
            # it (after an object's last field) the draft is cut before it. Free text
            # copies the line and its end.
            text = text[:end] + ('",' if context.structured else "\n")
        elif not text:
            return []
        draft = self.tokenizer.encode(text, add_special_tokens=False)
        if end < 0 and begin + len(text) < len(prompt) and len(draft) > 1:
            draft = draft[:-1]  # cut mid-word: its last token may not be the model's
        return draft[:max_tokens]

    @staticmethod
    def _continuation(prompt: str, tail: str, structured: bool) -> int:
        """Where the prompt's text goes on after the longest suffix of `tail` found in it
        (its most recent occurrence), at least MIN_MATCH_CHARS long; -1 without one. A
        structured output's string value that has only one or two characters so far
        (`"El`, `"13`) is looked up where a word starts with them (`Elena`, not `Delft`)."""
        for size in range(min(MAX_MATCH_CHARS, len(tail)), MIN_MATCH_CHARS - 1, -1):
            start = prompt.rfind(tail[-size:])
            if start >= 0:
                return start + size
        value = _VALUE_START.search(tail) if structured else None
        if value is None:
            return -1
        words = list(re.finditer(rf"(?<!\w){re.escape(value.group(1))}", prompt))
        return words[-1].end() if words else -1  # the most recent occurrence

    def _prompt_text(self, context: DraftContext) -> str:
        prompt_ids = context.token_ids[: context.num_prompt_tokens]
        known = self._prompts.get(context.req_id)
        if known is None or known[0] != prompt_ids:  # a new request under a reused id
            known = (list(prompt_ids), self.tokenizer.decode(prompt_ids))
            self._prompts[context.req_id] = known
        return known[1]

    def drop(self, req_id: str) -> None:
        self._prompts.pop(req_id, None)
