"""Speculative decoding end to end: with greedy fp32 decoding, every method returns exactly the
tokens drafting off returns (plain text, JSON schema, tool calls; with prefix caching, chunked
prefill, preemption, stop strings, EOS and max_tokens inside a draft), drafts really happen
(the stats say so), and the KV pool stays consistent through aborts and preemptions."""

from __future__ import annotations

import pytest

from agentrt.engine.client.llm import LLM
from agentrt.engine.sampling_params import SamplingParams, StructuredOutputsParams
from agentrt.grammar import GrammarSpec

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "city": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
    },
    "required": ["name", "age", "city", "tags"],
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather of a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
                "required": ["city", "unit"],
            },
        },
    }
]
TEXT_PROMPTS = [
    "Repeat exactly: one two three four five. one two three four five. one two three",
    "List the numbers from 1 to 40 separated by commas: 1, 2, 3,",
]
JSON_PROMPTS = [
    "<|im_start|>user\nAnna Berg, 31, lives in Oslo; she likes skiing and chess. "
    "Give her as JSON.<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>user\nJohn Smith is 42 and lives in Paris. JSON please.<|im_end|>\n"
    "<|im_start|>assistant\n",
]
TOOL_PROMPT = (
    "<|im_start|>user\nWhat is the weather in Rome, in Celsius?<|im_end|>\n<|im_start|>assistant\n"
)


def greedy(max_tokens: int, **kwargs) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **kwargs)


def schema(max_tokens: int = 90) -> SamplingParams:
    return greedy(max_tokens, structured_outputs=StructuredOutputsParams(json=PERSON))


def tools(max_tokens: int = 60) -> SamplingParams:
    spec = GrammarSpec.from_tools(TOOLS, "required")
    return greedy(max_tokens, structured_outputs=StructuredOutputsParams(spec=spec))


def workload() -> list[tuple[str, SamplingParams]]:
    return (
        [(p, greedy(64)) for p in TEXT_PROMPTS]
        + [(p, schema()) for p in JSON_PROMPTS]
        + [(TOOL_PROMPT, tools())]
    )


def run(llm: LLM, items: list[tuple[str, SamplingParams]]) -> list[list[int]]:
    outputs = llm.generate([p for p, _ in items], [s for _, s in items])
    return [o.outputs[0].token_ids for o in outputs]


def spec_llm(model, method: str, **options) -> LLM:
    """dtype "auto": the embedded model in its own Q4_1 blocks (as users run it; every row
    of a step is computed as it would be alone, so drafting changes no token), a tiny fp32
    checkpoint in fp32."""
    config = {"method": method, "adaptive": False, **options.pop("spec", {})}
    return LLM(model, speculative_config=config, **options)


@pytest.fixture(scope="module")
def baseline(smollm2_default_llm) -> list[list[int]]:
    return run(smollm2_default_llm, workload())


@pytest.fixture(scope="module")
def baseline_no_jump_forward() -> list[list[int]]:
    """Grammar drafts replace jump-forward: their reference is decoding without it."""
    llm = LLM(None, kv_cache_memory_gb=0.25, jump_forward=False)
    return run(llm, workload())


def assert_drafted(llm: LLM) -> None:
    stats = llm.engine.stats().spec_decode
    assert stats.num_drafts > 0 and stats.num_accepted_tokens > 0, stats
    llm.engine.kv_manager.check_invariants()


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_embedded_model_same_tokens(method, baseline):
    llm = spec_llm(None, method, kv_cache_memory_gb=0.25)
    manager = llm.engine.engine_core.spec
    flags = []
    set_drafts = manager._set_drafts

    def recording(request, draft, max_tokens):
        set_drafts(request, draft, max_tokens)
        flags.append(list(request.spec_forced))

    manager._set_drafts = recording
    assert run(llm, workload()) == baseline
    assert_drafted(llm)
    # Drafts went on after tokens the grammar forced (jump-forward's), drafted anew.
    assert any(True in f and False in f[f.index(True) :] for f in flags)


def test_grammar_drafts_same_tokens_as_sampling_them(baseline_no_jump_forward):
    llm = spec_llm(None, "grammar", kv_cache_memory_gb=0.25)
    assert not llm.engine.scheduler_config.jump_forward  # the drafts replace it
    assert run(llm, workload()) == baseline_no_jump_forward
    assert_drafted(llm)
    # Forced JSON keys are long drafts the model accepts.
    assert llm.engine.stats().spec_decode.mean_accepted_length > 2


