"""`POST /v1/chat/completions`: messages through the chat template, n choices, structured
outputs and tool calls, as one JSON body or as a stream of `chat.completion.chunk` events."""

from __future__ import annotations

from typing import Any

from fastapi import Request
from fastapi.responses import Response

from agentrt.engine.client.outputs import CompletionOutput, RequestDelta, RequestOutput
from agentrt.engine.errors import InvalidRequestError
from agentrt.reasoning import (
    ReasoningRequest,
    constrain,
    count_reasoning_tokens,
)
from agentrt.reply import ReplyReader, read_reply
from agentrt.server.errors import bad_request
from agentrt.server.generation import Generation, respond
from agentrt.server.offload import check_text_length, off_loop
from agentrt.server.params import ChatConstraint, chat_constraint, choice_params
from agentrt.server.protocol import ChatCompletionRequest, ChatMessage
from agentrt.server.responses import chat_logprobs, kv_transfer, new_id, now, usage
from agentrt.server.state import ServerState
from agentrt.tool_calls import (
    ReplyCalls,
    tool_call_style,
)
from agentrt.turn import decoding, reasoning_mode, render_prompt, reply_shape


async def create_chat_completion(
    state: ServerState, request: ChatCompletionRequest, raw: Request
) -> Response:
    state.check_model(request.model)
    tool_style = tool_call_style(state.engine.tokenizer)
    constraint = chat_constraint(request, tool_style)
    prompt_ids, reasoning = await off_loop(
        state.prompt_limiter, chat_prompt_and_reasoning, state, request, constraint
    )
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
        structured=constrain(constraint.structured, reasoning),
        cache_salt=state.cache_salt(request.cache_salt, request.user, raw.headers),
    )
    generation = Generation(
        state.engine,
        state.metrics,
        [prompt_ids] * len(params),
        params,
        priority=state.priority(request.priority),
        param_names={"prompt": "messages", "max_tokens": max_field},
    )
    view = _ChatView(
        state.model_name,
        constraint,
        top_n if request.logprobs else None,
        tool_style,
        reasoning=reasoning,
        include_reasoning=request.include_reasoning,
        tokenizer=state.engine.tokenizer,
    )
    view.read_tokens(prompt_ids, params[0])
    return await respond(generation, view, request, raw.receive)


def chat_prompt(
    state: ServerState, request: ChatCompletionRequest, constraint: ChatConstraint
) -> list[int]:
    """The prompt token ids: messages (tool calls and tool results included) rendered by the
    model's chat template; tools go to the template, or into the system message."""
    return chat_prompt_and_reasoning(state, request, constraint)[0]


