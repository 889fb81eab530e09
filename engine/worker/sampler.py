"""Sampler: logits -> one token per request, with vLLM V1 semantics.

Order of operations on a step's logits `[B, V]` (one row per request, batch order):

1. padded columns (`>= vocab_size`) are set to -inf;
2. raw logprobs (fp32 log_softmax, before any processing) when some row asked for them;
3. blocked token ids -> -inf (min_tokens: EOS / stop ids; later grammar);
4. logit bias is added;
5. penalties: repetition (prompt or output tokens: `l > 0 -> l / p`, else `l * p`),
   frequency (`- f * count_in_output`), presence (`- p * (count_in_output > 0)`);
6. greedy rows take `argmax` (ties -> lowest id, like `torch.argmax` and HF greedy);
7. random rows: `/ temperature`, top-k, top-p, min-p, then one inverse-CDF draw per row.
   A seeded row draws its uniform from its own generator, so its token does not depend on
   which other rows share the batch.

Per-row Python loops run only over seeded rows; everything else is batched. Penalties and
biases touch only the (row, token) pairs they name, never a dense `[B, V]` mask.

Only the top of a row is needed by a greedy row, a row whose top-k truncates (k <=
TOP_K_CANDIDATES) and a top-p row whose nucleus lies within its TOP_P_CANDIDATES most likely
tokens: on the CPU those take the C kernels of kernels/cpu_sampling.py, one pass over the
row (torch's argmax and topk cost 0.3-1 ms a row over a 150k vocabulary), then the softmax,
top-p, min-p and draw over the candidates only (`sample_candidates`): every later stage
depends on the kept tokens' probabilities relative to each other (and top-p's target on the
row's whole mass, one sum), and the draw walks the candidates in token-id order as the full
row's inverse CDF does, so a row draws the token the full path draws for the same uniform
(up to fp32 rounding at a boundary between two tokens).

On a GPU the step must not wait for the device until its tokens are read back: which rows
are random, which truncate and by how much is known on the host when the metadata is built
(sampling_metadata.py), so the sampler never asks the device (`nonzero`, `.item()`, a branch
on device data). One data-dependent branch remains: top-p rows whose nucleus is wider than
TOP_P_CANDIDATES.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from agentrt.engine.worker.sampling_metadata import LimitedRows, SamplingMetadata, to_device
from agentrt.kernels.cpu_sampling import default_cpu_sampling

# top-p first looks for the nucleus among this many top tokens (a cheap `topk`); only rows
# whose nucleus is wider fall back to a full sort.
TOP_P_CANDIDATES = 256
# Top-k rows with k up to this sample among their k candidates alone (on the CPU), and
# the ties with their k-th value, up to this many candidates in all.
TOP_K_CANDIDATES = 256
TOP_K_TIES = 4 * TOP_K_CANDIDATES


@dataclass(slots=True)
class LogprobsTensors:
    """Logprobs of the raw (unprocessed) logits for every row of the step.

    Rows that did not ask for logprobs are computed anyway and ignored by the caller; a row
    that asked for `n` uses columns `[: 1 + n]`.
    """

    token_ids: torch.Tensor  # [B, 1 + max_num_logprobs] int64: sampled token, then top ids
    logprobs: torch.Tensor  # [B, 1 + max_num_logprobs] float32
    ranks: torch.Tensor  # [B] int64: 1 + number of tokens strictly more likely than sampled


@dataclass(slots=True)
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [B] int64
    logprobs: LogprobsTensors | None  # set when any row asked for logprobs


class Sampler:
    """Stateless; `__call__` may modify `logits` in place (a fp32 copy is made otherwise)."""

    def __call__(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        logits = self._prepare(logits, metadata)
        raw_logprobs = None
        if metadata.max_num_logprobs is not None:
            raw_logprobs = torch.log_softmax(logits, dim=-1)  # [B, V]

        apply_blocked_and_bias(logits, metadata)
        apply_penalties(logits, metadata)
        sampled = self.sample(logits, metadata)  # [B]

        logprobs = None
        if raw_logprobs is not None:
            logprobs = gather_logprobs(raw_logprobs, sampled, metadata.max_num_logprobs)
        return SamplerOutput(sampled_token_ids=sampled, logprobs=logprobs)

    @staticmethod
    def _prepare(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """Checked fp32 logits with padded columns at -inf."""
        # logits: [B, V_padded] with V_padded >= metadata.vocab_size
        if logits.dim() != 2 or logits.shape[0] != metadata.num_rows:
            raise ValueError(
                f"logits must be [num_rows={metadata.num_rows}, vocab], got {tuple(logits.shape)}"
            )
        if logits.shape[1] < metadata.vocab_size:
            raise ValueError(f"logits have {logits.shape[1]} columns < {metadata.vocab_size}")
        if logits.dtype != torch.float32:
            logits = logits.float()
        if logits.shape[1] > metadata.vocab_size:
            logits[:, metadata.vocab_size :] = -math.inf
        return logits

    def distributions(
        self, logits: torch.Tensor, metadata: SamplingMetadata
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """What `__call__` would sample from, without drawing (for verifying drafts): the
        processed logits' argmax `[B]` (a greedy row's token) and the random rows'
        distributions `[B, V]` (unnormalised; greedy rows hold zeros), None when every row
        is greedy. Logprobs are not computed. May modify `logits` in place."""
        logits = self._prepare(logits, metadata)
        apply_blocked_and_bias(logits, metadata)
        apply_penalties(logits, metadata)
        argmax = greedy_tokens(logits)  # [B]
        if metadata.all_greedy:
            return None, argmax
        if metadata.all_random:
            return random_probs(logits, metadata, None), argmax
        random_rows = metadata.random_rows  # [R]
        probs = torch.zeros_like(logits)
        probs[random_rows] = random_probs(logits[random_rows], metadata, random_rows)
        return probs, argmax

    def sample(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """Greedy and random sampling of processed logits `[B, V]` -> `[B]` int64."""
        if metadata.all_greedy:
            return greedy_tokens(logits)
        if metadata.all_random:
            return sample_random(logits, metadata, None)
        sampled = greedy_tokens(logits)  # [B]
        random_rows = metadata.random_rows  # [R]
        # Only random rows do the truncation and draw work: [R, V] copy.
        sampled[random_rows] = sample_random(logits[random_rows], metadata, random_rows)
        return sampled


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """`logits.argmax(dim=-1)` `[B]` (ties -> the lowest id); one vectorized pass a row on
    the CPU."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.shape[1]:
        if logits.stride(1) == 1:
            return default_cpu_sampling().argmax(logits)
    return logits.argmax(dim=-1)


