"""SamplingMetadata: a step's sampling options as tensors, built once on the host from the
requests' SamplingParams, for the Sampler (sampler.py) to apply.

Built on the host so that the sampler never asks the device what it needs to know: which
rows are random, which truncate (top-k, top-p) and by how much, which (row, token) pairs a
penalty, a bias or a block touches (sparse, never a dense `[B, V]` mask). The tensors travel
to a GPU through pinned memory without waiting (`to_device`). Token ids are checked here:
one outside the vocabulary is an `InvalidRequestError` naming the option.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain

import torch

from agentrt.engine.errors import InvalidRequestError
from agentrt.engine.sampling_params import SamplingParams


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
