"""One chat turn: (messages, tools, format, reasoning options, tokenizer) -> the prompt's
token ids, the constraint the engine enforces (reasoning first, then the format: the
`SamplingParams` side), and how the reply is read (`agentrt.reply`). The SDK's
`LocalBackend`, chat completions, the Responses and the Messages endpoints all prepare a
turn here (`prepare_turn`).

- The messages (tool calls and results included) go through the model's chat template;
  tools go to the template, or into the system message of one that cannot render them
  (`agentrt.tool_calls.render_messages`).
- Reasoning (`agentrt.reasoning`): `reasoning` True / False / "auto" (OpenAI's
  `reasoning_effort` decides an "auto": "none" / "minimal" off, any other effort on); a
  template that takes `enable_thinking` gets it; the rendered prompt tells whether the
  template opened the reasoning block.
- The reply's shape: what the reader expects of it (reasoning, calls in the model's style,
  calls or an answer).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from agentrt.engine.client.outputs import CompletionOutput
from agentrt.engine.sampling_params import SamplingParams, StructuredOutputsParams
from agentrt.formats import OutputFormat
from agentrt.reasoning import (
    ReasoningRequest,
    constrain,
    plan_request,
    resolve_spec,
    template_kwargs,
)
from agentrt.reply import Reply, ReplyReader, ReplyShape, read_reply
from agentrt.server.calls_or_answer import tool_names
from agentrt.tool_calls import render_messages

# OpenAI's `reasoning_effort` values that turn a reasoning model's thinking off.
EFFORTS_OFF = ("none", "minimal")


def reasoning_mode(reasoning: Any = "auto", effort: str | None = None) -> Any:
    """`reasoning` (True, False, "auto"); an "auto" follows `reasoning_effort` when given."""
    if reasoning == "auto" and effort is not None:
        return effort not in EFFORTS_OFF
    return reasoning


@dataclass(frozen=True, slots=True)
class ChatConstraint:
    """What constrains a turn's reply: `structured` for the engine (None: free text);
    `tools` when the reply is tool calls (or, under "auto", text: a "tools" `OutputFormat`
    whose `tool_style` is the served model's); `tools_in_prompt` is what the prompt shows;
    `answer_too`: with tools, the reply may instead be the answer in a format
    (`agentrt.server.calls_or_answer`); `parallel`: the prompt shows parallel calls."""

    structured: StructuredOutputsParams | None
    tools: OutputFormat | None
    tools_in_prompt: list[dict] | None
    answer_too: bool = False
    parallel: bool = True

    @classmethod
    def of(cls, fmt: OutputFormat) -> ChatConstraint:
        """The constraint of the SDK's `fmt` (a "tools" format carries its tools)."""
        if fmt.kind != "tools":
            return cls(fmt.structured_outputs(), None, None)
        return cls(fmt.structured_outputs(), fmt, list(fmt.tools), parallel=fmt.parallel_tool_calls)


def render_prompt(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    *,
    mode: Any = "auto",
    max_reasoning_tokens: int | None = None,
    reasoning_parser: str | None = None,
    template_vars: dict[str, Any] | None = None,
    parallel: bool = True,
    add_generation_prompt: bool = True,
    require_markers: bool = True,
) -> tuple[str, ReasoningRequest]:
    """The prompt's text and how the reply reasons. `template_vars`: chat template variables
    given by the caller (the server's `chat_template_kwargs`). `require_markers`: reasoning
    asked of a model without markers is an InvalidRequestError (the SDK); else such a model
    simply does not reason (the server). Template errors propagate as the template raises
    them."""
    spec = resolve_spec(tokenizer, mode if require_markers else "auto", reasoning_parser)
    rendered, template_tools = render_messages(messages, tools, tokenizer, parallel=parallel)
    text = tokenizer.apply_chat_template(
        rendered,
        tools=template_tools,
        tokenize=False,
        add_generation_prompt=add_generation_prompt,
        **template_kwargs(tokenizer, mode, template_vars),
    )
    return text, plan_request(tokenizer, spec, text, mode, max_reasoning_tokens)


def reply_shape(
    reasoning: ReasoningRequest, tools: OutputFormat | None, *, answer_too: bool = False
) -> ReplyShape:
    """What the reply of a turn may hold: its reasoning, and calls of `tools` (a "tools"
    `OutputFormat` whose `tool_style` is the served model's; None: no tools); with
    `answer_too`, calls or an answer in a format."""
    if tools is None:
        return ReplyShape(reasoning)
    return ReplyShape(
        reasoning,
        tools.tool_style,
        answer_too,
        frozenset(tool_names(list(tools.tools))),
        tools.max_parallel_tool_calls,
    )


@dataclass(frozen=True, slots=True)
class Turn:
    """A prepared turn: the prompt's token ids, how the reply reasons, the engine's
    constraint (reasoning first, then the format; None: free text) and the reply's shape."""

    prompt_ids: list[int]
    reasoning: ReasoningRequest
    structured: StructuredOutputsParams | None
    shape: ReplyShape

    def sampling_params(self, **options: Any) -> SamplingParams:
        """The request's `SamplingParams`: `options` and the turn's constraint."""
        return SamplingParams(**options, structured_outputs=self.structured)

    def decoding(self, params: SamplingParams) -> dict[str, Any]:
        """How a reply read from its token ids is decoded: as `params` decode it, after the
        prompt (the reader's options)."""
        return {
            "prompt_token_ids": self.prompt_ids,
            "skip_special_tokens": params.skip_special_tokens,
            "stop": params.stop,
            "include_stop_str_in_output": params.include_stop_str_in_output,
        }

    def reader(self, tokenizer: Any, params: SamplingParams) -> ReplyReader:
        """A reader of the reply of a request of `params`, as it streams."""
        return ReplyReader(tokenizer, self.shape, **self.decoding(params))

    def read(self, tokenizer: Any, params: SamplingParams, completion: CompletionOutput) -> Reply:
        """The finished reply of a request of `params`, read whole."""
        return read_reply(
            tokenizer, self.shape, completion.text, completion.token_ids, **self.decoding(params)
        )


def prepare_turn(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    constraint: ChatConstraint,
    *,
    mode: Any = "auto",
    max_reasoning_tokens: int | None = None,
    reasoning_parser: str | None = None,
    template_vars: dict[str, Any] | None = None,
    add_generation_prompt: bool = True,
    require_markers: bool = True,
    check_text: Callable[[str], None] | None = None,
) -> Turn:
    """The turn of `messages` under `constraint` (`ChatConstraint.of(fmt)` for the SDK's
    format). `check_text(prompt_text)` runs before tokenizing (the server's length check);
    the other options are `render_prompt`'s."""
    text, plan = render_prompt(
        tokenizer,
        messages,
        constraint.tools_in_prompt,
        mode=mode,
        max_reasoning_tokens=max_reasoning_tokens,
        reasoning_parser=reasoning_parser,
        template_vars=template_vars,
        parallel=constraint.parallel,
        add_generation_prompt=add_generation_prompt,
        require_markers=require_markers,
    )
    if check_text is not None:
        check_text(text)
    return Turn(
        tokenizer.encode(text, add_special_tokens=False),
        plan,
        constrain(constraint.structured, plan),
        reply_shape(plan, constraint.tools, answer_too=constraint.answer_too),
    )
