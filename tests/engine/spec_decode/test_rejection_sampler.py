"""Rejection sampler: greedy semantics exactly, and the target distribution preserved.

Distribution tests: a chi-square goodness-of-fit test at significance ALPHA = 0.001 on
N_TRIALS = 20,000 draws with a fixed seed, over the tokens the target gives nonzero
probability (a zero-probability token must never appear at all). Each trial is one request
of the batch, so one call covers all trials.
"""

from __future__ import annotations

import math

import pytest
import torch

from agentrt.engine.spec_decode.rejection_sampler import rejection_sample

ALPHA = 0.001
N_TRIALS = 20_000
# Chi-square critical values at ALPHA = 0.001 by degrees of freedom (scipy.stats.chi2.ppf(0.999,
# df); scipy is not a dependency).
CHI2_CRITICAL = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515}

# Target distributions of a 2-draft request over V = 6 tokens: rows p0, p1 (the draft
# positions) and p2 (the bonus). Token 2 is impossible at position 0, token 0 at position 1.
TARGET = torch.tensor(
    [
        [0.10, 0.30, 0.00, 0.25, 0.20, 0.15],
        [0.00, 0.05, 0.40, 0.15, 0.10, 0.30],
        [0.20, 0.20, 0.10, 0.10, 0.20, 0.20],
    ]
)
V = TARGET.shape[1]


def assert_matches(tokens: list[int], target: torch.Tensor) -> None:
    """`tokens` look drawn from `target` (a normalised `[V]` row) at significance ALPHA."""
    counts = torch.bincount(torch.tensor(tokens), minlength=V).double()
    support = target > 0
    assert counts[~support].sum() == 0, f"drew impossible tokens: {counts.tolist()}"
    expected = target[support].double() * len(tokens)
    assert expected.min() >= 5, "too few draws for a chi-square test"
    statistic = float(((counts[support] - expected) ** 2 / expected).sum())
    df = int(support.sum()) - 1
    assert statistic < CHI2_CRITICAL[df], (
        f"chi2={statistic:.2f} >= {CHI2_CRITICAL[df]} (df={df}): counts {counts.tolist()}, "
        f"expected {expected.tolist()}"
    )


def trial_probs(generator: torch.Generator) -> torch.Tensor:
    """`[3 * N_TRIALS, V]`: TARGET per trial, each row scaled by a random factor (rows need not
    be normalised)."""
    scale = torch.rand(3 * N_TRIALS, 1, generator=generator) * 4 + 0.5
    return TARGET.repeat(N_TRIALS, 1) * scale


def run_trials(draft_probs: torch.Tensor | None, seed: int) -> list[list[int]]:
    """N_TRIALS random requests of 2 drafts each; drafts drawn from `draft_probs`
    `[N_TRIALS, 2, V]`, or uniformly at random and verified as one-hot drafts when None."""
    generator = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)  # the unseeded requests' uniforms
    probs = trial_probs(generator)
    if draft_probs is None:
        drafts = torch.randint(0, V, (N_TRIALS, 2), generator=generator)
        q_list = [None] * N_TRIALS
    else:
        drafts = torch.multinomial(draft_probs.view(-1, V), 1, generator=generator)
        drafts = drafts.view(N_TRIALS, 2)
        q_list = list(draft_probs)
    return rejection_sample(
        probs,
        probs.argmax(dim=-1),
        drafts.tolist(),
        [False] * N_TRIALS,
        q_list,
        [None] * N_TRIALS,
    )


def random_draft_probs(seed: int) -> torch.Tensor:
    """`[N_TRIALS, 2, V]`: a different random draft distribution per trial and position,
    unnormalised, giving mass to the tokens the target excludes."""
    generator = torch.Generator().manual_seed(seed)
    return torch.rand(N_TRIALS, 2, V, generator=generator) ** 3 * 5


@pytest.mark.parametrize("drafts", ["one_hot", "model"])
def test_first_token_follows_the_target(drafts):
    q = None if drafts == "one_hot" else random_draft_probs(1)
    outputs = run_trials(q, seed=0)
    assert all(1 <= len(out) <= 3 for out in outputs)
    assert_matches([out[0] for out in outputs], TARGET[0])


@pytest.mark.parametrize("drafts", ["one_hot", "model"])
def test_second_token_given_the_first_draft_held(drafts):
    # A second token exists exactly when draft 0 was accepted; given that, it is drawn from
    # p1 (the row that saw draft 0), however draft 1 fares.
    q = None if drafts == "one_hot" else random_draft_probs(2)
    outputs = run_trials(q, seed=3)
    second = [out[1] for out in outputs if len(out) >= 2]
    assert len(second) > N_TRIALS // 8
    assert_matches(second, TARGET[1])


