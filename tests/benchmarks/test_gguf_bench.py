"""benchmarks/gguf.py without llama.cpp: its synthetic GGUF writer makes a llama file that
gguf-py reads back as written (shapes, types, weights, the embedded tokenizer, the metadata),
its decode ratio is the median of its alternating rounds, and bad options are refused before
anything runs (exit status 2, the option named)."""

from __future__ import annotations

import importlib.util
import pathlib
import subprocess
import sys

import numpy as np
import pytest

SCRIPT = pathlib.Path(__file__).parents[2] / "benchmarks" / "gguf.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("gguf_bench", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


@pytest.mark.slow
def test_synthetic_file_reads_back(bench, tmp_path):
    import gguf

    from agentrt.engine.model.checkpoint import gguf_source

    shape = bench.Shape(64, 2, 128, 4, 2, 10000.0, 256)
    path = tmp_path / "tiny.gguf"
    bench.write_synthetic(path, shape, gguf_source(None), seed=0)

    reader = gguf.GGUFReader(path)
    source = gguf.GGUFReader(gguf_source(None))
    vocab = len(source.fields["tokenizer.ggml.tokens"].data)
    expected = bench.synthetic_tensors(shape, vocab)
    assert [t.name for t in reader.tensors] == [name for name, _ in expected]
    for tensor, (_, dims) in zip(reader.tensors, expected, strict=True):
        assert tuple(tensor.data.shape) == dims
        kind = gguf.GGMLQuantizationType.F32 if len(dims) == 1 else gguf.GGMLQuantizationType.F16
        assert tensor.tensor_type == kind
    weights = {t.name: np.asarray(t.data, np.float32) for t in reader.tensors}
    assert np.all(weights["blk.0.attn_norm.weight"] == 1)
    assert abs(weights["blk.1.ffn_down.weight"].std() - bench.WEIGHT_STD) < 0.002
    tokens = reader.fields["tokenizer.ggml.tokens"]
    assert tokens.contents() == source.fields["tokenizer.ggml.tokens"].contents()
    assert reader.fields["tokenizer.chat_template"].contents().startswith("{%")
    fields = {
        key: reader.fields[f"llama.{key}"].contents()
        for key in ("embedding_length", "block_count", "feed_forward_length", "vocab_size")
    }
    assert fields == {
        "embedding_length": 64,
        "block_count": 2,
        "feed_forward_length": 128,
        "vocab_size": vocab,
    }
    assert reader.fields["llama.attention.head_count_kv"].contents() == 2


def test_decode_ratio_is_the_median_of_the_rounds(bench):
    def side(decode: float) -> dict:
        return {
            "written_bytes": 0,
            "load_s": 1.0,
            "peak_rss_mib": 100.0,
            "decode_tok_s": decode,
            "prefill_tok_s": 1.0,
            "batch_tok_s": 1.0,
            "top_ids": [],
        }

    result = {
        "size_bytes": 1000,
        "agentrt": side(30.0),
        "llama_cpp": side(40.0),
        # Round ratios 0.75, 1.2, 1.1 (the first is the main run's).
        "decode_rounds": {"agentrt": [30.0, 48.0, 44.0], "llama_cpp": [40.0, 40.0, 40.0]},
    }
    ratios = bench.compare(result)["vs_llama_cpp"]
    assert ratios["decode"] == pytest.approx(1.1)
    assert ratios["decode_first_round"] == pytest.approx(0.75)
    assert result["targets_met"]["decode"] is True


@pytest.mark.parametrize(
    ("options", "named"),
    [
        (["--threads", "0"], "--threads"),
        (["--decode-rounds", "0"], "--decode-rounds"),
        (["--kv-cache-memory-gb", "0"], "--kv-cache-memory-gb"),
        (["--types", "--no-embedded", "--no-llama-cpp"], "nothing to run"),
        (["--types", "Q5_K"], "--types"),
        (["--llama-python", sys.executable + "-missing"], "--llama-python"),
        (["--llama-python", sys.executable], "cannot import llama_cpp"),
    ],
)
def test_bad_options_are_refused(tmp_path, options, named):
    if named == "cannot import llama_cpp" and importlib.util.find_spec("llama_cpp"):
        pytest.skip("this interpreter has llama_cpp")
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--files-dir", str(tmp_path), *options],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2, done.stderr
    assert named in done.stderr
    assert list(tmp_path.iterdir()) == []  # nothing made
