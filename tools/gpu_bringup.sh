#!/usr/bin/env bash
# One command that checks a GPU machine: wheels in, one results folder (and one archive) out, in a time budget.
#
#   bash tools/gpu_bringup.sh --quick --budget 540 --tar "$OUT/gpu.tar.gz"   # one GPU, no network
#   bash tools/gpu_bringup.sh --dry-run          # anywhere: check the inputs, print the budgeted plan
#   bash tools/gpu_bringup.sh --help
#
# See docs/gpu-check.md, "One command: tools/gpu_bringup.sh".
#
# Test hook (tests/test_gpu_bringup.py): when GPU_BRINGUP_TEST_STEP holds a shell snippet, every step runs
# `bash -c "$GPU_BRINGUP_TEST_STEP" step PASS STEP` instead of its command, and the input checks' problems
# (no GPU, no wheels) are printed without stopping the run; budgets, records and the archive are the real ones.
set -euo pipefail

START_MS=$(( $(date +%s%N) / 1000000 ))   # the budget counts from here
PROG=gpu_bringup.sh
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
MCORE_MAIN_PIN=0.19.2        # newest megatron-core 0.19.x when this was written: what the download line names
MCORE_SECOND_PIN=0.16.1      # what CI runs: the optional second pass
TARGET_PYTHON=3.12           # the GPU machines' Python, what the wheels are checked for
KILL_GRACE=3                 # seconds between a step's SIGTERM and its SIGKILL
STEP_OVERHEAD=4              # per step beyond its timeout: the kill grace, the summary and the archive
RESERVE=8                    # kept at the end of the budget: the last summary and archive

usage() {
    cat <<EOF
usage: bash tools/$PROG [--wheels DIR] [--out DIR] [--install-dir DIR] [--python PY]
                           [--target-python X.Y] [--quick] [--no-second-pass]
                           [--gpu-check-args "FLAGS"] [--budget SEC] [--step-timeout SEC]
                           [--min-start SEC] [--tar FILE] [--dry-run]

Checks one GPU with this repository on a machine that has a CUDA build of torch but no
megatron-core and no network, within a time budget. Each megatron-core release found as a wheel
(0.19.x, required; $MCORE_SECOND_PIN, optional) is installed with 'pip install --no-index --no-deps --target'
into its own private folder (pip never touches torch), put on PYTHONPATH, and checked. The steps,
most valuable first:

  machine      nvidia-smi -q; environment facts (Python, torch, CUDA, cuDNN, NCCL version,
               GPU name, capability, multiprocessors, memory, package versions) as JSON
  per release  install the wheels; install this repository; the imports (which megatron-core,
               from where); a bf16 pretrain_llama.py pair on one rank with NCCL, tawpipe against
               native 1f1b, compared by tools/compare_metrics.py --rtol 1e-2; tools/gpu_check.py's
               compute check (weight-passing compute against native megatron-core, tokens/s on the
               same layers; its 'timings' check where the tool has no 'compute'); python -m pytest
               -m gpu tests (JUnit XML); tools/gpu_check.py's other checks
  the $MCORE_SECOND_PIN pass comes last, after every step of the 0.19.x one.

Each step's timeout is the smaller of its cap and what is left of the budget; a step that cannot
start with at least min(its cap, --min-start) seconds left is recorded as 'skipped: budget' (not
failed), and so is a comparison whose runs were skipped. Every other step runs even when an
earlier one failed. Everything goes into one results folder: a log per step, summary.md and
summary.json (each step, its status, exit status, duration, timeout), rewritten after every step,
as is the --tar archive, so a run cut short still leaves both. Exit status: 0 when no step failed
(skipped ones included), 1 when a step failed or timed out, 2 when the inputs are missing (the
missing wheel and its download command are named, one line each) or a flag is wrong.

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
  --budget SEC          finish within SEC seconds of the script's start (default 540: a 600-s call
                        with room to spare; 0: no budget). $RESERVE s of it are kept for the end.
  --step-timeout SEC    every step's cap is SEC seconds instead of its own (0: no cap, the budget
                        alone limits it); the budget still applies
  --min-start SEC       a step starts only with min(its cap, SEC) seconds of budget left (default 15)
  --tar FILE, --archive FILE
                        pack the results folder into FILE (.tar.gz) after every step: written to
                        FILE.part, then renamed, so FILE is always a whole archive
  --dry-run             run nothing: check the inputs (wheel folder, which wheels are found or
                        missing, their Python tags and requirements, this Python, whether torch
                        sees CUDA), print the budgeted plan: every step with its exact command, its
                        cap, its timeout and when it ends in the worst case; exit 0 when the inputs
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
RESULTS=""
INSTALL_DIR=""
PY=python3
QUICK=0
SECOND_PASS=1
GPU_CHECK_EXTRA=""
BUDGET=540
STEP_TIMEOUT=""              # empty: each step's own cap
MIN_START=15
TAR=""
DRY_RUN=0

