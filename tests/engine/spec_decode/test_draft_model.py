"""DraftModelProposer on tiny random models sharing the SmolLM2 vocabulary (a Llama target, a
Llama or Qwen3 draft) and on the embedded model as its own draft: the drafts are the draft
model's greedy continuation (HF transformers as the reference), one batch gives what each
request gives alone, the draft KV it keeps across calls is exactly as valid as it believes
(after partial acceptance the next proposal equals a fresh proposer's and recomputes only
from the first rejected draft; preemption and a finished request start over), it writes no
block outside the requests' tables, stays within max_model_len, and refuses a draft model
with another vocabulary."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from agentrt.engine.args import EngineArgs
from agentrt.engine.config import SpeculativeConfig
from agentrt.engine.errors import ConfigError
from agentrt.engine.loader.checkpoint import load_hf_config
from agentrt.engine.model.arch import ModelArchConfig
from agentrt.engine.records import ScheduledChunk
from agentrt.engine.spec_decode.base import DraftContext
from agentrt.engine.spec_decode.draft_model import DraftModelProposer, resolve_draft_model
from agentrt.engine.worker.model_runner import kv_block_bytes
from tests.engine.conftest import hf_greedy

CPU = torch.device("cpu")
BS = 8
NUM_BLOCKS = 64
K = 4
PROMPT = [(7 * i + 3) % 1000 + 100 for i in range(21)]  # 21 tokens: blocks of 8, 8 and 5
SHORT_PROMPT = [(13 * i + 5) % 900 + 200 for i in range(9)]
# Distinct block ids per request, out of order on purpose (8 blocks: 64 slots each).
BLOCKS = {"a": [9, 2, 30, 5, 41, 17, 3, 22], "b": [11, 40, 7, 28, 1, 36, 19, 50]}


def arch_of(path: Path) -> ModelArchConfig:
    return ModelArchConfig.from_hf_dict(load_hf_config(path))


def make_proposer(
    draft: Path, target: Path | None = None, *, max_model_len: int = 256, backend: str = "auto"
) -> DraftModelProposer:
    config = EngineArgs(
        str(target or draft),
        dtype="float32",
        block_size=BS,
        num_kv_blocks=NUM_BLOCKS,
        max_model_len=max_model_len,
        attention_backend=backend,
        speculative_config={"method": "draft_model", "model": str(draft)},
    ).create_engine_config()
    return DraftModelProposer(config.draft_model, config.cache, CPU)


def context(req_id: str, token_ids: list[int], num_preemptions: int = 0, blocks=None):
    return DraftContext(
        req_id,
        token_ids,
        num_prompt_tokens=len(token_ids),
        cache_key=None,
        block_ids=BLOCKS[req_id] if blocks is None else blocks,
        num_preemptions=num_preemptions,
    )


def record_passes(proposer: DraftModelProposer) -> list[list[ScheduledChunk]]:
    """The chunks of every forward pass the proposer runs from now on."""
    passes: list[list[ScheduledChunk]] = []
    execute = proposer.runner.execute

    def spy(scheduler_output):
        passes.append(list(scheduler_output.chunks))
        return execute(scheduler_output)

    proposer.runner.execute = spy
    return passes


@pytest.fixture(scope="module")
def llama(tiny_checkpoint) -> Path:
    return tiny_checkpoint("llama")


@pytest.fixture(scope="module")
def qwen3(tiny_checkpoint) -> Path:
    return tiny_checkpoint("qwen3")


def hf_model(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


# --- the drafts are the draft model's greedy continuation ------------------------------------


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("draft_arch", ["llama", "qwen3"])
def test_drafts_are_the_draft_models_greedy_continuation(tiny_checkpoint, draft_arch, backend):
    """A Llama target drafted for by itself or by a Qwen3 of the same vocabulary."""
    draft = tiny_checkpoint(draft_arch)
    proposer = make_proposer(draft, tiny_checkpoint("llama"), backend=backend)
    assert proposer.method == "draft_model"
    assert proposer.runner.attention.name == backend
    drafts = proposer.propose([context("a", PROMPT), context("b", SHORT_PROMPT)], [K, K])
    hf = hf_model(draft)
    assert drafts == [hf_greedy(hf, PROMPT, K), hf_greedy(hf, SHORT_PROMPT, K)]


def test_the_embedded_model_drafts_its_own_greedy_continuation(smollm2_dir, hf_smollm2):
    from agentrt.engine.loader.tokenizer import load_tokenizer

    prompt = load_tokenizer(smollm2_dir).encode("The history of Rome begins with")
    proposer = make_proposer(smollm2_dir)
    drafts = proposer.propose([context("a", prompt)], [K])
    assert drafts == [hf_greedy(hf_smollm2, prompt, K)]


# --- batching ----------------------------------------------------------------------------------


def test_a_batch_drafts_what_each_request_drafts_alone(llama, qwen3):
    """Different lengths and draft counts in one batch, plus a request asking for none: it
    gets [] and no work; the others drop out of the passes once they have their drafts."""
    proposer = make_proposer(qwen3, llama)
    passes = record_passes(proposer)
    ctxs = [context("a", PROMPT), context("b", SHORT_PROMPT), context("c", [1, 2, 3], blocks=[4])]
    batched = proposer.propose(ctxs, [K, 2, 0])
    alone_a = make_proposer(qwen3, llama).propose([context("a", PROMPT)], [K])[0]
    alone_b = make_proposer(qwen3, llama).propose([context("b", SHORT_PROMPT)], [2])[0]
    assert batched == [alone_a, alone_b, []]
    assert [[c.req_id for c in p] for p in passes] == [["a", "b"], ["a", "b"], ["a"], ["a"]]
    first = {c.req_id: c for c in passes[0]}
    assert first["a"].token_ids == PROMPT and first["a"].start_pos == 0
    assert first["b"].token_ids == SHORT_PROMPT and first["b"].start_pos == 0
    # Each later pass feeds the previous draft at the next position.
    assert [(c.token_ids, c.start_pos) for c in passes[1]] == [
        ([alone_a[0]], len(PROMPT)),
        ([alone_b[0]], len(SHORT_PROMPT)),
    ]
    assert [(c.token_ids, c.start_pos) for c in passes[3]] == [([alone_a[2]], len(PROMPT) + 2)]


def test_the_draft_kv_is_written_into_the_requests_blocks_only(llama, qwen3):
    proposer = make_proposer(qwen3, llama)
    proposer.propose([context("a", PROMPT), context("b", SHORT_PROMPT)], [K, 2])
    # Slots written: a's positions 0 .. 21 + 4 - 2 (blocks 0-2 of its table), b's 0 .. 9.
    used = set(BLOCKS["a"][:3]) | set(BLOCKS["b"][:2])
    for layer in proposer.runner.kv_caches:  # (num_blocks, 2, BS, kv_heads, head_dim)
        written = {b for b in range(NUM_BLOCKS) if layer[b].abs().sum() > 0}
        assert written == used


def test_no_drafts_past_the_draft_models_max_model_len(llama):
    proposer = make_proposer(llama, max_model_len=24)
    passes = record_passes(proposer)
    unlimited = make_proposer(llama).propose([context("a", PROMPT)], [K])[0]
    # 21 tokens + 3 drafts fill the 24 positions; 24 tokens leave no room at all.
    assert proposer.propose([context("a", PROMPT)], [K]) == [unlimited[:3]]
    assert proposer.propose([context("b", SHORT_PROMPT * 3)], [K]) == [[]]
    assert len(passes) == 3  # the second call ran nothing


# --- draft KV kept across calls ----------------------------------------------------------------


@pytest.mark.parametrize("num_accepted", [0, 2, K])
def test_after_partial_acceptance_the_next_drafts_equal_a_fresh_proposers(
    llama, qwen3, num_accepted
):
    """The target accepts `num_accepted` drafts and adds its own token (a correction, or the
    bonus token when all were accepted). The proposer recomputes from the first position
    whose draft KV is stale (the first rejected draft, or the last draft, never fed) and
    drafts what a proposer that never saw the request drafts."""
    proposer = make_proposer(qwen3, llama)
    drafts = proposer.propose([context("a", PROMPT)], [K])[0]
    if num_accepted < K:
        target_token = (drafts[num_accepted] + 1) % 1000 + 100  # not the draft
    else:
        target_token = 777  # the bonus token
    tokens = PROMPT + drafts[:num_accepted] + [target_token]
    passes = record_passes(proposer)
    incremental = proposer.propose([context("a", tokens)], [K])
    assert incremental == make_proposer(qwen3, llama).propose([context("a", tokens)], [K])
    valid = len(PROMPT) + min(num_accepted, K - 1)
    assert passes[0][0].start_pos == valid and passes[0][0].token_ids == tokens[valid:]

    # One more round: all drafts rejected this time; only the new token is fed after them.
    tokens2 = tokens + [(incremental[0][0] + 1) % 1000 + 100]
    passes.clear()
    fresh = make_proposer(qwen3, llama).propose([context("a", tokens2)], [K])
    assert proposer.propose([context("a", tokens2)], [K]) == fresh
    assert passes[0][0].start_pos == len(tokens)


def test_target_tokens_after_the_drafts_invalidate_from_the_first_mismatch(llama, qwen3):
    """The grammar cut the drafts after d0, the target then disagreed with d1 (which the
    proposer had fed), and a step without drafting appended one more token: the stale KV
    begins at the first mismatch, not at the last token."""
    proposer = make_proposer(qwen3, llama)
    drafts = proposer.propose([context("a", PROMPT)], [K])[0]
    tokens = PROMPT + [drafts[0], (drafts[1] + 1) % 1000 + 100, drafts[2]]
    passes = record_passes(proposer)
    fresh = make_proposer(qwen3, llama).propose([context("a", tokens)], [K])
    assert proposer.propose([context("a", tokens)], [K]) == fresh
    assert passes[0][0].start_pos == len(PROMPT) + 1


def test_a_preempted_request_starts_over_in_its_new_blocks(llama, qwen3):
    """Preemption dropped the blocks: the new ones hold someone else's KV, which must not be
    read as this request's."""
    proposer = make_proposer(qwen3, llama)
    drafts = proposer.propose([context("a", PROMPT)], [K])[0]
    tokens = PROMPT + drafts[:2]
    new_blocks = BLOCKS["b"]
    for layer in proposer.runner.kv_caches:  # stale, unrelated KV in the new blocks
        layer[new_blocks] = torch.randn_like(layer[new_blocks])
    passes = record_passes(proposer)
    resumed = proposer.propose([context("a", tokens, num_preemptions=1, blocks=new_blocks)], [K])
    fresh = make_proposer(qwen3, llama).propose([context("a", tokens, blocks=new_blocks)], [K])
    assert resumed == fresh
    assert passes[0][0].start_pos == 0 and passes[0][0].token_ids == tokens


