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


class TextLookup:
    """Keeps each running request's prompt text (decoded once) until `drop`."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._prompts: dict[str, tuple[Sequence[int], str]] = {}  # req_id -> (ids, text)

    def propose(self, context: DraftContext, max_tokens: int) -> list[int]:
        """Up to `max_tokens` tokens that follow, in the prompt's text, the longest tail of
        the output's text found there (its most recent occurrence); [] without a match."""
        num_output = len(context.token_ids) - context.num_prompt_tokens
        if max_tokens <= 0 or num_output <= 0:
            return []
        prompt = self._prompt_text(context)
        tail_ids = context.token_ids[len(context.token_ids) - min(TAIL_TOKENS, num_output) :]
        tail = self.tokenizer.decode(tail_ids)
        for size in range(min(MAX_MATCH_CHARS, len(tail)), MIN_MATCH_CHARS - 1, -1):
            start = prompt.rfind(tail[-size:])
            if start >= 0:
                break
        else:
            return []
        begin = start + size
        text = prompt[begin : begin + CHARS_PER_TOKEN * max_tokens]
        line_end = text.find("\n")
        if line_end >= 0:
            # A value copied from a line of the document ends with the line; in a JSON
            # string (the structured outputs' usual place for it) a closing quote follows.
            # Outside one the grammar cuts the quote off, so nothing is lost.
            text = text[:line_end] + '"'
        elif not text:
            return []
        draft = self.tokenizer.encode(text, add_special_tokens=False)
        if line_end < 0 and begin + len(text) < len(prompt) and len(draft) > 1:
            draft = draft[:-1]  # cut mid-word: its last token may not be the model's
        return draft[:max_tokens]

    def _prompt_text(self, context: DraftContext) -> str:
        prompt_ids = context.token_ids[: context.num_prompt_tokens]
        known = self._prompts.get(context.req_id)
        if known is None or known[0] != prompt_ids:  # a new request under a reused id
            known = (list(prompt_ids), self.tokenizer.decode(prompt_ids))
            self._prompts[context.req_id] = known
        return known[1]

    def drop(self, req_id: str) -> None:
        self._prompts.pop(req_id, None)
