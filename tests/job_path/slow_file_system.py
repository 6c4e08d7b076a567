"""Test-only: a slow file system for chosen checkpoint folders.

``install("iter_0000001:2.5,iter_0000004:2")`` makes ``os.fsync`` of a file under one of those
folders take that many seconds longer, in this process and in the processes it forks.
megatron-core's write workers ``fsync`` every ``.distcp`` file they write, so that save's write
ends later than the saves around it, as on a loaded or slow file system. Nothing of
megatron-core is touched.
"""

import os
import time
from typing import Dict

_installed = False


def parse(spec: str) -> Dict[str, float]:
    slow: Dict[str, float] = {}
    for part in filter(None, spec.split(",")):
        iteration, _, seconds = part.partition(":")
        name = iteration if iteration.startswith("iter_") else "iter_%07d" % int(iteration)
        slow[name] = float(seconds)
    return slow


def install(spec: str) -> None:
    global _installed
    slow = parse(spec)
    if _installed or not slow:
        return
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        try:
            path = os.readlink("/proc/self/fd/%d" % fd)
        except OSError:
            path = ""
        for folder, seconds in slow.items():
            if os.sep + folder + os.sep in path:
                time.sleep(seconds)
        real_fsync(fd)

    os.fsync = fsync
    _installed = True
