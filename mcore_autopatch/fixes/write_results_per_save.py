"""Each async save is finalized with its own write results, not whichever save's came first.

megatron-core 0.8 and later (and nvidia-resiliency-ext 0.3 and later) give every save of a
process one module-global results queue: ``FileSystemWriterAsync.prepare_write_data`` takes
it from ``_get_write_results_queue()`` (``get_write_results_queue()`` in 0.17+ and NVRx 0.6+),
which makes a ``Manager().Queue()`` once and keeps it in ``_results_queue``. Each save's write
process puts its results there and ``retrieve_write_results`` takes the head at finalization;
nothing ties an entry to its save, and two saves of one job have as many results as each
other. So when a later save's write ends first (saves that overlap: Megatron-LM's loop starts
one without waiting for the last), when a synchronous save is made while an async one is in
flight, or after a save was abandoned between its write and its finalize, a checkpoint's
``.metadata`` is written from another save's offsets and lengths: it reports success and
cannot be loaded.

What is read, never assumed from a version: the writer class's ``prepare_write_data`` and the
module functions it calls; one of them keeps a module global (``global _results_queue``) and
hands out the queue. 0.6 and 0.7 give each writer its own ``Manager().dict()``: not needed.

What is rebound, in that module only: that function's global name (looked up by
``prepare_write_data`` at each save) to one that calls megatron-core's own function (which
makes the manager once, in the multiprocessing context that release chose) and returns a new
queue on that same manager, so no process is started per save. A queue proxy travels to a
forked write process, to a spawned one and to an already running persistent worker exactly
as the shared queue did. When the manager has gone (an abort shut it down), the module's
cached queue is cleared and megatron-core's function makes a new one, as it did the first
time. Nothing changes in what a checkpoint holds.
"""

from __future__ import annotations

import weakref
from types import ModuleType
from typing import Any, Callable, Tuple

from mcore_autopatch.shared import code_reading, versions
from mcore_autopatch.shared.log import logger
from mcore_autopatch.shared.values import Decision

WRITER_CLASS = "FileSystemWriterAsync"
MARK = "__mcore_autopatch__"


class SharedQueue:
    """Where a writer takes its results queue: ``getter`` (a function of the module, by its
    global name) keeps the queue in the module global ``cache``."""

    __slots__ = ("cache", "getter", "name")

    def __init__(self, name: str, getter: Callable[..., Any], cache: str) -> None:
        self.name = name
        self.getter = getter
        self.cache = cache


class Evaluation:
    __slots__ = ("decision", "shared")

    def __init__(self, decision: Decision, shared: Tuple[SharedQueue, ...] = ()) -> None:
        self.decision = decision
        self.shared = shared


def queue_globals_stored(function: Any) -> "set[str]":
    """The module globals named like a queue that ``function`` (or code nested in it) assigns
    (``global X; X = ...``), through what decorates it (0.17+ and nvidia-resiliency-ext 0.6+
    wrap the getter in ``@_disable_gc()``, whose wrapper's own code stores nothing). Only code
    that names a queue is read instruction by instruction (``prepare_write_data`` calls several
    helpers that do not)."""
    return {
        name
        for code in code_reading.codes_of(function)
        for c in code_reading.nested(code)
        if any("queue" in n.lower() for n in c.co_names)
        for name in code_reading.stored_names(c, "STORE_GLOBAL")
        if "queue" in name.lower()
    }


def shared_queues(module: ModuleType) -> Tuple[SharedQueue, ...]:
    """The module functions ``prepare_write_data`` calls that keep one queue in a module global."""
    writer = vars(module).get(WRITER_CLASS)
    prepare = vars(writer).get("prepare_write_data") if isinstance(writer, type) else None
    code = getattr(prepare, "__code__", None)
    if code is None:
        return ()
    found = []
    for name in sorted(code_reading.mentions(code)):
        value = vars(module).get(name)
        if getattr(value, "__module__", None) != module.__name__ or not callable(value):
            continue
        original = getattr(value, "__wrapped__", value) if getattr(value, MARK, False) else value
        stored = sorted(queue_globals_stored(original))
        if stored:
            found.append(SharedQueue(name, original, stored[0]))
    return tuple(found)


