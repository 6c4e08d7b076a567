"""The command line: ``mcore-autopatch`` and ``python -m mcore_autopatch``.

``commands`` parses and runs (status, check, selftest, inspect, repair); ``report`` is what
``status`` and ``check`` know (also ``mcore_autopatch.status()``); ``selftest`` and
``inspect_checkpoint`` do the rest. Kept empty of imports: ``mcore_autopatch.status()``
imports ``report`` from here without the argument parser.
"""

from __future__ import annotations

from typing import List, Optional


def main(argv: Optional[List[str]] = None) -> int:
    """The console script's entry point (``mcore_autopatch.cli.commands.main``)."""
    from mcore_autopatch.cli import commands

    return commands.main(argv)