def test_a_finished_request_is_forgotten(llama):
    """A new request may reuse a finished one's id: it starts from position 0."""
    proposer = make_proposer(llama)
    proposer.propose([context("a", PROMPT)], [K])
    proposer.request_finished(context("a", PROMPT), completed=True)
    passes = record_passes(proposer)
    proposer.propose([context("a", PROMPT)], [K])
    assert passes[0][0].start_pos == 0
    proposer.request_finished(context("b", PROMPT), completed=False)  # unknown: ignored


def test_max_tokens_zero_keeps_the_draft_kv_state(llama):
    proposer = make_proposer(llama)
    drafts = proposer.propose([context("a", PROMPT)], [K])[0]
    passes = record_passes(proposer)
    assert proposer.propose([context("a", PROMPT + drafts[:1])], [0]) == [[]]
    assert passes == []
    corrected = PROMPT + drafts[:2] + [(drafts[2] + 1) % 1000 + 100]
    proposer.propose([context("a", corrected)], [K])
    assert passes[0][0].start_pos == len(PROMPT) + 2  # the fed drafts still count


def test_tokens_that_all_have_draft_kv_still_feed_the_last_one(llama):
    """Its logits give the first draft (writing the same KV again)."""
    proposer = make_proposer(llama)
    drafts = proposer.propose([context("a", PROMPT)], [K])[0]
    passes = record_passes(proposer)
    again = proposer.propose([context("a", PROMPT + drafts[:2])], [K])
    assert again == make_proposer(llama).propose([context("a", PROMPT + drafts[:2])], [K])
    assert again[0][:2] == drafts[2:]
    assert passes[0][0].start_pos == len(PROMPT) + 1


