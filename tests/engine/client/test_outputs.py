"""OutputProcessor: RequestOutput / RequestDelta built from hand-made EngineCoreOutput deltas,
decoded with the real SmolLM2 tokenizer: incremental text, stop strings (and the ids the
engine must abort), logprobs, metrics, finish fields, abort, and state cleanup."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from agentrt.engine.client import outputs as outputs_module
from agentrt.engine.client.outputs import Logprob, OutputProcessor, RequestDelta
from agentrt.engine.errors import ErrorCode
from agentrt.engine.loader.tokenizer import load_tokenizer
from agentrt.engine.records import EngineCoreOutput, SampledToken
from agentrt.engine.sampling_params import SamplingParams

PROMPT_IDS = [504, 2988, 314]  # "The answer is"
HELLO = "Hello, world! How are you?"
ANSWER = "The answer is 42. END of story"


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir: Path):
    return load_tokenizer(smollm2_dir)


def core(req_id: str, token_ids: list[int], finish_reason: str | None = None, **fields):
    return EngineCoreOutput(
        req_id, token_ids, fields.pop("new_logprobs", None), finish_reason, **fields
    )


def processor_with(tokenizer, params: SamplingParams, *req_ids: str) -> OutputProcessor:
    processor = OutputProcessor(tokenizer)
    for req_id in req_ids or ("r",):
        processor.add_request(req_id, "The answer is", PROMPT_IDS, params)
    return processor


def feed_one_by_one(
    processor: OutputProcessor, token_ids: list[int], last_finish: str | None = None
) -> list[tuple[list[RequestDelta], list[str]]]:
    """One step per token for request "r"; the last step finishes with `last_finish`."""
    steps = []
    for i, token_id in enumerate(token_ids):
        finish = last_finish if i == len(token_ids) - 1 else None
        steps.append(processor.process_outputs([core("r", [token_id], finish)]))
    return steps


def streamed_text(steps) -> str:
    return "".join(d.text for deltas, _ in steps for d in deltas)


# --- incremental detokenization -------------------------------------------------------------


def test_streamed_deltas_concatenate_to_the_decoded_text(tokenizer):
    ids = tokenizer.encode(HELLO)
    processor = processor_with(tokenizer, SamplingParams())
    steps = feed_one_by_one(processor, ids, last_finish="length")
    texts = [d.text for deltas, _ in steps for d in deltas]
    assert texts == [tokenizer.decode([i]) for i in ids]  # one delta per token, in order
    assert streamed_text(steps) == HELLO == tokenizer.decode(ids)
    final = steps[-1][0][0]
    assert final.finished and final.output is not None
    completion = final.output.outputs[0]
    assert completion.text == HELLO
    assert completion.token_ids == ids
    assert completion.finish_reason == "length" and completion.stop_reason is None
    assert final.output.finished and final.output.prompt_token_ids == PROMPT_IDS
    assert final.output.prompt == "The answer is"
    assert all(not d.finished for deltas, _ in steps[:-1] for d in deltas)
    assert all(to_abort == [] for _, to_abort in steps)
    assert processor.states == {}  # dropped once finished


def test_running_output_text_grows_with_each_step(tokenizer):
    ids = tokenizer.encode(HELLO)
    processor = processor_with(tokenizer, SamplingParams())
    output = processor.states["r"].output
    processor.process_outputs([core("r", ids[:3])])
    assert output.outputs[0].text == "Hello, world"
    assert output.outputs[0].token_ids == ids[:3] and not output.finished
    processor.process_outputs([core("r", ids[3:5])])
    assert output.outputs[0].text == "Hello, world! How"


def test_a_character_split_across_tokens_is_delivered_once_whole(tokenizer):
    text = "Emoji 🎉 and 日本語"
    ids = tokenizer.encode(text)
    processor = processor_with(tokenizer, SamplingParams())
    steps = feed_one_by_one(processor, ids, last_finish="length")
    texts = [d.text for deltas, _ in steps for d in deltas]
    assert len(texts) == len(ids)  # a delta per step: its token ids, even with no text yet
    assert all("\ufffd" not in t for t in texts)
    assert " 🎉" in texts and texts.count("") == 6  # 🎉, 日, 語: 3 byte tokens each
    assert streamed_text(steps) == text
    assert steps[-1][0][0].output.outputs[0].text == text


def test_a_trailing_incomplete_character_is_released_on_finish(tokenizer):
    ids = tokenizer.encode("Party 🎉")[:-1]  # the emoji's last byte never comes
    processor = processor_with(tokenizer, SamplingParams())
    steps = feed_one_by_one(processor, ids, last_finish="length")
    final = steps[-1][0][0]
    assert final.output.outputs[0].text == tokenizer.decode(ids)
    assert final.output.outputs[0].text.endswith("\ufffd")
    assert streamed_text(steps) == tokenizer.decode(ids)


@pytest.mark.parametrize(("skip", "expected"), [(True, "ab"), (False, "a<|im_end|>b")])
def test_special_tokens_are_skipped_only_when_asked(tokenizer, skip, expected):
    ids = tokenizer.encode("a<|im_end|>b")
    assert len(ids) == 3
    processor = processor_with(tokenizer, SamplingParams(skip_special_tokens=skip))
    steps = feed_one_by_one(processor, ids, last_finish="length")
    assert streamed_text(steps) == expected
    assert steps[-1][0][0].output.outputs[0].text == expected


def test_several_tokens_in_one_step_form_one_delta(tokenizer):
    ids = tokenizer.encode(HELLO)
    processor = processor_with(tokenizer, SamplingParams())
    deltas, to_abort = processor.process_outputs([core("r", ids[:4]), core("r", ids[4:], "stop")])
    assert [d.text for d in deltas] == ["Hello, world!", " How are you?"]
    assert [d.token_ids for d in deltas] == [ids[:4], ids[4:]]
    assert to_abort == []
    assert deltas[1].output.outputs[0].finish_reason == "stop"


# --- stop strings ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("include", "expected"), [(False, "The answer is 42. "), (True, "The answer is 42. END")]
)
def test_a_stop_string_finishes_the_request_and_asks_the_engine_to_abort(
    tokenizer, include, expected
):
    ids = tokenizer.encode(ANSWER)
    processor = processor_with(
        tokenizer, SamplingParams(stop=["END"], include_stop_str_in_output=include)
    )
    end = ids.index(tokenizer.encode(" END")[0])
    steps = feed_one_by_one(processor, ids[: end + 1])
    assert [to_abort for _, to_abort in steps] == [[]] * end + [["r"]]
    final = steps[-1][0][0]
    assert final.finished
    completion = final.output.outputs[0]
    assert completion.finish_reason == "stop" and completion.stop_reason == "END"
    assert completion.text == expected
    assert streamed_text(steps) == expected  # nothing after the stop string is ever shown
    assert completion.token_ids == ids[: end + 1]
    assert processor.states == {}
    # The engine may still report the step it ran before the abort: ignored.
    assert processor.process_outputs([core("r", [ids[end + 1]])]) == ([], [])


def test_a_possible_stop_string_prefix_is_held_back_until_it_resolves(tokenizer):
    ids = tokenizer.encode(ANSWER)  # The, answer, is, " ", 4, 2, ., " END", ...
    dot = ids.index(tokenizer.encode(".")[0])
    processor = processor_with(tokenizer, SamplingParams(stop=[". END"]))
    steps = feed_one_by_one(processor, ids[: dot + 2])
    texts = [d.text for deltas, _ in steps for d in deltas]
    assert texts[dot] == ""  # "." could start ". END": held back
    assert processor.states == {}
    assert steps[-1][1] == ["r"]
    assert steps[-1][0][0].output.outputs[0].text == "The answer is 42"
    assert streamed_text(steps) == "The answer is 42"  # the held "." is never shown


def test_held_back_text_is_released_when_no_stop_string_follows(tokenizer):
    ids = tokenizer.encode("The answer is 42. And more")
    dot = ids.index(tokenizer.encode(".")[0])
    processor = processor_with(tokenizer, SamplingParams(stop=[". END"]))
    steps = feed_one_by_one(processor, ids[: dot + 2])
    texts = [d.text for deltas, _ in steps for d in deltas]
    assert texts[dot] == "" and texts[dot + 1] == ". And"
    # The request ends on a held-back prefix: the final delta releases it.
    steps = feed_one_by_one(processor, [ids[dot]], last_finish="length")
    assert steps[-1][0][0].text == "."
    assert steps[-1][0][0].output.outputs[0].text == "The answer is 42. And."
    assert steps[-1][0][0].output.outputs[0].finish_reason == "length"


def test_a_stop_string_inside_a_multi_token_step_cuts_the_text_there(tokenizer):
    ids = tokenizer.encode(ANSWER)
    processor = processor_with(tokenizer, SamplingParams(stop=["42"]))
    deltas, to_abort = processor.process_outputs([core("r", ids)])
    assert to_abort == ["r"]
    assert deltas[0].text == "The answer is "
    completion = deltas[0].output.outputs[0]
    assert completion.text == "The answer is " and completion.stop_reason == "42"
    # The output ends with the token that completed the stop string, as it would have if the
    # tokens had come one per step (jump-forward and drafts bring several at once).
    end = next(n for n in range(1, len(ids) + 1) if "42" in tokenizer.decode(ids[:n]))
    assert end < len(ids)
    assert completion.token_ids == ids[:end]
    assert deltas[0].token_ids == ids[:end]


def test_a_stop_string_in_the_engines_final_step_is_not_aborted_again(tokenizer):
    ids = tokenizer.encode(ANSWER)
    processor = processor_with(tokenizer, SamplingParams(stop=["END"]))
    deltas, to_abort = processor.process_outputs([core("r", ids, "length")])
    assert to_abort == []  # the engine already finished it
    completion = deltas[0].output.outputs[0]
    assert completion.finish_reason == "stop" and completion.stop_reason == "END"
    assert completion.text == "The answer is 42. "


def test_a_stop_token_finish_keeps_the_engines_stop_reason(tokenizer):
    ids = tokenizer.encode(HELLO)
    processor = processor_with(tokenizer, SamplingParams(stop_token_ids=[47]))
    deltas, _ = processor.process_outputs([core("r", ids, "stop", stop_reason=47)])
    completion = deltas[0].output.outputs[0]
    assert completion.finish_reason == "stop" and completion.stop_reason == 47
    assert completion.text == HELLO


# --- logprobs -------------------------------------------------------------------------------


def test_logprobs_accumulate_per_token_with_ranks_and_decoded_tokens(tokenizer):
    world, how, bang, comma, hello = 905, 1073, 17, 28, 19556
    processor = processor_with(tokenizer, SamplingParams(logprobs=2))
    first = SampledToken(world, -0.5, 1, {world: -0.5, how: -1.5})
    # The sampled token need not be in the top N (sampling at temperature > 0).
    second = SampledToken(bang, -3.0, 5, {comma: -0.25, hello: -2.0})
    third = SampledToken(how, -0.125, 1, {how: -0.125, bang: -4.0})
    deltas, _ = processor.process_outputs([core("r", [world], new_logprobs=[first])])
    assert deltas[0].logprobs == [
        {world: Logprob(-0.5, 1, " world"), how: Logprob(-1.5, 2, " How")}
    ]
    deltas, _ = processor.process_outputs(
        [core("r", [bang, how], "length", new_logprobs=[second, third])]
    )
    # The delta carries only this step's entries; the sampled token comes first.
    assert deltas[0].logprobs == [
        {
            bang: Logprob(-3.0, 5, "!"),
            comma: Logprob(-0.25, 1, ","),
            hello: Logprob(-2.0, 2, "Hello"),
        },
        {how: Logprob(-0.125, 1, " How"), bang: Logprob(-4.0, 2, "!")},
    ]
    assert list(deltas[0].logprobs[0]) == [bang, comma, hello]
    completion = deltas[0].output.outputs[0]
    assert len(completion.logprobs) == 3
    assert completion.logprobs[0] == {
        world: Logprob(-0.5, 1, " world"),
        how: Logprob(-1.5, 2, " How"),
    }
    assert completion.cumulative_logprob == -0.5 - 3.0 - 0.125


def test_logprobs_zero_keeps_the_sampled_tokens_logprob(tokenizer):
    processor = processor_with(tokenizer, SamplingParams(logprobs=0))
    deltas, _ = processor.process_outputs(
        [core("r", [905], "length", new_logprobs=[SampledToken(905, -0.75, 3)])]
    )
    completion = deltas[0].output.outputs[0]
    assert completion.logprobs == [{905: Logprob(-0.75, 3, " world")}]
    assert completion.cumulative_logprob == -0.75


def test_without_logprobs_requested_none_are_kept(tokenizer):
    processor = processor_with(tokenizer, SamplingParams())
    sampled = [SampledToken(905, -0.5, 1, {905: -0.5})]
    deltas, _ = processor.process_outputs([core("r", [905], "length", new_logprobs=sampled)])
    assert deltas[0].logprobs is None
    completion = deltas[0].output.outputs[0]
    assert completion.logprobs is None and completion.cumulative_logprob is None


# --- metrics --------------------------------------------------------------------------------


@pytest.fixture
def clock(monkeypatch):
    """The output processor's time.monotonic, set by the test (now[0])."""
    now = [100.0]
    monkeypatch.setattr(outputs_module, "time", SimpleNamespace(monotonic=lambda: now[0]))
    return now


