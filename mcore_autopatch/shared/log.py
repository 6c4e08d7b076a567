"""The ``mcore_autopatch`` logger: silent unless asked, never on stdout.

``MCORE_AUTOPATCH_LOG=debug|info|warning|error`` adds one stderr handler at that level,
with the pid in every line (forked and spawned checkpoint workers log too). Without it,
records only reach handlers the application configured itself; a NullHandler keeps
Python's last-resort handler from printing our warnings on its own.
"""

from __future__ import annotations

import logging
import os
import sys

LOG_ENV = "MCORE_AUTOPATCH_LOG"
LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
}
FORMAT = "mcore_autopatch[pid %(process)d] %(levelname)s: %(message)s"

logger = logging.getLogger("mcore_autopatch")


class _StderrHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes to whatever ``sys.stderr`` is at the time of the record."""

    def __init__(self) -> None:
        super().__init__()

    @property  # type: ignore[override]
    def stream(self) -> object:
        return sys.stderr

    @stream.setter
    def stream(self, _value: object) -> None:
        pass


def _configure() -> None:
    if not any(isinstance(h, logging.NullHandler) for h in logger.handlers):
        logger.addHandler(logging.NullHandler())
    level = LEVELS.get(os.environ.get(LOG_ENV, "").strip().lower())
    if level is None:
        return  # unset or not a level name: stay silent
    handler = _StderrHandler()
    handler.setFormatter(logging.Formatter(FORMAT))
    logger.addHandler(handler)
    logger.setLevel(level)
    logger.propagate = False  # the application's own handlers would print it twice


_configure()