def apply_blocked_and_bias(logits: torch.Tensor, metadata: SamplingMetadata) -> None:
    """Blocked ids -> -inf, then logit bias added (in place on `[B, V]`)."""
    if metadata.blocked is not None:
        logits[metadata.blocked.rows, metadata.blocked.token_ids] = -math.inf
    if (bias := metadata.logit_bias) is not None:
        logits.index_put_((bias.rows, bias.token_ids), bias.values, accumulate=True)


def apply_penalties(logits: torch.Tensor, metadata: SamplingMetadata) -> None:
    """Repetition, then frequency + presence penalties (in place, only the named pairs)."""
    if (rep := metadata.repetition) is not None:
        values = logits[rep.rows, rep.token_ids]  # [N]
        values = torch.where(values > 0, values / rep.values, values * rep.values)
        logits[rep.rows, rep.token_ids] = values
    if (out := metadata.output_penalty) is not None:
        logits.index_put_((out.rows, out.token_ids), -out.values, accumulate=True)


def random_probs(
    logits: torch.Tensor, metadata: SamplingMetadata, rows: torch.Tensor | None
) -> torch.Tensor:
    """Temperature, top-k, top-p, min-p: the distribution a random row draws from, `[R, V]`
    and not normalised. `logits` `[R, V]` holds the random rows only (`rows[j]` is the batch
    row of logits row j; None means every batch row, in order). Modifies `logits` in place.

    Truncation zeroes probabilities instead of masking logits: the softmax is computed once,
    and the draw scales by each row's remaining total, so no renormalisation is needed.
    """

    def select(values: torch.Tensor | None) -> torch.Tensor | None:
        return values if values is None or rows is None else values[rows]

    logits.div_(select(metadata.temperature).unsqueeze(1))
    probs = logits.softmax(dim=-1)  # [R, V]
    apply_top_k(probs, select(metadata.top_k), metadata.vocab_size, metadata.top_k_rows)
    apply_top_p(probs, select(metadata.top_p), metadata.top_p_rows)
    if metadata.min_p is not None:
        # The most likely token survives top-k / top-p, so the max is the untruncated one.
        threshold = select(metadata.min_p).unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
        probs.masked_fill_(probs < threshold, 0.0)
    return probs


