"""GGUF files as users download them: agentrt vs llama-cpp-python, side by side in one run,
2 threads each, on GGUF files of popular small models' shapes made the way published files
are made (gguf_models.py: a random HF checkpoint, llama.cpp's converter, llama.cpp's quantizer
to Q4_K_M, which gives each shape its real type mix), and on the embedded
SmolLM2-135M-Instruct (Q4_1). Defaults on both sides.

Files (--models; gguf_models.SHAPES): Qwen2.5-0.5B (hidden 896: mostly Q5_0, a tied Q8_0
151,936-row output), Qwen2.5-1.5B (Q4_K + Q6_K, Q6_K output), Llama-3.2-1B (128,256-row tied
output, llama3 rope scaling), Qwen3-0.6B (q/k norm); TinyLlama-1.1B's shape on request (the
earlier runs'); issue 40's families on request, each held to its own targets: SmolLM3-3B (NoPE
layers), Granite-3.3-2B (multipliers), OLMo2-1B (post-norms), Phi-3.5-mini (fused qkv and
gate_up, LongRoPE; prompts of its own tokenizer), and qwen3-moe-48e (a 3.4 GiB
Qwen3-MoE: decode >= 1.0x, batch of 16 >= 2x llama.cpp's one request; run it with
--no-reference: the fp32 reference would need ~22 GiB). Qwen shapes carry the real Qwen2.5
tokenizer, llama-style shapes the embedded one.
They are cached in --files-dir (default ~/.cache/agentrt-bench/gguf, with the F16 sources)
and reused. On random weights the perplexity is near the vocabulary size: it compares the
engines and the quantizations of one model, nothing more; the embedded model gives the
figure on real weights.

Per file, each engine in its own subprocess (its own memory), the file in the page cache:
  load      first load: wall time of the constructor (agentrt with an empty model cache in
            --agentrt-cache-dir; its C kernels are built beforehand, by a warm-up run)
  start     process start to the first generated token of a 1-token request: --start-rounds
            fresh processes each side, the median (agentrt with its metadata cached), and
            agentrt's first start on the file (model cache emptied)
  peak RSS  VmHWM after the load, one request and the prefill (the work both sides do);
            agentrt's after 16 concurrent requests as well (`peak_rss_batch_mib`)
  written   /proc/self/io write_bytes during the load (agentrt: also its cache's growth)
  decode    one request, a short chat prompt, 128 tokens greedy, EOS ignored: tokens/s from
            the first token to the last; then --decode-rounds - 1 more rounds of decode alone,
            each engine in a fresh process in turn (one engine's rate moves 15-30% between
            runs on a shared machine): the ratio is the median round's
  prefill   a 512-token prompt, nothing cached, best of 2: prompt tokens/s
  batch16   agentrt: 16 concurrent requests of 128 tokens, output tokens/s; llama-cpp-python
            serves one request at a time: its figure is its decode rate
  quality   perplexity of latency.PPL_TEXT, teacher forced (the same token ids on every
            side; agentrt in steps of latency.PPL_CHUNK rows), and the share of positions
            whose top token is the reference's, and agentrt's whose top token is llama.cpp's;
            the reference is the GGUF dequantized to fp32: by default agentrt's dense path
            (`quantization="none"`, fp32), which gives transformers' perplexity to 1e-7
            (Qwen2.5-0.5B Q4_K_M 181,132.094 vs 181,132.108; Qwen2.5-1.5B 220,965.334 vs
            220,965.355: an earlier 223,236 there was not reproduced on a clean tree), in a
            quarter of the time; --reference-engine transformers for HF transformers' own
            (`from_pretrained(dir, gguf_file=..., dtype=float32)`; Qwen2.5-1.5B: 217 s and
            7.9 GB peak on a loaded 2-core AMD EPYC)
Ratios are agentrt / llama.cpp measured in the same run, printed beside issue 39's targets
(TARGETS). The CPU model is printed first; last line: JSON with every figure.

llama-cpp-python is optional and may live in another interpreter, `--llama-python` (it needs
numpy and llama_cpp there; the agentrt side runs in this one). Making the files needs it too
(the quantizer) and llama.cpp's converter, `--llama-cpp-dir`: vendor/llama.cpp of the same
sdist, run by that interpreter with the converter's requirements. So, once:
    python3 -m venv ../bench-venv
    CMAKE_ARGS="-DGGML_NATIVE=ON" ../bench-venv/bin/pip install llama-cpp-python==0.3.36
    ../bench-venv/bin/pip install torch==2.13.0 transformers safetensors sentencepiece
    pip download --no-binary :all: --no-deps llama-cpp-python==0.3.36 -d ../llama-sdist
    tar xzf ../llama-sdist/llama_cpp_python-0.3.36.tar.gz -C ../llama-sdist
(~10 minutes on 2 cores; latency.py says how to build it where the CPU reports AMX but the
VM does not grant it). Then:
    .venv/bin/python benchmarks/gguf.py --llama-python ../bench-venv/bin/python \
        --llama-cpp-dir ../llama-sdist/llama_cpp_python-0.3.36/vendor/llama.cpp
    .venv/bin/python benchmarks/gguf.py --llama-python ... --models qwen2.5-0.5b --no-embedded
    .venv/bin/python benchmarks/gguf.py --no-llama-cpp --no-reference    # agentrt alone
    .venv/bin/python benchmarks/gguf.py --llama-python ... --quality-only  # quality alone
A full run takes ~25 minutes on 2 cores with the files made (making them: ~15 more).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

# This file's folder goes last on the module path: first, this file would hide gguf-py (which
# `import gguf` means here, and in transformers); `import latency` still finds its neighbour.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE] + [str(_HERE)]

TYPES = ("Q4_K_M", "Q4_0", "Q8_0")
MODELS = ("qwen2.5-0.5b", "qwen2.5-1.5b", "llama-3.2-1b", "qwen3-0.6b")  # the default run
EMBEDDED = "embedded"
DECODE_TOKENS = 128
PREFILL_TOKENS = 512
BATCH = 16
LLAMA_N_CTX = 2048
# Issue 39's targets: agentrt / llama.cpp ratios (peak RSS on files of RSS_TARGET_MIN_MIB or
# more), the share of the file written, perplexity against the fp32 reference, and start-up
# in seconds (process start to first token, metadata cached; a first start on a new file).
TARGETS = {
    "decode": 1.15,
    "prefill": 2.0,
    "peak_rss": 1.1,
    "written": 0.01,
    "perplexity": 0.01,
    "start_s": 2.5,
    "start": 2.0,
    "first_start_s": 5.0,
}
RSS_TARGET_MIN_MIB = 400


class BenchError(RuntimeError):
    """A worker failed or the setup cannot run; the message says what to do."""


# -- the files ------------------------------------------------------------------------------------


def prepare_files(args: argparse.Namespace) -> dict[str, Path]:
    """The GGUF file of each benchmarked model and kind, made once (gguf_models: checkpoint,
    converter, quantizer) and cached in --files-dir; every file appears there complete or not
    at all. Keys are "model kind"."""
    from gguf_models import SHAPES, VERSION, convert, write_checkpoint

    from agentrt.engine.loader.checkpoint import gguf_source

    files: dict[str, Path] = {}
    args.files_dir.mkdir(parents=True, exist_ok=True)
    for model in args.models:
        stem = f"{model}-v{VERSION}-s{args.seed}"
        source = args.files_dir / f"{stem}-F16.gguf"
        for kind in args.types:
            path = args.files_dir / f"{stem}-{kind}.gguf"
            if not path.is_file():
                if args.llama_python is None or args.llama_cpp_dir is None:
                    raise BenchError(
                        f"{path} is not made yet, and making it needs llama.cpp's converter "
                        "and quantizer: pass --llama-python PATH (an interpreter with llama_cpp "
                        "and the converter's requirements) and --llama-cpp-dir DIR, once."
                    )
                if not source.is_file():
                    checkpoint = args.files_dir / f"{stem}-hf"
                    print(f"writing {checkpoint.name} (random, F16)", flush=True)
                    write_checkpoint(checkpoint, SHAPES[model], args.seed)
                    print(f"converting to {source.name} with llama.cpp", flush=True)
                    convert(args.llama_python, args.llama_cpp_dir, checkpoint, _partial(source))
                    _partial(source).rename(source)
                    shutil.rmtree(checkpoint)
                print(f"quantizing to {path.name} with llama.cpp", flush=True)
                job = {"source": str(source), "target": str(_partial(path)), "kind": kind}
                run_worker(args.llama_python, "quantize", job | {"threads": args.threads})
                _partial(path).rename(path)
            files[f"{model} {kind}"] = path
    if args.embedded:
        files[EMBEDDED] = gguf_source(None)
    return files


def _partial(path: Path) -> Path:
    return path.with_name(f".partial-{path.name}")


# -- measurements shared by the workers ----------------------------------------------------------


def peak_rss_mib() -> float:
    """This process's peak resident set (VmHWM) so far, MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise BenchError("/proc/self/status has no VmHWM: this benchmark needs Linux")


