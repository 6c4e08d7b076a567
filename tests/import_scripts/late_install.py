"""Situation 3: ``python -S``; the writer is imported before mcore_autopatch is activated.

No ``.pth`` file runs under ``-S``, so the script adds the venv's site-packages and the
megatron-core folder to ``sys.path`` by hand, imports the writer (unfixed), then calls
``mcore_autopatch.install()`` twice: the first call must fix the loaded module at once,
the second must change nothing (one finder, one wrapper). This script imports
mcore_autopatch because the case is precisely about ``install()``.
Usage: python -S late_install.py CHECKPOINT_DIR --path SITE_PACKAGES --path MEGATRON_FOLDER
"""

import importlib
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _save


def main(argv: "list[str]") -> None:
    (folder,) = _save.add_paths(argv)
    out = {"no_site": bool(sys.flags.no_site), "finders_at_start": _save.our_finders()}
    writer = importlib.import_module(_save.WRITER)
    out["before_install"] = _save.write_item_report(writer)
    import mcore_autopatch

    out["first_install"] = mcore_autopatch.install()
    out["after_first_install"] = _save.write_item_report(writer)
    out["second_install"] = mcore_autopatch.install()
    out["after_second_install"] = _save.write_item_report(writer)
    out["finders"] = _save.our_finders()
    out["save"] = _save.save_and_load(folder)
    out["status_applied"] = mcore_autopatch.status()["applied"]
    _save.emit(out)


if __name__ == "__main__":
    main(sys.argv[1:])