def sample_random(
    logits: torch.Tensor, metadata: SamplingMetadata, rows: torch.Tensor | None
) -> torch.Tensor:
    """Draw one token per random row from `random_probs` (same arguments); rows that
    truncate to their most likely tokens take `sample_candidates`, the same draw."""
    uniform = random_uniforms(logits, metadata, rows)  # [R, 1]
    if (sampled := sample_candidates(logits, metadata, rows, uniform)) is not None:
        return sampled
    if (sampled := sample_untruncated(logits, metadata, rows, uniform)) is not None:
        return sampled
    return draw_inverse_cdf(random_probs(logits, metadata, rows), uniform)


def _softmax_kernel(logits: torch.Tensor):
    """kernels/cpu_sampling.py's library where its softmax_draw takes these logits."""
    if logits.device.type != "cpu" or logits.dtype != torch.float32 or logits.stride(1) != 1:
        return None
    kernels = default_cpu_sampling()
    return kernels if kernels.has_softmax and logits.shape[1] % 16 == 0 else None


def sample_untruncated(
    logits: torch.Tensor,
    metadata: SamplingMetadata,
    rows: torch.Tensor | None,
    uniform: torch.Tensor,
) -> torch.Tensor | None:
    """Rows without top-k, top-p or min-p on the CPU: the inverse-CDF draw from softmax(x /
    t) in one kernel (kernels/cpu_sampling.c), the probabilities never written; None where
    it does not apply (another device, a truncation, a NaN). Same arguments and draw as
    `draw_inverse_cdf(random_probs(...), uniform)`, up to fp32 rounding at a boundary
    between two tokens."""
    if metadata.top_k is not None or metadata.top_p is not None or metadata.min_p is not None:
        return None
    if (kernels := _softmax_kernel(logits)) is None:
        return None
    temperature = metadata.temperature if rows is None else metadata.temperature[rows]
    _, tokens = kernels.softmax_draw(logits, temperature, uniform.squeeze(1))
    return None if bool((tokens < 0).any()) else tokens


def random_uniforms(
    logits: torch.Tensor, metadata: SamplingMetadata, rows: torch.Tensor | None
) -> torch.Tensor:
    """One uniform per random row `[R, 1]`; seeded rows draw theirs from their own generator
    (a CPU one: the draw is the same whatever device the logits are on, and is copied
    there)."""
    uniform = torch.rand(logits.shape[0], 1, device=logits.device)  # [R, 1]
    if metadata.generators:
        position = {r: j for j, r in enumerate(metadata.random_batch_rows)}
        seeded = [row if rows is None else position[row] for row in metadata.generators]  # [S]
        draws = torch.cat(
            [
                torch.rand(1, generator=g, device=g.device).cpu()
                for g in metadata.generators.values()
            ]
        )  # [S], one copy to the device for all of them
        index = to_device(torch.tensor(seeded, dtype=torch.int64), logits.device)
        uniform[index, 0] = to_device(draws, logits.device)
    return uniform


