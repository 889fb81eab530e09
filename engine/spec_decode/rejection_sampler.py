"""Rejection sampling: verify draft tokens against the model so the output keeps exactly the
model's distribution (Leviathan et al. 2023, Chen et al. 2023; vLLM V1's rejection sampler).

Layout (one spec, read by the sampler and the tests): request i drafted `k_i` tokens and owns
`k_i + 1` consecutive rows of the step's target rows, in request order. Row `start_i + j`
(j < k_i) is the model's distribution for the position of draft j (it saw drafts 0..j-1);
row `start_i + k_i` is the bonus position after the last draft.

- Greedy request: accept draft j while it equals the row's argmax; the first mismatch is
  replaced by the argmax, or, when all drafts hold, the bonus row's argmax is appended.
- Random request: accept draft j with probability `min(1, p_j(d) / q_j(d))`, where q is the
  draft distribution it was drawn from (one-hot when the proposer is deterministic: n-gram,
  suffix, grammar; then the ratio is just `p_j(d)`). At the first rejection the token is
  drawn from the residual `normalise(max(p_j - q_j, 0))` (one-hot q: `p_j` with d zeroed),
  and the rest of the drafts are dropped; when all drafts hold, the bonus is drawn from
  `p_{k}`. Each emitted token is then distributed exactly as the model would have sampled it.

Every request emits its accepted drafts plus exactly one more token. A seeded request draws
all `k_i + 1` of its uniforms from its own generator, in row order, whatever it accepts, so
its output does not depend on the rest of the batch.
"""

from __future__ import annotations

from itertools import chain

import torch

from agentrt.engine.worker.sampler import draw_inverse_cdf


