"""`agentrt tune` on a tiny model and a tiny search space: it finishes, never chooses a
configuration over the latency bound, and its file round-trips into `serve` and `Runtime`."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import httpx
import pytest

from agentrt.bench import DatasetConfig, LoadConfig, run_benchmark
from agentrt.bench.results import RequestRecord, build_result
from agentrt.bench.tune import MIN_GAIN, SearchSpace, Trial, choose, p99, tune
from agentrt.bench.tune_report import config_file, format_table
from agentrt.cli import build_parser, main
from agentrt.engine.args import EngineArgs
from agentrt.runtime import Runtime
from agentrt.server.state import ServerConfig
from tests.agentrt.server.helpers import ServerProcess


@pytest.fixture(scope="module")
def base(tiny_checkpoint) -> EngineArgs:
    return EngineArgs(model=str(tiny_checkpoint("llama")), dtype="float32", kv_cache_memory_gb=0.02)


DATASET = DatasetConfig(name="extraction", num_prompts=8, output_len=48)


@pytest.mark.slow
def test_a_configuration_over_the_bound_is_never_chosen(base):
    """One request at a time (max_num_seqs=1) makes the last of 8 simultaneous requests wait
    for the other 7: its TTFT is ~7 requests long (measured ~1.1 s here), against ~15 ms for
    a batch of 8. A TTFT bound of 3 requests' time lets batching configurations through
    and never that one. (Free text: on the tiny model grammar compiles would dominate.)"""
    text = DatasetConfig(name="random", num_prompts=8, input_len=32, output_len=96)
    one = run_benchmark(
        "latency", text, LoadConfig(num_iters=3, num_iters_warmup=1), engine_args=base
    )
    bound_ms = 3 * one.e2e_ms.p50
    result = tune(
        base,
        SearchSpace(max_num_seqs=(1, 8)),
        text,
        LoadConfig(),
        bound_ms=bound_ms,
        bound_on="ttft",
        screen_prompts=4,
        keep=2,
    )
    by_seqs = {t.args.max_num_seqs: t for t in result.trials}
    assert set(by_seqs) == {1, 8, base.max_num_seqs}
    serial = by_seqs[1]
    assert serial.status.startswith(("over bound", "pruned")), format_table(result)
    assert result.best is not None and result.best is not serial
    assert p99(result.best.final, "ttft") <= bound_ms
    assert result.baseline.final is not None  # always measured in full
    for trial in result.trials:
        assert trial.status, trial.label  # every configuration has a verdict
    table = format_table(result)
    assert "seqs=1" in table and "seqs=8" in table and "baseline" in table

    # Nothing meets an impossible bound: no winner, and nothing to write.
    hopeless = tune(base, SearchSpace(), text, LoadConfig(), bound_ms=1e-3, screen_prompts=8)
    assert hopeless.best is None
    assert hopeless.baseline.status.startswith("over bound")


def test_a_winner_needs_the_minimum_gain_over_the_baseline():
    """Within the bound, 2% more goodput than the baseline is run-to-run noise here: the
    baseline stays, and the table says why; 10% more wins. A baseline over the bound has no
    say: the best configuration within it wins."""

    def trials(*goodputs: float) -> list[Trial]:
        return [
            Trial({"max_num_seqs": i} if i else {}, None, final=SimpleNamespace(goodput=g))
            for i, g in enumerate(goodputs)
        ]

    baseline, close = trials(4.33, 4.42)
    assert choose([baseline, close], baseline, 0.05) is baseline
    assert baseline.status == "best"
    assert close.status == "within bound (1.02x: under the 5% minimum gain)"
    baseline, close, far = trials(4.33, 4.42, 4.80)
    assert choose([baseline, close, far], baseline, 0.05) is far
    assert [t.status for t in (baseline, close)] == ["within bound"] * 2
    baseline, close = trials(4.33, 4.42)
    assert choose([close], baseline, 0.05) is close
    assert choose([], baseline, 0.05) is None


@pytest.mark.slow
def test_the_written_file_round_trips_into_serve_and_runtime(base, tmp_path):
    path = tmp_path / "tuned.json"
    code = main(
        [
            # The screen is the whole workload (no pruning on a noisy machine's short run):
            # both configurations get final figures, so the choice below is the rule's.
            "tune", "--num-prompts", "4", "--screen-prompts", "4", "--output-len", "32",
            "--max-p99-e2e-ms", "600000",
            "--max-num-seqs-list", "4", "--jump-forward-list", "off",
            "--model", base.model, "--dtype", "float32", "--kv-cache-memory-gb", "0.02",
            "--output", str(path), "--plot", str(tmp_path / "tune.png"),
            "--result-json", str(tmp_path / "trials.json"),
        ]
    )  # fmt: skip
    assert code == 0
    written = json.loads(path.read_text())
    assert written["engine_args"]["model"] == base.model
    assert written["tune"]["goodput"] > 0 and math.isfinite(written["tune"]["p99_ms"])
    assert (tmp_path / "tune.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    trials = json.loads((tmp_path / "trials.json").read_text())
    assert [t["configuration"] for t in trials] == ["baseline", "seqs=4 jf=False"]
    # The file names the configuration its own figures choose (the bound is loose: both
    # are within it): the other one only with MIN_GAIN more goodput than the baseline.
    baseline, other = (t["final"]["goodput"] for t in trials)
    expected = "seqs=4 jf=False" if other >= (1 + MIN_GAIN) * baseline else "baseline"
    assert written["tune"]["chosen"] == expected, trials
    assert ("max_num_seqs" in written["engine_args"]) == (expected != "baseline")

    expected = EngineArgs(**written["engine_args"])
    assert Runtime(config=path)._local.args == expected
    parsed = build_parser().parse_args(["serve", "--config", str(path)])
    assert EngineArgs.from_cli_args(parsed) == expected
    with ServerProcess("--config", str(path)) as server:  # it serves with those options
        card = httpx.get(server.url + "/v1/models").json()["data"][0]
        assert card["id"] == ServerConfig(engine_args=EngineArgs(model=base.model)).model_name


def fake_measure(goodputs: dict[str, float]):
    """A measure whose figures the test sets: every request valid, completed in
    `1 / goodput` s each, one after another (`goodputs` by `max_num_seqs`)."""

    def measure(args: EngineArgs, workload: DatasetConfig, load: LoadConfig):
        seconds = 1 / goodputs[str(args.max_num_seqs)]
        records = [
            RequestRecord(ok=True, output_tokens=8, ttft=0.001, e2e=seconds, valid=True)
            for _ in range(workload.num_prompts)
        ]
        return build_result("structured", {}, records, seconds * workload.num_prompts)

    return measure


@pytest.mark.parametrize(("gain", "chosen"), [(2.0, "seqs=4"), (1 + MIN_GAIN / 2, "baseline")])
def test_config_file_records_what_was_chosen(base, gain, chosen):
    """A configuration with twice the baseline's goodput is written; one with half the
    minimum gain is not (the baseline's options, the defaults, are)."""
    goodputs = {str(base.max_num_seqs): 4.0, "4": 4.0 * gain}
    result = tune(
        base, SearchSpace(max_num_seqs=(4,)), DATASET, LoadConfig(), bound_ms=600000,
        screen_prompts=2, measure=fake_measure(goodputs),
    )  # fmt: skip
    written = config_file(result, DATASET)
    assert written["tune"]["chosen"] == chosen, format_table(result)
    assert written["tune"]["configurations_tried"] == 2
    assert written["tune"]["load"]["goodput_e2e_ms"] == 600000
    won = chosen != "baseline"
    assert written["engine_args"].get("max_num_seqs") == (4 if won else None)
    assert written["tune"]["goodput"] == pytest.approx(4.0 * gain if won else 4.0, rel=1e-3)
    assert written["tune"]["gain_vs_baseline"] == pytest.approx(gain if won else 1.0, rel=1e-3)


def test_bad_search_options_are_refused():
    from agentrt.bench import BenchConfigError

    with pytest.raises(BenchConfigError, match="medusa"):
        SearchSpace(speculative=("off", "medusa"))
    with pytest.raises(BenchConfigError, match="draft model"):
        SearchSpace(speculative=("draft_model",))
    with pytest.raises(BenchConfigError, match="'num_spec_tokens'.*'num_speculative_tokens'"):
        SearchSpace(speculative=("suffix:num_spec_tokens=4",))
    options = SearchSpace(speculative=("off", "suffix:disable_by_batch_size=0")).changes()
    assert options == [
        {"speculative_config": None},
        {"speculative_config": {"method": "suffix", "disable_by_batch_size": 0}},
    ]
    with pytest.raises(SystemExit):
        build_parser().parse_args(["tune"])  # a bound is required
    with pytest.raises(SystemExit):
        build_parser().parse_args(["tune", "--max-p99-e2e-ms", "1", "--jump-forward-list", "x"])
    with pytest.raises(BenchConfigError, match="min_gain=-0.1"):
        tune(EngineArgs(), SearchSpace(), DATASET, LoadConfig(), bound_ms=1, min_gain=-0.1)


def test_secrets_never_reach_result_files(base):
    # The kv secret used to be written with every other engine option.
    import dataclasses
    import secrets

    from agentrt.bench.runner import _without_userinfo, public_options

    secret = secrets.token_hex(16)
    args = dataclasses.replace(base, kv_secret=secret)
    assert "kv_secret" not in public_options(args)
    assert public_options(args)["max_num_seqs"] == args.max_num_seqs
    goodputs = {str(base.max_num_seqs): 4.0, "4": 8.0}
    result = tune(
        args, SearchSpace(max_num_seqs=(4,)), DATASET, LoadConfig(), bound_ms=600000,
        screen_prompts=2, measure=fake_measure(goodputs),
    )  # fmt: skip
    assert secret not in json.dumps(config_file(result, DATASET))
    assert _without_userinfo("http://me:pw@host:8000/v1") == "http://host:8000/v1"


def test_the_prefill_cap_is_searched_per_machine(base):
    """`--long-prefill-token-threshold-list` (the cap on one request's prefill chunk while
    others run) becomes trials whose engines schedule with that cap; the device's default
    cap (64 on the CPU) is the baseline, not tried twice; the winner's cap is written."""
    parsed = build_parser().parse_args(
        ["tune", "--max-p99-e2e-ms", "1", "--long-prefill-token-threshold-list", "64,256,0"]
    )
    assert parsed.long_prefill_token_threshold_list == (64, 256, 0)
    caps_run = []

    def measure(args: EngineArgs, workload: DatasetConfig, load: LoadConfig):
        cap = args.create_engine_config().scheduler.long_prefill_token_threshold
        caps_run.append(cap)
        seconds = {64: 0.5, 256: 0.25, 0: 0.4}[cap]
        records = [RequestRecord(ok=True, output_tokens=8, ttft=0.001, e2e=seconds, valid=True)]
        return build_result("structured", {}, records * workload.num_prompts, seconds)

    space = SearchSpace(long_prefill_token_threshold=parsed.long_prefill_token_threshold_list)
    result = tune(
        base, space, DATASET, LoadConfig(), bound_ms=600000, screen_prompts=2, measure=measure
    )
    assert [t.label for t in result.trials] == ["baseline", "prefill_cap=256", "prefill_cap=0"]
    assert set(caps_run) == {64, 256, 0}
    assert result.best.label == "prefill_cap=256", format_table(result)
    assert config_file(result, DATASET)["engine_args"]["long_prefill_token_threshold"] == 256