def sample_candidates(
    logits: torch.Tensor,
    metadata: SamplingMetadata,
    rows: torch.Tensor | None,
    uniform: torch.Tensor,
) -> torch.Tensor | None:
    """`draw_inverse_cdf(random_probs(logits, ...), uniform)` `[R]` computed over each row's
    most likely tokens alone, or None where that does not apply. Two cases, on the CPU:

    - every random row's top-k truncates, k <= TOP_K_CANDIDATES: its k candidates, with the
      ties of its k-th value (up to TOP_K_TIES candidates in all; every tied token is kept);
    - no row has top-k and every random row's top-p truncates: the TOP_P_CANDIDATES most
      likely tokens, where they hold the row's nucleus (the row's whole mass, which top-p's
      target is a share of, is one sum over the row); a row whose nucleus is wider takes the
      full path alone.

    A NaN takes the full path too. Same arguments as `random_probs`; does not modify `logits`.

    The candidates come in the order of a stable descending sort (value, then id), which is
    the order top-p's nucleus is taken in; the truncations zero probabilities as the full
    path does, and the draw walks the kept candidates by ascending id, as the full row's
    cumulative sum does (the truncated tokens add nothing to it)."""
    if logits.device.type != "cpu" or logits.dtype != torch.float32 or logits.stride(1) != 1:
        return None

    def select(values: torch.Tensor | None) -> torch.Tensor | None:
        return values if values is None or rows is None else values[rows]

    temperature = select(metadata.temperature).unsqueeze(1)  # [R, 1]
    top_p, by_k, by_p = select(metadata.top_p), metadata.top_k_rows, metadata.top_p_rows
    whole = None  # [R, 1]: the row's whole unnormalised mass, where top-p needs it
    if by_k is not None:
        if by_k.index is not None or not 1 <= by_k.max_top_k <= TOP_K_CANDIDATES:
            return None
        found = _top_k_candidates(logits, select(metadata.top_k) - 1, by_k.max_top_k)
        if found is None:
            return None
        values, ids, keep = found
        scaled = values.div_(temperature).masked_fill_(~keep, -math.inf)  # [R, K]
    elif by_p is not None and by_p.index is None:
        width = min(TOP_P_CANDIDATES, logits.shape[1])
        values, ids, num_ge = default_cpu_sampling().top_k(logits, width)  # [R, C]
        if bool((num_ge < 0).any()):  # a NaN
            return None
        scaled = values.div_(temperature)
        # exp(x - max) as softmax takes it, summed over the row: [R, 1]
        if (kernels := _softmax_kernel(logits)) is not None:
            whole = kernels.softmax_draw(logits, temperature.squeeze(1), None)[0].unsqueeze(1)
        else:
            top = scaled[:, :1].clone()
            whole = (logits / temperature).sub_(top).exp_().sum(dim=-1, keepdim=True)
    else:
        return None
    probs = scaled.sub_(scaled[:, :1].clone()).exp_()  # [R, K] unnormalised, descending
    wide = None  # [W]: rows whose nucleus is wider than their candidates
    if top_p is not None:
        total = probs.sum(dim=-1, keepdim=True) if whole is None else whole
        target = top_p.unsqueeze(1) * total  # [R, 1]
        if whole is not None:
            wide = (probs.sum(dim=-1) < target.squeeze(1)).nonzero().squeeze(1)
        # p == 1 rows are left whole, as apply_top_p leaves them
        nucleus = _nucleus(probs, target) | (top_p >= 1.0).unsqueeze(1)  # [R, K]
        probs.masked_fill_(~nucleus, 0.0)
    if metadata.min_p is not None:
        threshold = select(metadata.min_p).unsqueeze(1) * probs[:, :1]  # the top token's
        probs.masked_fill_(probs < threshold, 0.0)
    order = ids.argsort(dim=-1)  # [R, K]: the candidates by ascending id
    by_id = ids.gather(1, order)
    drawn = draw_inverse_cdf(probs.gather(1, order), uniform)  # [R] positions in by_id
    sampled = by_id.gather(1, drawn.unsqueeze(1)).squeeze(1)
    if wide is not None and wide.numel():  # every random row has top-p and no top-k: so too
        batch_rows = wide if rows is None else rows[wide]  # the wide ones alone
        probs = random_probs(logits[wide], metadata, batch_rows)  # [W, V]
        sampled[wide] = draw_inverse_cdf(probs, uniform[wide])
    return sampled


