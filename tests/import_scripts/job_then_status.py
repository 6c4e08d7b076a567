"""Run a job script unchanged, then report ``mcore-autopatch status`` of this same process.

    python job_then_status.py examples/checkpoint_job.py [job arguments]

The job runs first, as ``__main__``, exactly as ``python examples/checkpoint_job.py`` would
run it: it never imports mcore_autopatch, so its save is fixed (or not) by the installed
``.pth`` alone. Only after it has finished does this script ask mcore-autopatch what it
decided for the writer module the job imported, and print that ``status()`` dict (what
``mcore-autopatch status --json`` prints) on one line after ``MCORE_AUTOPATCH_STATUS ``.
One process instead of a second interpreter that would import torch and megatron-core again.
"""

import json
import runpy
import sys

sys.argv = sys.argv[1:]
code = 0
try:
    runpy.run_path(sys.argv[0], run_name="__main__")
except SystemExit as exc:
    code = exc.code if isinstance(exc.code, int) else 1

import mcore_autopatch  # noqa: E402  (after the job, on purpose)

print("MCORE_AUTOPATCH_STATUS " + json.dumps(mcore_autopatch.status(), sort_keys=True, default=str), flush=True)
sys.exit(code)