@pytest.mark.slow
def test_draft_model_same_tokens(smollm2_dir, baseline):
    """The embedded model drafting for itself: every greedy draft is accepted."""
    llm = spec_llm(None, "draft_model", kv_cache_memory_gb=0.25, spec={"model": str(smollm2_dir)})
    assert run(llm, workload()) == baseline
    stats = llm.engine.stats().spec_decode
    assert stats.num_accepted_tokens == stats.num_draft_tokens > 0
    llm.engine.kv_manager.check_invariants()


def test_request_metrics_carry_spec_stats():
    llm = spec_llm(None, "ngram", kv_cache_memory_gb=0.25)
    (out,) = llm.generate([TEXT_PROMPTS[1]], greedy(40))
    stats = out.metrics.spec_decode
    assert stats.num_draft_tokens >= stats.num_accepted_tokens > 0
    assert stats.mean_accepted_length > 1
    engine_stats = llm.engine.stats()
    assert engine_stats.spec_decode_method == "ngram"
    assert engine_stats.spec_decode == stats  # the only request so far


# -- tiny models: every scheduler path ------------------------------------------------------


# A tiny model's KV block is a few KB: 6,553 blocks of 0.05 GiB hold every test here (the
# preemption cases set their own few).
TINY_POOL = {"kv_cache_memory_gb": 0.05}


def tiny_items(n: int = 6, max_tokens: int = 48) -> list[tuple[list[int], SamplingParams]]:
    prompts = [[(7 * i + 3 * j) % 500 + 100 for j in range(10 + 9 * i)] for i in range(n)]
    return [(p, greedy(max_tokens, ignore_eos=True)) for p in prompts]


@pytest.fixture(scope="module")
def tiny(tiny_checkpoint):
    return str(tiny_checkpoint("llama"))


@pytest.fixture(scope="module")
def tiny_base(tiny) -> LLM:
    """The tiny model without drafting (tests only generate on it)."""
    return LLM(tiny, dtype="float32", **TINY_POOL)


@pytest.fixture(scope="module")
def tiny_baseline(tiny_base) -> list[list[int]]:
    return run(tiny_base, tiny_items())


SCHEDULER_CASES = {
    "default": {},
    "no_prefix_caching": {"enable_prefix_caching": False},
    "chunked_prefill": {"max_num_batched_tokens": 24, "long_prefill_token_threshold": 8},
    # 3 requests of up to ~100 tokens cannot all fit in 12 blocks of 16: preemption.
    "preemption": {"num_kv_blocks": 12, "max_num_batched_tokens": 64},
}


@pytest.mark.parametrize("case", sorted(SCHEDULER_CASES))
@pytest.mark.parametrize("method", ["ngram", "suffix", "draft_model"])
def test_tiny_model_same_tokens(tiny, tiny_baseline, method, case):
    """Random tiny models do not repeat themselves, so n-gram drafts are all rejected here
    (the rejection path); the suffix cache drafts the second run of the same prompts from
    the first run's outputs, and the model drafting for itself is always right (the
    acceptance paths)."""
    spec = {"model": tiny} if method == "draft_model" else {}
    llm = spec_llm(tiny, method, spec=spec, **(TINY_POOL | SCHEDULER_CASES[case]))
    items, expected = tiny_items(), tiny_baseline
    if case == "preemption":
        items, expected = items[:3], expected[:3]
    assert run(llm, items) == expected
    if method == "suffix":
        assert run(llm, items) == expected
    stats = llm.engine.stats()
    assert stats.spec_decode.num_drafts > 0
    if method != "ngram":
        assert stats.spec_decode.num_accepted_tokens > len(items) * 10
    if case == "preemption":
        assert stats.num_preemptions > 0
    llm.engine.kv_manager.check_invariants()


def test_tiny_draft_model_of_another_architecture(tiny, tiny_checkpoint, tiny_baseline):
    """A different tiny model (qwen3, same vocabulary) drafts: few drafts hold, the output
    is still exactly the target's."""
    draft = {"model": str(tiny_checkpoint("qwen3"))}
    llm = spec_llm(tiny, "draft_model", spec=draft, **TINY_POOL)
    assert run(llm, tiny_items()) == tiny_baseline
    assert llm.engine.stats().spec_decode.num_draft_tokens > 0
    llm.engine.kv_manager.check_invariants()


def self_drafting(tiny, **options) -> LLM:
    """The tiny model drafting for itself: greedy drafts always hold, so each step appends
    1 + k tokens and a stop can fall anywhere inside them."""
    return spec_llm(tiny, "draft_model", spec={"model": tiny}, **(TINY_POOL | options))


@pytest.fixture(scope="module")
def tiny_drafting(tiny) -> LLM:
    """`self_drafting(tiny)`, shared by the stop tests (they leave it idle)."""
    return self_drafting(tiny)


