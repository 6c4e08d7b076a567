"""Situation 7: the writer module is imported through ``importlib.util.LazyLoader``.

The spec comes from ``importlib.util.find_spec`` (so through ``sys.meta_path`` and our
finder); ``LazyLoader`` defers executing the module until its first attribute access. The
fix must be in place right after that first access, and the save must work.
Usage: lazy_loader.py CHECKPOINT_DIR
"""

import importlib.util
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _save


def main(folder: str) -> None:
    spec = importlib.util.find_spec(_save.WRITER)
    loader = importlib.util.LazyLoader(spec.loader)
    spec.loader = loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[_save.WRITER] = module
    loader.exec_module(module)
    out = {"lazy_before_access": type(module).__name__ == "_LazyModule"}
    out["class_name"] = module.FileSystemWriterAsync.__name__  # the first access runs the module body
    out["lazy_after_access"] = type(module).__name__ == "_LazyModule"
    out["report"] = _save.write_item_report(module)
    out["save"] = _save.save_and_load(folder)
    out["same_module_after_save"] = sys.modules[_save.WRITER] is module
    _save.emit(out)


if __name__ == "__main__":
    main(sys.argv[1])