die() { echo "$PROG: error: $*" >&2; exit 2; }
need_value() { [ $# -ge 2 ] && [ -n "$2" ] || die "$1 needs a value"; }

while [ $# -gt 0 ]; do
    case "$1" in
        --wheels) need_value "$@"; WHEELS=$2; shift 2 ;;
        --wheels=*) WHEELS=${1#*=}; shift ;;
        --out) need_value "$@"; RESULTS=$2; shift 2 ;;
        --out=*) RESULTS=${1#*=}; shift ;;
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
        --budget) need_value "$@"; BUDGET=$2; shift 2 ;;
        --budget=*) BUDGET=${1#*=}; shift ;;
        --step-timeout) need_value "$@"; STEP_TIMEOUT=$2; shift 2 ;;
        --step-timeout=*) STEP_TIMEOUT=${1#*=}; shift ;;
        --min-start) need_value "$@"; MIN_START=$2; shift 2 ;;
        --min-start=*) MIN_START=${1#*=}; shift ;;
        --tar|--archive) need_value "$@"; TAR=$2; shift 2 ;;
        --tar=*|--archive=*) TAR=${1#*=}; shift ;;
        --dry-run) DRY_RUN=1; shift ;;
        -h|--help) usage; exit 0 ;;
        *) die "unknown argument '$1' (see --help)" ;;
    esac
done
[[ "$BUDGET" =~ ^[0-9]+$ ]] || die "--budget must be a whole number of seconds (0: none), got '$BUDGET'"
if [ "$BUDGET" != 0 ] && [ "$BUDGET" -le $((RESERVE + STEP_OVERHEAD)) ]; then
    die "--budget must be 0 (none) or more than $((RESERVE + STEP_OVERHEAD)) s (the end's reserve and one step's overhead), got $BUDGET"
fi
[ -z "$STEP_TIMEOUT" ] || [[ "$STEP_TIMEOUT" =~ ^[0-9]+$ ]] \
    || die "--step-timeout must be a whole number of seconds (0: no cap), got '$STEP_TIMEOUT'"
[[ "$MIN_START" =~ ^[0-9]+$ ]] && [ "$MIN_START" -ge 1 ] \
    || die "--min-start must be a whole number of seconds, at least 1, got '$MIN_START'"
[[ "$TARGET_PYTHON" =~ ^3\.[0-9]+$ ]] || die "--target-python must look like 3.12, got '$TARGET_PYTHON'"
command -v "$PY" >/dev/null 2>&1 || die "no Python interpreter '$PY' (--python)"