def written_bytes() -> int:
    """Bytes this process (and its reaped children) sent to storage so far."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("write_bytes:"):
            return int(line.split()[1])
    raise BenchError("/proc/self/io has no write_bytes: this benchmark needs Linux")


def token_scores(logits: np.ndarray, token_ids: list[int]) -> dict:
    """Teacher-forced scores: logits (n, vocab), row i predicting token i + 1."""
    rows = logits[:-1].astype(np.float64)
    top = rows.max(axis=1)
    log_norm = top + np.log(np.exp(rows - top[:, None]).sum(axis=1))
    targets = np.asarray(token_ids[1:])
    logprobs = rows[np.arange(len(targets)), targets] - log_norm
    return {
        "perplexity": float(np.exp(-logprobs.mean())),
        "top_ids": rows.argmax(axis=1).tolist(),
    }


# -- workers (each in its own process) -----------------------------------------------------------


def quantize_worker(job: dict) -> dict:
    import ctypes

    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{job['kind']}")
    params.nthread = job["threads"]
    status = llama_cpp.llama_model_quantize(
        job["source"].encode(), job["target"].encode(), ctypes.byref(params)
    )
    if status != 0:
        raise BenchError(f"llama_model_quantize to {job['kind']} failed with status {status}")
    return {}


def llama_worker(job: dict) -> dict:
    from llama_cpp import Llama

    threads = job["threads"]
    options = dict(n_threads=threads, n_threads_batch=threads, verbose=False, seed=0)
    if job.get("quality_only"):
        return _llama_scores(job["file"], job["ppl_ids"], options)
    written, start = written_bytes(), time.perf_counter()
    llm = Llama(job["file"], n_ctx=LLAMA_N_CTX, **options)
    result = {
        "load_s": time.perf_counter() - start,
        "written_bytes": written_bytes() - written,
        "peak_rss_load_mib": peak_rss_mib(),
    }
    _llama_tokens(llm, job["prompt_ids"], 8)  # warm-up
    llm.reset()
    start = time.perf_counter()
    times = _llama_tokens(llm, job["prompt_ids"], DECODE_TOKENS)
    result["decode_tok_s"] = (DECODE_TOKENS - 1) / (times[-1] - times[0])
    result["e2e_tok_s"] = DECODE_TOKENS / (times[-1] - start)
    if job.get("decode_only"):
        return result
    prefill_s = []
    for _ in range(2):
        llm.reset()  # else llama-cpp-python reuses the prefix it already holds
        start = time.perf_counter()
        llm.eval(job["prefill_ids"])
        prefill_s.append(time.perf_counter() - start)
    result["prefill_tok_s"] = len(job["prefill_ids"]) / min(prefill_s)
    result["batch_tok_s"] = result["decode_tok_s"]  # one request at a time
    result["peak_rss_mib"] = peak_rss_mib()
    del llm  # a second instance keeps every position's logits (the perplexity)
    return result | _llama_scores(job["file"], job["ppl_ids"], options)


def _llama_scores(file: str, ppl_ids: list[int], options: dict) -> dict:
    from llama_cpp import Llama

    llm = Llama(file, n_ctx=len(ppl_ids), n_batch=len(ppl_ids), logits_all=True, **options)
    llm.eval(ppl_ids)
    logits = np.array(llm.scores[: len(ppl_ids)], dtype=np.float32)  # (n, vocab)
    return token_scores(logits, ppl_ids)


def _llama_tokens(llm, prompt_ids: list[int], num_tokens: int) -> list[float]:
    """Greedy tokens after `prompt_ids` (llama-cpp-python's `generate` never stops on EOS:
    the caller stops it); the time each one came."""
    times = []
    for _, _token in zip(range(num_tokens), llm.generate(prompt_ids, temp=0.0), strict=False):
        times.append(time.perf_counter())
    return times


def agentrt_worker(job: dict) -> dict:
    import torch
    from latency import AGREEMENT_PROMPTS, teacher_forced_logits

    from agentrt.engine.client.llm import LLM
    from agentrt.engine.sampling_params import SamplingParams

    torch.set_num_threads(job["threads"])
    if job.get("quality_only"):
        llm = LLM(job["file"], kv_cache_memory_gb=job["kv_cache_memory_gb"])
        logits = teacher_forced_logits(llm, job["ppl_ids"]).float().numpy()
        return token_scores(logits, job["ppl_ids"])
    models = Path(os.environ["AGENTRT_CACHE_DIR"]) / "models"
    written, start = written_bytes(), time.perf_counter()
    llm = LLM(job["file"], kv_cache_memory_gb=job["kv_cache_memory_gb"])
    result = {
        "load_s": time.perf_counter() - start,
        "written_bytes": written_bytes() - written,
        "cache_growth_bytes": sum(p.stat().st_size for p in models.rglob("*") if p.is_file()),
        "peak_rss_load_mib": peak_rss_mib(),
        "dtype": str(llm.engine.model_config.dtype),
        "quantization": llm.engine.model_config.quantization,
    }

    def greedy(num_tokens: int) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_tokens=num_tokens, ignore_eos=True)

    llm.generate([job["prompt_ids"]], greedy(8))  # warm-up
    if job.get("warm_up_only"):
        return {}
    metrics = llm.generate([job["prompt_ids"]], greedy(DECODE_TOKENS))[0].metrics
    result["decode_tok_s"] = 1 / metrics.time_per_output_token
    result["e2e_tok_s"] = DECODE_TOKENS / (metrics.finished_time - metrics.arrival_time)
    if job.get("decode_only"):
        return result
    prefill_s = []
    for _ in range(2):
        llm.engine.reset_prefix_cache()
        start = time.perf_counter()
        llm.generate([job["prefill_ids"]], greedy(1))
        prefill_s.append(time.perf_counter() - start)
    result["prefill_tok_s"] = len(job["prefill_ids"]) / min(prefill_s)
    result["peak_rss_mib"] = peak_rss_mib()
    logits = teacher_forced_logits(llm, job["ppl_ids"]).float().numpy()
    result |= token_scores(logits, job["ppl_ids"])
    prompts = [f"{p} ({i})" for i, p in enumerate(AGREEMENT_PROMPTS * 2)][:BATCH]
    start = time.perf_counter()
    outputs = llm.generate(prompts, greedy(DECODE_TOKENS))
    num_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    result["batch_tok_s"] = num_tokens / (time.perf_counter() - start)
    result["peak_rss_batch_mib"] = peak_rss_mib()
    return result


def roofline_worker(job: dict) -> dict:
    """Tokens/s of reading what one decoded token of the file reads (module doc: roofline)."""
    import statistics

    import ggml_kernels

    positions = len(job["prompt_ids"]) + DECODE_TOKENS // 2
    buffers = [ggml_kernels.touched(n) for n in ggml_kernels.decode_reads(job["file"], positions)]
    walls = [ggml_kernels.read_buffers(buffers, job["threads"])[0] for _ in range(10)]
    return {"roofline_tok_s": 1 / statistics.median(walls[1:])}  # the first pass warms up


def start_worker(job: dict) -> dict:
    """Process start to the first token of a 1-token greedy request, measured in this fresh
    process against the parent's clock reading at the spawn (`spawned_at`, time.time())."""
    threads = job["threads"]
    if job["side"] == "llama_cpp":
        from llama_cpp import Llama

        options = dict(n_threads=threads, n_threads_batch=threads, verbose=False, seed=0)
        llm = Llama(job["file"], n_ctx=LLAMA_N_CTX, **options)
        next(iter(llm.generate(job["prompt_ids"], temp=0.0)))
    else:
        from agentrt.engine.client.llm import LLM
        from agentrt.engine.sampling_params import SamplingParams

        llm = LLM(job["file"], kv_cache_memory_gb=job["kv_cache_memory_gb"])
        llm.generate([job["prompt_ids"]], SamplingParams(temperature=0.0, max_tokens=1))
    return {"start_s": time.time() - job["spawned_at"]}


