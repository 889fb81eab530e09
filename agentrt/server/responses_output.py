"""The output items of a reply, built from its text as it streams, with the typed events
that announce them (`openai.types.responses`): a message (`output_item.added`,
`content_part.added`, `output_text.delta`..., then the `.done` events), or function calls
(`output_item.added`, `function_call_arguments.delta`..., then the `.done` events). A
reasoning model's reasoning comes first, as a `reasoning` item (`output_item.added`,
`content_part.added`, `reasoning_text.delta`..., then the `.done` events) whose `content`
is the reasoning text.

The reply is read by agentrt.reply (`ReplyReader`: from its token ids where the markers are
single tokens, else from its text): `ReplyItems` feeds what each delta adds (reasoning,
content, call deltas) to `OutputItems`. A whole reply goes through the same path, its events
discarded, so a streamed reply and a whole one have the same items.
"""

from __future__ import annotations

import json
import uuid
from typing import Any, get_args

from openai.types.responses import (
    ResponseContentPartAddedEvent,
    ResponseContentPartDoneEvent,
    ResponseFunctionCallArgumentsDeltaEvent,
    ResponseFunctionCallArgumentsDoneEvent,
    ResponseFunctionToolCall,
    ResponseOutputItemAddedEvent,
    ResponseOutputItemDoneEvent,
    ResponseOutputMessage,
    ResponseOutputText,
    ResponseReasoningItem,
    ResponseReasoningTextDeltaEvent,
    ResponseReasoningTextDoneEvent,
    ResponseTextDeltaEvent,
    ResponseTextDoneEvent,
)
from openai.types.responses.response_content_part_added_event import PartReasoningText
from openai.types.responses.response_content_part_done_event import (
    PartReasoningText as DonePartReasoningText,
)
from pydantic import BaseModel
from sse_starlette import ServerSentEvent

from agentrt.engine.client.outputs import Logprob
from agentrt.reply import ReplyDelta, ReplyReader
from agentrt.server.responses import chat_logprobs


def dump(model: BaseModel) -> dict[str, Any]:
    return model.model_dump(mode="json", by_alias=True, exclude_unset=True)


def item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def message_item(
    message_id: str, text: str, status: str, logprobs: list | None
) -> ResponseOutputMessage:
    part: dict[str, Any] = {"type": "output_text", "text": text, "annotations": []}
    if logprobs is not None:
        part["logprobs"] = logprobs
    return ResponseOutputMessage(
        type="message",
        id=message_id,
        role="assistant",
        status=status,
        content=[ResponseOutputText(**part)],
    )


def reasoning_item(reasoning_id: str, text: str, status: str) -> ResponseReasoningItem:
    content = [{"type": "reasoning_text", "text": text}] if text else []
    return ResponseReasoningItem(
        type="reasoning", id=reasoning_id, summary=[], content=content, status=status
    )


