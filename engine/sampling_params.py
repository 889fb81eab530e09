"""SamplingParams: how one request is decoded and when it stops (vLLM's names and meanings)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from agentrt.engine.errors import InvalidRequestError
from agentrt.grammar import GrammarSpec, GrammarSpecError

# Upper bound for `logprobs` / `prompt_logprobs` (OpenAI allows 20 top logprobs).
MAX_LOGPROBS = 20


# Caps on `stop`: each stop string is matched against every step's new text, and held-back
# text is at most the longest stop string.
MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 4096
MAX_CACHE_SALT_CHARS = 256

# Temperatures below this are treated as greedy (vLLM's `_SAMPLING_EPS`): dividing by them
# would overflow, and the distribution is a point mass anyway.
GREEDY_TEMPERATURE_EPS = 1e-5


@dataclass(frozen=True, slots=True)
class StructuredOutputsParams:
    """Constrain the output (vLLM's names). Set exactly one of: `json` (a JSON-schema dict or
    its text, or a Pydantic model class / any type pydantic's TypeAdapter accepts), `regex`,
    `choice` (a list of strings), `grammar` (a Lark grammar), `json_object` (any JSON
    object), `spec` (a prebuilt `agentrt.grammar.GrammarSpec`, e.g. `from_tools(...)`)."""

    json: object = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool = False
    spec: GrammarSpec | None = None

    def __post_init__(self) -> None:
        if self.choice is not None and not isinstance(self.choice, tuple):
            object.__setattr__(self, "choice", tuple(self.choice))
        given = [
            name
            for name in ("json", "regex", "choice", "grammar", "spec")
            if getattr(self, name) is not None
        ] + (["json_object"] if self.json_object else [])
        if len(given) != 1:
            raise InvalidRequestError(
                f"structured_outputs sets {given or 'nothing'}: expected exactly one of "
                "json, regex, choice, grammar, json_object, spec.",
                field="structured_outputs",
                value=given,
            )


def to_grammar_spec(params: StructuredOutputsParams) -> GrammarSpec:
    """The canonical spec for a request; raises InvalidRequestError for a bad one."""
    if params.spec is not None:
        if not isinstance(params.spec, GrammarSpec):
            raise InvalidRequestError(
                f"structured_outputs.spec must be a GrammarSpec, got {type(params.spec).__name__}.",
                field="structured_outputs",
            )
        return params.spec
    try:
        if params.json is not None:
            if isinstance(params.json, dict | str | bool):
                return GrammarSpec.from_json_schema(params.json)
            return GrammarSpec.from_type(params.json)
        if params.regex is not None:
            return GrammarSpec.from_regex(params.regex)
        if params.choice is not None:
            return GrammarSpec.from_choice(list(params.choice))
        if params.grammar is not None:
            return GrammarSpec.from_ebnf(params.grammar)
        return GrammarSpec.from_json_schema({"type": "object"})
    except GrammarSpecError as exc:
        raise InvalidRequestError(
            f"structured_outputs is invalid: {exc}", field="structured_outputs"
        ) from None


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Per-request decoding parameters, validated on creation.

    `temperature == 0` means greedy. `top_k=-1` disables top-k (0 is rejected: it
    would keep no token). `seed` makes sampling reproducible per request, independent of
    batch composition. `logprobs=N` returns the sampled token's logprob and the top N.
    Limits that depend on the model (vocabulary size, context length) are checked by the
    `Processor` when the request is added.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None
    # Disaggregated prefill/decode (vLLM's field): {"do_remote_decode": True} asks a p2p
    # producer to keep this prefill for another instance; a consumer is given what the
    # producer's output returned (`RequestOutput.kv_transfer_params`) to fetch it.
    kv_transfer_params: dict[str, Any] | None = None
    # vLLM's `cache_salt`: prefix-cache hits only between requests with the same salt
    # (engine/core/block_hash.py); None shares the cache with every unsalted request.
    cache_salt: str | None = None

    def __post_init__(self) -> None:
        # Accept lists / single strings from users, store tuples so the record stays hashable.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif not isinstance(self.stop, tuple):
            object.__setattr__(self, "stop", tuple(self.stop or ()))
        if not isinstance(self.stop_token_ids, tuple):
            object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        if self.logit_bias is not None:
            object.__setattr__(
                self, "logit_bias", {int(k): float(v) for k, v in self.logit_bias.items()}
            )
        self._validate()

    def _validate(self) -> None:
        def bad(name: str, value: object, expected: str) -> InvalidRequestError:
            return InvalidRequestError(
                f"{name}={value!r} is invalid: expected {expected}.", field=name, value=value
            )

        if self.n != 1:
            raise bad("n", self.n, "1 (use one request per sample; parallel n is not supported)")
        if not self.temperature >= 0.0:
            raise bad("temperature", self.temperature, ">= 0 (0 means greedy)")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", self.top_p, "a value in (0, 1]")
        if self.top_k < -1 or self.top_k == 0:
            raise bad("top_k", self.top_k, "-1 (disabled) or a positive integer")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", self.min_p, "a value in [0, 1]")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise bad("presence_penalty", self.presence_penalty, "a value in [-2, 2]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad("frequency_penalty", self.frequency_penalty, "a value in [-2, 2]")
        if not self.repetition_penalty > 0.0:
            raise bad("repetition_penalty", self.repetition_penalty, "a value > 0 (1 = off)")
        if self.seed is not None and not -(2**63) <= self.seed < 2**64:
            # torch generators take 64-bit seeds; a larger one would fail on the engine thread.
            raise bad("seed", self.seed, "an integer in [-2**63, 2**64)")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise bad("max_tokens", self.max_tokens, "at least 1 (or None for the context limit)")
        if self.min_tokens < 0:
            raise bad("min_tokens", self.min_tokens, ">= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", self.min_tokens, f"<= max_tokens ({self.max_tokens})")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise bad("logprobs", self.logprobs, f"an integer in [0, {MAX_LOGPROBS}]")
        if any(not s for s in self.stop):
            raise bad("stop", self.stop, "non-empty strings")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise bad("stop", f"<{len(self.stop)} strings>", f"at most {MAX_STOP_STRINGS}")
        longest = max((len(s) for s in self.stop), default=0)
        if longest > MAX_STOP_CHARS:
            raise bad(
                "stop",
                f"<a string of {longest} chars>",
                f"strings of at most {MAX_STOP_CHARS} chars",
            )
        if any(t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", self.stop_token_ids, "non-negative token ids")
        if self.logit_bias is not None:
            for token_id, bias in self.logit_bias.items():
                if token_id < 0:
                    raise bad("logit_bias", token_id, "non-negative token ids")
                if not -100.0 <= bias <= 100.0:
                    raise bad("logit_bias", bias, "biases in [-100, 100]")
        if self.cache_salt is not None and not (
            isinstance(self.cache_salt, str) and 0 < len(self.cache_salt) <= MAX_CACHE_SALT_CHARS
        ):
            raise bad(
                "cache_salt",
                self.cache_salt,
                f"a non-empty string of <= {MAX_CACHE_SALT_CHARS} chars",
            )
        if self.kv_transfer_params is not None and not isinstance(self.kv_transfer_params, dict):
            raise bad("kv_transfer_params", self.kv_transfer_params, "a JSON object or None")

    @property
    def greedy(self) -> bool:
        """Temperatures below GREEDY_TEMPERATURE_EPS are treated as greedy."""
        return self.temperature < GREEDY_TEMPERATURE_EPS

    @property
    def top_k_enabled(self) -> bool:
        return self.top_k > 0