def reference_worker(job: dict) -> dict:
    """The file dequantized to fp32: agentrt's dense path, or transformers' (module doc)."""
    import torch

    torch.set_num_threads(job["threads"])
    if job["reference_engine"] == "transformers":
        from transformers import AutoModelForCausalLM

        path = Path(job["file"])
        model = AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32
        ).eval()
        with torch.inference_mode():
            logits = model(torch.tensor([job["ppl_ids"]])).logits[0].numpy()  # (n, vocab)
    else:
        from latency import teacher_forced_logits

        from agentrt.engine.client.llm import LLM

        llm = LLM(job["file"], quantization="none", dtype="float32", kv_cache_memory_gb=0.05)
        logits = teacher_forced_logits(llm, job["ppl_ids"]).float().numpy()
    return token_scores(logits, job["ppl_ids"])


WORKERS = {
    "quantize": quantize_worker,
    "llama": llama_worker,
    "agentrt": agentrt_worker,
    "reference": reference_worker,
    "start": start_worker,
    "roofline": roofline_worker,
}


def run_worker(python: str, worker: str, job: dict, env: dict | None = None) -> dict:
    """`job` through `worker` in a fresh `python` process; its result (its last stdout line)."""
    done = subprocess.run(
        [python, __file__, "--worker", worker],
        input=json.dumps(job),
        capture_output=True,
        text=True,
        env=env,
    )
    if done.returncode != 0:
        tail = "\n".join(done.stderr.strip().splitlines()[-25:])
        raise BenchError(f"the {worker} worker ({python}) exited {done.returncode}:\n{tail}")
    return json.loads(done.stdout.strip().splitlines()[-1])


