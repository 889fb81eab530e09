"""`agentrt tune`: the engine settings with the most goodput under a latency bound.

Goodput is what an agent runtime's users count: schema-valid completions per second (any
completion, for an unstructured workload) whose P99 end-to-end latency, or TTFT, stays
within the bound the user gives. The search is the grid of the options given
(`SearchSpace`: max_num_seqs, max_num_batched_tokens, the prefill cap while others run,
block_size, speculative method, jump-forward) around the base engine options (the command's engine flags or `--config`),
each configuration a fresh in-process engine running the same workload (`run_benchmark`).

Two rounds, so that configurations that cannot win cost little:
1. screen: every configuration runs a short workload (`screen_prompts` requests);
2. final: the baseline (the base options, always) and the `keep` best screened
   configurations that met the bound run the whole workload.
Pruned after the screen: a configuration whose P99 is over the bound by more than
`PRUNE_OVER_BOUND` (noise does not fix that), or whose goodput is below
`1 - PRUNE_MARGIN` of the best one within the bound. A configuration over the bound in the
final round is never chosen. The winner is the final round's best goodput within the
bound, if it beats the baseline's by at least `min_gain` (MIN_GAIN, 5%: two runs of one
configuration differ by a few percent here, and a change of settings should not rest on
noise); else the baseline (the table then shows the defaults are the best).

What the search found is reported by `tune_report` (the table, the chart, the config file).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from agentrt.bench.datasets import DatasetConfig
from agentrt.bench.errors import BenchConfigError
from agentrt.bench.load import LoadConfig
from agentrt.bench.results import BenchResult
from agentrt.bench.runner import run_benchmark
from agentrt.engine.args import EngineArgs
from agentrt.engine.config import SpeculativeConfig
from agentrt.engine.errors import ConfigError, EngineError

PRUNE_OVER_BOUND = 1.5  # screened P99 above 1.5x the bound: cannot get within it
PRUNE_MARGIN = 0.25  # screened goodput 25% below the best within the bound: cannot win
MIN_GAIN = 0.05  # the gain over the baseline a winner must have (see the module doc)
BOUNDS = ("e2e", "ttft")
# One configuration's run: (engine options, workload, load) -> its figures.
Measure = Callable[[EngineArgs, DatasetConfig, LoadConfig], BenchResult]


@dataclass(frozen=True, slots=True)
class SearchSpace:
    """The values to try per option; an option left None keeps the base value."""

    max_num_seqs: tuple[int, ...] | None = None
    max_num_batched_tokens: tuple[int, ...] | None = None
    # The cap on one request's prefill chunk while others run (0: none): the per-machine
    # trade between a new request's TTFT and the others' inter-token latency.
    long_prefill_token_threshold: tuple[int, ...] | None = None
    block_size: tuple[int, ...] | None = None
    # "off", or a method with SpeculativeConfig options: "suffix", "ngram:num_speculative_tokens=4",
    # "suffix:disable_by_batch_size=0" (':' between options).
    speculative: tuple[str, ...] | None = None
    jump_forward: tuple[bool, ...] | None = None

    def __post_init__(self) -> None:
        for spec in self.speculative or ():
            config = speculative_config(spec)
            if config is not None and config["method"] == "draft_model":
                raise BenchConfigError(
                    "speculative method 'draft_model' needs a draft model: give it with "
                    "--speculative-config in the base options instead."
                )

    def changes(self) -> list[dict[str, Any]]:
        """Every combination, as the fields it sets."""
        axes: list[list[tuple[str, Any]]] = []
        for name in (
            "max_num_seqs",
            "max_num_batched_tokens",
            "long_prefill_token_threshold",
            "block_size",
            "jump_forward",
        ):
            values = getattr(self, name)
            if values:
                axes.append([(name, v) for v in dict.fromkeys(values)])
        if self.speculative:
            axes.append(
                [
                    ("speculative_config", speculative_config(spec))
                    for spec in dict.fromkeys(self.speculative)
                ]
            )
        return [dict(combo) for combo in itertools.product(*axes)]


def speculative_config(spec: str) -> dict[str, Any] | None:
    """ "off" -> None; "suffix:num_speculative_tokens=4" -> {"method": "suffix",
    "num_speculative_tokens": 4}, checked by SpeculativeConfig (`BenchConfigError`)."""
    if spec == "off":
        return None
    method, *options = spec.split(":")
    config: dict[str, Any] = {"method": method}
    for option in options:
        name, _, text = option.partition("=")
        try:
            config[name] = json.loads(text)  # numbers and true/false
        except json.JSONDecodeError:
            config[name] = text
    try:
        SpeculativeConfig.parse(config if method != "draft_model" else {**config, "model": "x"})
    except ConfigError as exc:
        raise BenchConfigError(f"speculative setting {spec!r}: {exc}") from None
    return config


@dataclass(slots=True)
class Trial:
    """One configuration: what it changes from the base, its two runs, and the verdict."""

    changes: dict[str, Any]
    args: EngineArgs | None
    screen: BenchResult | None = None
    final: BenchResult | None = None
    status: str = ""

    @property
    def label(self) -> str:
        if not self.changes:
            return "baseline"
        return " ".join(f"{_short(k)}={_value(v)}" for k, v in self.changes.items())

    def latest(self) -> BenchResult | None:
        return self.final or self.screen


@dataclass(slots=True)
class TuneResult:
    bound_on: str  # "e2e" or "ttft"
    bound_ms: float
    trials: list[Trial] = field(default_factory=list)
    best: Trial | None = None
    load: LoadConfig | None = None  # as run (with the goodput bound)
    min_gain: float = MIN_GAIN

    @property
    def baseline(self) -> Trial:
        return self.trials[0]


def p99(result: BenchResult, bound_on: str) -> float:
    summary = result.e2e_ms if bound_on == "e2e" else result.ttft_ms
    return summary.p99 if summary is not None else math.inf


def within(result: BenchResult, bound_on: str, bound_ms: float) -> bool:
    return result.failed == 0 and p99(result, bound_on) <= bound_ms


def gain(trial: Trial, baseline: Trial) -> float | None:
    """trial's final goodput over the baseline's; None without both final runs."""
    if trial.final is None or baseline.final is None:
        return None
    base = baseline.final.goodput
    return trial.final.goodput / base if base else math.inf


def tune(
    base: EngineArgs,
    space: SearchSpace,
    dataset: DatasetConfig,
    load: LoadConfig,
    *,
    bound_ms: float,
    bound_on: str = "e2e",
    screen_prompts: int | None = None,
    keep: int = 3,
    min_gain: float = MIN_GAIN,
    on_trial=None,
    measure: Measure | None = None,
) -> TuneResult:
    """Search `space` around `base` for the most goodput with P99 `bound_on` latency at most
    `bound_ms` on `dataset` under `load`. `on_trial(trial, round)` is called after each run.
    `measure(args, workload, load)` runs one configuration (default: `run_benchmark` on a
    fresh in-process engine); the search decides only from what it returns."""
    if bound_on not in BOUNDS:
        raise BenchConfigError(f"bound_on={bound_on!r}: expected one of {BOUNDS}.")
    if not bound_ms > 0:
        raise BenchConfigError(f"bound_ms={bound_ms} is invalid: expected > 0.")
    if keep < 1:
        raise BenchConfigError(f"keep={keep} is invalid: expected >= 1.")
    if not min_gain >= 0:
        raise BenchConfigError(f"min_gain={min_gain} is invalid: expected >= 0.")
    bounds = {f"goodput_{bound_on}_ms": bound_ms}
    load = dataclasses.replace(load, **bounds)
    if measure is None:
        mode = "structured" if dataset.structured else "throughput"

        def measure(args: EngineArgs, workload: DatasetConfig, load: LoadConfig) -> BenchResult:
            return run_benchmark(mode, workload, load, engine_args=args)

    result = TuneResult(bound_on, bound_ms, min_gain=min_gain)
    baseline = Trial({}, base)
    result.trials.append(baseline)
    for changes in space.changes():
        if all(same_option(_resolved(base, k), v) for k, v in changes.items()):
            continue  # the baseline itself
        try:
            args = dataclasses.replace(base, **changes)
        except ConfigError as exc:  # e.g. a block size the pool cannot take
            result.trials.append(Trial(changes, None, status=f"invalid: {exc}"))
            continue
        result.trials.append(Trial(changes, args))

    def run(trial: Trial, workload: DatasetConfig, round_name: str) -> BenchResult | None:
        try:
            outcome = measure(trial.args, workload, load)
        except (EngineError, BenchConfigError) as exc:
            trial.status = f"failed: {exc}"
            return None
        if on_trial is not None:
            on_trial(trial, round_name, outcome)
        return outcome

    # Round 1: screen everything (the whole workload when it is already small), after one
    # unmeasured run: the first one pays for compiling the workload's grammars.
    num_screen = min(screen_prompts or dataset.num_prompts, dataset.num_prompts)
    screening = num_screen < dataset.num_prompts
    short = dataclasses.replace(dataset, num_prompts=num_screen)
    runnable = [t for t in result.trials if t.args is not None]
    run(baseline, short, "warmup")
    for trial in runnable:
        outcome = run(trial, short, "screen" if screening else "final")
        if screening:
            trial.screen = outcome
        else:
            trial.final = outcome
    if screening:
        _prune(runnable, bound_on, bound_ms, keep, baseline)
        for trial in runnable:
            if not trial.status and trial.screen is not None:
                trial.final = run(trial, dataset, "final")
    # The winner: the final round's best goodput within the bound.
    finalists = [t for t in runnable if t.final is not None]
    for trial in finalists:
        if not within(trial.final, bound_on, bound_ms):
            trial.status = f"over bound (P99 {p99(trial.final, bound_on):.0f} ms)"
    result.best = choose([t for t in finalists if not t.status], baseline, min_gain)
    result.load = load
    return result


def choose(feasible: list[Trial], baseline: Trial, min_gain: float) -> Trial | None:
    """The winner among the configurations within the bound (their statuses set): the best
    goodput, unless the baseline is within the bound too and the best beats it by less than
    `min_gain`, which keeps the baseline."""
    if not feasible:
        return None
    best = max(feasible, key=lambda t: (t.final.goodput, t is baseline))
    if baseline in feasible and best is not baseline:
        ratio = gain(best, baseline)
        if ratio < 1 + min_gain:
            best.status = f"within bound ({ratio:.2f}x: under the {min_gain:.0%} minimum gain)"
            best = baseline
    for trial in feasible:
        trial.status = trial.status or ("best" if trial is best else "within bound")
    return best


def _prune(trials: list[Trial], bound_on: str, bound_ms: float, keep: int, baseline: Trial):
    """Mark screened configurations that cannot win; keep the baseline and `keep` others."""
    screened = [t for t in trials if t.screen is not None]
    for trial in screened:
        if trial.screen.failed:
            trial.status = f"pruned: {trial.screen.failed} requests failed"
        elif p99(trial.screen, bound_on) > PRUNE_OVER_BOUND * bound_ms:
            trial.status = f"pruned: P99 {p99(trial.screen, bound_on):.0f} ms, far over bound"
    candidates = [t for t in screened if not t.status]
    within_bound = [t for t in candidates if p99(t.screen, bound_on) <= bound_ms]
    if within_bound:
        best = max(t.screen.goodput for t in within_bound)
        for trial in candidates:
            if trial.screen.goodput < (1 - PRUNE_MARGIN) * best:
                trial.status = "pruned: goodput far below the best"
    ranked = sorted(
        (t for t in candidates if not t.status and t is not baseline),
        key=lambda t: t.screen.goodput,
        reverse=True,
    )
    for trial in ranked[keep:]:
        trial.status = f"pruned: not in the best {keep}"
    if baseline.screen is not None:
        baseline.status = ""  # always in the final round: the gain is measured against it


def _short(name: str) -> str:
    return {
        "max_num_seqs": "seqs",
        "max_num_batched_tokens": "tokens",
        "long_prefill_token_threshold": "prefill_cap",
        "block_size": "block",
        "speculative_config": "spec",
        "jump_forward": "jf",
    }.get(name, name)


def _value(value: Any) -> str:
    if value is None:
        return "off"
    if isinstance(value, dict) and "method" in value:
        return ":".join([value["method"], *(f"{k}={v}" for k, v in value.items() if k != "method")])
    return str(value)


def _resolved(base: EngineArgs, name: str) -> Any:
    """The base's value of an option as the engine takes it (the prefill cap's None is the
    device's default: a trial of that value would run the baseline again)."""
    if name == "long_prefill_token_threshold":
        return base.resolved_long_prefill_token_threshold()
    return getattr(base, name)


def same_option(a: Any, b: Any) -> bool:
    return option_json(a) == option_json(b)


def option_json(value: Any) -> Any:
    """An option as JSON: dtypes by name, a speculative config as its dict (or parsed)."""
    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    if dataclasses.is_dataclass(value):
        return dataclasses.asdict(value)
    if isinstance(value, str) and value.startswith("{"):
        return json.loads(value)
    return value