def test_metrics_time_the_first_token_and_the_tokens_after_it(tokenizer, clock):
    processor = processor_with(tokenizer, SamplingParams())  # arrives at 100.0
    metrics = processor.states["r"].output.metrics
    assert metrics.arrival_time == 100.0 and metrics.time_to_first_token is None
    clock[0] = 100.25
    processor.process_outputs([core("r", [])])  # a prefill chunk: no token yet
    assert metrics.first_token_time is None
    clock[0] = 100.5
    processor.process_outputs([core("r", [19556])])
    assert metrics.time_to_first_token == 0.5
    assert metrics.time_per_output_token is None  # not finished
    for token_id in (28, 905, 17):
        clock[0] += 1.0
        processor.process_outputs([core("r", [token_id])])
    clock[0] = 104.5
    deltas, _ = processor.process_outputs([core("r", [1073], "length")])
    metrics = deltas[0].output.metrics
    assert metrics.first_token_time == 100.5 and metrics.finished_time == 104.5
    assert metrics.num_output_tokens == 5
    assert metrics.time_to_first_token == 0.5
    assert metrics.time_per_output_token == 1.0  # 4 s over the 4 tokens after the first


def test_time_per_output_token_needs_two_tokens(tokenizer, clock):
    processor = processor_with(tokenizer, SamplingParams())
    clock[0] = 101.0
    deltas, _ = processor.process_outputs([core("r", [19556], "length")])
    metrics = deltas[0].output.metrics
    assert metrics.time_to_first_token == 1.0
    assert metrics.num_output_tokens == 1 and metrics.time_per_output_token is None


