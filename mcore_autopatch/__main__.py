"""``python -m mcore_autopatch``: the command line (see ``mcore_autopatch.cli``)."""

import sys

from mcore_autopatch.cli import main

if __name__ == "__main__":  # also guards spawned children that re-import __main__
    sys.exit(main())
