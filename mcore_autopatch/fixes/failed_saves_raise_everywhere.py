"""A failed async save fails on every rank at the same step, each naming the failed ranks and why.

megatron-core's async saves (0.7 and later; nvidia-resiliency-ext's copy too) are finalized in
call order by ``AsyncCallsQueue.maybe_finalize_async_calls``: every rank asks its caller whether
the head save is done, and the callers agree through one all-reduce of "still running" counts
(``sync_all_async_calls``; inline in 0.7 - 0.11), made at every training step while a save is in
flight. Nothing in that answer says *failed*: a rank whose write failed raises alone, before or
inside the finalize, while the others wait in its gather or barrier until the process group's
timeout (a dead save's process even reads as done), and a save that never ends blocks every
later one. torch's own ``dcp.save`` raises the same ``CheckpointException`` on every rank.

What is read: the module's caller classes (``is_current_async_call_done``), the queue class
(``maybe_finalize_async_calls``), and that the done check all-reduces through the module's
``torch`` global. What is rebound, in that module only:

* its ``torch`` global, to a stand-in whose ``distributed.all_reduce`` adds to the done check's
  count, while one of our callers' done checks runs, ``FAIL_UNIT`` for a rank whose save failed
  (its process died or was killed, its write or file check failed, its worker raised, its
  staging raised): every rank learns in the collective it already makes that some rank failed,
  and only then, all of them at the same point, gather why (``all_gather_object``: a collective
  no rank can miss, since each decides on the same count);
* ``is_current_async_call_done`` and ``schedule_async_call`` of each caller: the done check
  stops this rank's process of that save, raises torch's ``CheckpointException`` naming every
  failed rank with its reason, and leaves the caller ready for the next save (a dead or stopped
  persistent worker is replaced then); scheduling records what the save writes and, when it
  raises (a ``preload_fn`` in the trainer), records that as the save's failure instead of
  raising on one rank alone;
* ``maybe_finalize_async_calls``: the failed save (and the saves queued behind it on the same
  worker) leave the queue without their finalize functions running: no ``.metadata``, no
  tracker update.

Where the save's results queue is its own (``write_results_per_save``), the done check looks at
what the save put there once its process has ended: a write error, or results that do not match
this rank's own files (one ``stat`` per file of this rank), is this rank's failure.
"""

from __future__ import annotations

import os
import signal
import traceback
from types import ModuleType
from typing import Any, Callable, Dict, FrozenSet, List, Optional, Tuple

from mcore_autopatch.shared import code_reading, methods, process_watch, standin, versions
from mcore_autopatch.shared.log import logger
from mcore_autopatch.shared.values import Decision

NAME = "failed_saves_raise_everywhere"
QUEUE_CLASS = "AsyncCallsQueue"
# Added to the done check's count by a rank whose save failed. The count itself is at most the
# number of ranks still writing: 2**17 keeps any job below 131,072 ranks readable, and a sum
# that overflows int32 (more than 16,383 failed ranks) reads as negative, a failure too.
FAIL_UNIT = 1 << 17
FAILED_CALLER = "mcore_autopatch_failed_caller"
NOTE = "mcore-autopatch: the save failed on every rank; no .metadata was written and its finalize did not run"
_SAVE = "_mcore_autopatch_save"  # on a caller: what its save writes (Save)
_SAVES = "_mcore_autopatch_saves"  # on a persistent caller: Save by call index
_FAILED = "_mcore_autopatch_failed"  # on a caller: why its save failed before its process ran


class Evaluation:
    __slots__ = ("callers", "decision", "owners", "queue", "torch")

    def __init__(
        self,
        decision: Decision,
        callers: Tuple[type, ...] = (),
        queue: Any = None,
        torch: Any = None,
        owners: FrozenSet[str] = frozenset(),
    ) -> None:
        self.decision = decision
        self.callers = callers
        self.queue = queue
        self.torch = torch
        self.owners = owners


def caller_classes(module: ModuleType) -> Tuple[type, ...]:
    """The module's classes with a concrete ``is_current_async_call_done`` of their own."""
    found = []
    for value in vars(module).values():
        if not isinstance(value, type) or value.__module__ != module.__name__:
            continue
        done = vars(value).get("is_current_async_call_done")
        if callable(done) and not getattr(done, "__isabstractmethod__", False):
            found.append(value)
    return tuple(found)