# -- one file, both engines -----------------------------------------------------------------------


def bench_file(
    path: Path, args: argparse.Namespace, ids: dict, env: dict, targets: dict = TARGETS
) -> dict:
    """Every figure of one file: llama.cpp, agentrt, the reference, and the comparisons
    against `targets` (TARGETS, or a shape's own: gguf_models.ModelShape.targets)."""
    with path.open("rb") as f:  # into the page cache: both engines start from it
        while f.read(1 << 24):
            pass
    job = ids | {"file": str(path), "threads": args.threads}
    job |= {"reference_engine": args.reference_engine}
    result: dict = {"file": str(path), "size_bytes": path.stat().st_size, "targets": targets}
    if args.quality_only:
        return quality_file(job, result, args, env)
    if args.llama_python:
        result["llama_cpp"] = run_worker(args.llama_python, "llama", job)
    shutil.rmtree(args.agentrt_cache_dir / "models", ignore_errors=True)  # a first load
    job["kv_cache_memory_gb"] = args.kv_cache_memory_gb
    result["agentrt"] = run_worker(sys.executable, "agentrt", job, env)
    if args.reference:
        result["reference"] = run_worker(sys.executable, "reference", job, env)
    if args.llama_python:
        # One-request decode moves 15-30% between runs on a shared machine: more rounds,
        # each engine in a fresh process in turn; the ratio is the median round's.
        rounds = {side: [result[side]["decode_tok_s"]] for side in ("llama_cpp", "agentrt")}
        rounds["roofline"] = []
        for i in range(args.decode_rounds):
            if i:  # round 0 is the runs above
                done = run_worker(args.llama_python, "llama", job | {"decode_only": True})
                rounds["llama_cpp"].append(done["decode_tok_s"])
                done = run_worker(sys.executable, "agentrt", job | {"decode_only": True}, env)
                rounds["agentrt"].append(done["decode_tok_s"])  # its metadata cached by now
            rounds["roofline"].append(run_worker(sys.executable, "roofline", job)["roofline_tok_s"])
        result["decode_rounds"] = rounds
    if args.start_rounds:
        result["start"] = measure_start(args, job, env)
    return compare(result)