# --- finish fields --------------------------------------------------------------------------


def test_an_error_finish_carries_its_code_and_message(tokenizer):
    processor = processor_with(tokenizer, SamplingParams())
    processor.process_outputs([core("r", [19556])])
    deltas, to_abort = processor.process_outputs(
        [
            core(
                "r",
                [],
                "error",
                error_code=ErrorCode.STRUCTURED_OUTPUT_FAILED,
                error="the grammar allows no token after 'Hello'",
            )
        ]
    )
    assert to_abort == []
    output = deltas[0].output
    assert output.outputs[0].finish_reason == "error"
    assert output.error_code is ErrorCode.STRUCTURED_OUTPUT_FAILED
    assert output.error == "the grammar allows no token after 'Hello'"
    assert output.outputs[0].text == "Hello" and output.outputs[0].token_ids == [19556]
    assert deltas[0].text == "" and deltas[0].token_ids == []
    assert processor.states == {}


def test_a_normal_finish_has_no_error(tokenizer):
    processor = processor_with(tokenizer, SamplingParams())
    deltas, _ = processor.process_outputs([core("r", [19556], "stop", stop_reason=2)])
    assert deltas[0].output.error_code is None and deltas[0].output.error is None


def test_structured_output_fields_are_passed_through_on_finish(tokenizer):
    processor = processor_with(tokenizer, SamplingParams())
    processor.process_outputs(
        [core("r", [19556], structured_errors=["ignored while running"], num_steered_tokens=9)]
    )
    completion = processor.states["r"].output.outputs[0]
    assert completion.structured_errors is None and completion.num_steered_tokens == 0
    deltas, _ = processor.process_outputs(
        [core("r", [28], "length", structured_errors=["'name' is required"], num_steered_tokens=3)]
    )
    completion = deltas[0].output.outputs[0]
    assert completion.structured_errors == ["'name' is required"]
    assert completion.num_steered_tokens == 3


