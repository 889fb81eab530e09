"""The GGUF header index (gguf_reader.py `GGUFContainer.index`): a cached start reads the
header from the metadata cache, exactly as a walk reads it, and only while the file matches."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from agentrt.engine.loader import gguf_file, gguf_reader
from agentrt.engine.loader.gguf_file import embedded_gguf_path, gguf_metadata, open_gguf
from agentrt.engine.loader.gguf_reader import GGUFContainer, LazyStrings

from .gguf_files import write_tiny_gguf


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    return write_tiny_gguf(tmp_path_factory.mktemp("reader") / "tiny-llama.gguf")


def _contents(container: GGUFContainer) -> tuple:
    fields = {
        key: list(value) if isinstance(value, LazyStrings) else value
        for key, value in container.fields.items()
    }
    tensors = [
        (t.name, t.shape, t.tensor_type, t.offset, t.n_bytes, t.data.shape)
        for t in container.tensors
    ]
    return container.version, fields, tensors


@pytest.mark.parametrize("which", ["embedded", "tiny"])
def test_an_index_reads_what_the_walk_reads(which, tiny_gguf) -> None:
    path = embedded_gguf_path() if which == "embedded" else tiny_gguf
    walked = GGUFContainer(path)
    index = json.loads(json.dumps(walked.index()))  # as the cache stores it
    indexed = GGUFContainer(path, index)
    assert indexed._index is not None  # taken, not parsed again
    tokens = indexed.fields["tokenizer.ggml.tokens"]
    assert isinstance(tokens, LazyStrings) and tokens._values is None  # still decoded lazily
    assert _contents(indexed) == _contents(walked)
    assert isinstance(indexed.fields["tokenizer.ggml.token_type"], list)
    assert indexed.index() == index


def test_an_index_that_does_not_match_the_file_is_not_used(tiny_gguf, tmp_path) -> None:
    index = GGUFContainer(tiny_gguf).index()
    expected = _contents(GGUFContainer(tiny_gguf))
    stale = [
        {**index, "table_pos": index["table_pos"] + 8},  # not where the table starts
        {**index, "size": index["size"] + 1},
        {**index, "head": [index["head"][0], index["head"][1] + 1, index["head"][2]]},
        {**index, "version": gguf_reader.INDEX_VERSION + 1},
    ]
    for bad in stale:
        container = GGUFContainer(tiny_gguf, bad)
        assert container._index is None
        assert _contents(container) == expected
    # Another file of the same size: the first tensor's name is not where the index says.
    other = write_tiny_gguf(tmp_path / "other.gguf", hidden=128)
    assert GGUFContainer(other, index)._index is None


def test_a_cached_start_does_not_walk_the_header(tiny_gguf, monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("AGENTRT_CACHE_DIR", str(tmp_path / "cache"))
    gguf_file._open_cached.cache_clear()
    gguf_metadata(tiny_gguf)  # the first start: walks, and caches the index with the metadata
    walked = _contents(open_gguf(tiny_gguf).reader)
    gguf_file._open_cached.cache_clear()

    def refuse(self):
        raise AssertionError("the header was walked")

    monkeypatch.setattr(gguf_reader._Header, "read_fields", refuse)
    reader = open_gguf(tiny_gguf).reader
    assert reader._index is not None and _contents(reader) == walked
    gguf_file._open_cached.cache_clear()


def test_a_gguf_start_imports_no_gguf_py_or_transformers(tiny_gguf) -> None:
    """A start with the metadata cached, to the first token: no gguf-py (and so no yaml), no
    transformers, no server stack; the header comes from the index. LLM's module imports no
    torch (LLM(...) does: engine/client/llm.py), and the garbage collector makes no pass
    while LLM(...) imports it and builds the engine, whose objects are then frozen."""
    gguf_metadata(tiny_gguf)
    code = (
        "import gc, sys\n"
        "from agentrt.engine.client.llm import LLM\n"
        "from agentrt.engine.loader.gguf_file import open_gguf\n"
        "from agentrt.engine.sampling_params import SamplingParams\n"
        "print('torch' in sys.modules)\n"
        "passes = []\n"
        "gc.callbacks.append(lambda phase, info: passes.append(phase))\n"
        "llm = LLM(sys.argv[1], kv_cache_memory_gb=0.05)\n"
        "print(len(passes), gc.isenabled(), gc.get_freeze_count() > 0)\n"
        "out = llm.generate(['Hello'], SamplingParams(temperature=0.0, max_tokens=2))\n"
        "print(len(out[0].outputs[0].token_ids), open_gguf(sys.argv[1]).reader._index is not None)\n"
        "heavy = ('gguf', 'yaml', 'transformers', 'fastapi', 'uvicorn', 'agentrt.server')\n"
        "print(sorted(m for m in sys.modules if m in heavy))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code, str(tiny_gguf)],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, AGENTRT_NUM_THREADS="1"),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    before_torch, collector, generated, imported = result.stdout.splitlines()[-4:]
    assert before_torch == "False"
    assert collector == "0 True True"
    assert generated == "2 True"
    assert imported == "[]"


def test_a_later_llm_pauses_the_collector_without_freezing(tiny_gguf, monkeypatch) -> None:
    """With torch already imported, LLM(...) builds its engine with the collector paused and
    freezes nothing (a freeze would keep other code's uncollected garbage); the collector's
    state is restored after a build and after a failed one."""
    import gc

    from agentrt.engine.client import llm_engine
    from agentrt.engine.client.llm import LLM
    from agentrt.engine.errors import EngineError

    collecting = []  # the collector's state through each engine build
    build = llm_engine.LLMEngine.__init__

    def recorded(self, *args, **kwargs):
        collecting.append(gc.isenabled())
        build(self, *args, **kwargs)
        collecting.append(gc.isenabled())

    monkeypatch.setattr(llm_engine.LLMEngine, "__init__", recorded)
    frozen = gc.get_freeze_count()
    try:
        LLM(str(tiny_gguf), kv_cache_memory_gb=0.05)
        assert (collecting, gc.isenabled(), gc.get_freeze_count()) == ([False, False], True, frozen)
        with pytest.raises(EngineError):
            LLM(str(tiny_gguf), dtype="no-such-dtype")
        assert gc.isenabled()
        gc.disable()
        LLM(str(tiny_gguf), kv_cache_memory_gb=0.05)
        assert not gc.isenabled()
    finally:
        gc.enable()
