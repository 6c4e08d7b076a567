"""Waits on another process that also watch that process: a dead one ends the wait, and says how.

megatron-core (and nvidia-resiliency-ext) wait on processes through multiprocessing queues with
no timeout: the async save's process waits for its forked writers in ``count_queue.join()``,
and the trainer waits for the persistent worker in ``preload_q.join()``, ``queue.join()`` and a
``comp_q.get_nowait()`` loop. A process killed by a signal (the OOM killer, a segfault) never
calls ``task_done()`` or puts its item, so the wait never ends.

What the fixes rebind is the ``mp`` global of those modules: a stand-in whose ``get_context()``
returns the real context with three names replaced. ``Process`` records each process it makes;
``JoinableQueue`` and ``Queue`` make the queues below, real multiprocessing queues (they pickle
to other processes exactly as the real ones, which is all those processes use) whose waits in
this process poll every ``POLL_S`` seconds and ask a ``Watcher`` whether the process on the other
side has died. Nothing else of multiprocessing changes.

The waits read two private members of CPython's ``multiprocessing.queues.JoinableQueue``,
``_cond`` and ``_unfinished_tasks``, which its own ``join()`` uses, unchanged from 3.8 to 3.13.
"""

from __future__ import annotations

import multiprocessing.queues
import queue as queue_module
import signal
import threading
from typing import Any, Callable, Dict, Iterable, List, Optional

from mcore_autopatch.shared import standin
from mcore_autopatch.shared.log import logger

POLL_S = 0.2  # how often a wait looks at the process it waits on; a dead one is seen within this


def describe_end(process: Any) -> Optional[str]:
    """How ``process`` ended ("was killed by signal 9 (SIGKILL)", "exited with code 1"), or None
    while it runs or was never started."""
    code = getattr(process, "exitcode", None)
    if code is None:
        return None
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = "an unknown signal"
        return "was killed by signal %d (%s)" % (-code, name)
    return "exited with code %d" % code


def process_label(process: Any) -> str:
    return "%s (pid %s)" % (getattr(process, "name", "process"), getattr(process, "pid", "?"))


class Watcher:
    """What a watched queue asks while it waits: ``problem()`` is None while the other side can
    still answer, else why it cannot. ``raises``: the wait raises ``ProcessDied`` (in the async
    save's process: megatron-core's function ends and the fix reports it as the save's result);
    otherwise the wait just ends (in the trainer: the save is failed at the next done-check)."""

    raises = False

    def problem(self) -> Optional[str]:
        raise NotImplementedError


class ProcessDied(RuntimeError):
    """A process another one was waiting on ended without doing what it was waited for."""

    def __init__(self, problem: str, watcher: "Optional[Watcher]" = None) -> None:
        super().__init__(problem)
        self.watcher = watcher


class StartedHere(Watcher):
    """The processes one context made (the writers of one save): any that ended with a non-zero
    exit code or a signal before the wait was over is a problem."""

    raises = True

    def __init__(self) -> None:
        self.processes: List[Any] = []
        self.doing: "dict[int, str]" = {}  # id(process) -> what it was started to do

    def problem(self) -> Optional[str]:
        for process in self.processes:
            end = describe_end(process)
            if end is not None and process.exitcode != 0:
                doing = self.doing.get(id(process))
                return "the process %s %s%s" % (process_label(process), end, " while %s" % doing if doing else "")
        return None


class CurrentCaller(Watcher):
    """The process of the caller whose method is running in this thread (``watching(caller)``):
    the trainer's waits on the persistent worker, which megatron-core makes inside those methods."""

    def problem(self) -> Optional[str]:
        caller = current_caller()
        process = getattr(caller, "process", None) if caller is not None else None
        end = describe_end(process)
        if end is None:
            return None
        return "the checkpoint worker %s %s" % (process_label(process), end)


_current = threading.local()


def current_caller() -> Any:
    stack = getattr(_current, "stack", None)
    return stack[-1] if stack else None


class watching:
    """``with watching(caller):`` the trainer-side waits made meanwhile watch ``caller.process``."""

    def __init__(self, caller: Any) -> None:
        self.caller = caller

    def __enter__(self) -> None:
        stack = getattr(_current, "stack", None)
        if stack is None:
            stack = _current.stack = []
        stack.append(self.caller)

    def __exit__(self, *exc: Any) -> None:
        _current.stack.pop()


def _ended_wait(watcher: Watcher, problem: str, what: str) -> None:
    logger.warning("%s: %s", what, problem)
    if watcher.raises:
        raise ProcessDied(problem, watcher)


def stop_the_others(watcher: Any) -> None:
    """Kill the processes of ``watcher`` that still run: the work they share failed already."""
    for process in getattr(watcher, "processes", ()):
        if process.exitcode is None and getattr(process, "pid", None) is not None:
            try:
                process.kill()
                process.join(5)
            except Exception:
                logger.debug("stopping %s failed", process, exc_info=True)


