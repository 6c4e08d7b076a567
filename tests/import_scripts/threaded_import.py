"""Situation 6: eight threads import the writer module at the same moment.

A ``threading.Barrier`` releases them together. torch itself is imported first, in the
main thread, because a concurrent first import of torch is torch's business, not the
hook's; megatron-core and the writer are imported by the racing threads. The test reads
the hook's debug log on stderr to count how many times the fix was applied.
Usage: MCORE_AUTOPATCH_LOG=debug threaded_import.py CHECKPOINT_DIR
"""

import importlib
import os
import sys
import threading
from typing import Dict, List

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _save

THREADS = 8


def main(folder: str) -> None:
    import torch  # noqa: F401

    barrier = threading.Barrier(THREADS)
    modules: Dict[int, int] = {}
    errors: List[str] = []

    def work(index: int) -> None:
        barrier.wait()
        try:
            modules[index] = id(importlib.import_module(_save.WRITER))
        except Exception as exc:
            errors.append("%s: %s" % (type(exc).__name__, exc))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    out = {
        "errors": errors,
        "imported_by": len(modules),
        "distinct_modules": len(set(modules.values())),
        "report": _save.write_item_report(),
        "finders": _save.our_finders(),
    }
    out["save"] = _save.save_and_load(folder)
    _save.emit(out)


if __name__ == "__main__":
    main(sys.argv[1])
