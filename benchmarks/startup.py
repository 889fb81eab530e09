"""Start-up and the Python process's memory, two agentrt commits side by side (issue 39).

For each GGUF file and each side (a commit, checked out in a temporary git worktree and
imported from there), fresh processes measure the time from process start to the first
token of a 1-token greedy request (`LLM(file)` + `generate`), with the file's metadata
cached, and a first start on the file (its metadata cache emptied), in alternating rounds.
Each process also reports its memory (from /proc/self/status) and its CPU time (user + system: steadier than wall time on a
loaded machine), after torch's import,
after the engine is built, after the first token, and its peak; anonymous memory (the
process's own: Python objects, the tokenizer, torch's allocations) apart from file-backed
pages (the memory-mapped weights, shared libraries). And whether it imported transformers,
gguf-py or yaml (none is needed to start).
The start is broken down by stage, CPU seconds and wall seconds (medians of the cached
starts): torch's import, importing agentrt's engine, the tokenizer, the weights
(`load_weights`: read, interleaved, installed; since a58ab7d the tokenizer is built within
it, while the weights are interleaved), the rest of the engine's build, the first token.
The worker imports no torch itself: torch's import is timed where it happens (a meta-path
hook; its CPU is its thread's), which since b9ab55f is inside `LLM(...)`. A side from
b9ab55f to the arena's removal (issue 39: it slowed torch's import by more than it saved)
faulted in its weights' memory on a thread of its own while torch imported: "arena
(thread)", engine/loader/arena.py there. Torch's import, agentrt's and the rest of the
engine count their thread's CPU (an arena's runs beside them); the tokenizer, the weights
(their repack threads) and the first token the whole process's.

The workers write and reuse bytecode (under --workdir, as an installed package has its .pyc
files): with PYTHONDONTWRITEBYTECODE set, as in some shells, every start would compile
agentrt's ~100 modules again (0.3-0.4 s of CPU) and measure that instead.

Files: the embedded SmolLM2 (Q4_1), and a Qwen2.5-0.5B-shaped file (896 hidden, 24 layers,
FFN 4,864, 14/2 heads, tied 151,936-row embedding, qkv biases; random Q8_0 weights) carrying
the real Qwen2.5 tokenizer (tests/data) as llama.cpp writes it.

    python benchmarks/startup.py --base 03f1065~1 --after HEAD --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

# benchmarks/gguf.py would shadow gguf-py; the checkout's root holds tests/engine/
# tokenizer_ggufs.py, which writes the Qwen tokenizer as llama.cpp does.
ROOT = Path(__file__).resolve().parents[1]
sys.path[:] = [str(ROOT)] + [p for p in sys.path if Path(p or ".").resolve() != ROOT / "benchmarks"]

import gguf  # noqa: E402
import numpy as np  # noqa: E402

PROMPT = "Hello"
STAGES = (  # the breakdown's rows; "arena (thread)" runs beside the main thread (arena.py)
    "import torch",
    "import agentrt",
    "arena (thread)",
    "tokenizer",
    "weights",
    "engine (rest)",
    "first token",
)
# Runs in each fresh process, with the side's checkout first on sys.path.
WORKER = r"""
import json, os, resource, sys, time
started = time.time()
def memory():
    fields = {}
    with open("/proc/self/status") as status:
        for line in status:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "RssAnon", "RssFile", "VmHWM"):
                fields[key] = int(value.split()[0]) / 1024
    return fields
def cpu():
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime
job = json.loads(sys.argv[1])
stages = {}  # stage -> [cpu s, wall s]
spans = {}  # stage -> (wall start, wall end)
main_cpu = {}  # stage -> the main thread's CPU s in it
def timed(stage, function):
    def wrapper(*args, **kwargs):
        cpu0, own0, wall0 = cpu(), time.thread_time(), time.time()
        try:
            return function(*args, **kwargs)
        finally:
            stages[stage] = [cpu() - cpu0, time.time() - wall0]
            spans[stage], main_cpu[stage] = (wall0, time.time()), time.thread_time() - own0
    return wrapper