# --- construction ------------------------------------------------------------------------------


def test_kv_block_bytes_are_the_draft_models(llama, qwen3):
    proposer = make_proposer(qwen3, llama)
    # qwen3: 2 layers, 2 KV heads of 32 (llama's are 16 wide).
    assert proposer.kv_block_bytes == kv_block_bytes(arch_of(qwen3), BS, torch.float32)
    assert proposer.kv_block_bytes == 2 * BS * 2 * 32 * 4 * 2
    config = SpeculativeConfig(method="draft_model", model=str(qwen3))
    target = EngineArgs(str(llama), dtype="float32").create_engine_config().model
    draft = resolve_draft_model(config, target)
    assert draft.arch == arch_of(qwen3) and draft.path == qwen3.resolve()
    assert (draft.dtype, draft.quantization) == (torch.float32, "none")
    assert proposer.max_model_len == 256


def test_a_draft_model_with_another_vocabulary_is_refused(llama, qwen3):
    target = EngineArgs(str(llama), dtype="float32").create_engine_config().model
    target = dataclasses.replace(target, arch=dataclasses.replace(target.arch, vocab_size=32000))
    config = SpeculativeConfig(method="draft_model", model=str(qwen3))
    with pytest.raises(ConfigError, match=r"vocab_size 49152, but the target model's is 32000"):
        resolve_draft_model(config, target)
