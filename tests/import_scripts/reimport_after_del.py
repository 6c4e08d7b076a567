"""Situation 2: ``del sys.modules[writer]`` and import it again, then a save through the new module.

The second import creates a new module object from the file; the hook must fix it as well,
wrapping torch's original (not the first module's wrapper). ``strategies.torch`` is
re-imported too, so that the save really runs the second module's code.
Usage: reimport_after_del.py CHECKPOINT_DIR
"""

import importlib
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _save


def main(folder: str) -> None:
    first = importlib.import_module(_save.WRITER)
    importlib.import_module(_save.STRATEGIES_TORCH)
    out = {"first": _save.write_item_report(first)}
    del sys.modules[_save.WRITER]
    del sys.modules[_save.STRATEGIES_TORCH]
    second = importlib.import_module(_save.WRITER)
    strategies_torch = importlib.import_module(_save.STRATEGIES_TORCH)
    out["new_module"] = second is not first
    out["second"] = _save.write_item_report(second)
    out["first_after"] = _save.write_item_report(first)
    out["strategy_uses_second"] = strategies_torch.FileSystemWriterAsync is second.FileSystemWriterAsync
    out["class_used_by_strategy"] = _save.used_by_class(strategies_torch.FileSystemWriterAsync)
    out["save"] = _save.save_and_load(folder, strategies_torch)
    _save.emit(out)


if __name__ == "__main__":
    main(sys.argv[1])
