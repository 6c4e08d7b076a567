#!/usr/bin/env bash
# The GPU variants of the end-to-end tests, as one short script for a machine with a GPU
# (`make gpu-check`). No registry is reachable there, so `make gpu-check-prepare` first puts,
# under the ignored .gpu-check/ of this checkout, what the script installs: the wheel built
# from this checkout, megatron-core 0.12.1 and nvidia-resiliency-ext 0.3.0 as installed
# folders (their checkpointing code is pure Python; megatron-core 0.12.1 has no wheel for the
# GPU machine's Python 3.12), and numpy 1.26.4 for Python 3.12 (megatron-core's job path
# needs numpy 1.x). Carry .gpu-check with the command.
#
# What runs, with that machine's own torch (2.11.0 there: both breaks apply), on CUDA:
#   1. the training job's checkpoint path (tests/job_path/training_job.py --device cuda):
#      2 ranks, 3 async saves, a resume with another save, a resume on one rank; the job's
#      CPU stand-in for CUDA does nothing on a GPU machine;
#   2. the same save with MCORE_AUTOPATCH=0: it must fail with the _write_item error;
#   3. mcore-autopatch selftest and status;
#   4. nvidia-resiliency-ext 0.3.0's full async save (tests/import_scripts/nvrx_async_save.py).
# Each step prints PASS or FAIL; the exit status is the number of failed steps.
set -u
cd "$(dirname "$0")/.."
PREP=.gpu-check
PY=${GPU_CHECK_PYTHON:-python3}
OUT_DIR=${OUT:-/tmp/gpu-check-out}
mkdir -p "$OUT_DIR"
failed=0

if [ ! -d "$PREP" ]; then
    echo "gpu-check: run \`make gpu-check-prepare\` on a machine with the registry first, and carry $PREP" >&2
    exit 2
fi
if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "gpu-check: no CUDA device for $PY; this script is for a machine with a GPU" >&2
    exit 2
fi

VENV=/tmp/gpu-check-venv
rm -rf "$VENV" /tmp/gpu-check-site
"$PY" -m venv --system-site-packages "$VENV"
"$VENV/bin/python" -m pip install -q --no-index --no-deps --disable-pip-version-check "$PREP"/mcore_autopatch-*.whl
"$VENV/bin/python" -m pip install -q --no-index --no-deps --disable-pip-version-check --target /tmp/gpu-check-site \
    "$PREP"/numpy-1.26.4-*.whl
export PYTHONPATH="/tmp/gpu-check-site:$PREP/mcore-0.12.1:$PREP/nvrx-0.3.0"
export OMP_NUM_THREADS=1 TORCHINDUCTOR_COMPILE_THREADS=1 PYTHONUNBUFFERED=1
P="$VENV/bin/python"
JOB=tests/job_path/training_job.py

step() {  # step NAME EXPECTED(ok|fail) COMMAND...
    local name=$1 expected=$2
    shift 2
    local log="$OUT_DIR/$name.log"
    "$@" >"$log" 2>&1
    local rc=$?
    if { [ "$expected" = ok ] && [ $rc -eq 0 ]; } || { [ "$expected" = fail ] && [ $rc -ne 0 ]; }; then
        echo "PASS $name (rc=$rc)"
    else
        echo "FAIL $name (rc=$rc, expected $expected); last lines:"
        tail -n 30 "$log"
        failed=$((failed + 1))
    fi
}

ROOT_DIR=$(mktemp -d /tmp/gpu-check-job-XXXX)
step status ok "$P" -m mcore_autopatch status
step job-save ok "$P" $JOB --launch 2 save --root "$ROOT_DIR/with" --device cuda --json
step job-resume ok "$P" $JOB --launch 2 resume --root "$ROOT_DIR/with" --device cuda --then-save --json
step job-resume-1-rank ok "$P" $JOB --launch 1 resume --root "$ROOT_DIR/with" --device cuda --json
step job-save-without-fix fail env MCORE_AUTOPATCH=0 "$P" $JOB --launch 2 save --root "$ROOT_DIR/without" --device cuda --json
grep -q "_write_item() missing 1 required positional argument: 'serialization_format'" "$OUT_DIR/job-save-without-fix.log" \
    || { echo "FAIL job-save-without-fix did not fail with the _write_item error"; failed=$((failed + 1)); }
step selftest ok "$P" -m mcore_autopatch selftest
step nvrx-async-save ok "$P" tests/import_scripts/nvrx_async_save.py "$ROOT_DIR/nvrx"
echo "gpu-check: $failed step(s) failed; logs in $OUT_DIR"
exit "$failed"
