"""A checkpoint's ``.metadata`` is written only from write results that match its files.

Where write results come back to the finalize through a queue (megatron-core 0.8 and later,
nvidia-resiliency-ext 0.3 and later), the finalize checks only how many there are; a save given
another save's results (``write_results_per_save`` says how) writes a ``.metadata`` whose offsets
and lengths point into the wrong bytes, reports success, and fails at resume with
``UnpicklingError`` inside a ``CheckpointException``. The results of two saves of one job name
the same files and keys; their sizes differ (``shared/storage_layout.py``).

What is read: whether the writer class's ``retrieve_write_results`` takes its results from a
queue (``results_queue``); 0.6 and 0.7 keep them in a dict of the writer's own.

What is rebound: ``FileSystemWriterAsync.finish`` (torch's ``FileSystemWriter.finish``, which it
inherits, or its own), on that class only. On the coordinator, before the real ``finish``
writes ``.metadata``, every file the results name is ``stat``-ed; a file whose size is not
where its last item ends stops the save with megatron-core's ``CheckpointingException`` saying
so, and no ``.metadata`` is written. Files this rank cannot see (another node's local disk, an
object store) are not checked, said at debug level. Nothing changes in what a checkpoint holds.
"""

from __future__ import annotations

import os
import sys
from types import ModuleType
from typing import Any, Callable, Iterator, List

from mcore_autopatch.shared import methods, storage_layout
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
    code = getattr(retrieve, "__code__", None)
    if code is None or not callable(getattr(writer, "finish", None)):
        reason = "%s has no %s.retrieve_write_results and finish; not patching" % (label, WRITER_CLASS)
        return Evaluation(Decision(None, reason))
    if "results_queue" not in code_reading.mentions(code):
        reason = "%s's writer keeps its write results itself (no results queue): they are its own" % label
        return Evaluation(Decision(False, reason), writer)
    reason = (
        "%s's finalize writes .metadata from the write results on a queue, checking only their number: "
        "each file's size is now checked against where its last item ends before .metadata is written" % label
    )
    return Evaluation(Decision(True, reason), writer)


def _storage_infos(results: Any) -> Iterator[Any]:
    for rank_results in results or ():
        if not isinstance(rank_results, (list, tuple)):
            continue  # a rank's failure: megatron-core reports those itself before finish
        for result in rank_results:
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


def mismatch(writer: Any, results: Any) -> "str | None":
    """Why ``results`` cannot be this save's, or None."""
    folder = checkpoint_folder(writer)
    if folder is None:
        logger.debug("the write results are not checked: the checkpoint is not a local folder")
        return None
    mismatches, unseen = storage_layout.compare_with_files(folder, storage_layout.ends_by_file(_storage_infos(results)))
    if unseen:
        logger.debug("%d of the checkpoint's files are not visible here; not checked: %s", len(unseen), unseen[:5])
    if not mismatches:
        return None
    shown: List[str] = [m.text for m in mismatches[:3]]
    more = " (and %d more files)" % (len(mismatches) - 3) if len(mismatches) > 3 else ""
    return (
        "mcore-autopatch: not writing %s: the write results this save was given do not match its files: "
        "%s%s. They are another save's: async saves of one process share one results queue in megatron-core, "
        "and a save finalized while another was in flight, or after one was abandoned, takes the other's. "
        "This checkpoint is incomplete (no .metadata); resume from another iteration"
        % (os.path.join(folder, ".metadata"), "; ".join(shown), more)
    )


def exception_type(writer_module: str) -> type:
    for module in (sys.modules.get(writer_module), sys.modules.get(MEGATRON_EXCEPTIONS)):
        found = getattr(module, "CheckpointingException", None)
        if isinstance(found, type) and issubclass(found, Exception):
            return found
    return RuntimeError


def finish_checking_files(original: Callable[..., Any], writer_module: str) -> Callable[..., Any]:
    def finish(self: Any, metadata: Any, results: Any) -> Any:
        try:
            problem = mismatch(self, results)
        except Exception:  # a check that cannot run never stops a save
            logger.warning("checking the write results against the files failed; not checked", exc_info=True)
            problem = None
        if problem is not None:
            raise exception_type(writer_module)(problem)
        return original(self, metadata, results)

    return methods.marked(finish, original, "%s.finish" % WRITER_CLASS)


def is_applied(module: ModuleType) -> bool:
    return methods.is_rebound(module, WRITER_CLASS, "finish")


def apply(module: ModuleType, mode: str) -> "tuple[Decision, bool]":
    ev = evaluate(module, mode)
    if not ev.decision.needed or ev.writer is None:
        return ev.decision, is_applied(module)
    methods.rebind(ev.writer, "finish", lambda original: finish_checking_files(original, module.__name__))
    return ev.decision, True
