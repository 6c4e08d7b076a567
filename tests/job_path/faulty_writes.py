"""Test-only: a write of one checkpoint that fails, for the fault scenario of training_job.py.

``install("2:writer-sigkill")`` makes the first ``.distcp`` file of ``iter_0000002/`` fail when
its writer ``fsync``s it (megatron-core's write workers fsync every file they write): the
writer process is killed by SIGKILL (as the OOM killer does), dies of a real segmentation
fault (``writer-segfault``: a read of address 0), or gets ``OSError(ENOSPC)`` (``enospc``: a
full disk). Only in the processes of the rank that installs it and those it forks or spawns
(they inherit ``JOB_FAULTY_WRITES``); the trainer itself never writes a .distcp file. The time
of the fault is written to ``<root>/.fault-time`` first, so the job can say how long after it
every rank raised. Nothing of megatron-core is touched.
"""

import ctypes
import errno
import os
import signal
import time

KINDS = ("writer-sigkill", "writer-segfault", "enospc")
_installed = False


def record_fault_time(root: str) -> None:
    with open(os.path.join(root, ".fault-time"), "w") as f:
        f.write("%.6f" % time.time())


def install(spec: str) -> None:
    global _installed
    iteration, _, kind = spec.partition(":")
    if _installed or kind not in KINDS:
        return
    folder_name = "iter_%07d" % int(iteration)
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        try:
            path = os.readlink("/proc/self/fd/%d" % fd)
        except OSError:
            path = ""
        folder, name = os.path.basename(os.path.dirname(path)), os.path.basename(path)
        if folder == folder_name and name.endswith("_0.distcp"):
            record_fault_time(os.path.dirname(os.path.dirname(path)))
            if kind == "writer-sigkill":
                os.kill(os.getpid(), signal.SIGKILL)
            elif kind == "writer-segfault":
                ctypes.string_at(0)
            else:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
        real_fsync(fd)

    os.fsync = fsync
    _installed = True