def evaluate(module: ModuleType, mode: str) -> Evaluation:
    import sys

    label = versions.module_label(module.__name__)
    queue = vars(module).get(QUEUE_CLASS)
    callers = caller_classes(module)
    if not isinstance(queue, type) or "maybe_finalize_async_calls" not in vars(queue) or not callers:
        return Evaluation(Decision(False, "%s has no async calls queue here" % label))
    torch = sys.modules.get("torch")
    owners = code_reading.globals_bound_to(module, torch, standin.real_module) if torch is not None else frozenset()
    checks = [
        code
        for cls in (*callers, *(b for c in callers for b in c.__mro__[1:] if b.__module__ == module.__name__))
        for name in ("is_current_async_call_done", "sync_all_async_calls")
        for code in code_reading.codes_of(vars(cls).get(name))
    ]
    if not any(
        code_reading.attributes_loaded(code, owners, frozenset(("distributed",))) and "all_reduce" in code.co_names
        for c in checks
        for code in code_reading.nested(c)
    ):
        reason = "%s's done check makes no all-reduce through its torch global; not patching" % label
        return Evaluation(Decision(None, reason))
    reason = (
        "%s's async saves agree on 'done' in one all-reduce that cannot say 'failed': a rank whose save failed "
        "raises alone (or waits forever) while the others wait for it in a collective; a failed save now adds a "
        "failure to that all-reduce, and every rank raises CheckpointException with every failed rank's reason "
        "at the same step, without finalizing that save" % label
    )
    return Evaluation(Decision(True, reason), callers, queue, torch, owners)


# --- what a save writes, recorded when it is scheduled -------------------------------------------


class Save:
    """The results queue of one save (when it is that save's own) and the files it writes here."""

    __slots__ = ("files", "folder", "results_queue", "verdict")

    def __init__(self, results_queue: Any, files: List[str]) -> None:
        self.results_queue = results_queue
        self.files = files
        self.folder = os.path.dirname(files[0]) if files else None
        self.verdict: Optional[Tuple[Optional[str]]] = None  # looked at once: (failure or None,)


def _save_of(arguments: Any) -> Save:
    from mcore_autopatch.fixes import write_results_per_save

    results_queue = None
    files: List[str] = []
    for value in arguments:
        if write_results_per_save.is_own_queue(value):
            results_queue = value
        elif isinstance(value, (list, tuple)) and value and all(_is_bucket(b) for b in value):
            files = [os.fspath(b[0]) for b in value]
    return Save(results_queue, files)


def _is_bucket(value: Any) -> bool:
    return isinstance(value, tuple) and len(value) == 3 and isinstance(value[0], (str, os.PathLike))


