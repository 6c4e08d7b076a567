"""An async save whose writer process dies fails with the writer's signal, instead of waiting forever.

megatron-core 0.7 - 0.16 (and nvidia-resiliency-ext 0.3 and later, where it forks writers)
write each rank's files from processes forked by ``FileSystemWriterAsync.write_preloaded_data_multiproc``,
one per file, and wait for them with ``count_queue.join()`` (0.8+): a writer calls
``task_done()`` at its end, catching ``Exception`` only, so a writer killed by a signal (the
OOM killer, a segfault in the pinned-memory copy) leaves the save's process waiting forever.
That rank's "is it done?" answer stays yes-still-running, no later checkpoint is finalized, and
at the end of training every rank waits for a collective that never comes.

What is read: whether the writer class's ``write_preloaded_data_multiproc`` forks its writers
from the module's multiprocessing global (``mp.get_context(...)``), and which of its parameters
is the save's results queue. megatron-core 0.17+ write from threads: a thread cannot die alone.

What is rebound, in that module only: the multiprocessing global, to a stand-in whose contexts
give queues whose waits watch the processes that context started (``shared/process_watch.py``):
a writer that died ends ``count_queue.join()`` at once; and ``write_preloaded_data_multiproc``,
to a caller of megatron-core's own that puts what stopped it on the save's results queue, where
megatron-core puts a writer's exception itself: the save's finalize then reports ``Worker
failure: ... writer process ... was killed by signal 9 (SIGKILL) while writing .../__1_0.distcp``.
Nothing changes in what a checkpoint holds.
"""

from __future__ import annotations

import inspect
from types import ModuleType
from typing import Any, Callable, FrozenSet, Optional

from mcore_autopatch.shared import code_reading, methods, process_watch, standin, versions
from mcore_autopatch.shared.log import logger
from mcore_autopatch.shared.values import Decision

NAME = "writer_processes_watched"
WRITER_CLASS = "FileSystemWriterAsync"
METHOD = "write_preloaded_data_multiproc"


class Evaluation:
    __slots__ = ("decision", "owners", "queue_parameter", "writer")

    def __init__(
        self,
        decision: Decision,
        writer: Any = None,
        owners: FrozenSet[str] = frozenset(),
        queue_parameter: Optional[str] = None,
    ) -> None:
        self.decision = decision
        self.writer = writer
        self.owners = owners
        self.queue_parameter = queue_parameter


def multiprocessing_globals(module: ModuleType) -> FrozenSet[str]:
    """The module's globals that are a multiprocessing module (``mp``), ours included."""
    return frozenset(
        name
        for name, value in vars(module).items()
        if isinstance(standin.real_module(value), ModuleType)
        and callable(getattr(standin.real_module(value), "get_context", None))
        and "multiprocessing" in getattr(standin.real_module(value), "__name__", "")
    )


def results_queue_parameter(function: Callable[..., Any]) -> Optional[str]:
    """The parameter the save's results queue comes in (``global_results_queue``), or None (0.7)."""
    try:
        names = list(inspect.signature(function).parameters)
    except (TypeError, ValueError):
        return None
    return next((n for n in names if "results_queue" in n), None)


def evaluate(module: ModuleType, mode: str) -> Evaluation:
    label = versions.module_label(module.__name__)
    writer = vars(module).get(WRITER_CLASS)
    if not isinstance(writer, type):
        return Evaluation(Decision(False, "%s has no %s: no async writer here" % (label, WRITER_CLASS)))
    member = vars(writer).get(METHOD)
    function = getattr(member, "__func__", member)
    if getattr(function, methods.MARK, None) == NAME:  # ours already: read megatron-core's
        function = function.__wrapped__
    codes = list(code_reading.codes_of(function)) if function is not None else []
    if not codes:
        reason = "%s's %s has no %s: it writes from threads, which cannot die alone" % (label, WRITER_CLASS, METHOD)
        return Evaluation(Decision(False, reason))
    owners = multiprocessing_globals(module)
    if not any(code_reading.attributes_loaded(code, owners, frozenset(("get_context",))) for code in codes):
        reason = "%s's %s.%s makes no processes from its multiprocessing global; not patching" % (
            label,
            WRITER_CLASS,
            METHOD,
        )
        return Evaluation(Decision(None, reason))
    waits = "count_queue.join()" if any("JoinableQueue" in code_reading.mentions(c) for c in codes) else "join()"
    reason = (
        "%s's %s.%s forks a writer process per file and waits for them in %s with no liveness check: a writer "
        "killed by a signal (the OOM killer, a segfault) leaves the save waiting forever; the wait now ends when "
        "a writer dies, and the save's results say which, how and while writing what"
        % (label, WRITER_CLASS, METHOD, waits)
    )
    return Evaluation(Decision(True, reason), writer, owners, results_queue_parameter(function))


def reporting_failures(original: Callable[..., Any], queue_parameter: Optional[str]) -> Callable[..., Any]:
    """``write_preloaded_data_multiproc`` that puts what stopped it on the save's results queue."""
    signature = inspect.signature(original)

    def write_preloaded_data_multiproc(*args: Any, **kwargs: Any) -> Any:
        try:
            return original(*args, **kwargs)
        except Exception as exc:
            if isinstance(exc, process_watch.ProcessDied):  # the other writers' work is lost with it
                process_watch.stop_the_others(exc.watcher)
            arguments = signature.bind_partial(*args, **kwargs).arguments
            results_queue = arguments.get(queue_parameter) if queue_parameter else None
            rank = arguments.get("rank")
            where = "rank %s: " % rank if rank is not None else ""
            logger.warning("%sthe async save's writing failed: %s: %s", where, type(exc).__name__, exc)
            if results_queue is None:
                raise  # 0.7: no results queue; the save's process ends with an error
            results_queue.put(RuntimeError(str(exc)))
            return None

    wrapper = methods.marked(write_preloaded_data_multiproc, original, "%s.%s" % (WRITER_CLASS, METHOD), by=NAME)
    # The persistent worker is spawned: the function travels by its module and qualified name.
    wrapper.__module__ = original.__module__
    return wrapper


def is_applied(module: ModuleType) -> bool:
    writer = vars(module).get(WRITER_CLASS)
    member = vars(writer).get(METHOD) if isinstance(writer, type) else None
    return methods.is_ours(getattr(member, "__func__", member), NAME) and any(
        "get_context" in standin.overrides(vars(module).get(name)) for name in multiprocessing_globals(module)
    )


def apply(module: ModuleType, mode: str) -> "tuple[Decision, bool]":
    ev = evaluate(module, mode)
    if not ev.decision.needed or ev.writer is None:
        return ev.decision, is_applied(module)
    refused = process_watch.watch_contexts(vars(module), ev.owners, process_watch.StartedHere)
    if refused:
        why = "%s; but %s.%s, so it is left alone" % (ev.decision.reason, module.__name__, refused)
        return Decision(True, why), False
    member = vars(ev.writer).get(METHOD)
    function = getattr(member, "__func__", member)
    if not methods.is_ours(function, NAME):
        setattr(ev.writer, METHOD, staticmethod(reporting_failures(function, ev.queue_parameter)))
    return ev.decision, True
