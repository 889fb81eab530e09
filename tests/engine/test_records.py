"""The records that cross the engine core's boundary (`EngineCoreRequest` in,
`EngineCoreOutput` out; `SchedulerOutput` for a worker) are plain data: msgpack carries them
through msgspec and back unchanged, as an engine core in another process will receive them.
A record holding live state (a tensor, a future, a Python type) would fail here."""

from __future__ import annotations

import msgspec
import pytest
from pydantic import BaseModel

from agentrt.engine.errors import ErrorCode
from agentrt.engine.records import (
    EngineCoreOutput,
    EngineCoreRequest,
    SampledToken,
    ScheduledChunk,
    SchedulerOutput,
)
from agentrt.engine.sampling_params import SamplingParams, StructuredOutputsParams


def _round_trip(record):
    return msgspec.msgpack.decode(msgspec.msgpack.encode(record), type=type(record))


class City(BaseModel):
    name: str
    population: int


def test_a_processed_request_travels_as_a_message(smollm2_llm):
    params = SamplingParams(
        temperature=0.7,
        seed=3,
        stop=["\n\n"],
        logit_bias={42: -5.0},
        max_tokens=20,
        structured_outputs=StructuredOutputsParams(json=City),  # a Python type
    )
    request = smollm2_llm.engine.processor.process("r1", "Name a city.", params, priority=2)
    assert isinstance(request, EngineCoreRequest)
    # The constraint travels in its canonical form; the Python type stays in the front end.
    assert request.grammar is not None and request.grammar.kind == "json_schema"
    assert request.sampling_params.structured_outputs is None
    assert _round_trip(request) == request


def test_outputs_and_scheduler_steps_travel_as_messages():
    token = SampledToken(7, logprob=-0.25, rank=1, top_logprobs={7: -0.25, 9: -1.5})
    outputs = [
        EngineCoreOutput("a", [7, 8], [token], None, num_cached_tokens=16),
        EngineCoreOutput(
            "b",
            [],
            None,
            "error",
            structured_errors=["[1, 1] has non-unique elements"],
            error_code=ErrorCode.STRUCTURED_OUTPUT_FAILED,
            error="the output cannot be completed into a valid instance",
        ),
    ]
    for output in outputs:
        assert _round_trip(output) == output
    step = SchedulerOutput([ScheduledChunk("a", [1, 2, 3], 16, [4, 5], True)], 3, ["c"])
    assert _round_trip(step) == step


def test_live_state_does_not_travel():
    import torch

    with pytest.raises(TypeError):
        msgspec.msgpack.encode(SampledToken(torch.tensor(7)))