def test_acceptance_rate_is_the_overlap_of_p_and_q():
    # For a model draft, P(accept draft 0) = sum_x min(p0(x), q0(x)); for a one-hot draft d,
    # p0(d). 20k trials put the rate within ~0.01 (4 sigma).
    q0 = torch.tensor([0.5, 0.1, 0.2, 0.1, 0.05, 0.05])
    q = torch.stack([q0, TARGET[1]]).expand(N_TRIALS, 2, V)
    outputs = run_trials(q.contiguous(), seed=4)
    rate = sum(len(out) >= 2 for out in outputs) / N_TRIALS
    expected = float(torch.minimum(TARGET[0], q0).sum())  # 0.55
    assert abs(rate - expected) < 4 * math.sqrt(expected * (1 - expected) / N_TRIALS)


def test_greedy_accepts_while_the_draft_is_the_argmax():
    argmax = torch.tensor([5, 1, 3, 0, 5, 1, 4, 7, 2, 9, 8])
    probs = torch.full((11, 10), float("nan"))  # greedy rows are never read
    outputs = rejection_sample(
        probs,
        argmax,
        [[5, 1, 2], [5, 1], [], [3, 9]],
        [True] * 4,
        [None] * 4,
        [None] * 4,
    )
    assert outputs == [
        [5, 1, 3],  # third draft != argmax 3: replaced by it
        [5, 1, 4],  # both held: the bonus argmax follows
        [7],  # no drafts: the argmax
        [2],  # first draft rejected
    ]


def test_certain_and_impossible_drafts():
    # p(d) = 1: always accepted; p(d) = 0: always rejected and never emitted.
    certain = torch.tensor([0.0, 1.0, 0.0, 0.0])
    impossible = torch.tensor([0.5, 0.0, 0.5, 0.0])
    for _ in range(50):
        probs = torch.stack([certain, certain, impossible, certain])
        out = rejection_sample(
            probs,
            probs.argmax(dim=-1),
            [[1, 1, 1]],
            [False],
            [torch.tensor([[0.1, 0.9, 0.0, 0.0]] * 3)],
            [None],
        )
        assert out[0][:2] == [1, 1] and out[0][2] in (0, 2) and len(out[0]) == 3


def test_mixed_batch_and_seeded_requests_are_independent_of_the_batch():
    v = 8
    probs_row = torch.softmax(torch.randn(v, generator=torch.Generator().manual_seed(0)), 0)

    def seeded_alone(seed: int) -> list[int]:
        probs = probs_row.repeat(4, 1)
        out = rejection_sample(
            probs,
            probs.argmax(dim=-1),
            [[3, 1, 4]],
            [False],
            [None],
            [torch.Generator().manual_seed(seed)],
        )
        return out[0]

    def seeded_in_batch(seed: int) -> list[int]:
        torch.manual_seed(seed + 100)
        greedy_probs = torch.full((3, v), float("nan"))
        probs = torch.cat([greedy_probs, probs_row.repeat(4, 1), probs_row.repeat(2, 1)])
        argmax = torch.cat([torch.tensor([6, 6, 2]), probs.argmax(dim=-1)[3:]])
        out = rejection_sample(
            probs,
            argmax,
            [[6, 6], [3, 1, 4], [0]],
            [True, False, False],
            [None, None, None],
            [None, torch.Generator().manual_seed(seed), None],
        )
        assert out[0] == [6, 6, 2]
        return out[1]

    results = [seeded_alone(seed) for seed in range(20)]
    assert results == [seeded_in_batch(seed) for seed in range(20)]
    assert len({tuple(r) for r in results}) > 1  # the seed matters


def test_forced_drafts_are_accepted_with_the_drafts_before_them():
    """Forced drafts (tokens jump-forward would append unsampled) hold whenever every draft
    before them holds, whatever the model prefers there; the drafts after them are verified
    as usual."""
    vocab = 10
    argmax = torch.tensor([1, 2, 5, 5, 3,  1, 4, 5, 0,  1, 5, 3, 0, 9])  # fmt: skip
    # request 2 is wrong at its first draft; request 3 at its last, after a forced one
    drafts = [[1, 2, 3, 4], [0, 5, 5], [1, 2, 3, 4]]
    forced = [[False, False, True, True], [False, True, True], [False, True]]
    for probs in (None, torch.rand(14, vocab)):
        out = rejection_sample(
            probs, argmax, drafts, [True] * 3, [None] * 3, [None] * 3, forced=forced
        )
        assert out == [[1, 2, 3, 4, 3], [1], [1, 2, 3, 0]]
