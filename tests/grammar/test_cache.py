"""Compile caches (cache.py): the byte-bounded LRU of grammars and the on-disk routing cache."""

from __future__ import annotations

import pytest

from agentrt.grammar import GrammarCompiler, GrammarSpec
from agentrt.grammar.cache import DiskCache, GrammarCache, RoutedSource

from .helpers import SYNTH_VOCAB


def test_an_equal_spec_gets_the_same_compiled_grammar(synth_tok) -> None:
    compiler = GrammarCompiler(synth_tok, vocab_size=SYNTH_VOCAB)
    first = compiler.compile(GrammarSpec.from_json_schema({"type": "object", "required": ["a"]}))
    # The same schema written another way is an equal spec: no second compile.
    again = compiler.compile(GrammarSpec.from_json_schema('{"required": ["a"], "type": "object"}'))
    assert again is first and compiler.cache.hits == 1 and len(compiler.cache) == 1
    assert compiler.compile_async(GrammarSpec.from_choice(["b", "a", "b"])).result(10) is (
        compiler.compile(GrammarSpec.from_choice(["a", "b"]))
    )


def test_the_lru_stays_within_its_byte_bound() -> None:
    cache = GrammarCache(max_bytes=100)
    cache.put("a", "A", 40)
    cache.put("b", "B", 40)
    assert cache.get("a") == "A"  # now b is the least recently used
    cache.put("c", "C", 40)
    assert cache.get("b") is None and cache.get("a") == "A" and cache.get("c") == "C"
    assert len(cache) == 2 and cache.num_bytes == 80 <= cache.max_bytes
    cache.put("a", "A2", 60)  # replacing an entry counts its new size only
    assert cache.get("a") == "A2" and cache.num_bytes == 100
    cache.put("huge", "H", 101)  # larger than the whole cache: never kept, evicts nothing
    assert cache.get("huge") is None and len(cache) == 2
    assert (cache.hits, cache.misses) == (4, 2)


def test_a_negative_bound_is_refused() -> None:
    with pytest.raises(ValueError, match="max_bytes must be >= 0"):
        GrammarCache(-1)


def test_the_disk_cache_round_trips_a_routing_decision(tmp_path) -> None:
    disk = DiskCache(tmp_path / "grammars")
    routed = RoutedSource("xgrammar", "json", '{"type":"string"}', [["type", "enforced"]], True)
    disk.put("k1", routed)
    assert disk.get("k1") == routed and disk.get("k2") is None
    assert [p.name for p in (tmp_path / "grammars").iterdir()] == ["k1.json"]  # no temp file
    (tmp_path / "grammars" / "k3.json").write_text("{not json")
    assert disk.get("k3") is None  # a damaged entry is a miss, not an error


def test_a_new_compiler_reuses_the_routing_from_disk(synth_tok, tmp_path, monkeypatch) -> None:
    spec = GrammarSpec.from_json_schema({"type": "array", "uniqueItems": True})
    first = GrammarCompiler(synth_tok, disk_cache_dir=str(tmp_path)).compile(spec)

    def no_routing(*args, **kwargs):
        raise AssertionError("routed again despite the disk cache")

    monkeypatch.setattr("agentrt.grammar.compiler.compile_spec", no_routing)
    again = GrammarCompiler(synth_tok, disk_cache_dir=str(tmp_path)).compile(spec)
    assert again is not first and again.report == first.report and again.gate_eos