def test_num_cached_tokens_follows_the_engine(tokenizer):
    processor = processor_with(tokenizer, SamplingParams())
    deltas, _ = processor.process_outputs([core("r", [19556], num_cached_tokens=16)])
    assert deltas[0].num_cached_tokens == 16
    deltas, _ = processor.process_outputs([core("r", [28], "length", num_cached_tokens=16)])
    assert deltas[0].output.num_cached_tokens == 16


# --- several requests, unknown ids, empty steps ---------------------------------------------


def test_one_step_updates_several_requests_in_order_and_ignores_unknown_ids(tokenizer):
    processor = processor_with(tokenizer, SamplingParams(), "a", "b")
    deltas, to_abort = processor.process_outputs(
        [core("b", [19556]), core("ghost", [28]), core("a", [905], "length")]
    )
    assert [(d.request_id, d.text, d.finished) for d in deltas] == [
        ("b", "Hello", False),
        ("a", " world", True),
    ]
    assert to_abort == []
    assert list(processor.states) == ["b"]
    assert processor.process_outputs([core("ghost", [1], "stop")]) == ([], [])
    assert list(processor.states) == ["b"]


def test_a_step_with_nothing_new_yields_no_delta(tokenizer):
    processor = processor_with(tokenizer, SamplingParams())
    assert processor.process_outputs([core("r", [])]) == ([], [])
    deltas, _ = processor.process_outputs([core("r", [], "abort")])
    assert len(deltas) == 1 and deltas[0].finished and deltas[0].text == ""
    assert deltas[0].output.outputs[0].finish_reason == "abort"


# --- abort ----------------------------------------------------------------------------------


def test_abort_returns_a_final_delta_for_each_tracked_request(tokenizer, clock):
    processor = processor_with(tokenizer, SamplingParams(), "a", "b", "c")
    processor.process_outputs([core("a", [19556, 28], num_cached_tokens=32), core("b", [905])])
    processor.process_outputs([core("c", [47], "length")])  # already finished
    clock[0] = 107.0
    deltas = processor.abort(["a", "unknown", "c", "b"])
    assert [d.request_id for d in deltas] == ["a", "b"]
    for delta in deltas:
        assert delta.finished and delta.text == "" and delta.token_ids == []
        assert delta.logprobs is None
        assert delta.output.finished
        assert delta.output.outputs[0].finish_reason == "abort"
        assert delta.output.metrics.finished_time == 107.0
    a = deltas[0].output
    assert a.outputs[0].token_ids == [19556, 28] and a.outputs[0].text == "Hello,"
    assert a.metrics.num_output_tokens == 2 and deltas[0].num_cached_tokens == 32
    assert processor.states == {}
    assert processor.abort(["a", "b"]) == []  # a second abort finds nothing
    assert processor.process_outputs([core("a", [905])]) == ([], [])
