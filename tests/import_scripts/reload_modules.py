"""Situation 1: ``importlib.reload`` of the writer module and of ``strategies.torch``, then a save.

A reload re-executes the module body in the same namespace, so ``from torch... import
_write_item`` puts torch's original back; the hook must see the reload (it goes through
``sys.meta_path`` like an import) and fix the module again, without a second wrapper.
Usage: reload_modules.py CHECKPOINT_DIR
"""

import importlib
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _save


def main(folder: str) -> None:
    writer = importlib.import_module(_save.WRITER)
    out = {"imported": _save.write_item_report(writer)}
    out["same_module_after_reload"] = importlib.reload(writer) is writer
    out["after_writer_reload"] = _save.write_item_report(writer)
    strategies_torch = importlib.reload(importlib.import_module(_save.STRATEGIES_TORCH))
    out["after_strategies_reload"] = _save.write_item_report(writer)
    out["class_used_by_strategy"] = _save.used_by_class(strategies_torch.FileSystemWriterAsync)
    out["save"] = _save.save_and_load(folder, strategies_torch)
    _save.emit(out)


if __name__ == "__main__":
    main(sys.argv[1])
