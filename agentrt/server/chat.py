"""`POST /v1/chat/completions`: messages through the chat template, n choices, structured
outputs and tool calls, as one JSON body or as a stream of `chat.completion.chunk` events."""

from __future__ import annotations

from typing import Any

from fastapi import Request
from fastapi.responses import Response

from agentrt.engine.client.outputs import CompletionOutput, RequestDelta, RequestOutput
from agentrt.engine.errors import InvalidRequestError
from agentrt.engine.sampling_params import SamplingParams
from agentrt.reply import Reply, ReplyReader
from agentrt.server.errors import bad_request
from agentrt.server.generation import Generation, respond
from agentrt.server.offload import check_text_length, off_loop
from agentrt.server.params import chat_constraint, choice_params
from agentrt.server.protocol import ChatCompletionRequest, ChatMessage
from agentrt.server.responses import chat_logprobs, kv_transfer, new_id, now, usage
from agentrt.server.state import ServerState
from agentrt.tool_formats import tool_call_style
from agentrt.turn import ChatConstraint, Turn, prepare_turn, reasoning_mode


async def create_chat_completion(
    state: ServerState, request: ChatCompletionRequest, raw: Request
) -> Response:
    state.check_model(request.model)
    tool_style = tool_call_style(state.engine.tokenizer)
    constraint = chat_constraint(request, tool_style)
    turn = await off_loop(state.prompt_limiter, chat_turn, state, request, constraint)
    if request.top_logprobs is not None and not request.logprobs:
        raise bad_request("top_logprobs needs logprobs=true.", param="top_logprobs")
    top_n = request.top_logprobs or 0
    if request.max_completion_tokens is not None:
        max_tokens, max_field = request.max_completion_tokens, "max_completion_tokens"
    else:
        max_tokens, max_field = request.max_tokens, "max_tokens"
    params = choice_params(
        request,
        max_tokens=max_tokens,
        max_tokens_field=max_field,
        logprobs=top_n if request.logprobs else None,
        structured=turn.structured,
        cache_salt=state.cache_salt(request.cache_salt, request.user, raw.headers),
    )
    generation = Generation(
        state.engine,
        state.metrics,
        [turn.prompt_ids] * len(params),
        params,
        priority=state.priority(request.priority),
        param_names={"prompt": "messages", "max_tokens": max_field},
    )
    view = _ChatView(
        state.model_name,
        turn,
        params[0],
        state.engine.tokenizer,
        top_n if request.logprobs else None,
        include_reasoning=request.include_reasoning,
    )
    return await respond(generation, view, request, raw.receive)


def chat_prompt(
    state: ServerState, request: ChatCompletionRequest, constraint: ChatConstraint
) -> list[int]:
    """The prompt token ids: messages (tool calls and tool results included) rendered by the
    model's chat template; tools go to the template, or into the system message."""
    return chat_turn(state, request, constraint).prompt_ids


def chat_turn(
    state: ServerState, request: ChatCompletionRequest, constraint: ChatConstraint
) -> Turn:
    """The turn of a chat request (agentrt.turn): a reasoning model's template gets
    `chat_template_kwargs` (`enable_thinking` decides, default as the template does, or
    `reasoning_effort`); a model without reasoning markers does not reason, whatever asked.
    A template that cannot render the messages is a 400 naming them."""
    messages = [_message_dict(i, m) for i, m in enumerate(request.messages)]
    kwargs = dict(request.chat_template_kwargs or {})
    thinking = bool(kwargs["enable_thinking"]) if "enable_thinking" in kwargs else "auto"

    def check_text(text: str) -> None:
        check_text_length(text, state.max_model_len, state.max_token_chars)

    try:
        return prepare_turn(
            state.engine.tokenizer,
            messages,
            constraint,
            mode=reasoning_mode(thinking, request.reasoning_effort),
            max_reasoning_tokens=request.max_reasoning_tokens,
            reasoning_parser=request.reasoning_parser,
            template_vars=kwargs,
            add_generation_prompt=request.add_generation_prompt is not False,
            require_markers=False,
            check_text=check_text,
        )
    except InvalidRequestError:  # it names its field (the length check's too)
        raise
    except Exception as exc:  # jinja2 errors and the like: the messages do not fit the template
        raise bad_request(
            f"the chat template cannot render these messages: {exc}", param="messages"
        ) from None


def _message_dict(index: int, message: ChatMessage) -> dict[str, Any]:
    role = "system" if message.role == "developer" else message.role
    content = message.content
    if isinstance(content, list):
        texts = []
        for part in content:
            if part.type != "text" or part.text is None:
                raise bad_request(
                    f"content part of type {part.type!r} is not supported: this model reads "
                    "text parts only.",
                    param=f"messages.{index}.content",
                )
            texts.append(part.text)
        content = "".join(texts)
    out: dict[str, Any] = {"role": role, "content": content or ""}
    if message.tool_calls:
        out["tool_calls"] = [call.model_dump() for call in message.tool_calls]
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    if message.name is not None:
        out["name"] = message.name
    return out


