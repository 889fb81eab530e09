"""Jump-forward decoding on the embedded model: the tokens a grammar forces (a JSON object's
next key) are appended without a sampling step each, computed with the request's next chunk.
Outputs stay valid, steps go down, and max_tokens, stop token ids and logprobs still hold."""

from __future__ import annotations

import json

import pytest
from pydantic import BaseModel, Field

from agentrt.engine.sampling_params import SamplingParams, StructuredOutputsParams


class Address(BaseModel):
    street: str = Field(max_length=40)
    city: str = Field(max_length=30)
    country: str = Field(max_length=30)


class Contact(BaseModel):
    name: str = Field(max_length=40)
    email: str = Field(max_length=40)
    address: Address
    num_orders: int = Field(ge=0, le=50)


PROMPTS = [
    [{"role": "user", "content": f"Invent customer number {i} of a bakery, as JSON."}]
    for i in range(4)
]


def _params(**overrides) -> SamplingParams:
    options = dict(
        temperature=0.0, max_tokens=200, structured_outputs=StructuredOutputsParams(json=Contact)
    )
    return SamplingParams(**(options | overrides))


def _runner(llm, monkeypatch):
    """run(params, jump_forward) -> (outputs, number of engine steps) on `llm`."""

    def run(params, jump_forward: bool, prompts=PROMPTS):
        # Jump-forward is the structured-output manager's (StructuredOutputManager.accept).
        structured = llm.engine.engine_core.structured
        monkeypatch.setattr(structured, "jump_forward", jump_forward)
        steps = 0
        step = llm.engine.step

        def counting_step():
            nonlocal steps
            steps += 1
            return step()

        monkeypatch.setattr(llm.engine, "step", counting_step)
        try:
            return llm.chat(prompts, params), steps
        finally:
            monkeypatch.undo()

    return run


@pytest.fixture
def run_fp32(smollm2_llm, monkeypatch):
    """On fp32, for the test that holds the two paths' outputs to the same JSON value."""
    return _runner(smollm2_llm, monkeypatch)


@pytest.fixture
def run(smollm2_default_llm, monkeypatch):
    """On the default engine (the GGUF's Q4_1 blocks): the tests of one path's bounds."""
    return _runner(smollm2_default_llm, monkeypatch)


@pytest.mark.slow
def test_jump_forward_keeps_outputs_valid_in_fewer_steps(run_fp32, smollm2_llm):
    plain, plain_steps = run_fp32(_params(), jump_forward=False)
    jumped, jumped_steps = run_fp32(_params(), jump_forward=True)
    for out in plain + jumped:
        assert out.outputs[0].finish_reason == "stop"
        Contact.model_validate_json(out.outputs[0].text)
    # The skeleton ('", "email": "', '"address": {"street": "', ...) is most of the tokens.
    assert jumped_steps < 0.75 * plain_steps, (jumped_steps, plain_steps)
    # Forced tokens are the grammar's canonical tokens: the JSON is the same value the
    # model would write, even where its tokens differ.
    for a, b in zip(plain, jumped, strict=True):
        assert json.loads(a.outputs[0].text) == json.loads(b.outputs[0].text)
    smollm2_llm.kv_manager.check_invariants()


def test_max_tokens_caps_forced_tokens(run):
    for max_tokens in (1, 2, 3, 5, 8):
        (out,), _ = run(_params(max_tokens=max_tokens), jump_forward=True, prompts=PROMPTS[:1])
        assert len(out.outputs[0].token_ids) == max_tokens
        assert out.outputs[0].finish_reason == "length"


def test_stop_token_id_among_forced_tokens_stops_there(run):
    (reference,), _ = run(_params(), jump_forward=True, prompts=PROMPTS[:1])
    tokens = reference.outputs[0].token_ids
    stop_id = tokens[3]  # inside '{"name": "' ... , which the grammar forces
    (out,), _ = run(_params(stop_token_ids=(stop_id,)), jump_forward=True, prompts=PROMPTS[:1])
    assert out.outputs[0].token_ids == tokens[: tokens.index(stop_id) + 1]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == stop_id


def test_logprobs_turn_jump_forward_off(run):
    """Forced tokens have no distribution to report: a request asking for logprobs samples
    every token, and each one has its logprob."""
    (out,), steps = run(_params(logprobs=2), jump_forward=True, prompts=PROMPTS[:1])
    completion = out.outputs[0]
    Contact.model_validate_json(completion.text)
    assert len(completion.logprobs) == len(completion.token_ids) == steps  # one per step