@pytest.mark.parametrize("position", range(28, 33))  # every offset in a 1 + 4 token step
def test_stops_inside_a_draft(tiny_base, tiny_drafting, tiny_baseline, position):
    """A stop token id, a stop string and max_tokens that fall inside accepted drafts end
    the output exactly where drafting off ends it."""
    base, llm = tiny_base, tiny_drafting
    accepted = llm.engine.stats().spec_decode.num_accepted_tokens
    prompt, _ = tiny_items()[1]
    tokens = tiny_baseline[1]
    stop_text = base.tokenizer.decode(tokens[position : position + 2])
    cases = [
        greedy(48, ignore_eos=True, stop_token_ids=[tokens[position]]),
        greedy(48, ignore_eos=True, stop=[stop_text]),
        greedy(position, ignore_eos=True),
    ]
    for params in cases:
        (want,) = base.generate([prompt], params)
        (got,) = llm.generate([prompt], params)
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
        assert got.outputs[0].text == want.outputs[0].text
        assert got.outputs[0].finish_reason == want.outputs[0].finish_reason
    assert llm.engine.stats().spec_decode.num_accepted_tokens > accepted
    llm.engine.kv_manager.check_invariants()


def test_eos_inside_a_draft(tiny, tiny_baseline):
    """The model's EOS, when it comes from a draft, ends the output like a sampled one."""
    base = LLM(tiny, dtype="float32", **TINY_POOL)  # its EOS is changed: its own engine
    llm = self_drafting(tiny)
    prompt, _ = tiny_items()[1]
    eos = tiny_baseline[1][30]  # a token the output reaches becomes the EOS
    for engine in (base.engine, llm.engine):
        engine.eos_token_ids = frozenset({eos})
        engine.processor.eos_token_ids = frozenset({eos})
    (want,) = base.generate([prompt], greedy(48))
    (got,) = llm.generate([prompt], greedy(48))
    assert want.outputs[0].finish_reason == "stop"
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
    assert got.outputs[0].finish_reason == "stop"
    assert llm.engine.stats().spec_decode.num_accepted_tokens > 0


def test_abort_with_drafts_in_flight(tiny):
    llm = self_drafting(tiny, num_kv_blocks=40)
    engine = llm.engine
    for i, (prompt, params) in enumerate(tiny_items(4, 200)):
        engine.add_request(engine.processor.process(f"r{i}", prompt, params), None)
    seen_drafts = False
    for _ in range(60):
        engine.step()
        seen_drafts |= any(r.spec_token_ids for r in engine.scheduler.running)
        engine.kv_manager.check_invariants()
    assert seen_drafts
    in_flight = [r.req_id for r in engine.scheduler.running if r.spec_token_ids]
    engine.abort_requests(in_flight)
    engine.kv_manager.check_invariants()
    while engine.has_unfinished_requests():
        engine.step()
    engine.kv_manager.check_invariants()
    assert engine.kv_manager.pool.num_free_blocks == engine.kv_manager.num_blocks


def test_random_sampling_with_drafts_is_seeded(tiny):
    """Seeded random requests draw from their own generator, drafts or not: the same seed
    gives the same output, whatever else shares the batch."""
    llm = self_drafting(tiny)
    prompt, _ = tiny_items()[2]
    params = SamplingParams(max_tokens=40, temperature=0.7, seed=11, ignore_eos=True)
    (alone,) = llm.generate([prompt], params)
    together = llm.generate([prompt, tiny_items()[3][0]], [params, greedy(40)])
    assert together[0].outputs[0].token_ids == alone.outputs[0].token_ids
    assert llm.engine.stats().spec_decode.num_drafts > 0


def test_logprob_requests_do_not_draft_beside_ones_that_do(tiny, tiny_base, tiny_baseline):
    llm = self_drafting(tiny)
    (prompt, _), (other, _) = tiny_items()[1:3]
    want = tiny_base.generate([prompt], greedy(30, ignore_eos=True, logprobs=2))
    out, drafted = llm.generate(
        [prompt, other], [greedy(30, ignore_eos=True, logprobs=2), greedy(30, ignore_eos=True)]
    )
    assert out.metrics.spec_decode.num_drafts == 0
    assert drafted.metrics.spec_decode.num_accepted_tokens > 0
    assert drafted.outputs[0].token_ids == tiny_baseline[2][:30]
    assert out.outputs[0].token_ids == want[0].outputs[0].token_ids
    for got_step, want_step in zip(
        out.outputs[0].logprobs, want[0].outputs[0].logprobs, strict=True
    ):
        assert got_step.keys() == want_step.keys()  # (values differ by float rounding: batch)
        for token_id, logprob in want_step.items():
            assert got_step[token_id].logprob == pytest.approx(logprob.logprob, abs=1e-4)