class _ChatView:
    """Shapes engine outputs into chat response bodies."""

    def __init__(
        self,
        model: str,
        turn: Turn,
        params: SamplingParams,
        tokenizer: Any,
        top_n: int | None,
        *,
        include_reasoning: bool = True,
    ) -> None:
        # A reasoning reply is split: its reasoning as `reasoning_content` (vLLM's name;
        # left out with include_reasoning=false), its answer as content or tool calls, read
        # by agentrt.reply as the turn shapes it (tools with a response_format: calls or the
        # answer) and as `params` (a choice's) decode it.
        self.turn = turn
        self.params = params
        self.include_reasoning = include_reasoning
        self.tokenizer = tokenizer
        self.model = model
        self.top_n = top_n
        self.id = new_id("chatcmpl")
        self.created = now()

    def completion(self, outputs: list[RequestOutput]) -> dict[str, Any]:
        choices = []
        replies = [self.turn.read(self.tokenizer, self.params, o.outputs[0]) for o in outputs]
        for index, (output, reply) in enumerate(zip(outputs, replies, strict=True)):
            completion = output.outputs[0]
            message, finish_reason = _reply_message(reply, completion)
            if reply.reasoning is not None and self.include_reasoning:
                message["reasoning_content"] = reply.reasoning
            logprobs = None
            if self.top_n is not None:
                logprobs = {"content": chat_logprobs(completion.logprobs or [], self.top_n)}
            choices.append(
                {
                    "index": index,
                    "message": message,
                    "logprobs": logprobs,
                    "finish_reason": finish_reason,
                }
            )
        return {
            "id": self.id,
            "object": "chat.completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": self._usage(outputs, sum(r.num_reasoning_tokens for r in replies)),
            **kv_transfer(outputs),
        }

    def _delta(self, reader: ReplyReader, delta: RequestDelta) -> dict[str, Any]:
        """The chunk delta of what `delta` added: reasoning, content and call deltas."""
        read = reader.feed(delta.text, delta.token_ids)
        if delta.output is not None:
            read += reader.finish()
        body: dict[str, Any] = {}
        if read.reasoning and self.include_reasoning:
            body["reasoning_content"] = read.reasoning
        if read.content:
            body["content"] = read.content
        if read.calls:
            body["tool_calls"] = read.calls
        return body

    def _usage(self, outputs: list[RequestOutput], num_reasoning: int) -> dict[str, Any]:
        """`usage`, with the reasoning's tokens (as the reader counted them) apart (OpenAI's
        completion_tokens_details)."""
        body = usage(outputs, len(outputs))
        if self.turn.reasoning.spec is not None:
            body["completion_tokens_details"] = {"reasoning_tokens": num_reasoning}
        return body

    def chunk(self, choices: list[dict[str, Any]], usage_: dict | None = None, **extra) -> dict:
        body = {
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        body.update(extra)
        if usage_ is not None:
            body["usage"] = usage_
        return body

    async def stream(
        self,
        generation: Generation,
        firsts: list[RequestDelta],
        emit,
        include_usage: bool,
    ) -> None:
        extra = {"usage": None} if include_usage else {}
        readers = [self.turn.reader(self.tokenizer, self.params) for _ in firsts]

        async def on_delta(index: int, delta: RequestDelta) -> None:
            body = self._delta(readers[index], delta)
            logprobs = None
            if self.top_n is not None and delta.logprobs:
                logprobs = {"content": chat_logprobs(delta.logprobs, self.top_n)}
            if body or logprobs:
                await emit(self.chunk([_choice(index, body, logprobs)], **extra))

        async def on_finish(index: int, output: RequestOutput) -> None:
            finish = readers[index].finish_reason(output.outputs[0].finish_reason)
            await emit(self.chunk([_choice(index, {}, None, finish)], **extra))

        for index in range(len(firsts)):
            await emit(self.chunk([_choice(index, {"role": "assistant", "content": ""})], **extra))
        outputs = await generation.stream_choices(firsts, emit, on_delta, on_finish)
        if include_usage:
            num_reasoning = sum(reader.num_reasoning_tokens for reader in readers)
            await emit(self.chunk([], self._usage(outputs, num_reasoning)))


def _reply_message(reply: Reply, completion: CompletionOutput) -> tuple[dict[str, Any], str | None]:
    """The message of a reply and its finish reason: its calls (`ReplyCalls`: those before
    a repeat, the cap or a cut) with the text before them, or its text (`calls` None: it
    made none); a reply cut inside its first call has the text before it, no call."""
    calls = reply.calls
    if calls is None:
        message = {"role": "assistant", "content": reply.text, "refusal": None}
        return message, completion.finish_reason
    if not calls.calls:
        message = {"role": "assistant", "content": reply.content.strip() or None, "refusal": None}
        return message, completion.finish_reason
    message = _calls_message(calls.calls, reply.content)
    return message, calls.finish_reason(completion.finish_reason)


def _calls_message(calls: list[Any], content: str | None) -> dict[str, Any]:
    """The message of a reply that called tools, with the text it wrote before them."""
    return {
        "role": "assistant",
        "content": (content or "").strip() or None,
        "refusal": None,
        "tool_calls": [call.to_openai() for call in calls],
    }


def _choice(index: int, delta: dict, logprobs: dict | None = None, finish: str | None = None):
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