abspath() { case "$1" in /*) printf '%s\n' "$1" ;; *) printf '%s\n' "$PWD/$1" ;; esac; }
WHEELS=$(abspath "$WHEELS")
[ -z "$RESULTS" ] || RESULTS=$(abspath "$RESULTS")
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
[ -n "$RESULTS" ] || RESULTS="$REPO/examples/results/gpu/$STAMP-$GPU_SLUG"
[ -n "$INSTALL_DIR" ] || INSTALL_DIR="/tmp/tawpipe-gpu-bringup/$STAMP"
RUN_HELPER="$INSTALL_DIR/bringup.py"   # the helper's copy that the steps run (kept with the installs)
case "$TAR" in
    "$RESULTS"/*) die "--tar $TAR lies inside the results folder $RESULTS: name a file outside it" ;;
esac

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
# tools/gpu_check.py's checks, as its CHECKS tuple names them: the compute check first, the others later.
GPU_CHECK_ALL=$(sed -n 's/^CHECKS = (\(.*\)).*/\1/p' tools/tawpipe_lab/gpu_check.py | tr -d "\"' ")
if [[ ",$GPU_CHECK_ALL," == *",compute,"* ]]; then
    COMPUTE_CHECK=compute
else
    COMPUTE_CHECK=timings
    NOTES+=("tools/gpu_check.py has no 'compute' check: the compute step runs its 'timings' (per-shard compute times)")
fi
OTHER_CHECKS=$(printf '%s' "$GPU_CHECK_ALL" | tr ',' '\n' | grep -vx "$COMPUTE_CHECK" | paste -sd, -)

# Each step's own cap in seconds (--step-timeout replaces them all): generous for a GPU machine, where
# most steps take a small part of theirs; the budget is what bounds the whole.
own_cap() {
    case "$1" in
        nvidia-smi-q|compare-losses) echo 20 ;;
        environment|install|imports) echo 45 ;;
        install-repo) echo 60 ;;
        pretrain-tawpipe|pretrain-1f1b) echo 120 ;;
        gpu_check-compute) echo 150 ;;
        pytest-gpu|gpu_check-others) echo 300 ;;
        *) echo 60 ;;
    esac
}
cap_of() { if [ -n "$STEP_TIMEOUT" ]; then echo "$STEP_TIMEOUT"; else own_cap "$1"; fi; }
elapsed_ms() { echo $(( $(date +%s%N) / 1000000 - START_MS )); }

# timeout_for CAP USED_MS: the step's timeout in seconds (0: none) when it may start after USED_MS of the
# budget, or -1 when it cannot start: less than min(CAP, --min-start) left after the overhead and reserve.
timeout_for() {
    local cap=$1 used_ms=$2 left need
    if [ "$BUDGET" = 0 ]; then echo "$cap"; return; fi
    left=$(( (BUDGET - RESERVE - STEP_OVERHEAD) * 1000 - used_ms ))
    if [ "$left" -lt 1000 ]; then echo -1; return; fi
    left=$(( left / 1000 ))
    need=$MIN_START
    if [ "$cap" -gt 0 ] && [ "$cap" -lt "$need" ]; then need=$cap; fi
    if [ "$left" -lt "$need" ]; then echo -1; return; fi
    if [ "$cap" -gt 0 ] && [ "$cap" -lt "$left" ]; then echo "$cap"; else echo "$left"; fi
}

NSTEP=0
FAILED=0
WORST_MS=0                   # the dry run's plan: the budget used when every step runs to its timeout
declare -A STATUS=()
show() { printf '%q ' "$@" | sed 's/ $//'; }

