"""Situation 4: ``python -I`` / ``-E`` / ``-s``: site-packages' ``.pth`` files still run.

These flags drop ``PYTHONPATH``, the script's folder or the user site from ``sys.path``,
but not ``site`` itself, so the wheel's ``.pth`` must have installed the finder. The
megatron-core folder is added by hand (``-I`` and ``-E`` ignore ``PYTHONPATH``).
Usage: python -I startup_flags.py CHECKPOINT_DIR --path MEGATRON_FOLDER
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _save


def main(argv: "list[str]") -> None:
    (folder,) = _save.add_paths(argv)
    flags = sys.flags
    out = {
        "flags": {
            "isolated": flags.isolated,
            "ignore_environment": flags.ignore_environment,
            "no_user_site": flags.no_user_site,
            "no_site": flags.no_site,
        },
        "finders": _save.our_finders(),
    }
    out["save"] = _save.save_and_load(folder)
    out["report"] = _save.write_item_report()
    _save.emit(out)


if __name__ == "__main__":
    main(sys.argv[1:])
