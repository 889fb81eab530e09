#!/usr/bin/env bash
# The first-GPU check (`make gpu-check`, issue 32). It runs on the lent GPU machine with only
# what a command carries there: the image's python3 (torch with CUDA, triton, transformers,
# safetensors, pydantic, numpy, anyio ...), this working tree, and the carried folder
# .gpu_check/ (gitignored; fill it here with `make gpu-carry`, 15 MB):
#   .gpu_check/wheels/     the packages agentrt imports that the image lacks (gguf, xgrammar,
#                          apache-tvm-ffi, llguidance, outlines-core, jsonschema and its
#                          three, msgspec, pyzmq), for CPython 3.12 on manylinux x86-64
#   .gpu_check/tokenizer/  the embedded SmolLM2's tokenizer files (3.5 MB): the random
#                          checkpoints are built there from it (the 98 MB GGUF stays here)
#
# The device tool's command (one call, about 7 minutes of work; 64 MiB carried at most):
#   run(command="bash benchmarks/gpu_check.sh", carry=[".gpu_check"], timeout_s=480)
#
# Stages, in order, each under its own limit (420 s in all, benchmarks/gpu_check/run.py
# holds the table):
#   preflight 20s    nvidia-smi, versions; without a CUDA device: exit 2, nothing written
#   install 40s      the wheels and agentrt (--no-deps, --no-index) into a temp site
#   kernel-sweep 55s kernel-tests 45s checkpoints 40s tiny-engine 50s big-vs-hf 60s
#   throughput 100s  (see benchmarks/gpu_check/run.py)
# Results: at most 3 files in the folder given as the argument, else $OUT, else
# ./gpu-results: summary.json (every stage's status, time and figures), gpu_check.log
# (every stage's log) and kernel-tests.xml (JUnit). The last line printed is the summary,
# also when a stage fails or the Python driver dies.
#
#   bash benchmarks/gpu_check.sh [--dry-run] [--only STAGE ...] [OUT_DIR]
# --only: preflight, install and the named Python stages (a rerun of what failed; a stage
# needing checkpoints needs --only checkpoints too).
# --dry-run: no CUDA needed; the same stages, tiny, on the CPU (Triton interpreted, limits x3): the
# random checkpoints, the install into a temp site, the stage plumbing and the summary.
# $PYTHON is the interpreter (default python3; the dry run here: .venv/bin/python),
# $GPU_CHECK_CARRY the carried folder (default .gpu_check). Exit status: 0 all passed,
# 1 a stage failed or ran out of time, 2 no Python or no CUDA device.
set -uo pipefail

dry_run=0
out_arg=""
only=()
while (($#)); do
  case "$1" in
    --dry-run) dry_run=1 ;;
    --only) only+=(--only "${2:?--only needs a stage name}"); shift ;;
    -h | --help) sed -n '2,37p' "$0"; exit 0 ;;
    *) out_arg=$1 ;;
  esac
  shift
done
repo="$(cd -- "$(dirname -- "$0")/.." && pwd)"
out_dir="$(realpath -m -- "${out_arg:-${OUT:-./gpu-results}}")"
py="${PYTHON:-python3}"
carry="$(realpath -m -- "${GPU_CHECK_CARRY:-$repo/.gpu_check}")"
summary="$repo/benchmarks/gpu_check/summary.py"
start_s=$(date +%s)
budget_s=420   # run.py TOTAL_BUDGET_S
preflight_s=20 # run.py SHELL_LIMITS_S
install_s=40
dry_flag=()
if ((dry_run)); then
  # A busy CPU machine is slower than the GPU machine's host: limits x3 (run.py DRY_RUN_SLACK).
  dry_flag=(--dry-run)
  budget_s=$((budget_s * 3)) preflight_s=$((preflight_s * 3)) install_s=$((install_s * 3))
fi
deadline_s=$((start_s + budget_s))
# Nothing outside the GPU machine can be reached: no library may try (and wait).
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1 PYTHONUNBUFFERED=1

if ! command -v -- "$py" >/dev/null 2>&1; then
  echo "gpu_check: no Python at $py: set \$PYTHON to an interpreter with torch." >&2
  exit 2
fi
work="$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")" || exit 2
[[ -n "${GPU_CHECK_KEEP:-}" ]] || trap 'rm -rf -- "$work"' EXIT
mkdir -p "$work/logs" "$work/stages"

# record INDEX NAME RC SECONDS [KEY=VALUE ...]: the shell stages' records (summary.py).
record() {
  local index=$1 name=$2 rc=$3 seconds=$4 status=ok
  shift 4
  ((rc == 124 || rc == 137)) && status="timed out"
  ((rc != 0 && rc != 124 && rc != 137)) && status=failed
  "$py" "$summary" record "$work" "$index" "$name" "$status" "$seconds" "$@"
  echo "gpu_check: $name $status ${seconds}s"
}