def chat_prompt_and_reasoning(
    state: ServerState, request: ChatCompletionRequest, constraint: ChatConstraint
) -> tuple[list[int], ReasoningRequest]:
    """`chat_prompt`, and how the reply reasons (agentrt.reasoning): a reasoning model's
    template gets `chat_template_kwargs` (`enable_thinking` decides, default as the template
    does), and the rendered prompt tells whether it opened the reasoning block."""
    messages = [_message_dict(i, m) for i, m in enumerate(request.messages)]
    tokenizer = state.engine.tokenizer
    kwargs = dict(request.chat_template_kwargs or {})
    thinking = bool(kwargs["enable_thinking"]) if "enable_thinking" in kwargs else "auto"
    try:
        text, plan = render_prompt(
            tokenizer,
            messages,
            constraint.tools_in_prompt,
            mode=reasoning_mode(thinking, request.reasoning_effort),
            max_reasoning_tokens=request.max_reasoning_tokens,
            reasoning_parser=request.reasoning_parser,
            template_vars=kwargs,
            parallel=request.parallel_tool_calls is not False,
            add_generation_prompt=request.add_generation_prompt is not False,
            require_markers=False,  # a model without markers does not reason, whatever asked
        )
    except InvalidRequestError:  # it names its field; the error handler reports it
        raise
    except Exception as exc:  # jinja2 errors and the like: the messages do not fit the template
        raise bad_request(
            f"the chat template cannot render these messages: {exc}", param="messages"
        ) from None
    check_text_length(text, state.max_model_len, state.max_token_chars)
    return tokenizer.encode(text, add_special_tokens=False), plan


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
        constraint: ChatConstraint,
        top_n: int | None,
        tool_style: str,
        *,
        reasoning: ReasoningRequest | None = None,
        include_reasoning: bool = True,
        tokenizer: Any = None,
    ) -> None:
        # A reasoning reply is split: its reasoning as `reasoning_content` (vLLM's name;
        # left out with include_reasoning=false), its answer as content or tool calls.
        self.reasoning = reasoning or ReasoningRequest(None)
        self.include_reasoning = include_reasoning
        self.tokenizer = tokenizer
        self.model = model
        # What a reply may hold, read by agentrt.reply: tools with a response_format are
        # calls or the answer (agentrt.server.calls_or_answer).
        self.shape = reply_shape(self.reasoning, constraint.tools, answer_too=constraint.answer_too)
        self.top_n = top_n
        self.id = new_id("chatcmpl")
        self.created = now()
        self._decoding: dict[str, Any] = {}

    def read_tokens(self, prompt_ids: list[int], params: Any) -> None:
        """Decode replies as `params` (a choice's SamplingParams) do, after `prompt_ids`
        (where they are read from their token ids: agentrt.reply)."""
        self._decoding = decoding(prompt_ids, params)

    def completion(self, outputs: list[RequestOutput]) -> dict[str, Any]:
        choices = []
        for index, output in enumerate(outputs):
            completion = output.outputs[0]
            message, finish_reason = self._message(completion)
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
            "usage": self._usage(outputs),
            **kv_transfer(outputs),
        }

    def _message(self, completion: CompletionOutput) -> tuple[dict[str, Any], str | None]:
        reply = read_reply(
            self.tokenizer, self.shape, completion.text, completion.token_ids, **self._decoding
        )
        message, finish = _reply_message(reply.text, reply.content, reply.calls, completion)
        if reply.reasoning is not None and self.include_reasoning:
            message["reasoning_content"] = reply.reasoning
        return message, finish

    def _delta(self, reader: ReplyReader, delta: RequestDelta) -> dict[str, Any]:
        """The chunk delta of what `delta` added: reasoning, content and call deltas."""
        read = reader.feed(delta.text, delta.token_ids)
        if delta.output is not None:
            end = reader.finish()
            read.reasoning, read.content = (
                read.reasoning + end.reasoning,
                read.content + end.content,
            )
            read.calls += end.calls
        body: dict[str, Any] = {}
        if read.reasoning and self.include_reasoning:
            body["reasoning_content"] = read.reasoning
        if read.content:
            body["content"] = read.content
        if read.calls:
            body["tool_calls"] = read.calls
        return body

    def _usage(self, outputs: list[RequestOutput]) -> dict[str, Any]:
        """`usage`, with the reasoning's tokens apart (OpenAI's completion_tokens_details)."""
        body = usage(outputs, len(outputs))
        if self.reasoning.spec is not None:
            num = sum(
                count_reasoning_tokens(self.tokenizer, o.outputs[0].token_ids, self.reasoning)
                for o in outputs
            )
            body["completion_tokens_details"] = {"reasoning_tokens": num}
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
        readers = [ReplyReader(self.tokenizer, self.shape, **self._decoding) for _ in firsts]

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
            await emit(self.chunk([], self._usage(outputs)))


def _reply_message(
    text: str, content: str, calls: ReplyCalls | None, completion: CompletionOutput
) -> tuple[dict[str, Any], str | None]:
    """The message of a reply and its finish reason: its calls (`ReplyCalls`: those before
    a repeat, the cap or a cut) with the text before them, or its text (`calls` None: it
    made none); a reply cut inside its first call has the text before it, no call."""
    if calls is None or calls.invalid:
        message = {"role": "assistant", "content": text, "refusal": None}
        return message, completion.finish_reason
    if not calls.calls:
        message = {"role": "assistant", "content": content.strip() or None, "refusal": None}
        return message, completion.finish_reason
    return _calls_message(calls.calls, content), calls.finish_reason(completion.finish_reason)


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
