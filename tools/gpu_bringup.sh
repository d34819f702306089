#!/usr/bin/env bash
# One command that checks a GPU machine: wheels in, one results folder out.
#
#   bash tools/gpu_bringup.sh                    # on a machine with one GPU and no network
#   bash tools/gpu_bringup.sh --dry-run          # anywhere: check the inputs, print every step
#   bash tools/gpu_bringup.sh --help
#
# See docs/gpu-check.md, "One command: tools/gpu_bringup.sh".
set -euo pipefail

PROG=gpu_bringup.sh
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
MCORE_MAIN_PIN=0.19.2        # newest megatron-core 0.19.x when this was written: what the download line names
MCORE_SECOND_PIN=0.16.1      # what CI runs: the optional second pass
TARGET_PYTHON=3.12           # the GPU machines' Python, what the wheels are checked for

usage() {
    cat <<EOF
usage: bash tools/$PROG [--wheels DIR] [--out DIR] [--install-dir DIR] [--python PY]
                           [--target-python X.Y] [--quick] [--no-second-pass]
                           [--gpu-check-args "FLAGS"] [--step-timeout SEC] [--tar FILE] [--dry-run]

Checks one GPU with this repository on a machine that has a CUDA build of torch but no
megatron-core and no network. Each megatron-core release found as a wheel (0.19.x, required;
$MCORE_SECOND_PIN, optional) is installed with 'pip install --no-index --no-deps --target' into its
own private folder (pip never touches torch), put on PYTHONPATH, and checked:

  machine      nvidia-smi -q; environment facts (Python, torch, CUDA, cuDNN, NCCL version,
               GPU name, capability, multiprocessors, memory, package versions) as JSON
  per release  install the wheels; install this repository; the imports (which megatron-core,
               from where); tools/gpu_check.py --json (te, losses, wait, timings, memory; te is
               skipped by the tool without Transformer Engine); python -m pytest -m gpu tests
               (JUnit XML); a bf16 pretrain_llama.py pair on one rank with NCCL, tawpipe against
               native 1f1b, compared by tools/compare_metrics.py --rtol 1e-2

Every step runs even when an earlier one failed. Everything goes into one results folder:
a log per step, summary.md and summary.json (each step, its exit status, its duration).
Exit status: 0 when every step passed, 1 when a step failed, 2 when the inputs are missing
(the missing wheel and its download command are named, one line each) or a flag is wrong.

options:
  --wheels DIR          the wheels (default: .whl at the repository root)
  --out DIR             the results folder (default: examples/results/gpu/<date>-<time>-<gpu>);
                        refused when it exists and is not empty
  --install-dir DIR     where the private installs go (default: /tmp/tawpipe-gpu-bringup/<date>-<time>)
  --python PY           the interpreter, the one with the CUDA build of torch (default: python3)
  --target-python X.Y   the Python the wheels must fit (default: $TARGET_PYTHON, the GPU machines')
  --quick               smaller tools/gpu_check.py sizes (hidden 2048, sequence 4096, 3 repeats)
  --no-second-pass      only megatron-core 0.19.x, even when the $MCORE_SECOND_PIN wheel is there
  --gpu-check-args F    more flags for tools/gpu_check.py (word-split), e.g. "--checks losses,wait"
  --step-timeout SEC    stop a step after SEC seconds (default 1200; 0: no limit)
  --tar FILE            also pack the results folder into FILE (.tar.gz)
  --dry-run             run nothing: check the inputs (wheel folder, which wheels are found or
                        missing, their Python tags and requirements, this Python, whether torch
                        sees CUDA), print every step with its exact command; exit 0 when the inputs
                        would do, 2 when something is missing. Works on a machine without a GPU.
  -h, --help            this text

The wheels, downloaded on a machine with access to PyPI, from the repository root (keep .whl
out of git: echo /.whl/ >> .git/info/exclude):

  python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \\
      --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \\
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \\
      --platform manylinux1_x86_64 -d .whl megatron-core==$MCORE_MAIN_PIN
  # optional second pass, the same command with megatron-core==$MCORE_SECOND_PIN

megatron-core needs torch, numpy and packaging>=24.2; this repository needs sentencepiece,
numpy, einops and psutil, and the tests pytest. Whatever of these the GPU machine lacks must be
in the wheel folder too: the script checks them first (against the machine's own packages and
the wheels) and names each missing one with its download command. Never put torch there.
EOF
}

# ---- flags ----------------------------------------------------------------------------------------

WHEELS="$REPO/.whl"
OUT=""
INSTALL_DIR=""
PY=python3
QUICK=0
SECOND_PASS=1
GPU_CHECK_EXTRA=""
STEP_TIMEOUT=1200
TAR=""
DRY_RUN=0

die() { echo "$PROG: error: $*" >&2; exit 2; }
need_value() { [ $# -ge 2 ] && [ -n "$2" ] || die "$1 needs a value"; }

while [ $# -gt 0 ]; do
    case "$1" in
        --wheels) need_value "$@"; WHEELS=$2; shift 2 ;;
        --wheels=*) WHEELS=${1#*=}; shift ;;
        --out) need_value "$@"; OUT=$2; shift 2 ;;
        --out=*) OUT=${1#*=}; shift ;;
        --install-dir) need_value "$@"; INSTALL_DIR=$2; shift 2 ;;
        --install-dir=*) INSTALL_DIR=${1#*=}; shift ;;
        --python) need_value "$@"; PY=$2; shift 2 ;;
        --python=*) PY=${1#*=}; shift ;;
        --target-python) need_value "$@"; TARGET_PYTHON=$2; shift 2 ;;
        --target-python=*) TARGET_PYTHON=${1#*=}; shift ;;
        --quick) QUICK=1; shift ;;
        --no-second-pass) SECOND_PASS=0; shift ;;
        --gpu-check-args) [ $# -ge 2 ] || die "--gpu-check-args needs a value"; GPU_CHECK_EXTRA=$2; shift 2 ;;
        --gpu-check-args=*) GPU_CHECK_EXTRA=${1#*=}; shift ;;
        --step-timeout) need_value "$@"; STEP_TIMEOUT=$2; shift 2 ;;
        --step-timeout=*) STEP_TIMEOUT=${1#*=}; shift ;;
        --tar) need_value "$@"; TAR=$2; shift 2 ;;
        --tar=*) TAR=${1#*=}; shift ;;
        --dry-run) DRY_RUN=1; shift ;;
        -h|--help) usage; exit 0 ;;
        *) die "unknown argument '$1' (see --help)" ;;
    esac
