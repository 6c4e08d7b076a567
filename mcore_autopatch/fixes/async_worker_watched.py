"""The trainer's waits on the persistent checkpoint worker end when the worker is dead.

megatron-core 0.12 and later (``--use-persistent-ckpt-worker``; Megatron-LM requires it for
async saves from 0.16) and nvidia-resiliency-ext (its default from 0.4.1) save through one
spawned worker per rank. The trainer waits for it with no liveness check: ``preload_q.join()``
while the worker stages the save's tensors, a ``comp_q.get_nowait()`` loop until the save is
written (forever with ``blocking=True``), and ``queue.join()`` in ``close()``, also from
``__del__`` at exit. The worker's loop has no ``try``: a ``preload_fn`` or ``async_fn`` that
raises ends the worker, as does a signal, and the trainer waits forever (Megatron-LM #6970).

What is read: the module's caller classes that run a worker loop (``async_loop``) and wait on
queues made from the module's multiprocessing global. What is rebound, in that module only:

* the multiprocessing global, to a stand-in whose contexts give queues whose waits, while one
  of the caller's methods runs, watch that caller's ``process`` (``shared/process_watch.py``):
  a dead worker ends ``join()``, and ``get_nowait()`` answers a ``WorkerFailure`` saying how
  the worker ended instead of "not yet" forever;
* ``schedule_async_call``, ``is_current_async_call_done`` and ``close`` of those classes, to
  callers of their own that say which caller's process the waits watch;
* the worker loop (``async_loop``), to a caller of its own that, when the loop raises, puts
  what it raised on ``comp_q`` before the worker ends, so that the trainer can say why.

Whether the failed save then fails on every rank at once is ``failed_saves_raise_everywhere``.
"""

from __future__ import annotations

import inspect
import traceback
from types import ModuleType
from typing import Any, Callable, FrozenSet, Tuple

from mcore_autopatch.shared import code_reading, methods, process_watch, standin, versions
from mcore_autopatch.shared.log import logger
from mcore_autopatch.shared.values import Decision

WATCHED_METHODS = ("schedule_async_call", "is_current_async_call_done", "close")
# What the worker loop puts on comp_q when it raises: a plain tuple, so that unpickling it in
# the trainer needs nothing of ours.
FAILURE_TAG = "mcore-autopatch: the checkpoint worker failed"


class Evaluation:
    __slots__ = ("callers", "decision", "owners")

    def __init__(
        self, decision: Decision, callers: Tuple[type, ...] = (), owners: FrozenSet[str] = frozenset()
    ) -> None:
        self.decision = decision
        self.callers = callers
        self.owners = owners


def worker_loops(cls: type) -> Tuple[str, ...]:
    """The names of ``cls``'s worker loops (static methods named ``async_loop*``)."""
    return tuple(
        name for name, value in vars(cls).items() if name.startswith("async_loop") and isinstance(value, staticmethod)
    )


def persistent_callers(module: ModuleType) -> Tuple[type, ...]:
    return tuple(
        value
        for value in vars(module).values()
        if isinstance(value, type) and value.__module__ == module.__name__ and worker_loops(value)
    )


def evaluate(module: ModuleType, mode: str) -> Evaluation:
    from mcore_autopatch.fixes.writer_processes_watched import multiprocessing_globals

    label = versions.module_label(module.__name__)
    callers = persistent_callers(module)
    if not callers:
        reason = "%s has no persistent checkpoint worker (one process per save: see failed_saves_raise_everywhere)"
        return Evaluation(Decision(False, reason % label))
    owners = multiprocessing_globals(module)
    waits = [
        cls.__name__
        for cls in callers
        if any(
            code_reading.attributes_loaded(code, owners, frozenset(("get_context",)))
            for _name, member in vars(cls).items()
            for code in code_reading.codes_of(member)
        )
    ]
    if not waits:
        reason = "%s's %s make their queues from no multiprocessing global here; not patching"
        return Evaluation(Decision(None, reason % (label, ", ".join(c.__name__ for c in callers))))
    reason = (
        "%s's %s waits on its spawned worker in preload_q.join(), queue.join() and a comp_q loop with no liveness "
        "check, and the worker's loop ends on any exception: a worker killed, or whose preload_fn or async_fn "
        "raised, leaves the trainer waiting forever; the waits now end when the worker is dead, and the worker "
        "says what it raised" % (label, ", ".join(waits))
    )
    return Evaluation(Decision(True, reason), callers, owners)


NAME = "async_worker_watched"


def watching_its_process(original: Callable[..., Any], qualname: str) -> Callable[..., Any]:
    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        with process_watch.watching(self):
            return original(self, *args, **kwargs)

    return methods.marked(method, original, qualname, by=NAME)


def reporting_what_it_raised(original: Callable[..., Any], qualname: str) -> Callable[..., Any]:
    """The worker loop, putting ``(FAILURE_TAG, text)`` on its ``comp_q`` when it raises."""
    signature = inspect.signature(original)

    def async_loop(*args: Any, **kwargs: Any) -> Any:
        try:
            return original(*args, **kwargs)
        except BaseException as exc:
            arguments = signature.bind_partial(*args, **kwargs).arguments
            frames = traceback.extract_tb(exc.__traceback__)
            where = " in %s (%s:%s)" % (frames[-1].name, frames[-1].filename, frames[-1].lineno) if frames else ""
            text = "its checkpoint worker raised %s: %s%s" % (type(exc).__name__, exc, where)
            try:
                arguments["comp_q"].put((FAILURE_TAG, text))
            except Exception:
                logger.warning("the checkpoint worker could not report its failure", exc_info=True)
            raise

    wrapper = methods.marked(async_loop, original, qualname, by=NAME)
    wrapper.__module__ = original.__module__  # the worker is spawned: found by module and name
    return wrapper


def is_applied(module: ModuleType) -> bool:
    from mcore_autopatch.fixes.writer_processes_watched import multiprocessing_globals

    callers = persistent_callers(module)
    return (
        bool(callers)
        and all(methods.is_rebound(module, c.__name__, "schedule_async_call", NAME) for c in callers)
        and any("get_context" in standin.overrides(vars(module).get(name)) for name in multiprocessing_globals(module))
    )


def apply(module: ModuleType, mode: str) -> "tuple[Decision, bool]":
    ev = evaluate(module, mode)
    if not ev.decision.needed:
        return ev.decision, is_applied(module)
    refused = process_watch.watch_contexts(vars(module), ev.owners, process_watch.CurrentCaller)
    if refused:
        why = "%s; but %s.%s, so it is left alone" % (ev.decision.reason, module.__name__, refused)
        return Decision(True, why), False
    for cls in ev.callers:
        for name in WATCHED_METHODS:
            if callable(getattr(cls, name, None)):
                qualname = "%s.%s" % (cls.__name__, name)
                methods.rebind(cls, name, lambda original, q=qualname: watching_its_process(original, q), NAME)
        for name in worker_loops(cls):
            function = vars(cls)[name].__func__
            if not methods.is_ours(function, NAME):
                setattr(cls, name, staticmethod(reporting_what_it_raised(function, "%s.%s" % (cls.__name__, name))))
    return ev.decision, True