def _top_k_candidates(
    logits: torch.Tensor, kth_at: torch.Tensor, width: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """Each row's top `width` (>= its k) and the ties of its k-th value (`kth_at` `[R]`:
    k - 1): (values, ids, keep: value >= the k-th), `[R, K]` each; None for a NaN or more
    than TOP_K_TIES candidates."""
    width = min(width, logits.shape[1])
    while True:
        values, ids, num_ge = default_cpu_sampling().top_k(logits, width)  # [R, K]
        kth = values.gather(1, kth_at.unsqueeze(1))  # [R, 1]
        if bool((num_ge < 0).any()):  # a NaN
            return None
        # Tokens tied with a k-th value that did not fit (a -inf k-th: they draw nothing)
        tied = int(torch.where(kth.squeeze(1) > -math.inf, num_ge, 0).max())
        if tied <= width:
            return values, ids, values >= kth
        if tied > TOP_K_TIES:
            return None
        width = tied


def draw_inverse_cdf(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Token `j` with `cdf[j-1] <= u * total < cdf[j]` per row; `probs` `[R, V]` need not be
    normalised. A zero-probability token never has `cdf[j-1] < cdf[j]`, so it is never
    drawn, except through fp32 rounding at the top end, which is repaired below."""
    cdf = probs.cumsum(dim=-1)  # [R, V]
    target = uniform * cdf[:, -1:]  # [R, 1]
    sampled = torch.searchsorted(cdf, target, right=True).clamp_max_(probs.shape[1] - 1)
    bad = probs.gather(1, sampled) <= 0  # [R, 1]
    # On a GPU the repair always runs: branching on `bad` would wait for the device.
    if probs.device.type != "cpu" or bad.any():
        # `target` rounded up to the total: take the last token with nonzero probability.
        last = probs.shape[1] - 1 - (probs > 0).flip(1).int().argmax(dim=1, keepdim=True)
        sampled = torch.where(bad, last, sampled)
    return sampled.squeeze(1)


def _limited_rows(
    probs: torch.Tensor,
    limits: torch.Tensor | None,
    mask: torch.Tensor | None,
    known: LimitedRows | None,
) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor] | None:
    """Rows where `mask` holds, or the `known` ones: (their indices or None for all, their
    probs, their limits). Avoids an indexing copy in the common case where every row uses
    the feature; with `known` (from the metadata) it does not ask the device."""
    if limits is None:
        return None
    if known is not None:
        index = known.index
        return (None, probs, limits) if index is None else (index, probs[index], limits[index])
    index = mask.nonzero().squeeze(1)  # [L]
    if index.numel() == 0:
        return None
    if index.numel() == probs.shape[0]:
        return None, probs, limits
    return index, probs[index], limits[index]


def apply_top_k(
    probs: torch.Tensor,
    top_k: torch.Tensor | None,
    vocab_size: int,
    known: LimitedRows | None = None,
) -> None:
    """Zero (in place) probabilities below each row's k-th largest (ties with it are kept).
    `topk` costs grow with k, so it runs only on rows whose k truncates (k < vocab_size):
    `known` names them (found on the host), else they are found from `top_k`."""
    mask = None if top_k is None or known is not None else top_k < vocab_size
    limited = _limited_rows(probs, top_k, mask, known)
    if limited is None:
        return
    index, rows, k = limited  # rows: [L, V], k: [L]
    max_k = known.max_top_k if known is not None else int(k.max())
    top_values = rows.topk(max_k, dim=-1).values  # [L, max_k], descending
    kth = top_values.gather(1, (k - 1).unsqueeze(1))  # [L, 1]
    rows.masked_fill_(rows < kth, 0.0)
    if index is not None:
        probs[index] = rows


def apply_top_p(
    probs: torch.Tensor, top_p: torch.Tensor | None, known: LimitedRows | None = None
) -> None:
    """Keep, per row, the smallest set of most likely tokens whose (renormalised) probability
    reaches top_p, the most likely token always; zero the rest, in place.

    The nucleus is first looked for among the `TOP_P_CANDIDATES` most likely tokens (a cheap
    `topk`); rows whose nucleus is wider are redone with one full stable sort. `known`
    names the rows with p < 1 (found on the host), else they are found from `top_p`.
    """
    # p == 1 rows are skipped: fp32 rounding of the cumulative sum must not trim them.
    mask = None if top_p is None or known is not None else top_p < 1.0
    limited = _limited_rows(probs, top_p, mask, known)
    if limited is None:
        return
    index, rows, p = limited  # rows: [P, V], p: [P]
    target = p.unsqueeze(1) * rows.sum(dim=-1, keepdim=True)  # [P, 1]: top_p of what is left
    values, token_ids = rows.topk(min(TOP_P_CANDIDATES, rows.shape[1]), dim=-1)  # [P, C]
    # topk orders ties arbitrarily: the full sort's order (ties by ascending id) instead
    by_id = token_ids.argsort(dim=-1)
    values, token_ids = values.gather(1, by_id), token_ids.gather(1, by_id)
    values, by_value = values.sort(dim=-1, descending=True, stable=True)
    token_ids = token_ids.gather(1, by_value)
    keep = torch.zeros_like(rows, dtype=torch.bool).scatter_(
        1, token_ids, _nucleus(values, target)
    )  # [P, V]
    wide = (values.sum(dim=-1, keepdim=True) < target).squeeze(1).nonzero().squeeze(1)  # [W]
    if wide.numel():
        sorted_values, sorted_ids = rows[wide].sort(dim=-1, descending=True, stable=True)
        keep[wide] = torch.zeros_like(sorted_ids, dtype=torch.bool).scatter_(
            1, sorted_ids, _nucleus(sorted_values, target[wide])
        )
    rows.masked_fill_(~keep, 0.0)
    if index is not None:
        probs[index] = rows


def _nucleus(sorted_probs: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Keep-mask over descending probs `[N, C]`: a token stays while the mass strictly before
    it is below `target` `[N, 1]`; the first token always stays."""
    keep = sorted_probs.cumsum(dim=-1).sub_(sorted_probs) < target  # [N, C]
    keep[:, 0] = True
    return keep


def gather_logprobs(
    logprobs: torch.Tensor, sampled: torch.Tensor, num_logprobs: int
) -> LogprobsTensors:
    """Sampled token's logprob, its rank, and the top `num_logprobs` of `logprobs` [B, V]."""
    sampled = sampled.unsqueeze(1)  # [B, 1]
    sampled_logprobs = logprobs.gather(1, sampled)  # [B, 1]
    ranks = (logprobs > sampled_logprobs).sum(dim=-1) + 1  # [B]
    token_ids, values = sampled, sampled_logprobs
    if num_logprobs > 0:
        top_logprobs, top_ids = logprobs.topk(num_logprobs, dim=-1)  # [B, n]
        token_ids = torch.cat([sampled, top_ids], dim=1)  # [B, 1 + n]
        values = torch.cat([sampled_logprobs, top_logprobs], dim=1)  # [B, 1 + n]
    return LogprobsTensors(token_ids=token_ids, logprobs=values, ranks=ranks)
