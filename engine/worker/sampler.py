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

On a GPU the step must not wait for the device until its tokens are read back: which rows
are random, which truncate and by how much is known on the host when the metadata is built,
so the sampler never asks the device (`nonzero`, `.item()`, a branch on device data); the
metadata's tensors travel through pinned memory without waiting. One data-dependent branch
remains: top-p rows whose nucleus is wider than TOP_P_CANDIDATES.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain

import torch

from agentrt.engine.errors import InvalidRequestError
from agentrt.engine.sampling_params import SamplingParams

# top-p first looks for the nucleus among this many top tokens (a cheap `topk`); only rows
# whose nucleus is wider fall back to a full sort.
TOP_P_CANDIDATES = 256


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


@dataclass(slots=True)
class SparseLogits:
    """(row, token) pairs with one value each, flattened: `logits[rows, token_ids] op values`."""

    rows: torch.Tensor  # [N] int64
    token_ids: torch.Tensor  # [N] int64
    values: torch.Tensor  # [N] f32


@dataclass(frozen=True, slots=True)
class LimitedRows:
    """The random rows a truncation (top-k, top-p) applies to, found on the host when the
    metadata is built: finding them on the device would wait for it."""

    index: torch.Tensor | None  # [L] int64 positions among the random rows; None: all of them
    max_top_k: int = 0  # top-k: the largest k among those rows


@dataclass(slots=True)
class SamplingMetadata:
    """Everything the sampler needs for one step, as tensors prepared once.

    Optional fields are `None` when no row uses them, so the sampler skips that stage.
    Inside a used tensor, rows that do not use the feature hold neutral values
    (top_k = vocab_size, top_p = 1, min_p = 0).
    """

    vocab_size: int
    temperature: torch.Tensor  # [B] f32; greedy rows hold 0
    all_greedy: bool
    all_random: bool
    # [R] int64, ascending: the batch rows that sample at random; None when all rows are
    # greedy or all random. `random_batch_rows` is the same on the host.
    random_rows: torch.Tensor | None
    random_batch_rows: tuple[int, ...]
    top_k: torch.Tensor | None  # [B] int64 in [1, vocab_size]
    top_p: torch.Tensor | None  # [B] f32 in (0, 1]
    min_p: torch.Tensor | None  # [B] f32 in [0, 1]
    top_k_rows: LimitedRows | None  # the random rows whose k truncates (set with top_k)
    top_p_rows: LimitedRows | None  # the random rows whose p truncates (set with top_p)
    generators: dict[int, torch.Generator]  # batch row -> generator, seeded random rows only
    blocked: SparseLogits | None  # values unused: these logits become -inf
    logit_bias: SparseLogits | None  # added
    repetition: SparseLogits | None  # tokens in prompt or output; value = the row's penalty
    output_penalty: SparseLogits | None  # tokens in output; value = f * count + p, subtracted
    max_num_logprobs: int | None  # max `logprobs` over rows; None when no row asked

    @property
    def num_rows(self) -> int:
        return self.temperature.shape[0]

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        prompt_token_ids: Sequence[Sequence[int]],
        output_token_ids: Sequence[Sequence[int]],
        generators: Sequence[torch.Generator | None],
        blocked_token_ids: Sequence[Sequence[int]],
        vocab_size: int,
        device: torch.device | str = "cpu",
    ) -> SamplingMetadata:
        """Build the step's metadata; every sequence has one entry per row, in batch order.

        `generators[i]` is the row's own generator (`Request.generator`) when its request
        has a seed, else None (the row then uses torch's default generator). Prompt ids are
        read only for rows with a repetition penalty, output ids only for penalised rows.
        Raises `InvalidRequestError` for a token id outside `[0, vocab_size)`.
        """
        num_rows = len(params)
        for name, column in (
            ("prompt_token_ids", prompt_token_ids),
            ("output_token_ids", output_token_ids),
            ("generators", generators),
            ("blocked_token_ids", blocked_token_ids),
        ):
            if len(column) != num_rows:
                raise ValueError(f"{name} has {len(column)} rows, expected {num_rows}")

        def tensor(values: list, dtype: torch.dtype) -> torch.Tensor:
            return to_device(torch.tensor(values, dtype=dtype), device)

        greedy = [p.greedy for p in params]
        random = [(i, p) for i, (p, g) in enumerate(zip(params, greedy, strict=True)) if not g]
        # Truncation only matters for random rows; greedy rows keep neutral values.
        top_k, top_p, min_p = [vocab_size] * num_rows, [1.0] * num_rows, [0.0] * num_rows
        for i, p in random:
            top_k[i] = min(p.top_k, vocab_size) if p.top_k_enabled else vocab_size
            top_p[i], min_p[i] = p.top_p, p.min_p

        repetition_rows = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0]
        output_rows = [i for i, p in enumerate(params) if p.frequency_penalty or p.presence_penalty]
        repetition = output_penalty = None
        if repetition_rows:
            rows, ids, _ = _unique_pairs(
                repetition_rows,
                [chain(prompt_token_ids[i], output_token_ids[i]) for i in repetition_rows],
                vocab_size,
            )
            per_row = tensor([p.repetition_penalty for p in params], torch.float32)  # [B]
            rows, ids = to_device(rows, device), to_device(ids, device)
            repetition = SparseLogits(rows, ids, per_row[rows])
        if output_rows:
            rows, ids, counts = (
                to_device(t, device)
                for t in _unique_pairs(
                    output_rows, [output_token_ids[i] for i in output_rows], vocab_size
                )
            )
            frequency = tensor([p.frequency_penalty for p in params], torch.float32)  # [B]
            presence = tensor([p.presence_penalty for p in params], torch.float32)  # [B]
            values = frequency[rows] * counts + presence[rows]  # [M]
            output_penalty = SparseLogits(rows, ids, values)

        bias = [(i, t, b) for i, p in enumerate(params) for t, b in (p.logit_bias or {}).items()]
        blocked = [(i, t, 0.0) for i, ids in enumerate(blocked_token_ids) for t in ids]
        for name, pairs in (("logit_bias", bias), ("blocked_token_ids", blocked)):
            for _, token_id, _ in pairs:
                _check_token_id(name, token_id, vocab_size)

        def sparse(pairs: list[tuple[int, int, float]]) -> SparseLogits | None:
            if not pairs:
                return None
            rows, ids, values = zip(*pairs, strict=True)
            return SparseLogits(
                tensor(rows, torch.int64), tensor(ids, torch.int64), tensor(values, torch.float32)
            )

        def limited(rows: list[int], max_top_k: int = 0) -> LimitedRows | None:
            """Positions `rows` among the random rows (None when there are none)."""
            if not rows:
                return None
            index = None if len(rows) == len(random) else tensor(rows, torch.int64)
            return LimitedRows(index, max_top_k)

        random_batch_rows = tuple(i for i, _ in random)
        top_k_rows = [j for j, i in enumerate(random_batch_rows) if top_k[i] < vocab_size]
        top_p_rows = [j for j, i in enumerate(random_batch_rows) if top_p[i] < 1.0]
        wanted_logprobs = [p.logprobs for p in params if p.logprobs is not None]
        return cls(
            vocab_size=vocab_size,
            temperature=tensor(
                [0.0 if g else p.temperature for p, g in zip(params, greedy, strict=True)],
                torch.float32,
            ),
            all_greedy=not random,
            all_random=len(random) == num_rows,
            random_rows=(
                tensor(list(random_batch_rows), torch.int64) if 0 < len(random) < num_rows else None
            ),
            random_batch_rows=random_batch_rows,
            top_k=tensor(top_k, torch.int64) if top_k_rows else None,
            top_p=tensor(top_p, torch.float32) if top_p_rows else None,
            min_p=tensor(min_p, torch.float32) if any(p > 0.0 for p in min_p) else None,
            top_k_rows=limited(
                top_k_rows, max((top_k[random_batch_rows[j]] for j in top_k_rows), default=0)
            ),
            top_p_rows=limited(top_p_rows),
            generators={i: generators[i] for i, _ in random if generators[i] is not None},
            blocked=sparse(blocked),
            logit_bias=sparse(bias),
            repetition=repetition,
            output_penalty=output_penalty,
            max_num_logprobs=max(wanted_logprobs) if wanted_logprobs else None,
        )


