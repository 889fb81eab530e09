"""Request bodies of the OpenAI-compatible API (pydantic models; they are the OpenAPI schema).

Top-level fields are closed (`extra="forbid"`): OpenAI answers an unknown argument with 400,
and so do we. Messages stay open, because clients echo assistant messages back with fields
(`refusal`, `annotations`, `audio`) that mean nothing to a local model. Besides OpenAI's
fields, vLLM's common extensions are accepted (`top_k`, `min_p`, `repetition_penalty`,
`min_tokens`, `ignore_eos`, `stop_token_ids`, `structured_outputs`, ...), so clients written
for vLLM work unchanged. Range checks here mirror `SamplingParams`, which checks again.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
)

# torch generators take seeds in [-2**63, 2**64).
MIN_SEED = -(2**63)
MAX_SEED = 2**64 - 1
MAX_N = 16  # choices per request: each one is a separate engine request
MAX_STOP = 16

# The chat_template_kwargs a client may set: variables model templates read to switch modes
# (Qwen3's enable_thinking, DeepSeek V3.1's thinking, gpt-oss' reasoning_effort). Anything
# else is refused: `chat_template` would render the client's own Jinja on the server, and
# keys such as `tokenize` or `messages` would change what the server itself passes.
CHAT_TEMPLATE_KWARGS = frozenset({"enable_thinking", "thinking", "reasoning_effort"})
MAX_TEMPLATE_KWARG_CHARS = 64

Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]
Seed = Annotated[int, Field(ge=MIN_SEED, le=MAX_SEED)]
TokenId = Annotated[int, Field(ge=0, lt=2**31)]


def _allowed_template_kwargs(kwargs: dict[str, Any] | None) -> dict[str, Any] | None:
    for key, value in (kwargs or {}).items():
        if key not in CHAT_TEMPLATE_KWARGS:
            allowed = ", ".join(sorted(CHAT_TEMPLATE_KWARGS))
            raise ValueError(f"{key!r} is not a template variable clients may set ({allowed})")
        if not isinstance(value, bool | int | float | str) or (
            isinstance(value, str) and len(value) > MAX_TEMPLATE_KWARG_CHARS
        ):
            raise ValueError(
                f"{key!r} must be a boolean, a number or a string of at most "
                f"{MAX_TEMPLATE_KWARG_CHARS} chars"
            )
    return kwargs


TemplateKwargs = Annotated[dict[str, Any] | None, AfterValidator(_allowed_template_kwargs)]
# Lists a body may hold, checked before their items are (an 8 MiB body of 250,000 messages
# took 5 s of the event loop to validate, stalling every other request and /health).
MAX_MESSAGES = 4096
MAX_PARTS = 1024  # content parts of one message, tool calls of one message
MAX_TOOLS = 512
MAX_LOGIT_BIAS = 4096


def _at_most(limit: int) -> BeforeValidator:
    def check(value: Any) -> Any:
        if isinstance(value, list | dict) and len(value) > limit:
            raise ValueError(f"at most {limit} items are accepted, got {len(value)}")
        return value

    return BeforeValidator(check)


# vLLM's `cache_salt`: prefix-cache hits only between requests that send the same salt.
CacheSalt = Annotated[str, Field(min_length=1, max_length=256)]


class _Closed(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Closed):
    include_usage: bool = False


class StructuredOutputsRequest(_Closed):
    """vLLM's `structured_outputs` extension: exactly one constraint."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class _SamplingFields(_Closed):
    """Fields both completion endpoints share."""

    model: str
    frequency_penalty: Penalty | None = None
    presence_penalty: Penalty | None = None
    logit_bias: Annotated[
        dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None, _at_most(MAX_LOGIT_BIAS)
    ] = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] | None = None
    seed: Seed | None = None
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP)] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    user: str | None = None
    # vLLM extensions
    top_k: Annotated[int, Field(ge=-1)] | None = None
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0, le=10.0)] | None = None
    min_tokens: Annotated[int, Field(ge=0)] | None = None
    ignore_eos: bool | None = None
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP)] | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    # Honoured only on a server started with --allow-client-priority (else a 400).
    priority: int | None = None
    cache_salt: CacheSalt | None = None
    # Disaggregated prefill/decode (vLLM's extension; `agentrt proxy` sets it): see
    # SamplingParams.kv_transfer_params. Only `{"do_remote_decode": true}` on a p2p producer,
    # or what a producer signed, unchanged, on a p2p consumer; anything else is a 400 from the
    # engine's Processor (engine/kv_transfer/auth.py).
    kv_transfer_params: dict[str, Any] | None = None


# -- chat ------------------------------------------------------------------------------------


class ContentPart(BaseModel):
    """A part of a message's content; only `{"type": "text", "text": ...}` is supported."""

    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str
    arguments: str


class MessageToolCall(BaseModel):
    model_config = ConfigDict(extra="allow")
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Annotated[str | list[ContentPart] | None, _at_most(MAX_PARTS)] = None
    name: str | None = None
    tool_calls: Annotated[list[MessageToolCall] | None, _at_most(MAX_PARTS)] = None
    tool_call_id: str | None = None


class FunctionDefinition(_Closed):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None
    # agentrt's extension (agentrt.grammar.tools): argument objects the grammar must not
    # produce (an agent's calls already answered); the model never sees them.
    excluded_arguments: list[dict[str, Any]] | None = None


class ToolDefinition(_Closed):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Closed):
    name: str


class NamedToolChoice(_Closed):
    type: Literal["function"]
    function: NamedFunction


