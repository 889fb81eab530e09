#!/usr/bin/env bash
# The first-GPU check (`make gpu-check`). On a machine with one CUDA GPU, after `make setup`,
# it runs in under 10 minutes, each stage under its own time limit:
#   gpu-tests     pytest -m gpu: kernels vs references at model sizes, the engine's CUDA path
#                 end to end vs its CPU path (greedy fp32), bitmask and seeded sampling on CUDA
#   kernel-tests  tests/kernels: with CUDA present they run the compiled Triton kernels
#   kernels-bench benchmarks/kernels.py --quick: Triton vs the torch references
#   throughput    benchmarks/throughput.py --quick on CUDA: agentrt vs HF generate
# Results go to the folder given as the first argument, else $OUT, else ./gpu-results:
# <stage>.log, gpu-tests.xml / kernel-tests.xml (JUnit), kernels.json, throughput.json and
# summary.json; a summary is printed at the end. It installs nothing.
# Exit status: 2 without a usable CUDA device (or without `make setup`), 1 when a stage
# fails or runs out of time, 0 otherwise. $PYTHON overrides the interpreter (.venv/bin/python).
set -uo pipefail

out_dir="${1:-${OUT:-./gpu-results}}"
out_dir="$(realpath -m -- "$out_dir")"
cd "$(dirname -- "$0")/.." || exit 2
py="${PYTHON:-.venv/bin/python}"

if [[ ! -x "$py" ]]; then
  echo "gpu_check: no Python at $py: run \`make setup\` first (or set \$PYTHON)." >&2
  exit 2
fi
if ! "$py" - <<'EOF'
import sys

import torch

if not torch.cuda.is_available():
    why = (
        f"torch {torch.__version__} is a CPU-only build"
        if torch.version.cuda is None
        else f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no device: check "
        "the driver (nvidia-smi) and CUDA_VISIBLE_DEVICES"
    )
    sys.exit(f"gpu_check: no CUDA device: {why}. Run it on a machine with one CUDA GPU.")
try:
    import triton  # noqa: F401
except ImportError:
    print("gpu_check: warning: triton does not import; the CUDA path falls back to torch.")
print(f"gpu_check: {torch.cuda.get_device_name()}, torch {torch.__version__}")
EOF
then
  exit 2
fi

mkdir -p -- "$out_dir" || exit 2
# A result left by an earlier run must not pass for this run's.
rm -f -- "$out_dir"/{gpu-tests,kernel-tests}.xml "$out_dir"/{kernels,throughput,summary}.json
stages=()

# run_stage NAME LIMIT_S COMMAND...: run it with its output in NAME.log; record the outcome.
run_stage() {
  local name=$1 limit=$2
  shift 2
  echo "gpu_check: $name (at most ${limit}s) ..."
  local start=$SECONDS
  timeout --kill-after=10 "$limit" "$@" >"$out_dir/$name.log" 2>&1
  local rc=$?
  stages+=("$name $rc $((SECONDS - start))")
  tail -n 3 "$out_dir/$name.log"
}

# Limits add up to 570 s: the whole check stays under 10 minutes.
run_stage gpu-tests 240 "$py" -m pytest -q -rfEs -m gpu tests --junitxml="$out_dir/gpu-tests.xml"
run_stage kernel-tests 120 "$py" -m pytest -q -rfEs -m "not gpu" tests/kernels \
  --junitxml="$out_dir/kernel-tests.xml"
run_stage kernels-bench 90 "$py" benchmarks/kernels.py --quick --json "$out_dir/kernels.json"
run_stage throughput 120 "$py" benchmarks/throughput.py --device cuda --quick \
  --json "$out_dir/throughput.json"

"$py" - "$out_dir" "${stages[@]}" <<'EOF'
"""Summarise the stages (name rc seconds) and their result files into summary.json."""
import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

RESULTS = {"kernels-bench": "kernels.json", "throughput": "throughput.json"}
out = Path(sys.argv[1])
summary = {"stages": [], "ok": True}
for stage in sys.argv[2:]:
    name, rc, seconds = stage.split()
    rc = int(rc)
    status = "ok" if rc == 0 else "timed out" if rc in (124, 137) else f"failed (exit {rc})"
    row = {"stage": name, "status": status, "seconds": int(seconds)}
    junit = out / f"{name}.xml"
    if junit.exists():
        suites = ET.parse(junit).getroot().iter("testsuite")
        counts = {k: 0 for k in ("tests", "failures", "errors", "skipped")}
        for suite in suites:
            for key in counts:
                counts[key] += int(suite.get(key, 0))
        row["tests"] = counts
    result = out / RESULTS.get(name, "-")
    if result.is_file():
        data = json.loads(result.read_text())
        row["result"] = data.get("targets", data)  # the kernel benchmark's verdicts
    summary["ok"] &= rc == 0
    summary["stages"].append(row)
(out / "summary.json").write_text(json.dumps(summary, indent=1))
print(f"\ngpu_check summary ({out}):")
for row in summary["stages"]:
    tests = row.get("tests")
    counts = "".join(f" {key}={n}" for key, n in (tests or {}).items())
    print(f"  {row['stage']:<14} {row['status']:<16} {row['seconds']:>4}s{counts}")
    if "result" in row:
        print(f"  {'':<14} {json.dumps(row['result'])}")
print("gpu_check: all stages passed" if summary["ok"] else "gpu_check: FAILED (see the logs)")
sys.exit(0 if summary["ok"] else 1)
EOF
