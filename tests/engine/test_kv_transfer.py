"""KV connectors (engine/kv_transfer/): storage and p2p, on the embedded model as users run
it (the GGUF's own Q4_1 blocks; the tensor-parallel test in fp32, as tensor parallelism runs).

Greedy decoding is deterministic and a row's numbers do not depend on what else its step
computes, so a request whose prefix KV came from storage or from another instance must give
exactly the tokens one instance computes alone. Failures (a corrupt file, a dead producer,
another prompt's params) must fall back to computing the prefill, with the same tokens,
counted and without hanging. (The default engine's decode step costs a tenth of dense
fp32's here: the file's non-TP tests took 50 CPU s in fp32, 20 s this way.)
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import time

import pytest
import zmq

from agentrt.engine.client.llm import LLM
from agentrt.engine.core.block_hash import extend_block_hashes
from agentrt.engine.core.request import RequestStatus
from agentrt.engine.errors import ConfigError, InvalidRequestError
from agentrt.engine.kv_transfer.auth import ParamsSigner
from agentrt.engine.kv_transfer.p2p_worker import curve_server_keys
from agentrt.engine.sampling_params import SamplingParams, StructuredOutputsParams

PROMPT = (
    "The history of London spans two thousand years. Founded by the Romans as Londinium, "
    "it grew into a trading port on the Thames, burned in 1666 and was rebuilt in stone. "
    "Summarise it in one sentence:"
)
SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "founded_by": {"type": "string"}},
    "required": ["city", "founded_by"],
    "additionalProperties": False,
}
GREEDY = SamplingParams(temperature=0, max_tokens=20)
JSON = SamplingParams(
    temperature=0, max_tokens=40, structured_outputs=StructuredOutputsParams(json=SCHEMA)
)
OPTIONS = {"kv_cache_memory_gb": 0.05}
SECRET = "kv-secret-of-the-tests"


def engine(**options) -> LLM:
    return LLM(None, **OPTIONS, **options)


@pytest.fixture(scope="module")
def solo() -> LLM:
    """One instance without a connector nor a prefix cache: what each prompt gives computed
    alone (tests only generate on it, so it stays as built)."""
    return engine(enable_prefix_caching=False)


@pytest.fixture(scope="module")
def reference(solo: LLM) -> dict[str, list[int]]:
    """What one instance without a connector generates."""
    plain, constrained = solo.generate([PROMPT, PROMPT], [GREEDY, JSON])
    return {"plain": plain.outputs[0].token_ids, "json": constrained.outputs[0].token_ids}


def test_options_are_validated():
    with pytest.raises(ConfigError, match="kv_role"):
        engine(kv_connector="storage", kv_role="sender")
    with pytest.raises(ConfigError, match="kv_connector"):
        engine(kv_connector="nixl")
    with pytest.raises(ConfigError, match="kv_port=5555 with data_parallel_size=2"):
        LLM(None, kv_connector="p2p", kv_port=5555, data_parallel_size=2)
    with pytest.raises(ConfigError, match="p2p' needs a shared secret"):
        engine(kv_connector="p2p")
    with pytest.raises(ConfigError, match="kv_allowed_producers"):
        engine(kv_connector="p2p", kv_secret=SECRET, kv_allowed_producers="localhost")


def test_p2p_under_tensor_parallelism_is_refused(tmp_path):
    # Refused with the options, before a model is looked for (this one is not there) or a
    # rank is started.
    with pytest.raises(ConfigError, match="p2p' runs with tensor_parallel_size=1 only"):
        LLM(
            str(tmp_path / "no-such-model"),
            dtype="float32",
            num_kv_blocks=64,
            kv_connector="p2p",
            kv_secret=SECRET,
            tensor_parallel_size=2,
        )


# -- storage ----------------------------------------------------------------------------------


def stored_blocks(path) -> list:
    return sorted(path.rglob("*.safetensors"))


CONSUMER_SCRIPT = """
import json, sys
from agentrt.engine.client.llm import LLM
from agentrt.engine.sampling_params import SamplingParams
llm = LLM(None, kv_cache_memory_gb=0.05, kv_connector="storage",
          kv_role="consumer", kv_storage_path=sys.argv[1])
