#!/usr/bin/env bash
# The GPU variants of the end-to-end tests, as one short script for a machine with a GPU
# (`make gpu-check`). No registry is reachable there, so `make gpu-check-prepare` first puts,
# under the ignored .gpu-check/ of this checkout, what the script installs: the wheel built
# from this checkout, megatron-core 0.12.1 and nvidia-resiliency-ext 0.3.0 as installed
# folders (their checkpointing code is pure Python; megatron-core 0.12.1 has no wheel for the
# GPU machine's Python 3.12), and numpy 1.26.4 for Python 3.12. Carry .gpu-check with the
# command.
#
# What runs, on CUDA, with that machine's own torch and numpy (torch 2.11.0 and numpy 2.5.2
# on the lent H200s: the two torch breaks and numpy 2 at once, as in a fresh vLLM image):
#   1. mcore-autopatch status: which fixes this stack needs;
#   2. the training job's checkpoint path (tests/job_path/training_job.py --device cuda):
#      2 ranks, 3 async saves, a resume that saves again, a resume on one rank; the job's
#      CPU stand-in for CUDA does nothing on a GPU machine;
#   3. the same save with MCORE_AUTOPATCH=0: it fails as upstream does there (numpy.product);
#   4. the job on numpy 1.26.4 (carried): save and resume with the wheel; without it, the
#      save fails with the _write_item error;
#   5. mcore-autopatch selftest;
#   6. nvidia-resiliency-ext 0.3.0's full async save (tests/import_scripts/nvrx_async_save.py);
#   7. async saves as Megatron-LM's loop makes them (two in flight, a synchronous one during
#      an async one, one abandoned), every iteration loaded and compared; without
#      write_results_per_save the same saves report success and do not load;
#   8. a resume into another padded vocabulary (allow_shape_mismatch; 0.12.1 passes it itself).
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

# A venv of its own, seeing the packages of the interpreter it is made from (torch and numpy;
# --system-site-packages would show those of the base interpreter instead, when that is a venv
# itself), with the wheel installed by pip as a user installs it.
VENV=/tmp/gpu-check-venv
NUMPY1=/tmp/gpu-check-numpy1
rm -rf "$VENV" "$NUMPY1"
"$PY" -m venv "$VENV"
PARENT=$("$PY" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
OWN=$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
echo "import site; site.addsitedir('$PARENT')" >"$OWN/_gpu_check_parent.pth"
"$VENV/bin/python" -m pip install -q --no-index --no-deps --disable-pip-version-check "$PREP"/mcore_autopatch-*.whl
"$VENV/bin/python" -m pip install -q --no-index --no-deps --disable-pip-version-check --target "$NUMPY1" \
    "$PREP"/numpy-1.26.4-*.whl
MCORE="$PREP/mcore-0.12.1:$PREP/nvrx-0.3.0"
export PYTHONPATH="$MCORE"
export OMP_NUM_THREADS=1 TORCHINDUCTOR_COMPILE_THREADS=1 PYTHONUNBUFFERED=1
P="$VENV/bin/python"
JOB=tests/job_path/training_job.py
"$P" -c "import sys, torch, numpy; print('gpu-check: python %s, torch %s, numpy %s, %s' % (sys.version.split()[0],
    torch.__version__, numpy.__version__, torch.cuda.get_device_name(0)))"

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

expect_in_log() {  # expect_in_log NAME TEXT: the step's log must hold TEXT
    if grep -qF -- "$2" "$OUT_DIR/$1.log"; then
        echo "PASS $1 says: $2"
    else
        echo "FAIL $1 does not say: $2"
        failed=$((failed + 1))
    fi
}

ROOT_DIR=$(mktemp -d /tmp/gpu-check-job-XXXX)
step status ok "$P" -m mcore_autopatch status
expect_in_log status "numpy_removed_names: needed: yes, applied: yes"
step job-save ok "$P" $JOB --launch 2 save --root "$ROOT_DIR/with" --device cuda --json
step job-resume ok "$P" $JOB --launch 2 resume --root "$ROOT_DIR/with" --device cuda --then-save --json
step job-resume-1-rank ok "$P" $JOB --launch 1 resume --root "$ROOT_DIR/with" --device cuda --json
step job-save-without-fix fail env MCORE_AUTOPATCH=0 "$P" $JOB --launch 2 save --root "$ROOT_DIR/without" \
    --device cuda --json --pg-timeout 120
expect_in_log job-save-without-fix "module 'numpy' has no attribute 'product'"
step numpy1-job-save ok env PYTHONPATH="$NUMPY1:$MCORE" "$P" $JOB --launch 2 save --root "$ROOT_DIR/numpy1" \
    --device cuda --json
step numpy1-job-resume ok env PYTHONPATH="$NUMPY1:$MCORE" "$P" $JOB --launch 2 resume --root "$ROOT_DIR/numpy1" \
    --device cuda --json
expect_in_log numpy1-job-resume '"numpy": "1.26.4"'
step numpy1-job-save-without-fix fail env MCORE_AUTOPATCH=0 PYTHONPATH="$NUMPY1:$MCORE" "$P" $JOB --launch 2 save \
    --root "$ROOT_DIR/numpy1-without" --device cuda --json --pg-timeout 120
expect_in_log numpy1-job-save-without-fix "_write_item() missing 1 required positional argument: 'serialization_format'"
step selftest ok "$P" -m mcore_autopatch selftest
step nvrx-async-save ok "$P" tests/import_scripts/nvrx_async_save.py "$ROOT_DIR/nvrx"
ASYNC=(--scenario async-results --growing-object --slow-write "1:after=2,4:after=3" --device cuda --json)
step async-saves ok "$P" $JOB --launch 2 save --root "$ROOT_DIR/async" "${ASYNC[@]}"
step async-saves-load ok "$P" $JOB --launch 2 resume --iteration all --root "$ROOT_DIR/async" --growing-object \
    --device cuda --json
step async-saves-without-fix ok env MCORE_AUTOPATCH_SKIP=write_results_per_save,results_match_files \
    "$P" $JOB --launch 2 save --root "$ROOT_DIR/async-without" "${ASYNC[@]}"
step async-saves-without-fix-load fail env MCORE_AUTOPATCH_SKIP=write_results_per_save,results_match_files \
    "$P" $JOB --launch 2 resume --iteration all --root "$ROOT_DIR/async-without" --growing-object --device cuda --json
step vocab-save ok "$P" $JOB --launch 2 save --root "$ROOT_DIR/vocab" --state model --iterations 1 \
    --padded-vocab 8 --device cuda --json
step vocab-resume ok "$P" $JOB --launch 2 resume --root "$ROOT_DIR/vocab" --state model --padded-vocab 12 \
    --saved-vocab 8 --device cuda --json
echo "gpu-check: $failed step(s) failed; logs in $OUT_DIR"
exit "$failed"
