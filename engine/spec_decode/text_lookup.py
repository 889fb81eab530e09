"""Prompt lookup by text, for values copied from the prompt into a structured output.

Token n-grams miss the start of a copied value: in a JSON string a word loses the leading
space it has in the document, so its first tokens differ (`"Ken` + `ji` in the output,
` Kenji` in the document) and a token lookup finds nothing until the value is half written.
The text does not change: the output's last characters are found in the prompt's text, and
the text that follows them there, to where the value ends, tokenized, is the draft (`"Ken`
-> `ji Haddad",`). A value about to start is found by its key's label in the document
(`"email": "` -> what follows `E-mail: `).

A draft is only a guess that the model verifies, so a continuation tokenized differently
from what the model writes costs one rejected draft, never a different output.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

from agentrt.engine.spec_decode.base import DraftContext

# The output's tail that is looked up: the text of its last TAIL_TOKENS tokens, matched from
# its longest suffix (at most MAX_MATCH_CHARS) down to MIN_MATCH_CHARS. Shorter matches (one
# or two letters) occur all over a document and predict nothing.
TAIL_TOKENS = 8
MAX_MATCH_CHARS = 32
MIN_MATCH_CHARS = 3
# A token match shorter than this defers to the text lookup: one common token (`"`, ` the`)
# predicts little, a few characters of text predict more.
MIN_TRUSTED_MATCH = 2
# Characters of continuation tokenized per draft token wanted (SmolLM2's tokens average
# ~4 characters of English; the surplus is cut off with the last, maybe partial, token).
CHARS_PER_TOKEN = 6
# Where a value copied into a structured output ends in the document's text.
VALUE_ENDS = ("\n", "\t", "  ", ", ", "; ")
# A JSON string value's first characters (fewer than MIN_MATCH_CHARS), after `: "` or `["`.
_VALUE_START = re.compile(r'[:\[,]\s*"(\w{1,2})$')
# A key's value about to start: the output ends with `"key":`, a space maybe, a quote maybe.
_KEY_VALUE_START = re.compile(r'"(\w+)":\s*(")?$')


class TextLookup:
    """Keeps each running request's prompt text (decoded once) until `drop`."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._prompts: dict[str, tuple[Sequence[int], str]] = {}  # req_id -> (ids, text)

    def propose_with(
        self,
        context: DraftContext,
        max_tokens: int,
        token_match: Callable[[], tuple[int, bool, list[int]]],
    ) -> list[int]:
        """A token proposer's draft, by text where the text knows better:
        1. a structured output about to write a key's value: by the key's label
           (`propose_labeled`);
        2. else the proposer's token match (`token_match()`: its length in tokens, whether
           it lies in the prompt only, its draft), unless it is shorter than
           MIN_TRUSTED_MATCH or, in a structured output, a copy from the prompt (the text
           knows where the value ends): then by text (`propose`), the token draft where the
           text finds nothing.
        The output's tail is decoded at most once."""
        tail = self._tail(context, max_tokens) if context.structured else None
        labeled = self.propose_labeled(context, max_tokens, tail) if tail is not None else []
        if labeled:
            return labeled
        num_matched, copied, draft = token_match()
        if num_matched < MIN_TRUSTED_MATCH or (copied and context.structured):
            return self.propose(context, max_tokens, tail) or draft
        return draft

    def propose(self, context: DraftContext, max_tokens: int, tail: str | None = None) -> list[int]:
        """Up to `max_tokens` tokens that follow, in the prompt's text, the longest tail of
        the output's text found there (its most recent occurrence; at least
        MIN_MATCH_CHARS long), or, in a structured output, a string value's first one or
        two characters where a word starts with them (`"El` -> `Elena`, not `Delft`); []
        without a match. `tail`: the output's tail text, when the caller decoded it."""
        tail = tail if tail is not None else self._tail(context, max_tokens)
        if tail is None:
            return []
        prompt = self._prompt_text(context)
        for size in range(min(MAX_MATCH_CHARS, len(tail)), MIN_MATCH_CHARS - 1, -1):
            start = prompt.rfind(tail[-size:])
            if start >= 0:
                return self._draft(prompt, start + size, "", context.structured, max_tokens)
        value = _VALUE_START.search(tail) if context.structured else None
        if value is None:
            return []
        words = list(re.finditer(rf"(?<!\w){re.escape(value.group(1))}", prompt))
        if not words:
            return []
        return self._draft(prompt, words[-1].end(), "", True, max_tokens)

    def propose_labeled(
        self, context: DraftContext, max_tokens: int, tail: str | None = None
    ) -> list[int]:
        """A structured output about to write a key's value (`"email": "`): what follows
        that key's label in the prompt (`E-mail: `: the key's letters, any of `-_ ` between
        them, up to 30 characters more to a colon; its most recent occurrence), the value's
        opening quote first where the output has not written it (not before a number); []
        elsewhere. `tail`: the output's tail text, when the caller decoded it."""
        if not context.structured:
            return []
        tail = tail if tail is not None else self._tail(context, max_tokens)
        key = _KEY_VALUE_START.search(tail) if tail is not None else None
        if key is None:
            return []
        prompt = self._prompt_text(context)
        label = r"[\s_-]?".join(re.escape(c) for c in key.group(1) if c.isalnum())
        # A label is a bare word: a quoted key (`"email": the e-mail of...`) is an
        # instruction about the output, not a value.
        found = list(re.finditer(rf'(?i)(?<![\w"]){label}(?![\w"])[^:\n]{{0,30}}:[ \t]*', prompt))
        if not found:
            return []
        begin = found[-1].end()
        prefix = ""
        if not key.group(2):  # the opening quote is not written yet
            prefix = "" if tail.endswith(" ") else " "
            prefix += "" if prompt[begin : begin + 1].isdigit() else '"'
        return self._draft(prompt, begin, prefix, True, max_tokens)

    def _tail(self, context: DraftContext, max_tokens: int) -> str | None:
        """The text of the output's last TAIL_TOKENS tokens (None: no output, no room)."""
        num_output = context.num_tokens - context.num_prompt_tokens
        if max_tokens <= 0 or num_output <= 0:
            return None
        return self.tokenizer.decode(context.last_tokens(min(TAIL_TOKENS, num_output)))

    def _draft(
        self, prompt: str, begin: int, prefix: str, structured: bool, max_tokens: int
    ) -> list[int]:
        """`prefix`, then the prompt's text from `begin` to where a copied value ends,
        tokenized: at most `max_tokens` tokens."""
        text = prompt[begin : begin + CHARS_PER_TOKEN * max_tokens]
        ends = VALUE_ENDS if structured else ("\n",)
        end = min((i for i in (text.find(sep) for sep in ends) if i >= 0), default=-1)
        if end >= 0:
            # A value copied from the document ends at its line's end or, in a structured
            # output, at a separator between fields of the document ("  ", ", "). There the
            # structured output's JSON string closes and the comma before the next field
            # follows: one token (`",`), as the model writes them. Where the grammar refuses
            # it (after an object's last field) the draft is cut before it. Free text
            # copies the line and its end.
            text = text[:end] + ('",' if structured else "\n")
        elif not text:
            return []
        draft = self.tokenizer.encode(prefix + text, add_special_tokens=False)
        if end < 0 and begin + len(text) < len(prompt) and len(draft) > 1:
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
