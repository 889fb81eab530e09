"""Request bodies of Anthropic's Messages API (`POST /v1/messages`, `/v1/messages/count_tokens`;
served by agentrt.server.messages_api).

Top-level fields are closed, as Anthropic's API answers an unknown one with a 400; content
blocks are open (clients echo back `cache_control`, `citations`, thinking `signature`s), and
each block's type is read by the endpoint, which refuses the ones it cannot serve by name.
Lists are capped before their items are validated, with the chat endpoint's caps.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from agentrt.server.protocol import (
    MAX_MESSAGES,
    MAX_PARTS,
    MAX_STOP,
    MAX_TOOLS,
    CacheSalt,
    _at_most,
    _Closed,
)


class ContentBlock(BaseModel):
    """A content block: `text`, `tool_use` (an assistant's call), `tool_result` (its
    result, `content` a string or text blocks), `thinking` (echoed back, not shown again);
    other types are refused by the endpoint."""

    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None
    id: str | None = None
    name: str | None = None
    input: dict[str, Any] | None = None
    tool_use_id: str | None = None
    content: Annotated[str | list[ContentBlock] | None, _at_most(MAX_PARTS)] = None
    is_error: bool | None = None


class MessageParam(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["user", "assistant"]
    content: Annotated[str | list[ContentBlock], _at_most(MAX_PARTS)]


class ToolParam(BaseModel):
    """A client tool. `type` is absent or "custom"; Anthropic's server tools (bash, web
    search, ...) carry other types and are refused."""

    model_config = ConfigDict(extra="allow")
    name: Annotated[str, Field(min_length=1, max_length=128)]
    description: str | None = None
    input_schema: dict[str, Any] = Field(default_factory=lambda: {"type": "object"})
    type: str | None = None


class ToolChoice(_Closed):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class ThinkingConfig(_Closed):
    """`enabled` turns a reasoning model's thinking on (`budget_tokens` caps it, then its end
    is forced), `disabled` off, `adaptive` leaves it to the chat template's default; a model
    without reasoning markers ignores it. `display` "omitted" leaves the thinking out."""

    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: Annotated[int, Field(ge=0)] | None = None
    display: Literal["summarized", "omitted"] | None = None


class JSONOutputFormat(_Closed):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Closed):
    """`format`: the reply is JSON of this schema (enforced by the grammar, as chat's
    `response_format`); `effort`: "low" and above think, as chat's `reasoning_effort`."""

    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    format: JSONOutputFormat | None = None


class Metadata(_Closed):
    user_id: Annotated[str, Field(max_length=256)] | None = None


class CountTokensRequest(_Closed):
    """What the prompt is made of: the fields `count_tokens` takes."""

    model: str
    messages: Annotated[list[MessageParam], Field(min_length=1), _at_most(MAX_MESSAGES)]
    system: Annotated[str | list[ContentBlock] | None, _at_most(MAX_PARTS)] = None
    tools: Annotated[list[ToolParam] | None, _at_most(MAX_TOOLS)] = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None
    output_config: OutputConfig | None = None
    # Accepted and ignored: the prefix cache is automatic.
    cache_control: dict[str, Any] | None = None


class MessagesRequest(CountTokensRequest):
    max_tokens: Annotated[int, Field(ge=1)]
    stop_sequences: Annotated[list[str], Field(max_length=MAX_STOP)] | None = None
    stream: bool | None = None
    temperature: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=1)] | None = None
    metadata: Metadata | None = None
    # Accepted and ignored (they change nothing for a local model).
    service_tier: str | None = None
    # agentrt's extension, as in chat: prefix-cache hits only between requests that send it.
    cache_salt: CacheSalt | None = None
    # vLLM's extension, as in chat (`agentrt proxy` sets it): a disaggregated prefill.
    kv_transfer_params: dict[str, Any] | None = None
