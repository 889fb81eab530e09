"""Structured outputs under attack (DESIGN.md, Security): a client's regex cannot stall the
engine thread, and slow schemas cannot take every grammar-compile worker; on a tiny random
model in fp32.

`EVIL` accepts exactly 40 a's, but a backtracking engine (Python's `re`) first tries the
impossible branch `(a+)+[^\\s\\S]` every way it can split the a's: 2^40 tries, hours on one
fullmatch. The grammar forces the a's; its matcher reaching the end is what proves the
match, so the final check must not backtrack on the engine thread.
"""

from __future__ import annotations

import json
import threading
import time

import pytest

from agentrt.engine.client.llm import LLM
from agentrt.engine.errors import ErrorCode
from agentrt.engine.sampling_params import SamplingParams, StructuredOutputsParams
from agentrt.grammar import GrammarCompiler

EVIL = r"(?:(a+)+[^\s\S])?a{40}"
NORMAL = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_checkpoint) -> LLM:
    return LLM(str(tiny_checkpoint("llama")), dtype="float32", num_kv_blocks=64)


def constrained(**fmt) -> SamplingParams:
    return SamplingParams(
        temperature=0, max_tokens=60, structured_outputs=StructuredOutputsParams(**fmt)
    )


AS = "a" * 40
PROPERTY = {"type": "string", "pattern": f"^{EVIL}$"}


@pytest.mark.parametrize(
    ("fmt", "expected"),
    [
        ({"regex": EVIL}, AS),
        ({"json": PROPERTY}, json.dumps(AS)),
        (
            {"json": {"type": "object", "properties": {"x": PROPERTY}, "required": ["x"]}},
            json.dumps({"x": AS}),
        ),
    ],
    ids=["regex", "json-pattern", "json-property"],
)
def test_a_backtracking_regex_does_not_stall_the_engine(llm, fmt, expected):
    normal_prompt = [5, 6, 7, 8, 9]
    reference = llm.generate([normal_prompt], NORMAL)[0].outputs[0].token_ids
    start = time.monotonic()
    evil, normal = llm.generate([[1, 2, 3], normal_prompt], [constrained(**fmt), NORMAL])
    elapsed = time.monotonic() - start
    assert elapsed < 30, f"{elapsed:.1f} s"  # before: hours in the final check's fullmatch
    assert normal.outputs[0].token_ids == reference  # the other request, unharmed
    out = evil.outputs[0]
    assert (out.finish_reason, out.text, out.structured_errors) == ("stop", expected, [])


def test_slow_compiles_fail_alone_and_free_their_workers(llm, monkeypatch):
    """More slow schemas than compile workers (8), each stuck in a native-like call that
    holds no lock (injected: a real one would need a schema minutes long to build), then a
    normal request: it compiles on a freed slot and completes; the slow ones fail clearly."""
    release = threading.Event()
    compile_now = GrammarCompiler._compile_now

    def slow_for_some(self, spec, key, runner=None):
        if '"slow-' in spec.text:
            release.wait(60)
        return compile_now(self, spec, key, *(() if runner is None else (runner,)))

    warm = llm.generate([[1, 2, 3]], constrained(regex="[d-f]{3}"))[0]  # backends built
    assert warm.outputs[0].finish_reason == "stop"
    monkeypatch.setattr(GrammarCompiler, "_compile_now", slow_for_some)
    budget = 3  # short, so that the slow ones time out soon (the backends are built by now)
    monkeypatch.setattr(llm.engine.engine_core.structured.compiler, "timeout_s", budget)
    slow = [constrained(json={"type": "string", "title": f"slow-{i}"}) for i in range(12)]
    try:
        start = time.monotonic()
        failed = llm.generate([[1, 2, 3]] * len(slow), slow)
        assert time.monotonic() - start < budget + 10
        for out in failed:
            assert out.outputs[0].finish_reason == "error"
            assert out.error_code == ErrorCode.INVALID_SCHEMA
            assert f"did not compile within {budget:g} s" in out.error
        # Every worker the slow ones took is still stuck; a normal request compiles anyway.
        start = time.monotonic()
        out = llm.generate([[1, 2, 3]], constrained(regex="[a-c]{3}"))[0]
        assert time.monotonic() - start < budget
        assert (out.outputs[0].finish_reason, out.error) == ("stop", None)
        assert len(out.outputs[0].text) == 3 and set(out.outputs[0].text) <= set("abc")
    finally:
        release.set()
