"""Test-only: a slow file system for chosen checkpoint folders.

``install("1:2.5,4:after=3")`` makes ``os.fsync`` of a file under ``iter_0000001/`` take 2.5 s
longer, and of a file under ``iter_0000004/`` wait until the file of the same name under
``iter_0000003/`` has been fsynced (two saves of one job write the same files) and the
process that writes that file, or the one that forked it, has since put its results on a
manager's queue (megatron-core's results queue, or the fix's own queue per save): the order
is then certain however slow the machine is, where a fixed margin was not. This holds in
this process and in the processes it forks or spawns (they inherit ``JOB_SLOW_WRITES``);
the puts are counted per process in ``.results-put/`` beside the iteration folders, whose
path the first ``install`` leaves in ``JOB_SLOW_WRITES_PUTS`` for them.
megatron-core's write workers ``fsync`` every ``.distcp`` file they write (only those are
slowed; the finalize's ``.metadata`` is not), so that save's write
ends after the other's, as on a loaded or slow file system. Every fsync under a checkpoint
folder leaves a marker in ``.fsynced/<iteration>/`` beside the iteration folders, holding the
writer's and its parent's pids and put counts. Nothing of megatron-core is touched.
"""

import os
import time
from multiprocessing import managers
from typing import Dict, Tuple

_installed = False
WAIT_LIMIT_S = 120.0  # a wait for another save's write that never comes stops here
PUTS_ENV = "JOB_SLOW_WRITES_PUTS"


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


def puts_made(pid: int) -> int:
    """How many results this process has put on a manager's queue (per the hook below)."""
    folder = os.environ.get(PUTS_ENV)
    if not folder:
        return 0
    try:
        with open(os.path.join(folder, str(pid))) as f:
            return len(f.read())
    except OSError:
        return 0


def _count_puts() -> None:
    """After each ``put`` through a manager's queue proxy returns (the item is then in the
    manager's process), one byte more in this process's file under ``JOB_SLOW_WRITES_PUTS``."""
    real_callmethod = managers.BaseProxy._callmethod

    def _callmethod(self, methodname, args=(), kwds={}):  # noqa: B006 - the signature it replaces
        result = real_callmethod(self, methodname, args, kwds)
        folder = os.environ.get(PUTS_ENV)
        if methodname in ("put", "put_nowait") and folder:
            os.makedirs(folder, exist_ok=True)
            with open(os.path.join(folder, str(os.getpid())), "a") as f:
                f.write(".")
        return result

    managers.BaseProxy._callmethod = _callmethod  # type: ignore[method-assign]


def _write_marker(path: str) -> None:
    """The writer's and its parent's pids and put counts now, whole or not at all."""
    pid, parent = os.getpid(), os.getppid()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        f.write("%d %d %d %d" % (pid, puts_made(pid), parent, puts_made(parent)))
    os.replace(path + ".tmp", path)


def _other_results_put(marker: str) -> bool:
    """The process that fsynced the other file, or its parent, has put results since."""
    try:
        with open(marker) as f:
            pid, pid_puts, parent, parent_puts = map(int, f.read().split())
    except (OSError, ValueError):
        return False
    return puts_made(pid) > pid_puts or puts_made(parent) > parent_puts


def install(spec: str, root: str = "") -> None:
    global _installed
    slow = parse(spec)
    if _installed or not slow:
        return
    if root and not os.environ.get(PUTS_ENV):
        os.environ[PUTS_ENV] = os.path.join(os.path.abspath(root), ".results-put")
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
            while not _other_results_put(_marker(root, how[1], name)) and time.monotonic() < deadline:
                time.sleep(0.05)
        real_fsync(fd)
        if folder.startswith("iter_") and name.endswith(".distcp"):
            _write_marker(_marker(root, folder, name))

    os.fsync = fsync
    _count_puts()
    _installed = True
