"""Situation 5: the site-packages folder is processed again (CPython gh-75723; ``site.addsitedir``).

Each ``site.addsitedir`` of site-packages runs every ``.pth`` import line there again. An
audit hook counts the ``exec`` of lines that mention mcore_autopatch, to show that ours
really ran again; yet exactly one finder may be on ``sys.meta_path``. The last round
runs after mcore_autopatch is dropped from ``sys.modules``, so a second copy of the
module is imported and must recognise the first copy's finder. The script itself never
imports mcore_autopatch.
Usage: site_processed_twice.py CHECKPOINT_DIR
"""

import os
import site
import sys
import sysconfig
from typing import Any, Tuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _save

PTH_RUNS = {"armed": False, "count": 0}


def _mentions_us(code: Any) -> bool:
    return "mcore_autopatch" in code.co_names or any("mcore_autopatch" in repr(c) for c in code.co_consts)


def _audit(event: str, args: Tuple[Any, ...]) -> None:
    if PTH_RUNS["armed"] and event == "exec" and args and hasattr(args[0], "co_names") and _mentions_us(args[0]):
        PTH_RUNS["count"] += 1


def process_site_packages(folder: str) -> int:
    """``site.addsitedir(folder)``; return how many mcore_autopatch ``.pth`` lines it ran."""
    PTH_RUNS["armed"], PTH_RUNS["count"] = True, 0
    site.addsitedir(folder)
    PTH_RUNS["armed"] = False
    return PTH_RUNS["count"]


def main(folder: str) -> None:
    site_packages = sysconfig.get_paths()["purelib"]
    sys.addaudithook(_audit)
    first_copy = sys.modules.get("mcore_autopatch")
    out = {
        "pth_present": os.path.isfile(os.path.join(site_packages, "mcore_autopatch.pth")),
        "finders_at_start": _save.our_finders(),
        "runs": [process_site_packages(site_packages), process_site_packages(site_packages)],
    }
    out["finders_after_twice"] = _save.our_finders()
    for name in [n for n in sys.modules if n == "mcore_autopatch" or n.startswith("mcore_autopatch.")]:
        del sys.modules[name]
    out["runs"].append(process_site_packages(site_packages))
    second_copy = sys.modules.get("mcore_autopatch")
    out["second_copy_imported"] = second_copy is not None and second_copy is not first_copy
    out["finders_after_second_copy"] = _save.our_finders()
    out["save"] = _save.save_and_load(folder)
    out["report"] = _save.write_item_report()
    _save.emit(out)


if __name__ == "__main__":
    main(sys.argv[1])