# -- 01 preflight: nvidia-smi, versions ----------------------------------------------------
log="$work/logs/01-preflight.log"
t0=$SECONDS
{
  echo "dry run: $dry_run; python: $(command -v -- "$py"); carry: $carry"
  if command -v nvidia-smi >/dev/null; then
    timeout -k 2 $((preflight_s / 4 - 2)) nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version \
      --format=csv
  else
    echo "nvidia-smi: not found"
  fi
  du -sh "$carry"/* 2>/dev/null
} >"$log" 2>&1
timeout -k 2 $((preflight_s * 3 / 4 - 2)) "$py" - "$dry_run" >>"$log" 2>&1 <<'EOF'
import platform
import sys
from importlib import metadata

import torch

dry_run = sys.argv[1] == "1"
print(f"python {platform.python_version()}, torch {torch.__version__}, CUDA {torch.version.cuda}")
for name in ("triton", "transformers", "tokenizers", "safetensors", "pydantic", "numpy"):
    try:
        print(f"{name} {metadata.version(name)}")
    except metadata.PackageNotFoundError:
        print(f"{name}: missing")
if torch.cuda.is_available():
    props = torch.cuda.get_device_properties(0)
    free, total = torch.cuda.mem_get_info()
    print(f"device: {props.name}, sm_{props.major}{props.minor}, {props.multi_processor_count} SMs,"
          f" {free / 2**30:.1f} of {total / 2**30:.1f} GiB free")
elif not dry_run:
    why = (
        f"torch {torch.__version__} is a CPU-only build"
        if torch.version.cuda is None
        else f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no device: check the "
        "driver (nvidia-smi) and CUDA_VISIBLE_DEVICES"
    )
    sys.exit(f"gpu_check: no CUDA device: {why}. Run it on a machine with one CUDA GPU "
             "(or with --dry-run).")
EOF
rc=$?
if ((rc != 0 && !dry_run)); then
  cat "$log" >&2
  exit 2
fi
mkdir -p -- "$out_dir" || exit 2
rm -f -- "$out_dir"/{summary.json,gpu_check.log,kernel-tests.xml}  # no stale results
record 1 preflight "$rc" $((SECONDS - t0))

# -- 02 install: the wheels, then agentrt itself, into a temp site -------------------------
log="$work/logs/02-install.log"
t0=$SECONDS
install() {
  local site="$work/site" wheels=("$carry"/wheels/*.whl) pip=(-m pip install -q --no-index
    --no-deps --no-compile --no-cache-dir --disable-pip-version-check)
  if [[ ! -e "${wheels[0]}" ]]; then
    echo "no wheels in $carry/wheels: using the interpreter's own packages"
  elif ((dry_run)); then
    # Built for the image's CPython 3.12: listed, not installed, by the dry run.
    echo "${#wheels[@]} wheels ($(du -shc "${wheels[@]}" | tail -1 | cut -f1)), not installed:"
    printf '  %s\n' "${wheels[@]##*/}"
  else
    "$py" "${pip[@]}" --target "$site/deps" "${wheels[@]}" || return
  fi
  # A copy of the sources: the build writes build/ and *.egg-info beside them.
  mkdir -p "$work/src" &&
    tar -C "$repo" --exclude=__pycache__ -cf - agentrt engine grammar kernels pyproject.toml \
      README.md | tar -C "$work/src" -xf - || return
  if ! "$py" "${pip[@]}" --no-build-isolation --target "$site/project" "$work/src"; then
    # No usable setuptools there: lay the package out as pyproject's package-dir maps it.
    echo "the build failed: copying the package folders into $site/project instead"
    rm -rf "$site/project" && mkdir -p "$site/project" &&
      cp -r "$work/src/agentrt" "$site/project/agentrt" &&
      for part in engine grammar kernels; do
        cp -r "$work/src/$part" "$site/project/agentrt/$part" || return
      done
  fi
  export PYTHONPATH="$site/project:$site/deps"
  # -P: the current folder (a checkout whose agentrt/ lacks engine/) must not come first.
  "$py" -P - "$site" <<'EOF'
import sys

import agentrt
import agentrt.engine.client.llm  # noqa: F401  (the engine, the grammar backends, the kernels)
import agentrt.grammar  # noqa: F401

assert agentrt.__file__.startswith(sys.argv[1]), f"agentrt imported from {agentrt.__file__}"
for name in ("gguf", "xgrammar", "llguidance", "jsonschema", "msgspec", "zmq"):
    __import__(name)
print(f"agentrt from {agentrt.__file__}")
EOF
}
(
  export -f install
  export work carry dry_run py repo
  timeout -k 2 $((install_s - 2)) bash -c install
) >"$log" 2>&1
rc=$?
record 2 install "$rc" $((SECONDS - t0))
export PYTHONPATH="$work/site/project:$work/site/deps"
if ((dry_run)); then
  export TRITON_INTERPRET=1  # Triton's interpreter runs the kernels on the CPU
  # Toy models gain nothing from threads, and spinning ones cost a loaded machine dearly.
  export OMP_NUM_THREADS=1 AGENTRT_NUM_THREADS=1
fi

# -- 03.. the Python stages, each under its own limit, all before the deadline ------------
if ((rc == 0)); then
  timeout -k 5 $((deadline_s - $(date +%s))) "$py" "$repo/benchmarks/gpu_check/run.py" \
    --work "$work" --out "$out_dir" --tokenizer "$carry/tokenizer" --deadline "$deadline_s" \
    "${dry_flag[@]}" "${only[@]}" 2>&1 | tee -a "$work/logs/99-driver.log"
  driver_rc=${PIPESTATUS[0]}
  ((driver_rc == 0)) || echo "gpu_check: the Python driver stopped (exit $driver_rc)"
else
  tail -n 20 "$log"
fi
"$py" "$summary" write "$work" "$out_dir" "${dry_flag[@]}"