# record PASS STEP STATUS EXIT SECONDS LOG COMMAND TIMEOUT
record() { printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$@" >>"$RESULTS/steps.tsv"; }

# pack: the results folder into --tar, whole or not at all (FILE.part, then renamed).
pack() {
    [ -n "$TAR" ] || return 0
    local status=0
    tar --warning=no-file-changed -czf "$TAR.part" -C "$(dirname "$RESULTS")" "$(basename "$RESULTS")" \
        2>"$WORK/tar.err" || status=$?
    if [ "$status" -le 1 ]; then   # 1: a log grew while it was read (bringup.log): the archive is whole
        mv -f "$TAR.part" "$TAR"
    else
        rm -f "$TAR.part"
        echo "$PROG: warning: could not pack $RESULTS into $TAR: $(head -c 300 "$WORK/tar.err")"
    fi
}

after_step() {
    "$PY" "$HELPER" summary "$RESULTS" "$(( $(elapsed_ms) / 1000 ))" >/dev/null 2>&1 || true
    pack
}

skip_step() {  # PASS NAME LOG SHOWN REASON
    echo "$PROG: [$1] $2 skipped: $5"
    STATUS[$1/$2]=skipped
    record "$1" "$2" "skipped: $5" - - - "$4" -
    after_step
}

# [NEEDS="STEP ..."] step PASS NAME LOG -- COMMAND...: run it within the budget (its output to LOG, under the
# results folder), record it. NEEDS names earlier steps of the pass whose results it reads.
step() {
    local pass=$1 name=$2 log=$3; shift 3
    [ "$1" = -- ] && shift
    NSTEP=$((NSTEP + 1))
    local shown cap t
    shown=$(show "$@")
    cap=$(cap_of "$name")
    if [ "$DRY_RUN" = 1 ]; then
        t=$(timeout_for "$cap" "$WORST_MS")
        local capped="cap ${cap} s"
        [ "$cap" != 0 ] || capped="no cap"
        if [ "$t" = -1 ]; then
            printf '  %2d  [%s] %s  (%s; worst case: skipped: budget, it runs if earlier steps end early)\n' \
                "$NSTEP" "$pass" "$name" "$capped"
        elif [ "$BUDGET" = 0 ] && [ "$t" = 0 ]; then
            printf '  %2d  [%s] %s  (no cap, no budget)\n' "$NSTEP" "$pass" "$name"
        else
            WORST_MS=$(( WORST_MS + (t + STEP_OVERHEAD) * 1000 ))
            printf '  %2d  [%s] %s  (%s; timeout %s s; worst case ends at %s s of %s)\n' "$NSTEP" "$pass" "$name" \
                "$capped" "$t" "$(( WORST_MS / 1000 ))" "$([ "$BUDGET" = 0 ] && echo "no budget" || echo "$((BUDGET - RESERVE)) s")"
        fi
        printf '      %s > %s 2>&1\n' "$shown" "$RESULTS/$log"
        return 0
    fi
    local need
    for need in ${NEEDS:-}; do
        if [ "${STATUS[$pass/$need]:-}" = skipped ]; then
            skip_step "$pass" "$name" "$log" "$shown" "budget ($need was skipped)"
            return 0
        fi
    done
    t=$(timeout_for "$cap" "$(elapsed_ms)")
    if [ "$t" = -1 ]; then
        skip_step "$pass" "$name" "$log" "$shown" "budget ($(( $(elapsed_ms) / 1000 )) s of $BUDGET s used)"
        return 0
    fi
    if [ -n "${GPU_BRINGUP_TEST_STEP:-}" ]; then
        set -- bash -c "$GPU_BRINGUP_TEST_STEP" step "$pass" "$name"
    fi
    printf '%s: [%s] %s (timeout %s) ... ' "$PROG" "$pass" "$name" "$([ "$t" = 0 ] && echo none || echo "$t s")"
    local start end status
    start=$(elapsed_ms)
    mkdir -p "$(dirname "$RESULTS/$log")"
    if [ "$t" -gt 0 ]; then
        if timeout -k "$KILL_GRACE" "$t" "$@" >"$RESULTS/$log" 2>&1 </dev/null; then status=0; else status=$?; fi
    else
        if "$@" >"$RESULTS/$log" 2>&1 </dev/null; then status=0; else status=$?; fi
    fi
    end=$(elapsed_ms)
    local seconds; seconds=$(awk -v a="$start" -v b="$end" 'BEGIN { printf "%.1f", (b - a) / 1000 }')
    local result=ok
    if [ "$t" -gt 0 ] && { [ "$status" = 124 ] || [ "$status" = 137 ]; }; then
        if [ "$cap" = 0 ] || [ "$t" -lt "$cap" ]; then result="timed out (${t} s: budget)"; else result="timed out (${t} s)"; fi
    elif [ "$status" != 0 ]; then
        result=FAILED
    fi
    [ "$result" = ok ] || FAILED=1
    STATUS[$pass/$name]=$result
    echo "$result (exit $status, $seconds s, $log)"
    record "$pass" "$name" "$result" "$status" "$seconds" "$log" "$shown" "$t"
    after_step
}

skip_pass() {  # PASS REASON
    if [ "$DRY_RUN" = 1 ]; then
        printf '      [%s] skipped: %s\n' "$1" "$2"
        return 0
    fi
    mkdir -p "$RESULTS/$1"
    printf '%s\n' "$2" >"$RESULTS/$1/SKIPPED.txt"
    echo "$PROG: [$1] skipped: $2"
    record "$1" "(all)" skipped - - "$1/SKIPPED.txt" "-" -
    after_step
}

# The checks of one megatron-core release, most valuable first: PASS WHEEL
run_pass() {
    local pass=$1 wheel=$2 version=${1#mcore-}
    local site="$INSTALL_DIR/$pass/site"
    local env_=(env "PYTHONPATH=$site" PYTHONUNBUFFERED=1)
    step "$pass" install "$pass/install.log" -- "$PY" -m pip install --no-index --no-deps --no-compile --no-cache-dir \
        --disable-pip-version-check --no-warn-script-location --upgrade --target "$site" "$wheel" "${EXTRA_WHEELS[@]}"
    step "$pass" install-repo "$pass/install-repo.log" -- "$PY" -m pip install --no-index --no-deps --no-build-isolation \
        --no-compile --no-cache-dir --disable-pip-version-check --no-warn-script-location --upgrade --target "$site" "$REPO"
    step "$pass" imports "$pass/imports.log" -- "${env_[@]}" "$PY" "$RUN_HELPER" imports "$site" "$version"
    step "$pass" pretrain-tawpipe "$pass/pretrain-tawpipe.log" -- "${env_[@]}" "$PY" pretrain_llama.py "${PAIR_FLAGS[@]}" \
        --pipeline-schedule tawpipe --metrics-file "$RESULTS/$pass/pretrain-tawpipe.jsonl"
    step "$pass" pretrain-1f1b "$pass/pretrain-1f1b.log" -- "${env_[@]}" "$PY" pretrain_llama.py "${PAIR_FLAGS[@]}" \
        --pipeline-schedule 1f1b --pipeline-model-parallel-size 1 --metrics-file "$RESULTS/$pass/pretrain-1f1b.jsonl"
    NEEDS="pretrain-tawpipe pretrain-1f1b" step "$pass" compare-losses "$pass/compare-losses.log" -- \
        "$PY" tools/compare_metrics.py "$RESULTS/$pass/pretrain-tawpipe.jsonl" "$RESULTS/$pass/pretrain-1f1b.jsonl" --rtol 1e-2
    step "$pass" gpu_check-compute "$pass/gpu_check-compute.log" -- "${env_[@]}" "$PY" tools/gpu_check.py \
        --json "$RESULTS/$pass/gpu_check-compute.json" --checks "$COMPUTE_CHECK" "${GPU_CHECK_FLAGS[@]}"
    step "$pass" pytest-gpu "$pass/pytest-gpu.log" -- "${env_[@]}" "$PY" -m pytest -m gpu -q -rs -p no:cacheprovider tests \
        --junitxml "$RESULTS/$pass/pytest-gpu.xml"
    if [ -n "$OTHER_CHECKS" ]; then
        step "$pass" gpu_check-others "$pass/gpu_check-others.log" -- "${env_[@]}" "$PY" tools/gpu_check.py \
            --json "$RESULTS/$pass/gpu_check-others.json" --checks "$OTHER_CHECKS" "${GPU_CHECK_FLAGS[@]}"
    fi
}

all_steps() {
    step machine nvidia-smi-q nvidia-smi-q.txt -- nvidia-smi -q
    step machine environment environment.log -- "$PY" "$RUN_HELPER" environment "$RESULTS/environment.json"
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

if [ "$BUDGET" = 0 ]; then
    BUDGET_SHOWN="none"
else
    BUDGET_SHOWN="$BUDGET s from the start ($((BUDGET - RESERVE)) s for the steps, each ${STEP_OVERHEAD} s of overhead beyond its timeout; $RESERVE s for the end)"
fi
if [ -n "$STEP_TIMEOUT" ]; then CAPS_SHOWN="--step-timeout $STEP_TIMEOUT s for every step"; else CAPS_SHOWN="each step's own"; fi

# ---- dry run ----------------------------------------------------------------------------------------

if [ "$DRY_RUN" = 1 ]; then
    echo "$PROG --dry-run: nothing is run or written."
    echo "inputs:"
    echo "  repository   $REPO"
    echo "$INVENTORY"
    echo "  results      $RESULTS (not created)"
    echo "  installs     $INSTALL_DIR/mcore-<version>/site (not created; PYTHONPATH of each pass)"
    for note in "${NOTES[@]}"; do echo "  note: $note"; done
    echo "budget: $BUDGET_SHOWN; caps: $CAPS_SHOWN; a step starts with at least min(its cap, $MIN_START s) left"
    echo "steps, most valuable first (each one's output goes to its log under the results folder; a step that"
    echo "fails does not stop the others; the worst case lets every step run to its timeout):"
    all_steps
    if [ "$BUDGET" != 0 ]; then
        echo "worst case: the steps end by $(( WORST_MS / 1000 )) s, within the $((BUDGET - RESERVE)) s of the $BUDGET-s budget left for them"
    fi
    echo "then: summary.md and summary.json in $RESULTS${TAR:+, packed into $TAR after every step}"
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
    [ -n "${GPU_BRINGUP_TEST_STEP:-}" ] || exit 2
    echo "$PROG: GPU_BRINGUP_TEST_STEP is set: going on with every step's command replaced" >&2
fi
if [ -d "$RESULTS" ] && [ -n "$(ls -A "$RESULTS" 2>/dev/null)" ]; then
    die "the results folder $RESULTS exists and is not empty: name another with --out"
fi
mkdir -p "$RESULTS" "$INSTALL_DIR"
[ -z "$TAR" ] || mkdir -p "$(dirname "$TAR")"
cp "$HELPER" "$RUN_HELPER"
exec > >(tee -a "$RESULTS/bringup.log") 2>&1
: >"$RESULTS/steps.tsv"
COMMIT=$(git -C "$REPO" rev-parse --short HEAD 2>/dev/null || echo "unknown (no git repository)")
if [ "${COMMIT#unknown}" = "$COMMIT" ] && [ -n "$(git -C "$REPO" status --porcelain --untracked-files=no 2>/dev/null)" ]; then
    COMMIT="$COMMIT (with uncommitted changes)"
fi
PASSES=("mcore-${MAIN_VERSION:-0.19.x}")
[ -z "$SECOND_WHEEL" ] || PASSES+=("mcore-$SECOND_VERSION")
"$PY" - "$RESULTS/run.json" "$STAMP" "$COMMIT" "$PY_VERSION" "$TORCH_VERSION" "$GPU_NAME" "$SECOND_SKIP" \
    "$WHEELS" "$INSTALL_DIR" "$BUDGET" "${STEP_TIMEOUT:-own caps}" "${PASSES[@]}" <<'PYEOF'
import json, sys
path, started, commit, python, torch, gpu, skipped, wheels, installs, budget, caps, *passes = sys.argv[1:]
json.dump({"started": started, "commit": commit, "python": python, "torch": torch, "gpu": gpu,
           "passes": passes, "skipped_passes": [skipped] if skipped else [], "wheels": wheels,
           "installs": installs, "budget_s": int(budget), "step_timeout": caps}, open(path, "w"), indent=1)
PYEOF
printf '%s\n' "$INVENTORY" >"$RESULTS/inputs.txt"
echo "$PROG: $GPU_NAME; python $PY_VERSION, torch $TORCH_VERSION; results in $RESULTS"
echo "$PROG: budget: $BUDGET_SHOWN; caps: $CAPS_SHOWN"
for note in "${NOTES[@]}"; do echo "$PROG: note: $note"; done
after_step
all_steps
"$PY" "$HELPER" summary "$RESULTS" "$(( $(elapsed_ms) / 1000 ))"
if [ "$FAILED" = 0 ]; then
    echo "$PROG: no step failed, in $(( $(elapsed_ms) / 1000 )) s; summary in $RESULTS/summary.md"
    STATUS_CODE=0
else
    echo "$PROG: some steps FAILED, in $(( $(elapsed_ms) / 1000 )) s (see $RESULTS/summary.md)"
    STATUS_CODE=1
fi
pack
[ -z "$TAR" ] || echo "$PROG: results packed into $TAR"
exit "$STATUS_CODE"