class JsonSchemaFormat(_Closed):
    name: Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Closed):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None
    # llama.cpp's extension (older Instructor sends it): json_object constrained to a schema.
    schema_: dict[str, Any] | None = Field(None, alias="schema")


class ChatCompletionRequest(_SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1), _at_most(MAX_MESSAGES)]
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    response_format: ResponseFormat | None = None
    tools: Annotated[list[ToolDefinition] | None, _at_most(MAX_TOOLS)] = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # agentrt: the most calls one reply makes (None: 8); a repeated call also ends them.
    max_parallel_tool_calls: Annotated[int, Field(ge=1, le=128)] | None = None
    # Accepted and ignored (they change nothing for a local model).
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    # vLLM extensions for chat
    add_generation_prompt: bool | None = None
    # Reasoning models (vLLM's names): template variables (`enable_thinking`), a cap on the
    # reasoning's tokens (then its end is forced), and whether to return it.
    chat_template_kwargs: TemplateKwargs = None
    max_reasoning_tokens: Annotated[int, Field(ge=0)] | None = None
    include_reasoning: bool = True
    # OpenAI's: "none" / "minimal" turn thinking off, any other effort on (unless
    # chat_template_kwargs sets enable_thinking). agentrt's: the markers, for a model whose
    # template does not show them ("qwen3", "deepseek_r1").
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = (
        None
    )
    reasoning_parser: str | None = None


# -- completions -----------------------------------------------------------------------------


class CompletionRequest(_SamplingFields):
    prompt: (
        Annotated[str, Field(min_length=1)]
        | Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1)]
        | Annotated[list[TokenId], Field(min_length=1)]
        | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1)]
    )
    echo: bool | None = None
    logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    best_of: Annotated[int, Field(ge=1, le=MAX_N)] | None = None
    suffix: str | None = None


# -- tokenizer -------------------------------------------------------------------------------


class TokenizeRequest(_Closed):
    """Either `prompt` (text) or `messages` (rendered with the chat template)."""

    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1), _at_most(MAX_MESSAGES)] | None = (
        None
    )
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(_Closed):
    model: str | None = None
    tokens: list[TokenId]


# -- responses (`POST /v1/responses`, agentrt.server.responses_api) -------------------------


class _Open(BaseModel):
    """Items clients echo back from earlier responses carry fields (`id`, `status`,
    `annotations`, ...) that mean nothing here: accepted, not used."""

    model_config = ConfigDict(extra="allow")


class InputContent(_Open):
    """A content part: `input_text`, `output_text` (assistant text echoed back) and
    `refusal` are read; other types (images, files, audio) are refused by name."""

    type: str
    text: str | None = None
    refusal: str | None = None


class InputMessage(_Open):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: Annotated[str | list[InputContent], _at_most(MAX_PARTS)]


class FunctionCallItem(_Open):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputItem(_Open):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[InputContent]


class OtherInputItem(_Open):
    """Any other item type: `reasoning` items are skipped, the rest refused by name."""

    type: str


_ITEM_TAGS = ("message", "function_call", "function_call_output")


def _item_tag(value: Any) -> str | None:
    """The union member an input item validates as; None (a validation error, so a 400)
    for a value that is no item at all, such as a list or a number."""
    if isinstance(value, dict):
        kind = value.get("type", "message")
    elif isinstance(value, BaseModel):
        kind = getattr(value, "type", "message")
    else:
        return None
    return kind if kind in _ITEM_TAGS else "other"


InputItem = Annotated[
    Annotated[InputMessage, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[OtherInputItem, Tag("other")],
    Discriminator(_item_tag),
]


class ResponsesTool(_Open):
    """A tool: `function` tools are served; other types (web search, file search, computer
    use, MCP, ...) are refused by name."""

    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ResponsesToolChoice(_Open):
    type: str
    name: str | None = None


class TextFormat(_Closed):
    type: Literal["text", "json_object", "json_schema"]
    name: Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")] | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class TextConfig(_Closed):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ResponsesStreamOptions(_Closed):
    include_obfuscation: bool | None = None


class ReasoningConfig(_Closed):
    """`reasoning`: an effort of "none" or "minimal" turns a reasoning model's thinking off,
    any other effort on (a model without reasoning ignores it). No summaries are written:
    the reasoning item carries the reasoning text itself (`content`), as vLLM's does."""

    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None
    context: Literal["auto", "current_turn", "all_turns"] | None = None


class ResponsesRequest(_Closed):
    model: str | None = None
    input: Annotated[str | list[InputItem], _at_most(MAX_MESSAGES)]
    instructions: str | None = None
    previous_response_id: str | None = None
    store: bool | None = None
    stream: bool | None = None
    stream_options: ResponsesStreamOptions | None = None
    max_output_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    tools: Annotated[list[ResponsesTool] | None, _at_most(MAX_TOOLS)] = None
    tool_choice: Literal["none", "auto", "required"] | ResponsesToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # agentrt, as in chat: the most calls one reply makes (None: 8); a repeat also ends them.
    max_parallel_tool_calls: Annotated[int, Field(ge=1, le=128)] | None = None
    text: TextConfig | None = None
    include: list[str] | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    # Accepted and echoed or ignored (they change nothing for a local model).
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    service_tier: str | None = None
    cache_salt: CacheSalt | None = None
    reasoning: ReasoningConfig | None = None
    # agentrt's extension, as in chat: a cap on the reasoning's tokens (then its end is forced).
    max_reasoning_tokens: Annotated[int, Field(ge=0)] | None = None
    # Refused when set: this server has no background runs, conversations or stored prompts.
    background: bool | None = None
    conversation: str | dict[str, Any] | None = None
    prompt: dict[str, Any] | None = None
