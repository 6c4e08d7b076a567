"""`make demo`: a real megatron-core 0.12.1 async checkpoint save, without and with the fix.

1. Builds the wheel from this checkout and a .venv with torch 2.13.0 and megatron-core
   0.12.1 (--no-deps, plus numpy, psutil, packaging).
2. Runs examples/checkpoint_job.py there without mcore-autopatch: the save fails.
3. `pip install`s the wheel and runs the same job again: save and load succeed.
The job never imports mcore_autopatch; only the installed .pth changes the outcome.

What happens is told on stderr; stdout gets one line, the verdict (``demo ok: ...``).
"""

import os
import subprocess
import sys

import envs

JOB = os.path.join(envs.ROOT, "examples", "checkpoint_job.py")


def job(py: str) -> "tuple[int, str]":
    proc = subprocess.run([py, JOB], capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    return proc.returncode, proc.stdout.strip()


def say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def main() -> int:
    wheel = envs.wheel()
    envs.demo_megatron()
    py = envs.venv_python(envs.DEMO)
    pip = [py, "-m", "pip", "-q", "--disable-pip-version-check"]
    subprocess.run([*pip, "uninstall", "-y", "mcore-autopatch"], capture_output=True)

    say("\n== before: megatron-core 0.12.1 + torch 2.13.0, mcore-autopatch not installed")
    before_rc, before = job(py)
    say("   " + before)

    say("\n== pip install %s" % os.path.relpath(wheel, envs.ROOT))
    subprocess.run([*pip, "install", wheel], check=True, capture_output=True)

    say("\n== after: the same job, unchanged")
    after_rc, after = job(py)
    say("   " + after)

    say("\n== %s -m mcore_autopatch status" % os.path.relpath(py, envs.ROOT))
    sys.stderr.flush()
    subprocess.run([py, "-m", "mcore_autopatch", "status"], check=False, stdout=sys.stderr)

    if before_rc == 0 or after_rc != 0:
        say("\ndemo did not show failure-then-success (before rc=%d, after rc=%d)" % (before_rc, after_rc))
        return 1
    say("")
    print("demo ok: the save failed without mcore-autopatch and succeeded with it installed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