out = llm.generate(sys.argv[2], SamplingParams(temperature=0, max_tokens=20))[0]
stats = llm.engine.stats().kv_transfer
print(json.dumps({"tokens": out.outputs[0].token_ids, "cached": out.num_cached_tokens,
                  "loaded": stats.num_loaded_tokens, "failures": stats.num_load_failures}))
"""


def test_a_second_process_reuses_the_stored_prefix(tmp_path, reference):
    producer = engine(kv_connector="storage", kv_role="producer", kv_storage_path=str(tmp_path))
    out = producer.generate(PROMPT, GREEDY)[0]
    assert out.outputs[0].token_ids == reference["plain"]
    producer.engine.shutdown()  # the writes are finished
    num_prompt = len(out.prompt_token_ids)
    # Every full block of computed tokens: the prompt and the output but the last token.
    num_full = (num_prompt + len(reference["plain"]) - 1) // 16
    assert len(stored_blocks(tmp_path)) == num_full
    assert producer.engine.stats().kv_transfer.num_saved_blocks == num_full

    run = subprocess.run(
        [sys.executable, "-c", CONSUMER_SCRIPT, str(tmp_path), PROMPT],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["tokens"] == reference["plain"]
    loadable = (num_prompt - 1) // 16 * 16  # whole blocks, the last prompt token computed
    assert result["loaded"] == result["cached"] == loadable
    assert result["failures"] == 0


def test_a_session_turn_loads_its_history_and_json_stays_exact(tmp_path, solo, reference):
    path = str(tmp_path)
    first = engine(kv_connector="storage", kv_storage_path=path)
    turn1 = first.generate(PROMPT, JSON)[0]
    assert turn1.outputs[0].token_ids == reference["json"]
    assert turn1.outputs[0].structured_errors == []
    first.engine.shutdown()

    # A new instance continues the conversation: the history (prompt and answer) loads.
    history = turn1.prompt_token_ids + turn1.outputs[0].token_ids
    second = engine(kv_connector="storage", kv_storage_path=path, enable_prefix_caching=False)
    follow_up = history + second.engine.tokenizer.encode(" Now the same for Paris:")
    out = second.generate(follow_up, JSON)[0]
    alone = solo.generate(follow_up, JSON)[0]
    assert out.outputs[0].token_ids == alone.outputs[0].token_ids
    assert out.num_cached_tokens == (len(history) - 1) // 16 * 16
    second.engine.kv_manager.check_invariants()


@pytest.mark.parametrize("damage", ["flip a byte", "truncate"])
def test_a_damaged_block_is_detected_and_computed_again(tmp_path, reference, damage):
    producer = engine(kv_connector="storage", kv_storage_path=str(tmp_path))
    producer.generate(PROMPT, GREEDY)
    producer.engine.shutdown()
    # Damage the prompt's second block (named by a MAC of its chained hash).
    prompt_ids = producer.engine.tokenizer.encode(PROMPT)
    assert len(prompt_ids) > 33  # at least two loadable blocks
    second = producer.engine.connector.path(extend_block_hashes([], prompt_ids, 16)[1])
    assert second in stored_blocks(tmp_path)
    original = second.read_bytes()
    data = bytearray(second.read_bytes())
    if damage == "flip a byte":
        data[-100] ^= 0xFF
    else:
        del data[len(data) // 2 :]
    second.write_bytes(bytes(data))

    consumer = engine(kv_connector="storage", kv_storage_path=str(tmp_path))
    out = consumer.generate(PROMPT, GREEDY)[0]
    assert out.outputs[0].token_ids == reference["plain"]
    stats = consumer.engine.stats().kv_transfer
    assert stats.num_load_failures == 1
    assert stats.num_loaded_tokens == out.num_cached_tokens == 16  # the block before it
    consumer.engine.shutdown()
    # The damaged file was replaced by the recomputed block (greedy fp32: the same bytes).
    assert second.read_bytes() == original
    consumer.engine.kv_manager.check_invariants()


@pytest.mark.slow
def test_tensor_parallel_ranks_store_and_load_their_own_heads(tmp_path):
    """Three ranks (one of the embedded model's three KV heads each, fp32): every rank stores
    its heads in its own folder; a new engine loads the prefix on every rank and decodes one
    unsharded fp32 instance's tokens; a block missing on one rank makes every rank load less."""
    other = "A short note on Paris, the capital of France, and its river, the Seine. " * 3
    alone = engine(dtype="float32", enable_prefix_caching=False)
    solo_plain, solo_other = (o.outputs[0] for o in alone.generate([PROMPT, other], GREEDY))
    del alone
    path = str(tmp_path)
    fp32 = {"dtype": "float32", "tensor_parallel_size": 3}
    writer = engine(kv_connector="storage", kv_storage_path=path, **fp32)
    try:
        first, first_other = writer.generate([PROMPT, other], GREEDY)
        assert writer.engine.runner.kv_caches[0].shape[3] == 1  # one KV head per rank
    finally:
        writer.shutdown()
    assert first.outputs[0].token_ids == solo_plain.token_ids
    assert first_other.outputs[0].token_ids == solo_other.token_ids
    folders = sorted(p for p in tmp_path.iterdir() if p.is_dir())
    assert [f.name.rsplit("-", 1)[1] for f in folders] == ["tp0of3", "tp1of3", "tp2of3"]
    names = [sorted(p.relative_to(f) for p in stored_blocks(f)) for f in folders]
    assert names[0] and names[0] == names[1] == names[2]  # the same blocks, each its heads
    num_prompt = len(first.prompt_token_ids)
    computed = [
        len(o.prompt_token_ids) + len(o.outputs[0].token_ids) - 1 for o in (first, first_other)
    ]
    assert len(names[0]) == sum(n // 16 for n in computed)  # every full block of computed tokens
    # Rank 2 loses the other prompt's second block: every rank loads one block of it.
    other_ids = first_other.prompt_token_ids
    second_block = writer.engine.connector.path(extend_block_hashes([], other_ids, 16)[1])
    (folders[2] / second_block.relative_to(folders[0])).unlink()

    reader = engine(
        kv_connector="storage", kv_storage_path=path, enable_prefix_caching=False, **fp32
    )
    try:
        # Both prompts in one batch (half the decode steps of three ranks on two cores): each
        # request's cached tokens say which one loaded what.
        out, out_other = reader.generate([PROMPT, other], GREEDY)
        stats = reader.engine.stats().kv_transfer
        reader.engine.kv_manager.check_invariants()
    finally:
        reader.shutdown()
    assert out.outputs[0].token_ids == solo_plain.token_ids
    loadable = (num_prompt - 1) // 16 * 16  # whole blocks, the last prompt token computed
    assert out.num_cached_tokens == loadable
    assert out_other.outputs[0].token_ids == solo_other.token_ids
    assert out_other.num_cached_tokens == 16
    assert stats.num_loaded_tokens == loadable + 16
    assert stats.num_load_failures == 1


# -- p2p ----------------------------------------------------------------------------------------


def p2p(role: str, **options) -> LLM:
    return engine(kv_connector="p2p", kv_role=role, kv_secret=SECRET, **options)


@pytest.fixture(scope="module")
def producer() -> LLM:
    return p2p("producer")


@pytest.fixture(scope="module")
def consumer() -> LLM:
    return p2p("consumer", kv_transfer_timeout_s=1.0)


def prefill(producer: LLM, prompt: str = PROMPT) -> dict:
    remote = SamplingParams(
        temperature=0, max_tokens=1, kv_transfer_params={"do_remote_decode": True}
    )
    out = producer.generate(prompt, remote)[0]
    assert out.kv_transfer_params is not None
    return out.kv_transfer_params


def with_params(params: SamplingParams, kv: dict) -> SamplingParams:
    return dataclasses.replace(params, kv_transfer_params=kv)


@pytest.mark.parametrize("kind", ["plain", "json"])
def test_prefill_on_one_instance_decode_on_another(producer, consumer, reference, kind):
    kv = prefill(producer)
    assert producer.engine.connector.held  # the blocks wait for the consumer
    before = consumer.engine.stats().kv_transfer
    params = with_params(GREEDY if kind == "plain" else JSON, kv)
    out = consumer.generate(PROMPT, params)[0]
    assert out.outputs[0].token_ids == reference[kind]
    stats = consumer.engine.stats().kv_transfer
    assert stats.num_loaded_tokens - before.num_loaded_tokens == kv["remote_num_tokens"]
    assert stats.num_load_failures == before.num_load_failures
    assert out.num_cached_tokens == kv["remote_num_tokens"]
    # The producer freed its blocks once they were sent (seen at its next step).
    producer.generate("Hello", SamplingParams(max_tokens=1))
    assert not producer.engine.connector.held
    for llm in (producer, consumer):
        llm.engine.kv_manager.check_invariants()
    consumer.engine.reset_prefix_cache()


def test_a_dead_producer_means_a_local_prefill(consumer, reference):
    llm = p2p("producer")
    kv = prefill(llm)
    llm.engine.shutdown()  # nothing listens at its port now
    before = consumer.engine.stats().kv_transfer.num_load_failures
    start = time.monotonic()
    out = consumer.generate(PROMPT, with_params(GREEDY, kv))[0]
    elapsed = time.monotonic() - start
    assert out.outputs[0].token_ids == reference["plain"]
    assert consumer.engine.stats().kv_transfer.num_load_failures == before + 1
    consumer.engine.kv_manager.check_invariants()
    consumer.engine.reset_prefix_cache()
    # The 1 s transfer timeout, then the prefill: no longer than a plain run plus the timeout
    # (with slack: a shared machine's runs vary).
    start = time.monotonic()
    consumer.generate(PROMPT, GREEDY)
    assert elapsed < time.monotonic() - start + 8
    consumer.engine.reset_prefix_cache()


def test_params_of_another_prompt_are_refused(producer, consumer, solo):
    kv = prefill(producer, "A different prompt, long enough to fill a block or two of KV. " * 2)
    other = "An unrelated question that is also long enough for a block or two. " * 2
    before = consumer.engine.stats().kv_transfer
    alone = solo.generate(other, GREEDY)[0]
    out = consumer.generate(other, with_params(GREEDY, kv))[0]
    assert out.outputs[0].token_ids == alone.outputs[0].token_ids
    stats = consumer.engine.stats().kv_transfer
    assert stats.num_load_failures == before.num_load_failures + 1
    assert stats.num_loaded_tokens == before.num_loaded_tokens
    consumer.engine.reset_prefix_cache()


def test_an_unfetched_prefill_is_freed_after_the_hold_timeout(reference):
    producer = p2p("producer", kv_hold_timeout_s=0.5)
    kv = prefill(producer)
    time.sleep(0.6)
    producer.generate("Hello", SamplingParams(max_tokens=1))  # a step notices the expiry
    assert not producer.engine.connector.held
    assert producer.engine.kv_manager.usage() == 0
    # A consumer that comes late is told so and computes the prefill.
    late = p2p("consumer")
    with pytest.raises(InvalidRequestError, match="expired"):  # its params are out of date
        late.generate(PROMPT, with_params(GREEDY, kv))
    assert late.engine.stats().kv_transfer.num_load_failures == 0


def test_waiting_for_kv_blocks_nobody_and_an_abort_frees_the_blocks_after_the_load(producer):
    llm = p2p("consumer", kv_transfer_timeout_s=120.0)
    # A producer that answers only when the test lets it (it holds the secret, like the test).
    silent = zmq.Context.instance().socket(zmq.ROUTER)
    silent.setsockopt(zmq.LINGER, 0)
    silent.curve_publickey, silent.curve_secretkey = curve_server_keys(SECRET)
    silent.curve_server = True
    port = silent.bind_to_random_port("tcp://127.0.0.1")
    fields = {k: v for k, v in prefill(producer).items() if k not in ("signature", "expires")}
    kv = ParamsSigner(SECRET).sign({**fields, "remote_port": port}, 60)
    core = llm.engine
    slow = core.processor.process("slow", PROMPT, with_params(GREEDY, kv))
    fast = core.processor.process("fast", "Hi!", SamplingParams(temperature=0, max_tokens=5))
    core.add_request(slow, PROMPT)
    core.step()
    assert core.scheduler.requests["slow"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    core.add_request(fast, "Hi!")
    finished = {}
    while "fast" not in finished:
        finished.update((d.request_id, d.output) for d in core.step() if d.finished)
    assert "slow" in core.connector.loading  # the other request finished meanwhile
    assert silent.poll(30_000)  # its ask is there, unanswered
    identity, _ = silent.recv_multipart()
    core.abort_requests(["slow"])
    assert core.kv_manager.usage() > 0  # a connector thread may still write its blocks
    silent.send_multipart([identity, json.dumps({"ok": False, "error": "gone"}).encode(), b""])
    while core.has_unfinished_requests():
        core.step()
    assert core.kv_manager.usage() == 0
    core.kv_manager.check_invariants()
    silent.close()