def record_save(caller: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> None:
    request = args[0] if args else kwargs.get("async_req")
    if hasattr(request, "async_fn_args"):  # 0.12+: an AsyncRequest
        save = _save_of(tuple(request.async_fn_args) + tuple((request.async_fn_kwargs or {}).values()))
        call_idx = getattr(request, "call_idx", None)
    else:  # 0.7 - 0.11: (async_fn, save_args)
        save = _save_of(tuple(args[1]) if len(args) > 1 and isinstance(args[1], (list, tuple)) else ())
        call_idx = None
    if _is_persistent(caller):
        vars(caller).setdefault(_SAVES, {})[call_idx] = save
    else:
        vars(caller)[_SAVE] = save


def _is_persistent(caller: Any) -> bool:
    return hasattr(caller, "cur_item")


# --- this rank's verdict on the save at the head of the queue ------------------------------------


def local_failure(caller: Any) -> Optional[str]:
    """Why this rank's head save failed, or None (running, or written and matching its files)."""
    state = vars(caller)
    if state.get(_FAILED):
        return str(state[_FAILED])
    process = getattr(caller, "process", None)
    end = process_watch.describe_end(process)
    if _is_persistent(caller):
        item = getattr(caller, "cur_item", None)
        if isinstance(item, process_watch.WorkerFailure):
            return item.reason
        from mcore_autopatch.fixes.async_worker_watched import FAILURE_TAG

        if isinstance(item, tuple) and len(item) == 2 and item[0] == FAILURE_TAG:
            return str(item[1])
        if item is None:
            if end is not None:  # a worker that is gone with a save in flight
                return "the checkpoint worker %s %s" % (process_watch.process_label(process), end)
            return None
        save = state.get(_SAVES, {}).get(item)
    else:
        if end is None:
            return None  # still running (or nothing was started: nothing to write here)
        if process.exitcode != 0:
            return "the async save's process %s %s" % (process_watch.process_label(process), end)
        save = state.get(_SAVE)
    return written_failure(save) if save is not None else None


def written_failure(save: Save) -> Optional[str]:
    """What the save's own results queue says of its write (looked at once), or None."""
    if save.verdict is None:
        save.verdict = (_read_results(save),)
    return save.verdict[0]


def _read_results(save: Save) -> Optional[str]:
    import queue as queue_module

    if save.results_queue is None:
        return None  # a queue shared by every save: its head may be another save's
    try:
        results = save.results_queue.get_nowait()
    except queue_module.Empty:
        return "the async save ended without putting its write results"
    except Exception as exc:  # the manager is gone: the finalize will say so itself
        logger.debug("the save's results queue cannot be read: %s", exc)
        return None
    save.results_queue.put(results)  # the finalize reads them, as megatron-core expects
    failure = _failure_in(results)
    if failure is not None:
        return "its write failed: %s" % failure
    if save.folder is None or not isinstance(results, dict):
        return None
    from mcore_autopatch.fixes import results_match_files

    return results_match_files.mismatch_in(
        save.folder, [r for per_writer in results.values() if isinstance(per_writer, list) for r in per_writer]
    )


def _failure_in(results: Any) -> Optional[str]:
    if isinstance(results, BaseException):
        return "%s: %s" % (type(results).__name__, results)
    if isinstance(results, tuple) and len(results) == 2 and isinstance(results[0], BaseException):
        return "%s: %s" % (type(results[0]).__name__, results[0])  # torch's wrapped exception (0.14+)
    return None


# --- the done check's all-reduce ----------------------------------------------------------------


class DoneCheck:
    """One done check of ``caller`` in progress: what this rank added and what the sum said."""

    __slots__ = ("caller", "failed_anywhere", "group", "item", "reason", "used")

    def __init__(self, caller: Any) -> None:
        self.caller = caller
        self.used = False
        self.reason: Optional[str] = None
        self.failed_anywhere = False
        self.group: Any = None
        self.item: Any = None  # a persistent caller's completed call, when the check ran


_checks: List[DoneCheck] = []  # the done checks running in this process, innermost last


def counting_failures(real_all_reduce: Callable[..., Any], torch_distributed: Any) -> Callable[..., Any]:
    """torch.distributed.all_reduce that carries failures in a done check's count."""

    def all_reduce(tensor: Any, *args: Any, **kwargs: Any) -> Any:
        check = _checks[-1] if _checks else None
        op = args[0] if args else kwargs.get("op")
        if (
            check is None
            or check.used
            or kwargs.get("async_op")
            or (op is not None and op != torch_distributed.ReduceOp.SUM)
            or getattr(tensor, "numel", lambda: 0)() != 1
        ):
            return real_all_reduce(tensor, *args, **kwargs)
        check.used = True
        check.group = args[1] if len(args) > 1 else kwargs.get("group")
        check.item = getattr(check.caller, "cur_item", None)
        try:
            check.reason = local_failure(check.caller)
        except Exception:  # a verdict that cannot be read never fails a save
            logger.warning("reading this rank's async save failed; taken as not failed", exc_info=True)
        if check.reason is not None:
            tensor.add_(FAIL_UNIT)
        work = real_all_reduce(tensor, *args, **kwargs)
        total = int(tensor.reshape(-1)[0].item())
        if total >= FAIL_UNIT or total < 0:
            check.failed_anywhere = True
            stop_process(check.caller)  # megatron-core joins it next: it must be gone
            tensor.zero_()  # "all done": megatron-core goes no further than its own joins
        return work

    all_reduce.__wrapped__ = real_all_reduce  # type: ignore[attr-defined]
    all_reduce.__doc__ = getattr(real_all_reduce, "__doc__", None)
    return all_reduce


def stop_process(caller: Any) -> None:
    """Kill the caller's process of the failed save (and the writers it forked), if it runs."""
    import multiprocessing.process

    process = getattr(caller, "process", None)
    if not isinstance(process, multiprocessing.process.BaseProcess) or process.pid is None:
        return  # not a process this interpreter started (or not started)
    if process.exitcode is not None:
        return
    pid = process.pid
    for child in _children(pid):
        try:
            os.kill(child, signal.SIGKILL)
        except OSError:
            pass
    try:
        process.kill()
        process.join(5)
    except Exception:
        logger.debug("stopping %s failed", process, exc_info=True)


def _children(pid: int) -> List[int]:
    found: List[int] = []
    try:
        tasks = os.listdir("/proc/%d/task" % pid)
    except OSError:
        return found
    for task in tasks:
        try:
            with open("/proc/%d/task/%s/children" % (pid, task)) as f:
                found += [int(word) for word in f.read().split()]
        except (OSError, ValueError):
            continue
    return found


# --- after the count said a save failed somewhere ------------------------------------------------


def raise_everywhere(check: DoneCheck) -> None:
    """Every rank: gather why, make the caller ready for the next save, raise."""
    import torch.distributed as dist

    rank = dist.get_rank()
    mine = (rank, check.reason) if check.reason is not None else None
    gathered: List[Any] = [None] * dist.get_world_size(check.group)
    dist.all_gather_object(gathered, mine, group=check.group)
    failures = {r: text for r, text in (g for g in gathered if g)}
    reset_caller(check.caller)
    raise save_failed(check.caller, failures)


def save_failed(caller: Any, failures: Dict[int, str]) -> BaseException:
    """torch's CheckpointException naming every failed rank and why, marked with the caller."""
    from mcore_autopatch.shared import checkpoint_errors  # only a failed save pays for it

    error = checkpoint_errors.checkpoint_exception(
        {rank: RuntimeError("rank %d: %s (%s)" % (rank, text, NOTE)) for rank, text in failures.items()}
    )
    setattr(error, FAILED_CALLER, caller)
    logger.warning("the async save failed on ranks %s: %s", sorted(failures), "; ".join(failures.values()))
    return error


def reset_caller(caller: Any) -> None:
    """The caller, ready for the next save: its process stopped and forgotten, and a persistent
    caller's queues new (the old ones may hold what the dead worker never took), so that the
    next save starts a worker of its own, as the first one did."""
    import multiprocessing.queues

    stop_process(caller)
    process = getattr(caller, "process", None)
    state = vars(caller)
    state.pop(_FAILED, None)
    state.pop(_SAVE, None)
    state.pop(_SAVES, None)
    if not _is_persistent(caller):
        caller.process = None
        return
    module = __import__(type(caller).__module__, fromlist=["_"])
    context = None
    for klass in type(caller).__mro__:  # megatron-core 0.17+: one worker per class
        for name, value in list(vars(klass).items()):
            if (process is not None and value is process) or isinstance(value, multiprocessing.queues.Queue):
                setattr(klass, name, None)
    for name, value in list(state.items()):
        if isinstance(value, multiprocessing.queues.Queue):
            if context is None:
                context = _spawn_context(module)
            joinable = isinstance(value, multiprocessing.queues.JoinableQueue)
            state[name] = context.JoinableQueue() if joinable else context.Queue()
    caller.process = None
    caller.cur_item = None


def _spawn_context(module: ModuleType) -> Any:
    """The context every release's persistent caller makes its queues from ('spawn'), through the
    module's own multiprocessing global (whose waits are watched where that fix applies)."""
    from mcore_autopatch.fixes.writer_processes_watched import multiprocessing_globals

    for name in sorted(multiprocessing_globals(module)):
        return vars(module)[name].get_context("spawn")
    import multiprocessing

    return multiprocessing.get_context("spawn")


# --- the rebound methods -------------------------------------------------------------------------


def done_check(original: Callable[..., Any], qualname: str) -> Callable[..., Any]:
    def is_current_async_call_done(self: Any, *args: Any, **kwargs: Any) -> Any:
        check = DoneCheck(self)
        _checks.append(check)
        try:
            done = original(self, *args, **kwargs)
        finally:
            _checks.remove(check)
        if check.failed_anywhere:
            raise_everywhere(check)
        if done and check.item is not None:  # finished on every rank: its record goes
            vars(self).get(_SAVES, {}).pop(check.item, None)
        if not check.used:  # no_dist=True: this rank decides alone, as it asked
            reason = local_failure(self)
            if reason is not None:
                reset_caller(self)
                raise save_failed(self, {_rank(): reason})
        return done

    return methods.marked(is_current_async_call_done, original, qualname, by=NAME)


def _rank() -> int:
    try:
        import torch.distributed as dist

        return dist.get_rank()
    except Exception:
        return 0


def scheduling(original: Callable[..., Any], qualname: str) -> Callable[..., Any]:
    def schedule_async_call(self: Any, *args: Any, **kwargs: Any) -> Any:
        vars(self).pop(_FAILED, None)
        try:
            record_save(self, args, kwargs)
        except Exception:
            logger.debug("what the save writes could not be read", exc_info=True)
        try:
            return original(self, *args, **kwargs)
        except Exception as exc:
            frames = traceback.extract_tb(exc.__traceback__)
            where = " in %s (%s:%s)" % (frames[-1].name, frames[-1].filename, frames[-1].lineno) if frames else ""
            reason = "scheduling the save raised %s: %s%s" % (type(exc).__name__, exc, where)
            logger.warning("rank %d: %s; it fails on every rank at the next done check", _rank(), reason)
            vars(self)[_FAILED] = reason
            return None

    return methods.marked(schedule_async_call, original, qualname, by=NAME)


def finalizing(original: Callable[..., Any], qualname: str) -> Callable[..., Any]:
    def maybe_finalize_async_calls(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return original(self, *args, **kwargs)
        except BaseException as exc:
            caller = getattr(exc, FAILED_CALLER, None)
            calls = getattr(self, "async_calls", None)
            if caller is not None and calls is not None:
                dropped = [c for c in list(calls) if getattr(c, "async_caller", None) is caller]
                for call in dropped:
                    calls.remove(call)
                if len(dropped) > 1:
                    logger.warning("%d saves queued on the same worker were dropped with it", len(dropped) - 1)
            raise

    return methods.marked(maybe_finalize_async_calls, original, qualname, by=NAME)


def is_applied(module: ModuleType) -> bool:
    queue = vars(module).get(QUEUE_CLASS)
    return isinstance(queue, type) and methods.is_rebound(module, QUEUE_CLASS, "maybe_finalize_async_calls", NAME)


def apply(module: ModuleType, mode: str) -> "tuple[Decision, bool]":
    ev = evaluate(module, mode)
    if not ev.decision.needed or ev.torch is None:
        return ev.decision, is_applied(module)
    namespace = vars(module)
    real_distributed = ev.torch.distributed
    for owner in sorted(ev.owners):
        if "distributed" in standin.overrides(namespace.get(owner)):
            continue
        distributed = standin.ModuleStandIn(
            real_distributed,
            {"all_reduce": counting_failures(real_distributed.all_reduce, real_distributed)},
            "all_reduce of the done check carries failures",
        )
        refused = standin.rebind(namespace, owner, ev.torch, {"distributed": distributed}, "distributed.all_reduce")
        if refused:
            return Decision(
                True, "%s; but %s.%s, so it is left alone" % (ev.decision.reason, module.__name__, refused)
            ), False
    for cls in ev.callers:
        for method, make in (("is_current_async_call_done", done_check), ("schedule_async_call", scheduling)):
            qualname = "%s.%s" % (cls.__name__, method)
            methods.rebind(cls, method, lambda original, m=make, q=qualname: m(original, q), NAME)
    qualname = "%s.maybe_finalize_async_calls" % QUEUE_CLASS
    methods.rebind(ev.queue, "maybe_finalize_async_calls", lambda original: finalizing(original, qualname), NAME)
    return ev.decision, True
