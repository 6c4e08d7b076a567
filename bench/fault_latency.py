"""How soon every rank raises after a fault in an async save (the failed-save rows).

Runs tests/job_path/training_job.py's fault scenario (2 gloo ranks, megatron-core 0.12.1, the
temporal and the persistent caller, one fault on rank 1 during save 2) with the wheel, and
prints, per fault, the seconds from the fault to the raise on the slowest rank. Without the
rows the same job stalls until the process group's timeout (tests/test_e2e_async_faults.py
shows that); the tests only tell a raise from a stall (60 s), this prints how soon.

    python3 bench/fault_latency.py          # or: python3 bench/run_all.py --only faults
"""

import json
import os
import sys
import tempfile
from typing import List, Optional, Tuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import AFFECTED, ROOT, BenchEnvs, Row, log, mcore_env, run_child, standalone

TRAINING_JOB = os.path.join(ROOT, "tests", "job_path", "training_job.py")
BUDGET_S = 10.0  # the bound README states for this machine
# (caller, fault): each kind of wait megatron-core 0.12.1 has.
FAULTS: List[Tuple[str, str]] = [
    ("temporal", "writer-sigkill"),
    ("temporal", "enospc"),
    ("temporal", "async-process-kill"),
    ("temporal", "preload-raises"),
    ("persistent", "writer-segfault"),
    ("persistent", "enospc"),
    ("persistent", "worker-kill"),
    ("persistent", "preload-raises"),
]
QUICK = [FAULTS[0], FAULTS[6]]
KILLED_WHILE_WRITING = ("async-process-kill", "worker-kill")


def fault_to_raise(e: BenchEnvs, caller: str, fault: str) -> Tuple[Optional[float], str]:
    """(the slowest rank's seconds from the fault to its raise, what went wrong instead)."""
    root = tempfile.mkdtemp(prefix="fault-", dir=e.tmp)
    args = [TRAINING_JOB, "--launch", "2", "save", "--root", root, "--json", "--scenario", "faults"]
    args += ["--fault", fault, "--pg-timeout", "300", "--rank-timeout", "300", "--fault-bound", "60"]
    if fault in KILLED_WHILE_WRITING:
        args += ["--slow-write", "2:3"]
    if caller == "persistent":
        args.append("--persistent")
    child = run_child([e.with_py, *args], mcore_env(AFFECTED, CPU_STAND_IN_FOR_CUDA="1"), timeout=600)
    lines = [ln for ln in child.stdout.splitlines() if ln.startswith("{")]
    if not lines:
        return None, "the job printed nothing (exit %s)" % child.returncode
    ranks = json.loads(lines[-1]).get("ranks") or []
    figures = [r.get("fault_to_raise_s") for r in ranks]
    if len(figures) != 2 or None in figures:
        return None, "not every rank raised: %s" % [r.get("error") for r in ranks]
    return max(figures), ""


def run(e: BenchEnvs, quick: bool) -> List[Row]:
    rows = []
    for caller, fault in QUICK if quick else FAULTS:
        log("faults: %s caller, %s on rank 1" % (caller, fault))
        seconds, problem = fault_to_raise(e, caller, fault)
        name = "a failed async save: %s on rank 1 (%s caller) -> every rank raises" % (fault, caller)
        if seconds is None:
            rows.append(Row(name, "did not raise", "<= %.0f s" % BUDGET_S, False, problem))
            continue
        rows.append(
            Row(
                name,
                "%.2f s" % seconds,
                "<= %.0f s" % BUDGET_S,
                seconds <= BUDGET_S,
                "megatron-core %s, 2 gloo ranks, torch of .cache/e2e-venv; from the fault (recorded by "
                "whoever met it) to the slowest rank's raise" % AFFECTED,
                seconds=seconds,
            )
        )
    return rows


if __name__ == "__main__":
    sys.exit(standalone(run))