def quality_file(job: dict, result: dict, args: argparse.Namespace, env: dict) -> dict:
    """--quality-only: the teacher-forced scores of llama.cpp, agentrt and the reference."""
    job = job | {"quality_only": True, "kv_cache_memory_gb": args.kv_cache_memory_gb}
    if args.llama_python:
        result["llama_cpp"] = run_worker(args.llama_python, "llama", job)
    result["agentrt"] = run_worker(sys.executable, "agentrt", job, env)
    result["reference"] = run_worker(sys.executable, "reference", job, env)
    result["targets_met"] = compare_quality(result)
    return result


def measure_start(args: argparse.Namespace, job: dict, env: dict) -> dict:
    """Start-up, process start to first token: --start-rounds fresh processes a side in turn
    (agentrt's metadata is cached by the runs before), then agentrt's first start on the file
    (its model cache emptied)."""

    def start(python: str, side: str, env: dict | None = None) -> float:
        spawn = job | {"side": side, "spawned_at": time.time()}
        return run_worker(python, "start", spawn, env)["start_s"]

    figures: dict = {"agentrt": [], "llama_cpp": []}
    for _ in range(args.start_rounds):
        figures["agentrt"].append(start(sys.executable, "agentrt", env))
        if args.llama_python:
            figures["llama_cpp"].append(start(args.llama_python, "llama_cpp"))
    shutil.rmtree(args.agentrt_cache_dir / "models", ignore_errors=True)
    figures["agentrt_first"] = start(sys.executable, "agentrt", env)
    return figures


def compare(result: dict) -> dict:
    """Ratios against llama.cpp, quality against the reference, each target met or not."""
    ours, theirs = result["agentrt"], result.get("llama_cpp")
    goal = result.get("targets", TARGETS)
    targets: dict[str, bool] = {}
    share = ours["written_bytes"] / result["size_bytes"]
    result["written_share"] = share
    targets["written"] = share <= goal["written"]
    if theirs:
        decode = result.get("decode_rounds", {})
        rounds = (
            decode.get("agentrt", [ours["decode_tok_s"]]),
            decode.get("llama_cpp", [theirs["decode_tok_s"]]),
        )
        result["vs_llama_cpp"] = {
            "load": ours["load_s"] / theirs["load_s"],
            "peak_rss": ours["peak_rss_mib"] / theirs["peak_rss_mib"],
            "decode": median_ratio(*rounds),
            "decode_first_round": ours["decode_tok_s"] / theirs["decode_tok_s"],
            "prefill": ours["prefill_tok_s"] / theirs["prefill_tok_s"],
            "batch": ours["batch_tok_s"] / theirs["batch_tok_s"],
        }
        ratios = result["vs_llama_cpp"]
        if "roofline" in decode:  # the most a decode ratio can be; each side's share of it
            ratios["roofline"] = median_ratio(decode["roofline"], rounds[1])
            result["of_roofline"] = {
                side: median_ratio(decode[side], decode["roofline"])
                for side in ("agentrt", "llama_cpp")
            }
        targets["decode"] = ratios["decode"] >= goal["decode"]
        targets["prefill"] = ratios["prefill"] >= goal["prefill"]
        if "batch" in goal:  # a MoE's batch against llama.cpp's one request (issue 40)
            targets["batch"] = ratios["batch"] >= goal["batch"]
        if result["size_bytes"] >= RSS_TARGET_MIN_MIB * 2**20:
            targets["peak_rss"] = ratios["peak_rss"] <= goal["peak_rss"]
    start = result.get("start")
    if start:
        ours_s = float(np.median(start["agentrt"]))
        start["agentrt_median_s"] = ours_s
        targets["start_s"] = ours_s <= goal["start_s"]
        targets["first_start_s"] = start["agentrt_first"] <= goal["first_start_s"]
        if start["llama_cpp"]:
            start["llama_cpp_median_s"] = float(np.median(start["llama_cpp"]))
            start["ratio"] = ours_s / start["llama_cpp_median_s"]
            targets["start"] = start["ratio"] <= goal["start"]
    result["targets_met"] = targets | compare_quality(result)
    return result


