"""Pieces of OpenAI response bodies shared by both completion endpoints: ids, usage and
logprobs. Bodies are plain dicts in OpenAI's field order; the official client parses them."""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from typing import Any

from agentrt.engine.client.outputs import Logprob, RequestOutput


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def kv_transfer(outputs: Sequence[RequestOutput]) -> dict[str, Any]:
    """`kv_transfer_params` of a p2p producer's response (what the decode instance needs to
    fetch the prefill), when the engine set any; nothing otherwise."""
    params = outputs[0].kv_transfer_params if outputs else None
    return {} if params is None else {"kv_transfer_params": params}


def usage(outputs: Sequence[RequestOutput], n: int) -> dict[str, Any]:
    """Usage of choices in prompt-major order, n per prompt: each prompt counts once (with
    the prefix-cache hits of its first choice), every choice's output counts."""
    firsts = outputs[::n]
    prompt_tokens = sum(len(o.prompt_token_ids) for o in firsts)
    completion_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": sum(o.num_cached_tokens for o in firsts)},
    }


def _sampled_and_top(entry: dict[int, Logprob], top_n: int) -> tuple[Logprob, list[Logprob]]:
    """The sampled token is the entry's first key (the engine inserts it first); the top
    alternatives are the ranked ones, best first."""
    sampled = next(iter(entry.values()))
    ranked = sorted((lp for lp in entry.values() if lp.rank is not None), key=lambda lp: lp.rank)
    return sampled, ranked[:top_n]


def _token(logprob: Logprob) -> str:
    return logprob.decoded_token if logprob.decoded_token is not None else ""


def chat_logprobs(entries: Sequence[dict[int, Logprob]], top_n: int) -> list[dict[str, Any]]:
    """`choices[i].logprobs.content` of a chat completion."""
    content = []
    for entry in entries:
        sampled, top = _sampled_and_top(entry, top_n)
        content.append(
            {
                "token": _token(sampled),
                "logprob": sampled.logprob,
                "bytes": list(_token(sampled).encode()),
                "top_logprobs": [
                    {"token": _token(lp), "logprob": lp.logprob, "bytes": list(_token(lp).encode())}
                    for lp in top
                ],
            }
        )
    return content


def completion_logprobs(
    entries: Sequence[dict[int, Logprob]], top_n: int, text_offset: int = 0
) -> dict[str, Any]:
    """`choices[i].logprobs` of a (legacy) completion."""
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    offset = text_offset
    for entry in entries:
        sampled, top = _sampled_and_top(entry, top_n)
        tokens.append(_token(sampled))
        token_logprobs.append(sampled.logprob)
        top_logprobs.append({_token(lp): lp.logprob for lp in top})
        offsets.append(offset)
        offset += len(_token(sampled))
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top_logprobs,
        "text_offset": offsets,
    }
