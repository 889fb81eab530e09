"""Each family's tool calls (agentrt.tool_formats) on its real chat template
(tests/data/chat_templates), paired with the Qwen2.5 tokenizer plus the family's marker
tokens: the style read from the template, the prompt it renders (the tools, a call and its
result), the grammar of the calls, and a reply in the family's format read back into calls
by the chat endpoint (whole and streamed) and by the SDK backend."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from agentrt.backend import LocalBackend
from agentrt.engine.loader.tokenizer import load_tokenizer
from agentrt.formats import tools_format
from agentrt.grammar import GrammarCompiler
from agentrt.server.chat import create_chat_completion
from agentrt.server.protocol import ChatCompletionRequest
from agentrt.session import check_completion, collect_completion
from agentrt.tool_formats import call_format, tool_call_style
from agentrt.turn import ChatConstraint, prepare_turn
from tests.agentrt.server.test_repeated_calls import (
    _calls,
    _chunks,
    _Engine,
    _Raw,
    _State,
    _streamed,
)
from tests.agentrt.test_turn import MESSAGES as HISTORY
from tests.agentrt.test_turn import TOOLS

TEMPLATES = Path(__file__).parents[1] / "data" / "chat_templates"
LLAMA_TOKENS = ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|python_tag|>"]
PHI_TOKENS = ["<|system|>", "<|user|>", "<|assistant|>", "<|end|>", "<|tool|>", "<|/tool|>"]
PHI_TOKENS += ["<|tool_call|>", "<|/tool_call|>", "<|tool_response|>"]
PARIS, ROME = {"city": "Paris"}, {"city": "Rome"}


def _phi(arguments: dict) -> str:
    call = json.dumps({"name": "get_weather", "arguments": arguments})
    return f"<|tool_call|>{call}<|/tool_call|>"


# family: (template, marker tokens, style, a reply in the family's format, its calls)
FAMILIES = {
    "llama3": (
        "llama-3.2-instruct.jinja",
        LLAMA_TOKENS,
        "llama3",
        '{"name": "get_weather", "parameters": {"city": "Paris"}}',
        [PARIS],  # Llama 3's template renders one call a turn
    ),
    "phi4": (
        "phi-4-mini-instruct-tools.jinja",
        PHI_TOKENS,
        "phi4_tokens",
        _phi(PARIS) + _phi(ROME),
        [PARIS, ROME],
    ),
    "phi4-own": (
        "phi-4-mini-instruct.jinja",
        PHI_TOKENS,
        "phi4_tokens",
        "Let me check." + _phi(PARIS),
        [PARIS],
    ),
    "gemma3": (
        "gemma-3-it.jinja",
        ["<start_of_turn>", "<end_of_turn>"],
        "json",
        json.dumps([{"name": "get_weather", "arguments": a} for a in (PARIS, ROME)]),
        [PARIS, ROME],
    ),
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, qwen_tokenizer_dir):
    template, tokens, style, reply, calls = FAMILIES[request.param]
    tokenizer = load_tokenizer(qwen_tokenizer_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": tokens})
    tokenizer.chat_template = (TEMPLATES / template).read_text()
    return request.param, tokenizer, style, reply, calls


def test_the_style_is_the_templates(family):
    _, tokenizer, style, _, _ = family
    assert tool_call_style(tokenizer) == style


def test_the_template_renders_the_tools_a_call_and_its_result(family):
    name, tokenizer, style, _, _ = family
    fmt = dataclasses.replace(tools_format(TOOLS), tool_style=style)
    text = tokenizer.decode(prepare_turn(tokenizer, HISTORY, ChatConstraint.of(fmt)).prompt_ids)
    if name == "llama3":  # the tools in the first user turn, the call with "parameters"
        assert "Given the following functions" in text and '"name": "get_weather"' in text
        assert '{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|>' in text
        # (its template writes a string result with tojson, quoted)
        assert '<|start_header_id|>ipython<|end_header_id|>\n\n"Sunny."<|eot_id|>' in text
    elif name.startswith("phi4"):
        assert "<|tool|>" in text and '"description": "The weather in a city."' in text
        assert f"<|assistant|>{_phi(PARIS)}<|end|>" in text
        assert "Sunny." in text and text.endswith("<|assistant|>")
    else:  # Gemma: no tools in the template; roles alternate, the result a user turn
        assert text.count("<start_of_turn>user\n") == 2 and "You can call these tools" in text
        assert "[call_1] Sunny.<end_of_turn>" in text
        assert text.endswith("<start_of_turn>model\n")


@pytest.mark.anyio
async def test_a_reply_in_the_familys_format_is_its_calls(family):
    """The chat endpoint (whole and streamed) and the SDK backend read the family's reply."""
    _, tokenizer, _, reply, calls = family
    expected = [("get_weather", arguments) for arguments in calls]
    body = {"model": "qwen2.5", "messages": HISTORY[:2], "tools": TOOLS, "max_tokens": 64}
    whole = await create_chat_completion(
        _State(_Engine(tokenizer, reply, "stop")), ChatCompletionRequest(**body), _Raw()
    )
    [choice] = json.loads(whole.body)["choices"]
    assert _calls(choice["message"]) == expected and choice["finish_reason"] == "tool_calls"
    content = "Let me check." if reply.startswith("Let") else None
    assert choice["message"]["content"] == content
    engine = _Engine(tokenizer, reply, "stop")
    response = await create_chat_completion(
        _State(engine), ChatCompletionRequest(**body, stream=True), _Raw()
    )
    assert _streamed(await _chunks(response)) == (content or "", expected, ["tool_calls"])
    fmt = tools_format(TOOLS, "required")
    backend = LocalBackend(_Engine(tokenizer, reply, "stop"))
    completion = await collect_completion(backend.stream(HISTORY[:2], fmt, {"max_tokens": 64}))
    read = check_completion(completion, fmt, completion.usage)
    assert [(c.name, c.arguments) for c in read] == expected


@pytest.mark.parametrize("family", ["llama3", "phi4"], indirect=True)  # their own grammars
def test_the_grammar_takes_the_familys_reply(family):
    _, tokenizer, style, reply, _ = family
    fmt = dataclasses.replace(tools_format(TOOLS, "required"), tool_style=style)
    compiler = GrammarCompiler(tokenizer, timeout_s=120)  # a loaded machine: no false timeouts
    matcher = compiler.compile(fmt.structured_outputs().spec).matcher()
    ids = tokenizer.encode(reply.removeprefix("Let me check."), add_special_tokens=False)
    assert all(matcher.accept_token(t) for t in ids) and matcher.can_terminate()
    if call_format(style).open is not None:  # the tag is its token, not its spelling
        assert ids[0] == tokenizer.convert_tokens_to_ids(call_format(style).open)