def median_ratio(a: list[float], b: list[float]) -> float:
    """The median of the rounds' ratios a[i] / b[i]."""
    return float(np.median([x / y for x, y in zip(a, b, strict=True)]))


def compare_quality(result: dict) -> dict[str, bool]:
    """Each side's perplexity against the reference's and its share of positions whose top
    token is the reference's; agentrt's top tokens against llama.cpp's (`top1_vs_llama_cpp`).
    The top-token lists are dropped once compared."""
    ours, theirs, ref = (result.get(k) for k in ("agentrt", "llama_cpp", "reference"))
    targets = {}

    def agreement(a: dict, b: dict) -> float:  # nan without positions
        same = sum(x == y for x, y in zip(a["top_ids"], b["top_ids"], strict=True))
        return same / (len(b["top_ids"]) or math.nan)

    for side in (ours, theirs):
        if side and ref:
            side["top1_agreement"] = agreement(side, ref)
            side["perplexity_vs_reference"] = side["perplexity"] / ref["perplexity"] - 1
    if theirs:
        ours["top1_vs_llama_cpp"] = agreement(ours, theirs)
    if ref:
        targets["perplexity"] = (
            abs(ours["perplexity_vs_reference"]) <= result.get("targets", TARGETS)["perplexity"]
        )
    for side in (ours, theirs, ref):
        if side:
            side.pop("top_ids")
    return targets


def print_file(kind: str, r: dict) -> None:
    ours, theirs = r["agentrt"], r.get("llama_cpp") or {}
    ratios, met, goal = r.get("vs_llama_cpp", {}), r["targets_met"], r.get("targets", TARGETS)
    if "load_s" not in ours:  # --quality-only
        print(f"\n== {kind}: {Path(r['file']).name} ({r['size_bytes'] / 2**20:,.0f} MiB)")
        print_quality(r)
        return

    def row(label, key, fmt, ratio=None, target=""):
        a = format(theirs[key], fmt) if key in theirs else "-"
        b = format(ours[key], fmt)
        x = f"{ratios[ratio]:.2f}x" if ratio in ratios else ""
        verdict = ("met" if met[ratio] else "MISSED") if ratio in met else ""
        print(f"  {label:22s} {a:>12s} {b:>12s} {x:>9s}  {target:16s} {verdict}")

    quant = f"{ours['quantization']}, {ours['dtype'].removeprefix('torch.')}"
    print(f"\n== {kind}: {Path(r['file']).name} ({r['size_bytes'] / 2**20:,.0f} MiB)")
    print(f"  {'':22s} {'llama.cpp':>12s} {'agentrt':>12s} {'ratio':>9s}  target")
    print(f"  {'agentrt runs':22s} {'':>12s} {quant:>12s}")
    row("first load (s)", "load_s", ".2f", "load")
    start = r.get("start")
    if start:
        theirs_s = start.get("llama_cpp_median_s")
        ratio = f"{start['ratio']:.2f}x" if "ratio" in start else ""
        verdict = "met" if met["start_s"] and met.get("start", True) else "MISSED"
        target = f"<= {goal['start_s']} s, {goal['start']}x"
        print(
            f"  {'start to 1st token (s)':22s} {theirs_s or math.nan:>12.2f} "
            f"{start['agentrt_median_s']:>12.2f} {ratio:>9s}  {target:16s} {verdict}"
        )
        verdict = "met" if met["first_start_s"] else "MISSED"
        target = f"<= {goal['first_start_s']} s"
        print(
            f"  {'  first start (s)':22s} {'':>12s} {start['agentrt_first']:>12.2f} {'':>9s}  "
            f"{target:16s} {verdict}"
        )
    rss_target = f"<= {goal['peak_rss']}x" if "peak_rss" in met else "(file < 400 MiB)"
    row("peak RSS (MiB)", "peak_rss_mib", ",.0f", "peak_rss", rss_target)
    row("  after load (MiB)", "peak_rss_load_mib", ",.0f")
    written = f"{r['written_share']:.1%}"  # of the file
    print(
        f"  {'written on load (MiB)':22s} {theirs.get('written_bytes', 0) / 2**20:>12,.1f} "
        f"{ours['written_bytes'] / 2**20:>12,.1f} {written:>9s}  {'<= 1% of file':16s} "
        f"{'met' if met['written'] else 'MISSED'}"
    )
    row("decode 1 req (tok/s)", "decode_tok_s", ".2f", "decode_first_round")
    rounds = r.get("decode_rounds")
    if rounds:
        pairs = zip(rounds["llama_cpp"], rounds["agentrt"], strict=True)
        decode_target = f">= {goal['decode']}x"
        each = ", ".join(f"{b:.1f}/{a:.1f}" for a, b in pairs)
        print(
            f"  {'  rounds (ours/theirs)':22s} {each}\n  {'  median round':22s} {'':>12s} "
            f"{'':>12s} {ratios['decode']:>8.2f}x  {decode_target:16s} "
            f"{'met' if met['decode'] else 'MISSED'}"
        )
    if "roofline" in ratios:
        shares = r["of_roofline"]
        roofline = float(np.median(rounds["roofline"]))
        print(
            f"  {'  read roofline (tok/s)':22s} {shares['llama_cpp']:>11.0%}  "
            f"{shares['agentrt']:>11.0%} {ratios['roofline']:>8.2f}x  (its median {roofline:.1f}: "
            "each side's share, the most a ratio can be)"
        )
    row("  end to end (tok/s)", "e2e_tok_s", ".2f")
    prefill_target = f">= {goal['prefill']}x"
    row(f"prefill {PREFILL_TOKENS} (tok/s)", "prefill_tok_s", ".1f", "prefill", prefill_target)
    batch_target = f">= {goal['batch']}x 1 req" if "batch" in goal else "(llama.cpp: 1 req)"
    row(f"batch {BATCH} (out tok/s)", "batch_tok_s", ".2f", "batch", batch_target)
    print(f"  {'  peak RSS (MiB)':22s} {'':>12s} {ours['peak_rss_batch_mib']:>12,.0f}")
    print_quality(r)


