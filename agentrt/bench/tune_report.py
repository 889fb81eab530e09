"""What `agentrt tune` found, for its users: the table of every configuration tried, the
latency-vs-goodput chart, and the config file (`--output`) that `agentrt serve --config` and
`Runtime(config=...)` read. The search itself is `tune.py`."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

from agentrt.bench.datasets import DatasetConfig
from agentrt.bench.errors import BenchConfigError
from agentrt.bench.results import BenchResult
from agentrt.bench.tune import TuneResult, gain, option_json, p99, same_option
from agentrt.engine.args import EngineArgs


def config_file(result: TuneResult, dataset: DatasetConfig) -> dict[str, Any]:
    """What `--output` holds: the chosen engine options (those that differ from EngineArgs'
    defaults) under "engine_args", which `agentrt serve --config` and `Runtime(config=...)`
    read, and the figures that chose them under "tune"."""
    best = result.best
    if best is None:
        raise BenchConfigError("no configuration met the bound: nothing to write.")
    defaults = EngineArgs()
    engine_args = {
        f.name: option_json(getattr(best.args, f.name))
        for f in dataclasses.fields(EngineArgs)
        # A secret (a field kept out of the repr: kv_secret) never goes into the file.
        if f.repr and not same_option(getattr(best.args, f.name), getattr(defaults, f.name))
    }
    baseline = result.baseline.final
    return {
        "engine_args": engine_args,
        "tune": {
            "objective": f"goodput with P99 {result.bound_on} <= {result.bound_ms:g} ms",
            "workload": dataclasses.asdict(dataset),
            "load": {
                k: "inf" if v == math.inf else v
                for k, v in dataclasses.asdict(result.load).items()
                if k not in ("num_iters", "num_iters_warmup", "progress")
            },
            "chosen": best.label,
            "goodput": best.final.goodput,
            "p99_ms": p99(best.final, result.bound_on),
            "baseline_goodput": baseline.goodput if baseline else None,
            "gain_vs_baseline": gain(best, result.baseline),
            "configurations_tried": len(result.trials),
        },
    }


def format_table(result: TuneResult) -> str:
    """Every configuration tried: its screen and final figures and its verdict."""
    bound = result.bound_on.upper()
    width = max(len("configuration"), *(len(t.label) for t in result.trials)) + 1
    header = (
        f"{'#':>3}  {'configuration':<{width}}{'screen goodput':>15}{f'P99 {bound}':>12}"
        f"{'goodput':>10}{f'P99 {bound}':>12}{'valid':>7}  verdict"
    )
    lines = [header, "-" * len(header)]
    for i, trial in enumerate(result.trials):
        screen, final = trial.screen, trial.final

        def cells(r: BenchResult | None) -> tuple[str, str]:
            if r is None:
                return "", ""
            return f"{r.goodput:.3f}/s", f"{p99(r, result.bound_on):.0f} ms"

        s_good, s_p99 = cells(screen)
        f_good, f_p99 = cells(final)
        latest = trial.latest()
        valid = (
            ""
            if latest is None or latest.valid_fraction is None
            else f"{latest.valid_fraction:.0%}"
        )
        lines.append(
            f"{i:>3}  {trial.label:<{width}}{s_good:>15}{s_p99:>12}{f_good:>10}{f_p99:>12}"
            f"{valid:>7}  {trial.status}"
        )
    if result.best is not None:
        if result.best is result.baseline:
            lines.append(
                "\nthe baseline is the best: no configuration has "
                f"{result.min_gain:.0%} more goodput within the bound"
            )
        else:
            ratio = gain(result.best, result.baseline)
            versus = (
                "the baseline failed" if ratio is None else f"{ratio:.2f}x the baseline's goodput"
            )
            lines.append(f"\nbest: {result.best.label} ({versus})")
    else:
        lines.append("\nno configuration met the bound")
    return "\n".join(lines)


def plot(result: TuneResult, path: str | Path) -> None:
    """Latency (P99) vs goodput of every configuration run, numbered as in the table, the
    chosen one marked; needs matplotlib (`pip install 'agentrt[plot]'`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for index, trial in enumerate(result.trials):
        run = trial.latest()
        if run is None:
            continue
        chosen = trial is result.best
        ax.scatter(
            run.goodput,
            p99(run, result.bound_on),
            marker="*" if chosen else "o",
            s=220 if chosen else 40,
            color="tab:red" if chosen else ("tab:blue" if trial.final else "tab:gray"),
            zorder=3 if chosen else 2,
            label=f"#{index} {trial.label}" if trial.final else None,  # finalists named
        )
        ax.annotate(
            f"#{index}",
            (run.goodput, p99(run, result.bound_on)),
            fontsize=7,
            xytext=(4, 4),
            textcoords="offset points",
        )
    ax.axhline(result.bound_ms, color="tab:red", linestyle="--", linewidth=1, label="bound")
    ax.set_xlabel("goodput (valid completions / s)")
    ax.set_ylabel(f"P99 {result.bound_on.upper()} (ms)")
    ax.set_title("agentrt tune: # as in the table; gray = screened only, star = chosen")
    ax.legend(loc="upper left", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
