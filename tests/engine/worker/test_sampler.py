"""Sampler: vLLM V1 semantics, checked against hand computations and brute-force references."""

from __future__ import annotations

import math

import pytest
import torch

from agentrt.engine.errors import InvalidRequestError
from agentrt.engine.sampling_params import SamplingParams
from agentrt.engine.worker.sampler import (
    TOP_P_CANDIDATES,
    Sampler,
    apply_penalties,
    apply_top_p,
    draw_inverse_cdf,
)
from agentrt.engine.worker.sampling_metadata import SamplingMetadata


def build(
    params: list[SamplingParams],
    vocab_size: int,
    *,
    prompts: list[list[int]] | None = None,
    outputs: list[list[int]] | None = None,
    blocked: list[tuple[int, ...]] | None = None,
) -> SamplingMetadata:
    num_rows = len(params)
    return SamplingMetadata.build(
        params,
        prompts or [[] for _ in range(num_rows)],
        outputs or [[] for _ in range(num_rows)],
        [torch.Generator().manual_seed(p.seed) if p.seed is not None else None for p in params],
        blocked or [() for _ in range(num_rows)],
        vocab_size,
        "cpu",
    )


def sample_many(logits_row: torch.Tensor, params: SamplingParams, n: int) -> torch.Tensor:
    """`n` independent draws of one request: the row repeated `n` times in one batch."""
    logits = logits_row.unsqueeze(0).repeat(n, 1)  # [n, V]
    metadata = build([params] * n, logits_row.shape[0])
    return Sampler()(logits, metadata).sampled_token_ids


def support(samples: torch.Tensor) -> set[int]:
    return set(samples.unique().tolist())


# A small vocabulary with known probabilities: 0.4, 0.25, 0.15, 0.1, 0.06, 0.04.
PROBS = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.06, 0.04])
LOGITS = PROBS.log()


def test_greedy_is_argmax_and_ties_take_lowest_id() -> None:
    logits = torch.randn(16, 300)
    logits[3, [7, 9, 200]] = 50.0  # a three-way tie
    expected = logits.argmax(dim=-1)
    out = Sampler()(logits.clone(), build([SamplingParams(temperature=0.0)] * 16, 300))
    assert torch.equal(out.sampled_token_ids, expected)
    assert out.sampled_token_ids[3].item() == 7
    assert out.logprobs is None


def test_seeded_row_is_reproducible_and_independent_of_batch_neighbours() -> None:
    vocab_size = 1000
    row = torch.randn(vocab_size) * 2
    seeded = SamplingParams(temperature=0.9, top_p=0.95, seed=1234)

    def run(batch: list[SamplingParams], position: int, steps: int = 12) -> list[int]:
        generators = [
            torch.Generator().manual_seed(p.seed) if p.seed is not None else None for p in batch
        ]
        tokens = []
        for step in range(steps):
            torch.manual_seed(step + 100 * len(batch))  # unseeded rows differ run to run
            logits = torch.randn(len(batch), vocab_size) * 3
            logits[position] = row
            num_rows = len(batch)
            metadata = SamplingMetadata.build(
                batch,
                [[1, 2]] * num_rows,
                [[3]] * num_rows,
                generators,
                [()] * num_rows,
                vocab_size,
                "cpu",
            )
            tokens.append(Sampler()(logits, metadata).sampled_token_ids[position].item())
        return tokens

    alone = run([seeded], 0)
    neighbours = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.7, seed=1),
        SamplingParams(temperature=1.3, top_k=5, repetition_penalty=1.3),
        SamplingParams(temperature=1.0, min_p=0.1, logprobs=3),
        seeded,
        SamplingParams(temperature=0.5, seed=99, frequency_penalty=1.0),
        SamplingParams(temperature=0.0, presence_penalty=0.5),
    ]
    assert run(neighbours, 5) == alone
    assert run([SamplingParams(temperature=1.0), seeded], 1) == alone
    assert len(set(alone)) > 1  # really random, not collapsed onto one token
    other_seed = run([SamplingParams(temperature=0.9, top_p=0.95, seed=4321)], 0)
    assert other_seed != alone


def test_temperature_sampling_matches_softmax_frequencies() -> None:
    torch.manual_seed(0)
    n = 40_000
    samples = sample_many(LOGITS, SamplingParams(temperature=0.5), n)
    expected = (LOGITS / 0.5).softmax(dim=-1)
    observed = torch.bincount(samples, minlength=6).float() / n
    assert torch.allclose(observed, expected, atol=0.01)