def to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """Host tensor `t` on `device`. To a GPU through pinned memory, without waiting: a copy
    from pageable memory would first wait for every kernel queued before it."""
    device = torch.device(device)
    if device.type == "cpu":
        return t
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def _check_token_id(name: str, token_id: int, vocab_size: int) -> None:
    if not 0 <= token_id < vocab_size:
        raise InvalidRequestError(
            f"{name} names token id {token_id}, outside the vocabulary [0, {vocab_size}): "
            "use ids of this model's tokenizer.",
            field=name,
            value=token_id,
        )


def _unique_pairs(
    rows: list[int], token_ids: list, vocab_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Distinct (row, token) pairs of `rows[j]` x `token_ids[j]` with their counts (CPU)."""
    token_lists = [list(ids) for ids in token_ids]
    flat = torch.tensor(list(chain.from_iterable(token_lists)), dtype=torch.int64)  # [T]
    if flat.numel() and not (0 <= int(flat.min()) and int(flat.max()) < vocab_size):
        bad = int(flat.min()) if int(flat.min()) < 0 else int(flat.max())
        _check_token_id("prompt_token_ids / output_token_ids", bad, vocab_size)
    lengths = torch.tensor([len(ids) for ids in token_lists], dtype=torch.int64)
    row_of = torch.repeat_interleave(torch.tensor(rows, dtype=torch.int64), lengths)  # [T]
    keys, counts = torch.unique(row_of * vocab_size + flat, return_counts=True)  # [N]
    return keys // vocab_size, keys % vocab_size, counts.to(torch.float32)


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
        argmax = logits.argmax(dim=-1)  # [B]
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
            return logits.argmax(dim=-1)
        if metadata.all_random:
            return sample_random(logits, metadata, None)
        sampled = logits.argmax(dim=-1)  # [B]
        random_rows = metadata.random_rows  # [R]
        # Only random rows do the truncation and draw work: [R, V] copy.
        sampled[random_rows] = sample_random(logits[random_rows], metadata, random_rows)
        return sampled


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
    """Draw one token per random row from `random_probs` (same arguments)."""
    probs = random_probs(logits, metadata, rows)
    # One uniform per row; seeded rows draw theirs from their own generator (a CPU one: the
    # draw is the same whatever device the logits are on, and is copied there).
    uniform = torch.rand(probs.shape[0], 1, device=probs.device)  # [R, 1]
    if metadata.generators:
        position = {r: j for j, r in enumerate(metadata.random_batch_rows)}
        seeded = [row if rows is None else position[row] for row in metadata.generators]  # [S]
        draws = torch.cat(
            [
                torch.rand(1, generator=g, device=g.device).cpu()
                for g in metadata.generators.values()
            ]
        )  # [S], one copy to the device for all of them
        index = to_device(torch.tensor(seeded, dtype=torch.int64), probs.device)
        uniform[index, 0] = to_device(draws, probs.device)
    return draw_inverse_cdf(probs, uniform)


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