class OutputItems:
    """The output items of one reply as its text arrives, and the typed events that open,
    grow and close them, numbered in the order they are sent (`emit`: an async callable
    taking a `ServerSentEvent`)."""

    def __init__(self, top_n: int | None, emit) -> None:
        self.top_n = top_n  # top logprobs per token (None: no logprobs)
        self.emit = emit
        self.sequence_number = 0
        self.output: list[BaseModel] = []  # the items done so far
        self.reasoning: dict[str, Any] | None = None  # the open reasoning item: id, text
        self.message: dict[str, Any] | None = None  # the open message: id, text, logprobs
        self.call: dict[str, Any] | None = None  # the open call: id, call_id, name, arguments
        self.logprobs: list = []  # of text not yet sent (held until the reply's kind shows)
        self.status: str | None = None  # "completed" or "incomplete", once closed

    async def send(self, cls: type[BaseModel], **fields) -> None:
        event = cls(type=event_type(cls), sequence_number=self.sequence_number, **fields)
        self.sequence_number += 1
        await self.emit(ServerSentEvent(json.dumps(dump(event)), event=event.type))

    async def reason(self, text: str) -> None:
        """Reasoning text (before the answer): opens the reasoning item, then grows it."""
        if self.reasoning is None:
            self.reasoning = {"id": item_id("rs"), "text": ""}
            item = reasoning_item(self.reasoning["id"], "", "in_progress")
            await self.send(ResponseOutputItemAddedEvent, output_index=self._index, item=item)
            await self.send(
                ResponseContentPartAddedEvent,
                item_id=item.id,
                output_index=self._index,
                content_index=0,
                part=PartReasoningText(type="reasoning_text", text=""),
            )
        if not text:
            return
        self.reasoning["text"] += text
        await self.send(
            ResponseReasoningTextDeltaEvent,
            item_id=self.reasoning["id"],
            output_index=self._index,
            content_index=0,
            delta=text,
        )

    async def end_reasoning(self, status: str = "completed") -> None:
        """Close the reasoning item, if one is open (its end marker came, or the reply's)."""
        if self.reasoning is None:
            return
        reasoning, self.reasoning = self.reasoning, None
        fields = {"item_id": reasoning["id"], "output_index": self._index, "content_index": 0}
        await self.send(ResponseReasoningTextDoneEvent, text=reasoning["text"], **fields)
        part = DonePartReasoningText(type="reasoning_text", text=reasoning["text"])
        await self.send(ResponseContentPartDoneEvent, part=part, **fields)
        item = reasoning_item(reasoning["id"], reasoning["text"], status)
        await self.send(ResponseOutputItemDoneEvent, output_index=self._index, item=item)
        self.output.append(item)

    async def feed(
        self,
        content: str,
        call_deltas: list[dict[str, Any]],
        entries: list[dict[int, Logprob]] | None,
    ) -> None:
        """What the reply's answer adds: its content, its calls' deltas (chat's, from
        agentrt.reply) and the logprobs of its tokens."""
        if content or call_deltas:
            await self.end_reasoning()
        if self.top_n is not None and entries:
            self.logprobs += chat_logprobs(entries, self.top_n)
        if content:
            await self._text(content)
        for call_delta in call_deltas:
            await self._call(call_delta)

    async def _text(self, text: str) -> None:
        logprobs, self.logprobs = self.logprobs, []
        if self.message is None:
            self.message = {"id": item_id("msg"), "text": "", "logprobs": []}
            item = message_item(self.message["id"], "", "in_progress", None)
            item.content = []
            await self.send(ResponseOutputItemAddedEvent, output_index=self._index, item=item)
            await self.send(
                ResponseContentPartAddedEvent,
                item_id=self.message["id"],
                output_index=self._index,
                content_index=0,
                part=ResponseOutputText(type="output_text", text="", annotations=[]),
            )
        if not text:  # an empty reply: the message alone
            return
        self.message["text"] += text
        self.message["logprobs"] += logprobs
        await self.send(
            ResponseTextDeltaEvent,
            item_id=self.message["id"],
            output_index=self._index,
            content_index=0,
            delta=text,
            logprobs=logprobs,
        )

    async def _call(self, call_delta: dict[str, Any]) -> None:
        """A chat tool-call delta (`ToolCallStreamer`): a header opens a call, a fragment
        adds to its arguments."""
        if "id" in call_delta:
            await self._close_call("completed")
            self.call = {
                "id": item_id("fc"),
                "call_id": call_delta["id"],
                "name": call_delta["function"]["name"],
                "arguments": "",
            }
            await self.send(
                ResponseOutputItemAddedEvent,
                output_index=self._index,
                item=self._call_item("in_progress"),
            )
        fragment = call_delta["function"].get("arguments")
        if fragment:
            self.call["arguments"] += fragment
            await self.send(
                ResponseFunctionCallArgumentsDeltaEvent,
                item_id=self.call["id"],
                output_index=self._index,
                delta=fragment,
            )

    @property
    def _index(self) -> int:
        """The output index of the open item (the next one when none is open)."""
        return len(self.output)

    def _call_item(self, status: str) -> ResponseFunctionToolCall:
        return ResponseFunctionToolCall(type="function_call", status=status, **self.call)

    async def _close_call(self, status: str) -> None:
        if self.call is None:
            return
        item = self._call_item(status)
        await self.send(
            ResponseFunctionCallArgumentsDoneEvent,
            item_id=item.id,
            output_index=self._index,
            arguments=item.arguments,
        )
        await self.send(ResponseOutputItemDoneEvent, output_index=self._index, item=item)
        self.output.append(item)
        self.call = None

    async def close(self, finish_reason: str | None) -> list[BaseModel]:
        """Close the open items at the end of the reply (a reply that is nothing yet is an
        empty message); returns the output. `finish_reason` is the reply's (calls that
        ended at a repeat or the cap are complete: `ReplyReader.finish_reason`)."""
        status = "incomplete" if finish_reason == "length" else "completed"
        self.status = status
        await self.end_reasoning(status)  # the reply ended in its reasoning
        if self.call is not None:  # a call cut off
            await self._close_call(status)
        if self.message is None and not self.output:
            await self._text("")
        if self.message is not None:
            message = self.message
            message["logprobs"] += self.logprobs  # of tokens without text (the end token)
            logprobs = message["logprobs"] if self.top_n is not None else None
            item = message_item(message["id"], message["text"], status, logprobs)
            fields = {"item_id": message["id"], "output_index": self._index, "content_index": 0}
            await self.send(
                ResponseTextDoneEvent, text=message["text"], logprobs=message["logprobs"], **fields
            )
            await self.send(ResponseContentPartDoneEvent, part=item.content[0], **fields)
            await self.send(ResponseOutputItemDoneEvent, output_index=self._index, item=item)
            self.output.append(item)
            self.message = None
        return self.output


async def discard(event: ServerSentEvent) -> None:
    pass


def event_type(cls: type[BaseModel]) -> str:
    (event_type,) = get_args(cls.model_fields["type"].annotation)
    return event_type


class ReplyItems:
    """Feeds a reply's deltas through its `ReplyReader` to `OutputItems`: the reasoning to
    its reasoning item, the answer (with the logprobs of the answer's tokens only) to the
    rest."""

    def __init__(self, items: OutputItems, reader: ReplyReader) -> None:
        self.items = items
        self.reader = reader
        self.entries: list[dict[int, Logprob]] = []  # held while the reasoning runs
        self.num_sent_entries = 0
        self.first_answer_token: int | None = None  # known once the answer starts

    async def feed(
        self, text: str, token_ids: list[int], entries: list[dict[int, Logprob]] | None
    ) -> None:
        self.entries += entries or []
        await self._forward(self.reader.feed(text, token_ids))

    async def close(self, finish_reason: str | None) -> list[BaseModel]:
        """What the reader still held, then `OutputItems.close`."""
        await self._forward(self.reader.finish())
        return await self.items.close(self.reader.finish_reason(finish_reason))

    async def _forward(self, read: ReplyDelta) -> None:
        if read.reasoning:
            await self.items.reason(read.reasoning)
        if self.reader.reasoning_done:
            await self.items.end_reasoning()
        entries = None
        if self.reader.in_answer:  # the answer's tokens follow the reasoning's
            if self.first_answer_token is None:
                self.first_answer_token = self.reader.num_reasoning_tokens
            entries = self.entries[max(self.first_answer_token, self.num_sent_entries) :]
            self.num_sent_entries = len(self.entries)
        await self.items.feed(read.content, read.calls, entries)