@pytest.mark.parametrize(
    ("params", "allowed"),
    [
        (SamplingParams(top_k=1), {0}),
        (SamplingParams(top_k=3), {0, 1, 2}),
        (SamplingParams(top_p=0.6), {0, 1}),  # 0.4 < 0.6, 0.65 >= 0.6
        (SamplingParams(top_p=0.7), {0, 1, 2}),  # 0.65 < 0.7
        (SamplingParams(top_p=0.1), {0}),  # the top token is always kept
        (SamplingParams(min_p=0.3), {0, 1, 2}),  # threshold 0.12
        (SamplingParams(min_p=0.2), {0, 1, 2, 3}),  # threshold 0.08
        (SamplingParams(top_k=4, top_p=0.7), {0, 1}),  # renormalised: 0.44, then 0.72 >= 0.7
        (SamplingParams(top_k=4, min_p=0.3), {0, 1, 2}),
        (SamplingParams(top_p=0.85, min_p=0.5), {0, 1}),  # threshold 0.2
        (SamplingParams(temperature=2.0, top_k=5), {0, 1, 2, 3, 4}),
    ],
)
def test_truncation_support_is_exactly_the_allowed_set(
    params: SamplingParams, allowed: set[int]
) -> None:
    torch.manual_seed(1)
    assert support(sample_many(LOGITS, params, 4000)) == allowed


def test_top_k_keeps_every_token_tied_with_the_kth() -> None:
    logits = torch.tensor([3.0, 1.0, 1.0, 1.0, 0.0])
    torch.manual_seed(2)
    assert support(sample_many(logits, SamplingParams(top_k=2), 4000)) == {0, 1, 2, 3}


def test_top_k_renormalises_the_kept_tokens() -> None:
    torch.manual_seed(3)
    n = 40_000
    samples = sample_many(LOGITS, SamplingParams(top_k=2), n)
    observed = torch.bincount(samples, minlength=6).float() / n
    assert observed[0].item() == pytest.approx(0.4 / 0.65, abs=0.01)
    assert observed[1].item() == pytest.approx(0.25 / 0.65, abs=0.01)


def reference_top_p(probs: torch.Tensor, top_p: float) -> set[int]:
    order = sorted(range(len(probs)), key=lambda i: -probs[i].item())
    kept, mass = set(), 0.0
    for i in order:
        kept.add(i)
        mass += probs[i].item()
        if mass >= top_p:
            break
    return kept


@pytest.mark.parametrize("scale", [0.3, 1.0, 4.0])  # 0.3: nucleus wider than the candidates
def test_top_p_matches_reference_on_candidate_and_full_sort_paths(scale: float) -> None:
    torch.manual_seed(4)
    vocab_size = 2 * TOP_P_CANDIDATES
    probs = (torch.randn(6, vocab_size) * scale).softmax(dim=-1)  # [6, V]
    top_p = torch.tensor([0.5, 0.8, 0.9, 0.95, 0.99, 1.0])
    masked = probs.clone()
    apply_top_p(masked, top_p)
    for row in range(6):
        kept = set((masked[row] > 0).nonzero().squeeze(1).tolist())
        expected = reference_top_p(probs[row], top_p[row].item())
        if top_p[row] == 1.0:
            expected = set(range(vocab_size))
        # fp32 vs Python float sums may disagree on a token sitting exactly on the boundary.
        assert len(kept ^ expected) <= 1, (row, len(kept), len(expected))
        assert torch.equal(masked[row][masked[row] > 0], probs[row][masked[row] > 0])


def test_penalties_change_logits_exactly_as_specified() -> None:
    logits = torch.tensor([[2.0, -1.0, 4.0, 0.5, -3.0, 1.0], [2.0, -1.0, 4.0, 0.5, -3.0, 1.0]])
    params = [
        SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25),
        SamplingParams(),  # untouched row
    ]
    # prompt has tokens 1, 2; output has 2 once and 3 twice.
    metadata = build(params, 6, prompts=[[1, 2], [1, 2]], outputs=[[2, 3, 3], [2, 3, 3]])
    apply_penalties(logits, metadata)
    expected_row = [
        2.0,  # never seen
        -1.0 * 2.0,  # prompt only, negative: multiplied
        4.0 / 2.0 - 0.5 * 1 - 0.25,  # prompt + output once, positive: divided
        0.5 / 2.0 - 0.5 * 2 - 0.25,  # output twice
        -3.0,
        1.0,
    ]
    assert logits[0].tolist() == pytest.approx(expected_row)
    assert logits[1].tolist() == [2.0, -1.0, 4.0, 0.5, -3.0, 1.0]


def test_penalties_flip_greedy_choice() -> None:
    logits = torch.tensor([[5.0, 4.9, 0.0]])
    metadata = build([SamplingParams(temperature=0.0, presence_penalty=0.5)], 3, outputs=[[0]])
    assert Sampler()(logits, metadata).sampled_token_ids.tolist() == [1]


def test_logit_bias_is_added_and_steers_sampling() -> None:
    logits = torch.zeros(2, 10)
    logits[:, 0] = 5.0
    params = [
        SamplingParams(temperature=0.0, logit_bias={7: 6.0, 0: -1.5}),
        SamplingParams(temperature=0.0, logit_bias={3: 4.0}),
    ]
    out = Sampler()(logits, build(params, 10))
    assert out.sampled_token_ids.tolist() == [7, 0]  # 6 > 3.5; 4 < 5
    assert logits[0, 7].item() == 6.0 and logits[0, 0].item() == 3.5  # modified in place