def rejection_sample(
    probs: torch.Tensor | None,
    argmax: torch.Tensor,
    draft_token_ids: list[list[int]],
    greedy: list[bool],
    draft_probs: list[torch.Tensor | None],
    generators: list[torch.Generator | None],
    forced: list[list[bool]] | None = None,
) -> list[list[int]]:
    """Per request, the accepted drafts followed by one more token (see the module docstring).

    `probs` `[N, V]` float32: the model's processed distribution per row (after temperature,
    top-k, top-p, min-p and the grammar mask); rows need not be normalised, and greedy
    requests' rows are never read (they may be garbage); None when every request is greedy. `argmax` `[N]`: argmax of the
    processed logits, used for greedy requests only. `N = sum(k_i + 1)`.
    `draft_probs[i]` `[k_i, V]`: the distribution each draft was drawn from (need not be
    normalised, on `probs`' device), or None for one-hot drafts. `generators[i]`: the
    request's own generator when it is seeded, else None (torch's default generator).
    `forced[i][j]`: draft j of request i is a token its grammar forces after the drafts before
    it (jump-forward's): it holds whenever they all do (a shorter list: the rest are not).
    Does not modify its inputs.
    """
    num_reqs = len(draft_token_ids)
    assert len(greedy) == len(draft_probs) == len(generators) == num_reqs
    num_drafts = [len(d) for d in draft_token_ids]
    starts = [0]
    for k in num_drafts:
        starts.append(starts[-1] + k + 1)
    num_rows = starts[-1]
    assert argmax.shape == (num_rows,)
    if probs is None:  # every request is greedy: accept while the draft is the argmax
        assert all(greedy)
        best = argmax.tolist()
        accepted = [
            token_id == best[starts[i] + j]
            for i, draft in enumerate(draft_token_ids)
            for j, token_id in enumerate(draft)
        ]
        num_accepted = _count_accepted(accepted, num_drafts, forced)
        return [
            draft[:n] + [best[start + n]]
            for draft, n, start in zip(draft_token_ids, num_accepted, starts[:-1], strict=True)
        ]
    assert probs.shape[0] == num_rows
    device = probs.device

    # One uniform per row, aligned with the rows: uniform[start_i + j] decides draft j, and
    # uniform[start_i + k_i] draws the request's last token.
    uniform = torch.rand(num_rows, device=device)
    for i, generator in enumerate(generators):
        if generator is not None and not greedy[i]:
            drawn = torch.rand(num_drafts[i] + 1, generator=generator, device=generator.device)
            uniform[starts[i] : starts[i + 1]] = drawn.to(device)

    # Accept or reject every draft at once: a draft row is any row but a request's last.
    draft_rows = torch.tensor(
        [starts[i] + j for i in range(num_reqs) for j in range(num_drafts[i])],
        dtype=torch.long,
        device=device,
    )  # [D]
    drafts = torch.tensor(list(chain.from_iterable(draft_token_ids)), dtype=torch.long)
    drafts = drafts.to(device)  # [D]
    draft_greedy = torch.tensor(
        [greedy[i] for i in range(num_reqs) for _ in range(num_drafts[i])],
        dtype=torch.bool,
        device=device,
    )  # [D]
    # q(d) and the row total of q per draft (1 and 1 for one-hot drafts).
    q_draft = torch.ones(len(drafts), device=device)  # [D]
    q_total = torch.ones(len(drafts), device=device)  # [D]
    offset = 0
    for i, q in enumerate(draft_probs):
        k = num_drafts[i]
        if q is not None and not greedy[i]:
            assert q.shape[0] == k
            q_draft[offset : offset + k] = q.gather(1, drafts[offset : offset + k, None])[:, 0]
            q_total[offset : offset + k] = q.sum(dim=-1)
        offset += k
    row_totals = probs.sum(dim=-1)  # [N]
    p_draft = probs[draft_rows, drafts]  # [D]
    # u < (p(d) / p_total) / (q(d) / q_total), without dividing by a zero q(d).
    random_ok = uniform[draft_rows] * q_draft * row_totals[draft_rows] < p_draft * q_total
    greedy_ok = argmax[draft_rows] == drafts
    accepted = torch.where(draft_greedy, greedy_ok, random_ok).tolist()  # one sync

    # Per request: how many drafts hold, and the row its last token comes from.
    num_accepted = _count_accepted(accepted, num_drafts, forced)
    final_rows = [starts[i] + num_accepted[i] for i in range(num_reqs)]
    last_tokens = argmax[torch.tensor(final_rows, dtype=torch.long, device=device)]  # [R]

    random_reqs = [i for i in range(num_reqs) if not greedy[i]]
    if random_reqs:
        rows = torch.tensor([final_rows[i] for i in random_reqs], dtype=torch.long, device=device)
        residual = probs[rows]  # [S, V], a copy
        # Where a draft was rejected, take its q out of p: zero d for a one-hot q, else
        # max(p - q, 0) on the normalised rows.
        one_hot, model, model_q = [], [], []
        for s, i in enumerate(random_reqs):
            n = num_accepted[i]
            if n == num_drafts[i]:
                continue  # all drafts held: the bonus comes from p_k itself
            if draft_probs[i] is None:
                one_hot.append((s, draft_token_ids[i][n]))
            else:
                model.append(s)
                model_q.append(draft_probs[i][n])
        if one_hot:
            index = torch.tensor(one_hot, dtype=torch.long, device=device)  # [H, 2]
            residual[index[:, 0], index[:, 1]] = 0.0
        if model:
            index = torch.tensor(model, dtype=torch.long, device=device)  # [M]
            q = torch.stack(model_q)  # [M, V]
            p = residual[index] / row_totals[rows[index], None]
            residual[index] = (p - q / q.sum(dim=-1, keepdim=True)).clamp_(min=0.0)
        # A rejection only happens where p(d) < q(d), so the residual has mass; should fp32
        # rounding leave none, p itself is the closest exact answer.
        has_mass = residual.sum(dim=-1, keepdim=True) > 0  # [S, 1]
        residual = torch.where(has_mass, residual, probs[rows])
        last_uniform = uniform[[starts[i + 1] - 1 for i in random_reqs]]  # [S]
        drawn = draw_inverse_cdf(residual, last_uniform[:, None])
        last_tokens[torch.tensor(random_reqs, dtype=torch.long, device=device)] = drawn

    last = last_tokens.tolist()  # one sync
    return [draft_token_ids[i][: num_accepted[i]] + [last[i]] for i in range(num_reqs)]


def _count_accepted(
    accepted: list[bool], num_drafts: list[int], forced: list[list[bool]] | None
) -> list[int]:
    """Per request, how many drafts hold in a row: `accepted` has one verdict per draft,
    requests one after the other; a forced draft holds whenever the drafts before it do."""
    counts, offset = [], 0
    for i, k in enumerate(num_drafts):
        flags = forced[i] if forced else []
        n = 0
        while n < k and ((n < len(flags) and flags[n]) or accepted[offset + n]):
            n += 1
        counts.append(n)
        offset += k
    return counts