done
[[ "$STEP_TIMEOUT" =~ ^[0-9]+$ ]] || die "--step-timeout must be a whole number of seconds, got '$STEP_TIMEOUT'"
[[ "$TARGET_PYTHON" =~ ^3\.[0-9]+$ ]] || die "--target-python must look like 3.12, got '$TARGET_PYTHON'"
command -v "$PY" >/dev/null 2>&1 || die "no Python interpreter '$PY' (--python)"

abspath() { case "$1" in /*) printf '%s\n' "$1" ;; *) printf '%s\n' "$PWD/$1" ;; esac; }
WHEELS=$(abspath "$WHEELS")
[ -z "$OUT" ] || OUT=$(abspath "$OUT")
[ -z "$INSTALL_DIR" ] || INSTALL_DIR=$(abspath "$INSTALL_DIR")
[ -z "$TAR" ] || TAR=$(abspath "$TAR")
cd "$REPO"

# The wheel folder as the download command should name it: relative when it is inside the repository.
case "$WHEELS" in
    "$REPO"/*) WHEELS_SHOWN=${WHEELS#"$REPO"/} ;;
    *) WHEELS_SHOWN=$WHEELS ;;
esac
DOWNLOAD="python3 -m pip download --no-deps --only-binary=:all: --python-version $TARGET_PYTHON --implementation cp \
--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
--platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d $WHEELS_SHOWN"

# ---- the helper (Python, standard library; packaging where installed) ---------------------------

WORK=$(mktemp -d "${TMPDIR:-/tmp}/tawpipe-gpu-bringup.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
HELPER="$REPO/tools/gpu_bringup_helper.py"   # standard library only: runs before anything is installed

# ---- inputs -----------------------------------------------------------------------------------------

"$PY" "$HELPER" inventory "$WHEELS" "$REPO" "$TARGET_PYTHON" "$DRY_RUN" "$MCORE_MAIN_PIN" "$MCORE_SECOND_PIN" \
    "$DOWNLOAD" "$WORK/inventory.sh" "$SECOND_PASS" \
    || die "the inventory of the inputs failed (the Python above): is '$PY' a working interpreter?"
# shellcheck disable=SC1091
source "$WORK/inventory.sh"

STAMP=$(date +%Y%m%d-%H%M%S)
slug() { printf '%s' "$1" | tr '[:upper:]' '[:lower:]' | sed -e 's/[^a-z0-9]\{1,\}/-/g' -e 's/^-//' -e 's/-$//'; }
GPU_SLUG=$(slug "${GPU_NAME:-}")
[ -n "$GPU_SLUG" ] || GPU_SLUG=nogpu
[ -n "$OUT" ] || OUT="$REPO/examples/results/gpu/$STAMP-$GPU_SLUG"
[ -n "$INSTALL_DIR" ] || INSTALL_DIR="/tmp/tawpipe-gpu-bringup/$STAMP"
RUN_HELPER="$INSTALL_DIR/bringup.py"   # the helper's copy that the steps run (kept with the installs)

# ---- the steps ----------------------------------------------------------------------------------------

source "$REPO/examples/llama_flags.sh"
# A small bf16 Llama on one rank: pretrain_llama.py's own process, NCCL world of one.
PAIR_FLAGS=("${LLAMA_FLAGS[@]}" --num-layers 4 --hidden-size 512 --ffn-hidden-size 1408 --num-attention-heads 8
            --seq-length 1024 --max-position-embeddings 1024 --micro-batch-size 1 --global-batch-size 8
            --train-iters 5 --lr 3e-4 --min-lr 3e-5 --lr-warmup-iters 1 --lr-decay-style cosine --clip-grad 1.0
            --seed 1234 --untie-embeddings-and-output-weights --mock-data --tokenizer-type NullTokenizer
            --vocab-size 32000 --log-interval 1 --eval-iters 0 --num-workers 0 --bf16)
GPU_CHECK_FLAGS=()
[ "$QUICK" = 0 ] || GPU_CHECK_FLAGS=(--hidden-size 2048 --num-attention-heads 16 --seq-length 4096 --repeats 3
                                      --warmup 1 --small-iters 3)
if [ -n "$GPU_CHECK_EXTRA" ]; then
    read -r -a _extra <<<"$GPU_CHECK_EXTRA"
    GPU_CHECK_FLAGS+=("${_extra[@]}")
fi

NSTEP=0
FAILED=0
show() { printf '%q ' "$@" | sed 's/ $//'; }

# record PASS STEP STATUS EXIT SECONDS LOG COMMAND
record() { printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$@" >>"$OUT/steps.tsv"; }

# step PASS NAME LOG -- COMMAND...: run it (all its output to LOG, under the results folder), record it.
step() {
    local pass=$1 name=$2 log=$3; shift 3
    [ "$1" = -- ] && shift
    NSTEP=$((NSTEP + 1))
    local shown; shown=$(show "$@")
    if [ "$DRY_RUN" = 1 ]; then
        printf '  %2d  [%s] %s\n      %s > %s 2>&1\n' "$NSTEP" "$pass" "$name" "$shown" "$OUT/$log"
        return 0
    fi
    printf '%s: [%s] %s ... ' "$PROG" "$pass" "$name"
    local start end status
    start=$(date +%s.%N)
    mkdir -p "$(dirname "$OUT/$log")"
    if [ "$STEP_TIMEOUT" -gt 0 ]; then
        if timeout -k 30 "$STEP_TIMEOUT" "$@" >"$OUT/$log" 2>&1 </dev/null; then status=0; else status=$?; fi
    else
        if "$@" >"$OUT/$log" 2>&1 </dev/null; then status=0; else status=$?; fi
    fi
    end=$(date +%s.%N)
    local seconds; seconds=$(awk -v a="$start" -v b="$end" 'BEGIN { printf "%.1f", b - a }')
    local result=ok
    if [ "$status" = 124 ] || { [ "$status" = 137 ] && [ "$STEP_TIMEOUT" -gt 0 ]; }; then
        result="timed out (${STEP_TIMEOUT} s)"
    elif [ "$status" != 0 ]; then
        result=FAILED
    fi
    [ "$result" = ok ] || FAILED=1
    echo "$result (exit $status, $seconds s, $log)"
    record "$pass" "$name" "$result" "$status" "$seconds" "$log" "$shown"
    "$PY" "$HELPER" summary "$OUT" >/dev/null 2>&1 || true
}

skip_pass() {  # PASS REASON
    if [ "$DRY_RUN" = 1 ]; then
        printf '      [%s] skipped: %s\n' "$1" "$2"
        return 0
    fi
    mkdir -p "$OUT/$1"
    printf '%s\n' "$2" >"$OUT/$1/SKIPPED.txt"
    echo "$PROG: [$1] skipped: $2"
    record "$1" "(all)" skipped - - "$1/SKIPPED.txt" "-"
}

# The checks of one megatron-core release: PASS WHEEL
run_pass() {
    local pass=$1 wheel=$2 version=${1#mcore-}
    local site="$INSTALL_DIR/$pass/site"
    local env_=(env "PYTHONPATH=$site" PYTHONUNBUFFERED=1)
    step "$pass" install "$pass/install.log" -- "$PY" -m pip install --no-index --no-deps --no-compile --no-cache-dir \
        --disable-pip-version-check --no-warn-script-location --upgrade --target "$site" "$wheel" "${EXTRA_WHEELS[@]}"
    step "$pass" install-repo "$pass/install-repo.log" -- "$PY" -m pip install --no-index --no-deps --no-build-isolation \
        --no-compile --no-cache-dir --disable-pip-version-check --no-warn-script-location --upgrade --target "$site" "$REPO"
    step "$pass" imports "$pass/imports.log" -- "${env_[@]}" "$PY" "$RUN_HELPER" imports "$site" "$version"
    step "$pass" gpu_check "$pass/gpu_check.log" -- "${env_[@]}" "$PY" tools/gpu_check.py --json "$OUT/$pass/gpu_check.json" \
        "${GPU_CHECK_FLAGS[@]}"
    step "$pass" pytest-gpu "$pass/pytest-gpu.log" -- "${env_[@]}" "$PY" -m pytest -m gpu -q -rs -p no:cacheprovider tests \
        --junitxml "$OUT/$pass/pytest-gpu.xml"
    step "$pass" pretrain-tawpipe "$pass/pretrain-tawpipe.log" -- "${env_[@]}" "$PY" pretrain_llama.py "${PAIR_FLAGS[@]}" \
        --pipeline-schedule tawpipe --metrics-file "$OUT/$pass/pretrain-tawpipe.jsonl"
    step "$pass" pretrain-1f1b "$pass/pretrain-1f1b.log" -- "${env_[@]}" "$PY" pretrain_llama.py "${PAIR_FLAGS[@]}" \
        --pipeline-schedule 1f1b --pipeline-model-parallel-size 1 --metrics-file "$OUT/$pass/pretrain-1f1b.jsonl"
    step "$pass" compare-losses "$pass/compare-losses.log" -- "$PY" tools/compare_metrics.py \
        "$OUT/$pass/pretrain-tawpipe.jsonl" "$OUT/$pass/pretrain-1f1b.jsonl" --rtol 1e-2
}

all_steps() {
    step machine nvidia-smi-q nvidia-smi-q.txt -- nvidia-smi -q
    step machine environment environment.log -- "$PY" "$RUN_HELPER" environment "$OUT/environment.json"
    if [ -n "$MAIN_WHEEL" ]; then
        run_pass "mcore-$MAIN_VERSION" "$MAIN_WHEEL"
    else
        run_pass "mcore-0.19.x" "$WHEELS/MISSING:megatron_core-0.19.x.whl"
    fi
    if [ -n "$SECOND_WHEEL" ]; then
        run_pass "mcore-$SECOND_VERSION" "$SECOND_WHEEL"
    else
        skip_pass "mcore-$SECOND_VERSION" "$SECOND_SKIP"
    fi
}

# ---- dry run ----------------------------------------------------------------------------------------

if [ "$DRY_RUN" = 1 ]; then
    echo "$PROG --dry-run: nothing is run or written."
    echo "inputs:"
    echo "  repository   $REPO"
    echo "$INVENTORY"
    echo "  results      $OUT (not created)"
    echo "  installs     $INSTALL_DIR/mcore-<version>/site (not created; PYTHONPATH of each pass)"
    for note in "${NOTES[@]}"; do echo "  note: $note"; done
    echo "steps (each step's output goes to its log under the results folder; every step runs even when one fails):"
    all_steps
    echo "then: summary.md and summary.json in $OUT${TAR:+; the results packed into $TAR}"
    if [ "${#PROBLEMS[@]}" -gt 0 ]; then
        for p in "${PROBLEMS[@]}"; do echo "$PROG: error: $p" >&2; done
        echo "$PROG --dry-run: ${#PROBLEMS[@]} input(s) missing or unusable (above): a real run would refuse" >&2
        exit 2
    fi
    echo "$PROG --dry-run: the inputs would do."
    exit 0
fi

# ---- the real run -------------------------------------------------------------------------------------

if [ "${#PROBLEMS[@]}" -gt 0 ]; then
    echo "$INVENTORY" >&2
    for p in "${PROBLEMS[@]}"; do echo "$PROG: error: $p" >&2; done
    exit 2
fi
if [ -d "$OUT" ] && [ -n "$(ls -A "$OUT" 2>/dev/null)" ]; then
    die "the results folder $OUT exists and is not empty: name another with --out"
fi
mkdir -p "$OUT" "$INSTALL_DIR"
cp "$HELPER" "$RUN_HELPER"
exec > >(tee -a "$OUT/bringup.log") 2>&1
: >"$OUT/steps.tsv"
COMMIT=$(git -C "$REPO" rev-parse --short HEAD 2>/dev/null || echo "unknown (no git repository)")
if [ "${COMMIT#unknown}" = "$COMMIT" ] && [ -n "$(git -C "$REPO" status --porcelain --untracked-files=no 2>/dev/null)" ]; then
    COMMIT="$COMMIT (with uncommitted changes)"
fi
PASSES=("mcore-$MAIN_VERSION")
[ -z "$SECOND_WHEEL" ] || PASSES+=("mcore-$SECOND_VERSION")
"$PY" - "$OUT/run.json" "$STAMP" "$COMMIT" "$PY_VERSION" "$TORCH_VERSION" "$GPU_NAME" "$SECOND_SKIP" \
    "$WHEELS" "$INSTALL_DIR" "${PASSES[@]}" <<'PYEOF'
import json, sys
path, started, commit, python, torch, gpu, skipped, wheels, installs, *passes = sys.argv[1:]
json.dump({"started": started, "commit": commit, "python": python, "torch": torch, "gpu": gpu,
           "passes": passes, "skipped_passes": [skipped] if skipped else [], "wheels": wheels,
           "installs": installs}, open(path, "w"), indent=1)
PYEOF
printf '%s\n' "$INVENTORY" >"$OUT/inputs.txt"
echo "$PROG: $GPU_NAME; python $PY_VERSION, torch $TORCH_VERSION; results in $OUT"
all_steps
"$PY" "$HELPER" summary "$OUT"
if [ -n "$TAR" ]; then
    mkdir -p "$(dirname "$TAR")"
    tar -czf "$TAR" -C "$(dirname "$OUT")" "$(basename "$OUT")" && echo "$PROG: results packed into $TAR"
fi
if [ "$FAILED" = 0 ]; then
    echo "$PROG: every step passed; summary in $OUT/summary.md"
    exit 0
fi
echo "$PROG: some steps FAILED (see $OUT/summary.md)"
exit 1