def test_blocked_ids_are_never_sampled() -> None:
    torch.manual_seed(5)
    blocked = (0, 1, 4)
    n = 3000
    logits = LOGITS.unsqueeze(0).repeat(n, 1)
    params = [SamplingParams(temperature=1.5)] * (n - 1) + [SamplingParams(temperature=0.0)]
    metadata = build(params, 6, blocked=[blocked] * n)
    sampled = Sampler()(logits, metadata).sampled_token_ids
    assert support(sampled[:-1]) == {2, 3, 5}
    assert sampled[-1].item() == 2  # greedy takes the best unblocked token


def test_logprobs_are_raw_log_softmax_with_top_ids_and_ranks() -> None:
    torch.manual_seed(6)
    logits = torch.randn(4, 50)
    raw = logits.log_softmax(dim=-1)
    order = raw.argsort(dim=-1, descending=True)
    params = [
        SamplingParams(temperature=0.0, logprobs=5),
        SamplingParams(temperature=0.0, logprobs=2, logit_bias={int(order[1, 2]): 100.0}),
        SamplingParams(temperature=0.0, repetition_penalty=1.5),  # no logprobs requested
        SamplingParams(temperature=0.8, logprobs=0, seed=3),
    ]
    out = Sampler()(logits.clone(), build(params, 50, outputs=[[], [], [1], []]))
    lp = out.logprobs
    assert lp is not None
    assert lp.token_ids.shape == (4, 6) and lp.logprobs.shape == (4, 6)
    sampled = out.sampled_token_ids
    assert torch.equal(lp.token_ids[:, 0], sampled)
    assert torch.allclose(lp.logprobs[:, 0], raw.gather(1, sampled.unsqueeze(1)).squeeze(1))
    assert torch.equal(lp.token_ids[:, 1:], order[:, :5])
    assert torch.allclose(lp.logprobs[:, 1:], raw.gather(1, order[:, :5]))
    assert sampled[1].item() == order[1, 2].item()  # bias changed the choice, not logprobs
    expected_ranks = (raw > raw.gather(1, sampled.unsqueeze(1))).sum(dim=-1) + 1
    assert lp.ranks.tolist() == expected_ranks.tolist()
    assert lp.ranks[0].item() == 1 and lp.ranks[1].item() == 3


def test_mixed_batch_greedy_rows_exact_random_rows_vary() -> None:
    torch.manual_seed(7)
    n = 400
    logits = LOGITS.unsqueeze(0).repeat(n, 1)
    params = [SamplingParams(temperature=0.0 if i % 2 else 1.0) for i in range(n)]
    sampled = Sampler()(logits, build(params, 6)).sampled_token_ids
    assert support(sampled[1::2]) == {0}
    assert support(sampled[0::2]) == set(range(6))


def test_padded_vocab_columns_are_never_sampled_and_bf16_is_accepted() -> None:
    torch.manual_seed(8)
    logits = torch.zeros(2000, 8, dtype=torch.bfloat16)
    logits[:, 6:] = 20.0  # padding beyond vocab_size=6 would win if not masked
    out = Sampler()(logits, build([SamplingParams(logprobs=1)] * 2000, 6))
    assert support(out.sampled_token_ids) == set(range(6))
    assert out.logprobs is not None
    assert torch.allclose(out.logprobs.logprobs[:, 0], torch.full((2000,), -math.log(6)))


def test_out_of_vocab_token_ids_raise_typed_errors() -> None:
    with pytest.raises(InvalidRequestError, match="logit_bias"):
        build([SamplingParams(logit_bias={10: 1.0})], 10)
    with pytest.raises(InvalidRequestError, match="blocked_token_ids"):
        build([SamplingParams()], 10, blocked=[(11,)])
    with pytest.raises(InvalidRequestError, match="output_token_ids"):
        build([SamplingParams(frequency_penalty=1.0)], 10, outputs=[[3, 12]])


def test_metadata_skips_unused_stages() -> None:
    metadata = build([SamplingParams(temperature=0.0), SamplingParams(temperature=1e-6)], 100)
    assert metadata.all_greedy and not metadata.all_random
    assert metadata.top_k is None and metadata.top_p is None and metadata.min_p is None
    assert metadata.repetition is None and metadata.output_penalty is None
    assert metadata.max_num_logprobs is None and metadata.generators == {}
    # A greedy row's top_k / seed does not turn on truncation or per-row draws.
    metadata = build([SamplingParams(temperature=0.0, top_k=5, seed=1)], 100)
    assert metadata.top_k is None and metadata.generators == {}


def test_inverse_cdf_draw_never_returns_zero_probability_tokens() -> None:
    probs = torch.tensor([[0.0, 0.3, 0.0, 0.7, 0.0, 0.0]] * 4)  # unnormalised is fine too
    uniform = torch.tensor([[0.0], [0.2999], [0.3001], [1.0]])  # 1.0: rounding at the top end
    assert draw_inverse_cdf(probs, uniform).tolist() == [1, 1, 3, 3]
    assert draw_inverse_cdf(probs * 5, uniform).tolist() == [1, 1, 3, 3]
