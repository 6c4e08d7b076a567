"""A failure in the form torch's checkpointing reports it: ``CheckpointException`` with, per rank,
an exception and its traceback (a "wrapped exception"), as ``dcp.save`` and megatron-core 0.14+
gather them. Shared by the fixes that fail a save (``results_match_files``,
``failed_saves_raise_everywhere``); torch is imported only when a failure is made.
"""

from __future__ import annotations

import traceback
from typing import Any, Dict


def wrapped(exc: BaseException) -> Any:
    """``(exc, its traceback)``: what a rank's write results are when its write failed."""
    try:
        from torch.distributed.checkpoint.api import _wrap_exception
    except ImportError:  # a torch that names it elsewhere: the same pair
        return (exc, traceback.extract_tb(exc.__traceback__))
    return _wrap_exception(exc)


def checkpoint_exception(failures: Dict[int, BaseException]) -> BaseException:
    """torch's ``CheckpointException("write", {rank: wrapped exception})``, naming every rank."""
    try:
        from torch.distributed.checkpoint.api import CheckpointException
    except ImportError:
        return RuntimeError("checkpoint save failed on ranks %s: %s" % (sorted(failures), failures))
    return CheckpointException("write", {rank: wrapped(exc) for rank, exc in sorted(failures.items())})
