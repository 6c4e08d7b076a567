"""Situation 10: the job carries its own fix for the ``_write_item`` call, beside ours.

Each ``--fix`` models a kind of fix that training frameworks ship (written here from the
description, not from their code):

* ``verl``: modelled on verl's patch for torch 2.8: the job replaces
  ``FileSystemWriterAsync.write_preloaded_data`` with its own staticmethod: a function
  built from the original's ``__code__`` over a copy of the module globals in which
  ``_write_item`` is a job-owned function that calls torch's ``_write_item`` with every
  argument (transforms and ``serialization_format``) itself.
* ``swift-keyword``: like ms-swift's shim, the module's ``_write_item`` global is wrapped
  by a function that adds ``serialization_format=SerializationFormat.TORCH_SAVE`` by
  keyword when the call lacks it.
* ``swift-positional``: the same shim, adding it as the 6th positional argument.

``--order`` says when ours comes: ``ours-first`` (the startup hook fixed the module at
import; the job's fix comes after, so a shim wraps ours), ``job-first-reload`` (the job's
fix, then ``importlib.reload`` of the writer re-runs ours) or ``job-first-install``
(``python -S`` with paths added by hand: the job's fix, then ``mcore_autopatch.install()``).

The job's functions append a line to ``CHECKPOINT_DIR.calls`` each time they run (write
workers are forked processes), so the test can tell whose code did the writing.
Usage: job_own_fix.py CHECKPOINT_DIR --fix FIX --order ORDER [--path P ...]
"""

import argparse
import importlib
import inspect
import os
import sys
import types
from typing import Any, Callable

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _save

FIXES = ["verl", "swift-keyword", "swift-positional"]
ORDERS = ["ours-first", "job-first-reload", "job-first-install"]


def recorder(path: str) -> Callable[[str], None]:
    def record(tag: str) -> None:
        with open(path, "a") as f:
            f.write(tag + "\n")

    return record


def verl_style_fix(writer: Any, record: Callable[[str], None]) -> None:
    """Replace ``write_preloaded_data`` with a copy whose ``_write_item`` is the job's own."""
    fs = sys.modules[_save.TORCH_FS]
    cls = writer.FileSystemWriterAsync
    # megatron-core decorates it with @_disable_gc(): copy the function inside, decorate the copy.
    original = inspect.unwrap(cls.__dict__["write_preloaded_data"].__func__)

    def job_write_item(*args: Any) -> Any:
        record("verl")
        if len(args) == 4:  # megatron-core < 0.12: (stream, data, write_item, storage_key)
            args = (fs._StorageWriterTransforms(), *args)
        return fs._write_item(*args, serialization_format=fs.SerializationFormat.TORCH_SAVE)

    namespace = dict(original.__globals__, _write_item=job_write_item)
    replacement = types.FunctionType(
        original.__code__, namespace, original.__name__, original.__defaults__, original.__closure__
    )
    replacement.__qualname__ = original.__qualname__
    replacement.__kwdefaults__ = original.__kwdefaults__
    cls.write_preloaded_data = staticmethod(writer._disable_gc()(replacement))


def swift_style_shim(writer: Any, record: Callable[[str], None], positional: bool) -> None:
    """Wrap the module's ``_write_item`` global in a shim that adds ``serialization_format``."""
    torch_save = sys.modules[_save.TORCH_FS].SerializationFormat.TORCH_SAVE
    inner = writer._write_item

    def job_shim(*args: Any, **kwargs: Any) -> Any:
        record("swift")
        if "serialization_format" not in kwargs:
            if positional:
                if len(args) == 5:  # (transforms, stream, data, write_item, storage_key)
                    args = (*args, torch_save)
            else:
                kwargs["serialization_format"] = torch_save
        return inner(*args, **kwargs)

    job_shim.job_inner = inner  # type: ignore[attr-defined]
    writer._write_item = job_shim


def main(argv: "list[str]") -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("folder")
    parser.add_argument("--fix", choices=FIXES, required=True)
    parser.add_argument("--order", choices=ORDERS, required=True)
    args = parser.parse_args(_save.add_paths(argv))
    calls = args.folder.rstrip("/") + ".calls"
    record = recorder(calls)
    writer = importlib.import_module(_save.WRITER)
    out = {"ours_before_job_fix": _save.write_item_report(writer)}
    if args.fix == "verl":
        verl_style_fix(writer, record)
    else:
        swift_style_shim(writer, record, positional=args.fix == "swift-positional")
    out["shim_wraps_ours"] = _save.is_ours(getattr(writer._write_item, "job_inner", None))
    if args.order == "job-first-reload":
        importlib.reload(writer)
    elif args.order == "job-first-install":
        import mcore_autopatch

        out["install"] = mcore_autopatch.install()
    out["report"] = _save.write_item_report(writer)
    out["save"] = _save.save_and_load(args.folder)
    job_calls = []
    if os.path.exists(calls):
        with open(calls) as f:
            job_calls = f.read().split()
    out["job_calls"] = len(job_calls)
    if args.order == "job-first-install":
        out["status_applied"] = mcore_autopatch.status()["applied"]
    _save.emit(out)


if __name__ == "__main__":
    main(sys.argv[1:])