def print_quality(r: dict) -> None:
    ours, theirs, met = r["agentrt"], r.get("llama_cpp") or {}, r["targets_met"]
    ref = r.get("reference")
    if ref:
        for name, side in (("llama.cpp", theirs), ("agentrt", ours)):
            if side:
                print(
                    f"  perplexity {name:10s} {side['perplexity']:12.2f} vs fp32 reference "
                    f"{ref['perplexity']:.2f}: {side['perplexity_vs_reference']:+.2%}, top-1 "
                    f"agreement {side['top1_agreement']:.1%}"
                )
        print(f"  {'':22s} agentrt target: within 1%: {'met' if met['perplexity'] else 'MISSED'}")
    if "top1_vs_llama_cpp" in ours:
        print(f"  top-1 agreement agentrt vs llama.cpp: {ours['top1_vs_llama_cpp']:.1%}")
    else:
        print(
            f"  perplexity: llama.cpp {theirs.get('perplexity', math.nan):.2f}, agentrt "
            f"{ours['perplexity']:.2f} (no reference)"
        )


# -- main -------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "agentrt-bench"
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    from gguf_models import SHAPES

    parser.add_argument("--models", nargs="*", default=list(MODELS), choices=tuple(SHAPES))
    parser.add_argument("--types", nargs="*", default=["Q4_K_M"], choices=TYPES + ("F16",))
    parser.add_argument("--no-embedded", dest="embedded", action="store_false")
    parser.add_argument("--llama-python", default=sys.executable, help="has llama_cpp")
    parser.add_argument("--no-llama-cpp", action="store_true", help="agentrt alone")
    parser.add_argument("--no-reference", dest="reference", action="store_false")
    parser.add_argument(
        "--reference-engine",
        choices=("agentrt", "transformers"),
        default="agentrt",
        help="what runs the fp32 dequantized reference (module doc)",
    )
    parser.add_argument(
        "--quality-only", action="store_true", help="perplexity and top-1 agreement alone"
    )
    parser.add_argument(
        "--llama-cpp-dir", type=Path, help="vendor/llama.cpp of the sdist (makes the files)"
    )
    parser.add_argument(
        "--start-rounds", type=int, default=3, help="start-up runs per engine (0: none)"
    )
    parser.add_argument("--files-dir", type=Path, default=cache / "gguf")
    parser.add_argument("--agentrt-cache-dir", type=Path, help="default: FILES_DIR/agentrt-cache")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--kv-cache-memory-gb", type=float, default=0.25, help="agentrt's")
    parser.add_argument("--seed", type=int, default=0, help="of the synthetic weights")
    parser.add_argument(
        "--decode-rounds", type=int, default=5, help="decode runs per engine, alternated"
    )
    parser.add_argument("--worker", choices=WORKERS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return args
    if args.threads < 1:
        parser.error(f"--threads {args.threads}: expected at least 1")
    if args.decode_rounds < 1:
        parser.error(f"--decode-rounds {args.decode_rounds}: expected at least 1")
    if not args.kv_cache_memory_gb > 0:
        parser.error(f"--kv-cache-memory-gb {args.kv_cache_memory_gb}: expected more than 0")
    if args.start_rounds < 0:
        parser.error(f"--start-rounds {args.start_rounds}: expected 0 or more")
    if not (args.types and args.models) and not args.embedded:
        parser.error("nothing to run: --models or --types is empty and --no-embedded is given")
    script = args.llama_cpp_dir and args.llama_cpp_dir / "convert_hf_to_gguf.py"
    if script and not script.is_file():
        parser.error(f"--llama-cpp-dir {args.llama_cpp_dir}: it has no convert_hf_to_gguf.py")
    args.agentrt_cache_dir = args.agentrt_cache_dir or args.files_dir / "agentrt-cache"
    args.llama_version = None
    if args.no_llama_cpp:
        args.llama_python = None
    else:
        probe = [args.llama_python, "-c", "import llama_cpp; print(llama_cpp.__version__)"]
        try:
            done = subprocess.run(probe, capture_output=True, text=True)
        except OSError as exc:
            parser.error(f"--llama-python {args.llama_python}: cannot run it: {exc}")
        if done.returncode != 0:
            parser.error(
                f"--llama-python {args.llama_python} cannot import llama_cpp. Build it in its "
                'own venv (CMAKE_ARGS="-DGGML_NATIVE=ON" pip install llama-cpp-python==0.3.36) '
                "and pass that venv's python, or pass --no-llama-cpp (the files must then be "
                "made already)."
            )
        args.llama_version = done.stdout.strip()
    return args


def token_ids(tokenizer_name: str, file: Path | None = None) -> dict[str, list[int]]:
    """The prompts every side runs on a file, as token ids of its tokenizer: "qwen2.5",
    "phi3" (the one in `file`, read by agentrt: gguf_models' module doc) or else "smollm2",
    the embedded model's."""
    from gguf_models import QWEN_TOKENIZER
    from latency import DECODE_PROMPT, PPL_TEXT
    from transformers import AutoTokenizer

    from agentrt.engine.loader.checkpoint import gguf_source
    from agentrt.engine.loader.tokenizer import load_tokenizer

    if tokenizer_name == "qwen2.5":
        tokenizer = AutoTokenizer.from_pretrained(str(QWEN_TOKENIZER))
    elif tokenizer_name == "phi3":
        tokenizer = load_tokenizer(file)
    else:
        path = gguf_source(None)
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    messages = [{"role": "user", "content": DECODE_PROMPT}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ppl_ids = tokenizer.encode(PPL_TEXT, add_special_tokens=False)
    long_text = " ".join([PPL_TEXT] * (PREFILL_TOKENS // len(ppl_ids) + 1))
    return {
        "prompt_ids": tokenizer.encode(text, add_special_tokens=False),
        "prefill_ids": tokenizer.encode(long_text, add_special_tokens=False)[:PREFILL_TOKENS],
        "ppl_ids": ppl_ids,
    }


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown CPU"


def main() -> None:
    args = parse_args()
    if args.worker:
        # A worker holds a whole model: when memory runs out, the kernel kills it first,
        # not whatever else shares the machine.
        Path("/proc/self/oom_score_adj").write_text("1000")
        print(json.dumps(WORKERS[args.worker](json.loads(sys.stdin.read()))))
        return
    load_before = os.getloadavg()
    commit = subprocess.run(  # the workers run the tree as it is when each starts
        ["git", "-C", str(_HERE), "rev-parse", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    from gguf_models import SHAPES

    cpu = cpu_model()
    print(f"CPU: {cpu}, {args.threads} threads each side", flush=True)
    files = prepare_files(args)
    tokenizers = {kind: SHAPES[kind.split()[0]].tokenizer for kind in files if kind != EMBEDDED}
    tokenizer_files = {name: files[kind] for kind, name in tokenizers.items()}
    ids = {
        name: token_ids(name, tokenizer_files.get(name))
        for name in {"smollm2", *tokenizers.values()}
    }
    env = os.environ | {
        "AGENTRT_CACHE_DIR": str(args.agentrt_cache_dir),
        "AGENTRT_NUM_THREADS": str(args.threads),
    }
    # The first run builds agentrt's C kernels into the cache: not in any measured load.
    warm_up = ids["smollm2"] | {"file": None, "threads": args.threads, "warm_up_only": True}
    run_worker(sys.executable, "agentrt", warm_up | {"kv_cache_memory_gb": 0.1}, env)
    shutil.rmtree(args.agentrt_cache_dir / "models", ignore_errors=True)
    results = {}
    for kind, path in files.items():
        shape = SHAPES.get(kind.split()[0])
        targets = TARGETS | (shape.targets if shape else {})
        results[kind] = bench_file(path, args, ids[tokenizers.get(kind, "smollm2")], env, targets)
        print_file(kind, results[kind])
    summary = {
        "cpu": cpu,
        "threads": args.threads,
        "commit": commit or None,
        "llama_cpp_python": args.llama_version,
        "kv_cache_memory_gb": args.kv_cache_memory_gb,
        "load_avg_before": load_before,
        "load_avg_after": os.getloadavg(),
        "targets": TARGETS,
        "files": results,
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    try:
        main()
    except BenchError as exc:
        sys.exit(f"error: {exc}")