# Modules timed (and patched) where they are imported: since LLM's module imports no torch,
# torch and the engine are imported inside LLM(...) (after its arena's thread, in a side
# that had one).
import importlib.abc
executed = {}  # module -> (its import's main-thread CPU s, wall start, wall end)
patches = {}  # module -> a function of the module, run once it is executed
class Timed(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name not in ("torch", "agentrt.engine.client.llm_engine", "agentrt.engine.worker.model_runner"):
            return None
        for finder in sys.meta_path:
            spec = None if finder is self else finder.find_spec(name, path, target)
            if spec is not None:
                break
        else:
            return None
        run = spec.loader.exec_module
        def exec_module(module):
            own0, wall0 = time.thread_time(), time.time()
            run(module)
            executed[name] = (time.thread_time() - own0, wall0, time.time())
            if name == "torch":
                executed["torch_mem"] = memory()
            if name in patches:
                patches[name](module)
        spec.loader.exec_module = exec_module
        return spec
sys.meta_path.insert(0, Timed())
def within(name, wall0, wall1):  # a module's import (CPU s, wall s) if it ran in [wall0, wall1]
    own, start, end = executed.get(name, (0.0, 0.0, 0.0))
    return (own, end - start) if wall0 <= start <= end <= wall1 else (0.0, 0.0)
def patch_engine(module):
    module.load_tokenizer = timed("tokenizer", module.load_tokenizer)
def patch_runner(module):
    module.load_weights = timed("weights", module.load_weights)
patches.update({"agentrt.engine.client.llm_engine": patch_engine,
                "agentrt.engine.worker.model_runner": patch_runner})
own0, import_wall = time.thread_time(), time.time()
from agentrt.engine.client.llm import LLM
from agentrt.engine.sampling_params import SamplingParams
import_own, import_end = time.thread_time() - own0, time.time()
torch_before_llm = "torch" in sys.modules
try:  # the arena's thread, where the side has one (module doc)
    import agentrt.engine.loader.arena as arena
    populate = arena.WeightArena._populate
    def timed_populate(self):
        own0, wall0 = time.thread_time(), time.time()
        populate(self)
        stages["arena (thread)"] = [time.thread_time() - own0, time.time() - wall0]
    arena.WeightArena._populate = timed_populate
except ImportError:
    pass
build_own, build_wall = time.thread_time(), time.time()
llm = LLM(job["file"], kv_cache_memory_gb=0.25)
build_own, build_end = time.thread_time() - build_own, time.time()
# The engine's import, in LLM's module's or in LLM(...); torch's within it. Main-thread CPU,
# but the weights' (their repack threads' too): an arena's thread runs beside torch's import.
engine_in_build = within("agentrt.engine.client.llm_engine", build_wall, build_end)
torch_cpu = executed["torch"][0]
torch_wall = executed["torch"][2] - executed["torch"][1]
stages["import torch"] = [torch_cpu, torch_wall]
stages["import agentrt"] = [
    import_own + engine_in_build[0] - torch_cpu,
    import_end - import_wall + engine_in_build[1] - torch_wall,
]
# Built alongside the weights' repack (within their stage), the tokenizer is not counted twice.
alongside = spans["weights"][0] <= spans["tokenizer"][0] <= spans["tokenizer"][1] <= spans["weights"][1]
inner = ("weights",) if alongside else ("tokenizer", "weights")
stages["engine (rest)"] = [
    build_own - engine_in_build[0] - sum(main_cpu[s] for s in inner),
    build_end - build_wall - engine_in_build[1] - sum(stages[s][1] for s in inner),
]
torch_s, torch_mem = executed["torch"][2] - started, executed["torch_mem"]
loaded_s, loaded_mem = time.time() - started, memory()
first_token_cpu = cpu()
llm.generate([job["prompt"]], SamplingParams(temperature=0.0, max_tokens=1))
first_s, first_mem, first_cpu = time.time() - started, memory(), cpu()
stages["first token"] = [first_cpu - first_token_cpu, first_s - loaded_s]
print(json.dumps({
    "start_s": time.time() - job["spawned_at"],
    "torch_s": torch_s, "loaded_s": loaded_s, "first_s": first_s,
    "torch_cpu": torch_cpu, "first_cpu": first_cpu, "stages": stages,
    "torch_mem": torch_mem, "loaded_mem": loaded_mem, "first_mem": first_mem,
    "transformers": any(m.split(".")[0] == "transformers" for m in sys.modules),
    "heavy": sorted({m.split(".")[0] for m in sys.modules} & {"transformers", "gguf", "yaml"}),
    "tokenizer": type(llm.engine.tokenizer).__name__,
    "alongside": alongside,
    "torch_before_llm": torch_before_llm,
}))
"""


def checkout(rev: str, workdir: Path) -> Path:
    """A directory to put first on sys.path so that `import agentrt` is `rev`'s: a worktree
    of the commit, and an `agentrt` package of links laid out as setuptools' package-dir
    maps the checkout (agentrt/, engine/, grammar/, kernels/)."""
    sha = subprocess.run(
        ["git", "rev-parse", "--short", rev], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.strip()
    tree = workdir / f"tree-{sha}"
    if not tree.exists():
        subprocess.run(["git", "worktree", "add", "--detach", str(tree), sha], cwd=ROOT, check=True)
    package = workdir / f"path-{sha}" / "agentrt"
    if not package.exists():
        package.mkdir(parents=True)
        for item in (tree / "agentrt").iterdir():
            (package / item.name).symlink_to(item)
        for sub in ("engine", "grammar", "kernels"):
            (package / sub).symlink_to(tree / sub)
    return package.parent


def write_qwen_shaped(path: Path) -> Path:
    """Qwen2.5-0.5B's shape with random Q8_0 blocks (a scale per block of 32 int8 weights)."""
    from tests.engine.tokenizer_ggufs import QWEN_FILE_VOCAB, add_qwen_tokenizer

    hidden, layers, ffn, heads, kv_heads = 896, 24, 4864, 14, 2
    head_dim = hidden // heads
    rng = np.random.default_rng(0)
    partial = path.with_suffix(".partial")
    writer = gguf.GGUFWriter(partial, "qwen2")
    writer.add_name("qwen2.5-0.5b-shaped")
    writer.add_block_count(layers)
    writer.add_context_length(32768)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(1_000_000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    add_qwen_tokenizer(writer, QWEN_FILE_VOCAB)
    scale = np.array([0.05 / 64], np.float16).view(np.uint8)  # weights of RMS ~0.03

    def q8_0(name: str, rows: int, cols: int) -> None:
        blocks = rng.integers(-128, 128, (rows, cols // 32, 34), dtype=np.int8).view(np.uint8)
        blocks[..., :2] = scale
        blocks = blocks.reshape(rows, -1)
        writer.add_tensor(
            name, blocks, raw_shape=blocks.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0
        )

    def vector(name: str, size: int, value: float) -> None:
        writer.add_tensor(name, np.full(size, value, np.float32))

    q8_0("token_embd.weight", QWEN_FILE_VOCAB, hidden)
    vector("output_norm.weight", hidden, 1.0)
    for i in range(layers):
        p = f"blk.{i}."
        vector(p + "attn_norm.weight", hidden, 1.0)
        vector(p + "ffn_norm.weight", hidden, 1.0)
        for part, rows in (("attn_q", hidden), ("attn_k", kv_heads * head_dim)):
            q8_0(p + part + ".weight", rows, hidden)
            vector(p + part + ".bias", rows, 0.0)
        q8_0(p + "attn_v.weight", kv_heads * head_dim, hidden)
        vector(p + "attn_v.bias", kv_heads * head_dim, 0.0)
        q8_0(p + "attn_output.weight", hidden, hidden)
        q8_0(p + "ffn_gate.weight", ffn, hidden)
        q8_0(p + "ffn_up.weight", ffn, hidden)
        q8_0(p + "ffn_down.weight", hidden, ffn)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    partial.rename(path)  # complete or absent
    return path


def run(path_dir: Path, cache: Path, file: Path, threads: int) -> dict:
    job = {"file": str(file), "prompt": PROMPT, "spawned_at": time.time()}
    env = dict(
        os.environ,
        PYTHONPATH=str(path_dir),
        PYTHONPYCACHEPREFIX=str(cache.parent / "pycache"),
        AGENTRT_CACHE_DIR=str(cache),
        OMP_NUM_THREADS=str(threads),
        AGENTRT_NUM_THREADS=str(threads),
    )
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    result = subprocess.run(
        [sys.executable, "-c", WORKER, json.dumps(job)],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
        cwd="/",
    )
    if result.returncode:
        raise RuntimeError(f"worker failed:\n{result.stderr[-4000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", required=True, help="the commit measured before")
    parser.add_argument("--after", default="HEAD", help="the commit measured after")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/agentrt-startup"))
    parser.add_argument(
        "--files",
        default="embedded,qwen2.5-0.5b",
        help="comma-separated: embedded, qwen2.5-0.5b (the Q8_0 file written here) or a .gguf path",
    )
    args = parser.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    sides = {
        "before": checkout(args.base, args.workdir),
        "after": checkout(args.after, args.workdir),
    }
    files = {}
    for name in args.files.split(","):
        if name == "embedded":
            from agentrt.engine.loader.gguf_file import embedded_gguf_path

            files[name] = embedded_gguf_path()
        elif name.endswith(".gguf"):  # e.g. a real mix that benchmarks/gguf_models.py made
            files[Path(name).stem] = Path(name).expanduser()
        else:
            target = args.workdir / "qwen2.5-0.5b-shaped.Q8_0.gguf"
            files[name] = target if target.exists() else write_qwen_shaped(target)
    cpu = next(
        (line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if "model name" in line),
        "?",
    )
    print(f"CPU: {cpu}; {os.cpu_count()} cores, {args.threads} threads a process")
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    report = {}
    for name, file in files.items():
        size = file.stat().st_size / 2**20
        figures: dict = {side: {"cached": [], "first": []} for side in sides}
        for side, path_dir in sides.items():  # warm-up: kernels compiled, metadata cached
            run(path_dir, args.workdir / f"cache-{side}", file, args.threads)
        for _ in range(args.rounds):
            for side, path_dir in sides.items():
                cache = args.workdir / f"cache-{side}"
                figures[side]["cached"].append(run(path_dir, cache, file, args.threads))
        for _ in range(max(1, args.rounds // 2)):
            for side, path_dir in sides.items():
                cache = args.workdir / f"cache-{side}"
                shutil.rmtree(cache / "models", ignore_errors=True)
                figures[side]["first"].append(run(path_dir, cache, file, args.threads))
        report[name] = figures
        print(f"\n{name} ({file.name}, {size:.0f} MiB)")
        print(
            f"{'side':7} {'cached s':>9} {'first s':>8} {'torch s':>8} {'cpu s':>6} "
            f"{'cpu-torch':>9} {'first cpu-torch':>15} {'RSS torch':>10} {'RSS loaded':>11} "
            f"{'anon loaded':>12} {'RSS 1st tok':>12} {'peak':>6}  imported      tokenizer"
        )
        for side in sides:
            cached, first = figures[side]["cached"], figures[side]["first"]

            def med(key: str, runs: list = cached) -> float:
                return statistics.median(r[key] for r in runs)

            def mem(stage: str, key: str, runs: list = cached) -> float:
                return statistics.median(r[stage][key] for r in runs)

            def own_cpu(runs: list) -> float:  # CPU time less torch's import's (its thread's)
                return statistics.median(r["first_cpu"] - r["torch_cpu"] for r in runs)

            print(
                f"{side:7} {med('start_s'):9.2f} {med('start_s', first):8.2f} "
                f"{med('torch_s'):8.2f} {med('first_cpu'):6.2f} {own_cpu(cached):9.2f} "
                f"{own_cpu(first):15.2f} "
                f"{mem('torch_mem', 'VmRSS'):10.0f} {mem('loaded_mem', 'VmRSS'):11.0f} "
                f"{mem('loaded_mem', 'RssAnon'):12.0f} {mem('first_mem', 'VmRSS'):12.0f} "
                f"{mem('first_mem', 'VmHWM'):6.0f}  "
                f"{','.join(cached[0].get('heavy', [])) or '-':12}  "
                f"{cached[0]['tokenizer']}"
            )
        print("cached start by stage, CPU s / wall s (medians):")
        print(f"  {'stage':15}" + "".join(f"{side:>16}" for side in sides))
        for stage in STAGES:
            cells = []
            for side in sides:
                runs = [r for r in figures[side]["cached"] if stage in r["stages"]]
                cells.append(
                    "{:7.2f} /{:6.2f}".format(
                        *(statistics.median(r["stages"][stage][i] for r in runs) for i in (0, 1))
                    )
                    if runs
                    else "-"
                )
            print(f"  {stage:15}" + "".join(f"{c:>16}" for c in cells))
        for side in sides:
            if figures[side]["cached"][0].get("alongside"):
                print(f"  ({side}: the tokenizer is built within the weights stage, alongside)")
        for what, key in (("wall", "start_s"), ("CPU less torch's import", None)):
            before, after = (
                statistics.median(
                    r[key] if key else r["first_cpu"] - r["torch_cpu"] for r in figures[s]["cached"]
                )
                for s in sides
            )
            print(f"cached start, {what}: after/before {after / before:.2f}x")
        print("(seconds and MiB, medians; cpu: user + system of the whole process)")
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    (args.workdir / "startup.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
