"""A checkpoint's ``.metadata`` is written only from write results that match its files.

Where write results come back to the finalize through a queue (megatron-core 0.8 and later,
nvidia-resiliency-ext 0.3 and later), the finalize checks only how many there are; a save given
another save's results (``write_results_per_save`` says how) writes a ``.metadata`` whose offsets
and lengths point into the wrong bytes, reports success, and fails at resume with
``UnpicklingError`` inside a ``CheckpointException``. The results of two saves of one job name
the same files and keys; their sizes differ (``shared/storage_layout.py``).

What is read: whether the writer class's ``retrieve_write_results`` takes its results from a
queue (``results_queue``); 0.6 and 0.7 keep them in a dict of the writer's own.

What is rebound: ``FileSystemWriterAsync.retrieve_write_results``, on that class only. On every
rank, once megatron-core has taken its results, each file they name is ``stat``-ed (the rank's
own files: one ``stat`` each, whatever the size of the job); a file whose size is not where its
last item ends makes the rank's results a failure (torch's wrapped ``CheckpointingException``),
which travels to the coordinator in the gather the finalize already makes, as a write error
does: the coordinator writes no ``.metadata`` and raises, naming the rank (megatron-core 0.14+
then raise on every rank; ``failed_saves_raise_everywhere`` looks at the same files earlier,
at the done check, so that every release does). Files this rank cannot see (an object store)
are not checked, said at debug level. Nothing changes in what a checkpoint holds.
"""

from __future__ import annotations

import os
import sys
from types import ModuleType
from typing import Any, Callable, Iterator, List

from mcore_autopatch.shared import methods
from mcore_autopatch.shared.log import logger
from mcore_autopatch.shared.values import Decision

WRITER_CLASS = "FileSystemWriterAsync"
MEGATRON_EXCEPTIONS = "megatron.core.dist_checkpointing.core"


class Evaluation:
    __slots__ = ("decision", "writer")

    def __init__(self, decision: Decision, writer: Any = None) -> None:
        self.decision = decision
        self.writer = writer


def evaluate(module: ModuleType, mode: str) -> Evaluation:
    from mcore_autopatch.shared import code_reading, versions

    label = versions.module_label(module.__name__)
    writer = vars(module).get(WRITER_CLASS)
    if not isinstance(writer, type):
        return Evaluation(Decision(False, "%s has no %s: no async writer here" % (label, WRITER_CLASS)))
    retrieve = vars(writer).get("retrieve_write_results")
    while getattr(retrieve, methods.MARK, False):  # ours already: read megatron-core's
        retrieve = retrieve.__wrapped__
    code = getattr(retrieve, "__code__", None)
    if code is None:
        reason = "%s has no %s.retrieve_write_results; not patching" % (label, WRITER_CLASS)
        return Evaluation(Decision(None, reason))
    if "results_queue" not in code_reading.mentions(code):
        reason = "%s's writer keeps its write results itself (no results queue): they are its own" % label
        return Evaluation(Decision(False, reason), writer)
    reason = (
        "%s's finalize writes .metadata from the write results on a queue, checking only their number: each rank "
        "now checks its own files' sizes against where their last items end, and a mismatch fails the save before "
        ".metadata is written" % label
    )
    return Evaluation(Decision(True, reason), writer)


def _storage_infos(results: Any) -> Iterator[Any]:
    for result in results or ():
        info = getattr(result, "storage_data", None)
        if info is not None and hasattr(info, "relative_path"):
            yield info


def checkpoint_folder(writer: Any) -> "str | None":
    """The local folder the writer writes to, or None (an object store, a URL)."""
    for name in ("path", "checkpoint_dir"):
        try:
            value = getattr(writer, name, None)
        except Exception:
            continue
        if isinstance(value, (str, os.PathLike)):
            folder = os.fspath(value)
            if isinstance(folder, str) and os.path.isdir(folder):
                return folder
    return None


def mismatch_in(folder: str, results: Any) -> "str | None":
    """Why one rank's ``results`` (WriteResults) cannot be this save's files in ``folder``, or None."""
    from mcore_autopatch.shared import storage_layout  # at a save's finalize, not at the watched import

    mismatches, unseen = storage_layout.compare_with_files(folder, storage_layout.ends_by_file(_storage_infos(results)))
    if unseen:
        logger.debug("%d of the save's files are not visible here; not checked: %s", len(unseen), unseen[:5])
    if not mismatches:
        return None
    shown: List[str] = [m.text for m in mismatches[:3]]
    more = " (and %d more files)" % (len(mismatches) - 3) if len(mismatches) > 3 else ""
    return (
        "mcore-autopatch: the write results this save was given do not match its files in %s: %s%s. They are "
        "another save's: async saves of one process share one results queue in megatron-core, and a save finalized "
        "while another was in flight, or after one was abandoned, takes the other's. This checkpoint is incomplete "
        "(no .metadata is written); resume from another iteration" % (folder, "; ".join(shown), more)
    )


def mismatch(writer: Any, results: Any) -> "str | None":
    folder = checkpoint_folder(writer)
    if folder is None:
        logger.debug("the write results are not checked: the checkpoint is not a local folder")
        return None
    return mismatch_in(folder, results)


def exception_type(writer_module: str) -> type:
    for module in (sys.modules.get(writer_module), sys.modules.get(MEGATRON_EXCEPTIONS)):
        found = getattr(module, "CheckpointingException", None)
        if isinstance(found, type) and issubclass(found, Exception):
            return found
    return RuntimeError


def retrieve_checking_files(original: Callable[..., Any], writer_module: str) -> Callable[..., Any]:
    def retrieve_write_results(self: Any, *args: Any, **kwargs: Any) -> Any:
        results = original(self, *args, **kwargs)
        if not isinstance(results, list):
            return results  # a failure megatron-core wrapped itself (0.14+): its own report
        try:
            problem = mismatch(self, results)
        except Exception:  # a check that cannot run never stops a save
            logger.warning("checking the write results against the files failed; not checked", exc_info=True)
            problem = None
        if problem is None:
            return results
        logger.warning("%s", problem)
        from mcore_autopatch.shared import checkpoint_errors  # only a failed check pays for it

        return checkpoint_errors.wrapped(exception_type(writer_module)(problem))

    return methods.marked(retrieve_write_results, original, "%s.retrieve_write_results" % WRITER_CLASS)


def is_applied(module: ModuleType) -> bool:
    return methods.is_rebound(module, WRITER_CLASS, "retrieve_write_results")


def apply(module: ModuleType, mode: str) -> "tuple[Decision, bool]":
    ev = evaluate(module, mode)
    if not ev.decision.needed or ev.writer is None:
        return ev.decision, is_applied(module)
    make = lambda original: retrieve_checking_files(original, module.__name__)  # noqa: E731
    methods.rebind(ev.writer, "retrieve_write_results", make)
    return ev.decision, True