def evaluate(module: ModuleType, mode: str) -> Evaluation:
    label = versions.module_label(module.__name__)
    writer = vars(module).get(WRITER_CLASS)
    if not isinstance(writer, type):
        return Evaluation(Decision(False, "%s has no %s: no async writer here" % (label, WRITER_CLASS)))
    if "prepare_write_data" not in vars(writer):
        return Evaluation(Decision(None, "%s has no %s.prepare_write_data; not patching" % (label, WRITER_CLASS)))
    shared = shared_queues(module)
    if not shared:
        reason = "%s's %s.prepare_write_data takes no module-global results queue: each writer has its own" % (
            label,
            WRITER_CLASS,
        )
        return Evaluation(Decision(False, reason))
    names = ", ".join("%s() (kept in %s)" % (s.name, s.cache) for s in shared)
    reason = (
        "%s's %s.prepare_write_data takes its results queue from %s, one queue for every save of the process: "
        "a save finalized while another is in flight, or after one was abandoned, can take the other's write "
        "results; each save now gets a queue of its own on the same manager" % (label, WRITER_CLASS, names)
    )
    return Evaluation(Decision(True, reason), shared)


# The queues handed out here, each one save's own: what a save puts there is its own results,
# which failed_saves_raise_everywhere may look at before the finalize does.
_own_queues: "weakref.WeakSet[Any]" = weakref.WeakSet()


def is_own_queue(value: Any) -> bool:
    """Whether ``value`` is a results queue this fix made for one save."""
    try:
        return value in _own_queues
    except TypeError:  # unhashable, or not weakly referenceable: not ours
        return False


def _own(queue: Any) -> Any:
    try:
        _own_queues.add(queue)
    except TypeError:
        pass
    return queue


def queue_per_save(module: ModuleType, shared: SharedQueue) -> Callable[..., Any]:
    """``shared.getter``'s stand-in: a new queue on the manager megatron-core's own function made."""
    original = shared.getter
    namespace = vars(module)

    def results_queue_of_this_save(*args: Any, **kwargs: Any) -> Any:
        queue = original(*args, **kwargs)  # megatron-core's: the manager, made once, its own way
        manager = getattr(queue, "_manager", None)
        if manager is None:
            return queue  # not a manager's queue: nothing to make another one from
        try:
            return _own(manager.Queue())
        except Exception as exc:  # the manager is gone (an abort shut it down): a new one
            logger.info("the results queue's manager is gone (%s: %s); making a new one", type(exc).__name__, exc)
            if namespace.get(shared.cache) is queue:
                namespace[shared.cache] = None
            queue = original(*args, **kwargs)
            return _own(queue._manager.Queue()) if getattr(queue, "_manager", None) is not None else queue

    results_queue_of_this_save.__wrapped__ = original  # type: ignore[attr-defined]
    results_queue_of_this_save.__name__ = original.__name__
    results_queue_of_this_save.__qualname__ = original.__qualname__
    results_queue_of_this_save.__module__ = original.__module__
    results_queue_of_this_save.__doc__ = (
        "mcore-autopatch: a results queue of its own for each save, on %s's manager." % (original.__name__)
    )
    setattr(results_queue_of_this_save, MARK, True)
    return results_queue_of_this_save


def is_applied(module: ModuleType) -> bool:
    shared = shared_queues(module)
    return bool(shared) and all(getattr(vars(module).get(s.name), MARK, False) for s in shared)


def apply(module: ModuleType, mode: str) -> "tuple[Decision, bool]":
    ev = evaluate(module, mode)
    if not ev.decision.needed:
        return ev.decision, is_applied(module)
    namespace = vars(module)
    for shared in ev.shared:  # the getter read here is the module's own, or ours already
        if not getattr(namespace.get(shared.name), MARK, False):
            namespace[shared.name] = queue_per_save(module, shared)
    return ev.decision, True