class WatchedJoinableQueue(multiprocessing.queues.JoinableQueue):  # type: ignore[type-arg]
    """A JoinableQueue whose ``join()`` ends when its watcher reports a problem."""

    def __init__(self, maxsize: int = 0, *, ctx: Any, watcher: Optional[Watcher] = None) -> None:
        super().__init__(maxsize, ctx=ctx)
        self._mcore_autopatch_watcher = watcher

    def __setstate__(self, state: Any) -> None:  # in another process: a plain queue there
        super().__setstate__(state)
        self._mcore_autopatch_watcher = None

    def join(self) -> None:
        watcher = getattr(self, "_mcore_autopatch_watcher", None)
        if watcher is None:
            return super().join()
        with self._cond:  # type: ignore[attr-defined]
            while not self._unfinished_tasks._semlock._is_zero():  # type: ignore[attr-defined]
                if self._cond.wait(POLL_S):  # type: ignore[attr-defined]
                    continue  # told that the count changed: look again
                problem = watcher.problem()
                if problem is not None:
                    _ended_wait(watcher, problem, "stopped waiting for a queue's tasks")
                    return


class WorkerFailure:
    """What a watched ``get_nowait()`` returns instead of raising ``Empty`` when the process that
    would have put the item is dead: megatron-core's loop ends, and the fix reads why."""

    __slots__ = ("reason",)

    def __init__(self, reason: str) -> None:
        self.reason = reason

    def __repr__(self) -> str:
        return "<no item: %s>" % self.reason


class WatchedQueue(multiprocessing.queues.Queue):  # type: ignore[type-arg]
    """A Queue whose ``get_nowait()`` answers a ``WorkerFailure`` once the putter is dead."""

    def __init__(self, maxsize: int = 0, *, ctx: Any, watcher: Optional[Watcher] = None) -> None:
        super().__init__(maxsize, ctx=ctx)
        self._mcore_autopatch_watcher = watcher

    def __setstate__(self, state: Any) -> None:
        super().__setstate__(state)
        self._mcore_autopatch_watcher = None

    def get_nowait(self) -> Any:
        try:
            return super().get_nowait()
        except queue_module.Empty:
            watcher = getattr(self, "_mcore_autopatch_watcher", None)
            problem = watcher.problem() if watcher is not None else None
            if problem is None:
                raise
            # Whatever the process put just before it died comes first.
            try:
                return super().get(timeout=POLL_S)
            except queue_module.Empty:
                pass
            _ended_wait(watcher, problem, "no item will come")  # type: ignore[arg-type]
            return WorkerFailure(problem)


class ContextStandIn:
    """A multiprocessing context: the real one, but for ``Process``, ``Queue`` and ``JoinableQueue``."""

    def __init__(self, real: Any, watcher: Watcher) -> None:
        self._real = real
        self._watcher = watcher

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def Process(self, *args: Any, **kwargs: Any) -> Any:
        process = self._real.Process(*args, **kwargs)
        if isinstance(self._watcher, StartedHere):
            self._watcher.processes.append(process)
            doing = _what_it_writes(getattr(process, "_args", ()), getattr(process, "_kwargs", {}))
            if doing:
                self._watcher.doing[id(process)] = doing
        return process

    def JoinableQueue(self, maxsize: int = 0) -> Any:
        return WatchedJoinableQueue(maxsize, ctx=self._real.get_context(), watcher=self._watcher)

    def Queue(self, maxsize: int = 0) -> Any:
        return WatchedQueue(maxsize, ctx=self._real.get_context(), watcher=self._watcher)

    def __repr__(self) -> str:
        return "<%r, its waits watched by mcore-autopatch>" % (self._real,)


def _what_it_writes(args: Any, kwargs: Any) -> Optional[str]:
    """ "writing <file>" for a writer process started on a WriteBucket (path, key, data)."""
    for value in (*tuple(args or ()), *(kwargs or {}).values()):
        if isinstance(value, tuple) and len(value) == 3 and hasattr(value[0], "__fspath__"):
            return "writing %s" % value[0]
        if isinstance(value, tuple) and len(value) == 3 and isinstance(value[0], str) and value[0].endswith(".distcp"):
            return "writing %s" % value[0]
    return None


def watched_get_context(real_mp: Any, make_watcher: Callable[[], Watcher]) -> Callable[..., Any]:
    """``mp.get_context`` whose contexts watch their waits with a new ``make_watcher()`` each."""

    def get_context(method: Optional[str] = None) -> Any:
        return ContextStandIn(real_mp.get_context(method), make_watcher())

    get_context.__wrapped__ = real_mp.get_context  # type: ignore[attr-defined]
    get_context.__doc__ = getattr(real_mp.get_context, "__doc__", None)
    return get_context


def watch_contexts(
    namespace: Dict[str, Any], owners: Iterable[str], make_watcher: Callable[[], Watcher]
) -> Optional[str]:
    """Make each ``namespace[owner]`` (a module's ``multiprocessing`` global) a stand-in whose
    contexts watch their waits. None when done, else why one was left alone."""
    def make(real: Any) -> Callable[..., Any]:
        return watched_get_context(real, make_watcher)

    return standin.override_each(namespace, owners, "get_context", make, "its contexts' waits watch")
