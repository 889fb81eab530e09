"""What every proposer implements, and the view of a request it drafts for."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True, slots=True)
class DraftContext:
    """One request, as a proposer sees it. `token_ids` is the request's own list (prompt,
    then output; read it, never change it). `draft_ids`: tokens already drafted this step (a
    draft goes on after the tokens the grammar forces): draft what follows them."""

    req_id: str
    token_ids: Sequence[int]
    num_prompt_tokens: int
    # Requests with equal keys tend to repeat each other (same schema and prompt head):
    # the suffix cache shares what it learnt between them. None: nothing to share.
    cache_key: Hashable | None
    # The output follows a grammar (a value copied from the prompt goes into a JSON string).
    structured: bool = False
    # For proposers that keep KV (the draft model): the request's block table, which holds
    # slots for every position below len(token_ids) + max_tokens - 1, and how often the
    # request was preempted (its KV, the draft model's included, was then dropped).
    block_ids: Sequence[int] = ()
    num_preemptions: int = 0
    draft_ids: Sequence[int] = ()

    @property
    def num_tokens(self) -> int:
        """The tokens drafted after: the request's and `draft_ids`."""
        return len(self.token_ids) + len(self.draft_ids)

    def last_tokens(self, num: int) -> list[int]:
        """The last `num` (at most) of the request's tokens followed by `draft_ids`."""
        num_own = max(0, num - len(self.draft_ids))
        own = self.token_ids[len(self.token_ids) - min(num_own, len(self.token_ids)) :]
        return [*own, *self.draft_ids[max(0, len(self.draft_ids) - num) :]]


class Proposer(Protocol):
    """Drafts the tokens a request is likely to produce next. Drafts are only guesses: the
    engine cuts them where the grammar refuses one and verifies the rest with the model."""

    method: str

    def propose(self, contexts: list[DraftContext], max_tokens: list[int]) -> list[list[int]]:
        """Up to `max_tokens[i]` draft tokens to follow `contexts[i].token_ids` and its
        `draft_ids` (maybe none)."""
        ...

    def request_finished(self, context: DraftContext, completed: bool) -> None:
        """The request left the engine (`completed`: it ended normally, not aborted or failed);
        a proposer that learns across requests may keep its output."""
        ...
