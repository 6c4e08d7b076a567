"""Test-only: a slow file system for chosen checkpoint folders.

``install("1:2.5,4:after=3")`` makes ``os.fsync`` of a file under ``iter_0000001/`` take 2.5 s
longer, and of a file under ``iter_0000004/`` wait until the file of the same name under
``iter_0000003/`` has been fsynced (two saves of one job write the same files), then two
seconds more, so that the other save's write process has put its results; in this process
and in the processes it forks or spawns (they inherit ``JOB_SLOW_WRITES``).
megatron-core's write workers ``fsync`` every ``.distcp`` file they write (only those are
slowed; the finalize's ``.metadata`` is not), so that save's write
ends after the other's, as on a loaded or slow file system; ``after=`` makes the order
certain whatever the machine's load. Every fsync under a checkpoint folder leaves a marker
in ``.fsynced/<iteration>/`` beside the iteration folders. Nothing of megatron-core is touched.
"""

import os
import time
from typing import Dict, Tuple

_installed = False
WAIT_LIMIT_S = 120.0  # a wait for another save's write that never comes stops here
AFTER_MARGIN_S = 2.0


def folder_name(iteration: str) -> str:
    return iteration if iteration.startswith("iter_") else "iter_%07d" % int(iteration)


def parse(spec: str) -> Dict[str, Tuple[str, str]]:
    """``{folder: ("sleep", seconds) or ("after", other folder)}``."""
    slow: Dict[str, Tuple[str, str]] = {}
    for part in filter(None, spec.split(",")):
        iteration, _, how = part.partition(":")
        if how.startswith("after="):
            slow[folder_name(iteration)] = ("after", folder_name(how[len("after=") :]))
        else:
            slow[folder_name(iteration)] = ("sleep", how)
    return slow


def _marker(root: str, folder: str, name: str) -> str:
    return os.path.join(root, ".fsynced", folder, name)


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
        folder, name = os.path.basename(os.path.dirname(path)), os.path.basename(path)
        root = os.path.dirname(os.path.dirname(path))
        # Only the write workers' .distcp files: the finalize's own .metadata is not slowed.
        how = slow.get(folder) if name.endswith(".distcp") else None
        if how is not None and how[0] == "sleep":
            time.sleep(float(how[1]))
        elif how is not None:
            deadline = time.monotonic() + WAIT_LIMIT_S
            while not os.path.exists(_marker(root, how[1], name)) and time.monotonic() < deadline:
                time.sleep(0.05)
            time.sleep(AFTER_MARGIN_S)
        real_fsync(fd)
        if folder.startswith("iter_") and name.endswith(".distcp"):
            os.makedirs(os.path.join(root, ".fsynced", folder), exist_ok=True)
            with open(_marker(root, folder, name), "a"):
                pass

    os.fsync = fsync
    _installed = True
