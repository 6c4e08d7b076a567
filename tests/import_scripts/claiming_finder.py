"""Situation 9: another finder at ``sys.meta_path[0]`` claims megatron-core modules itself.

It builds the spec with ``importlib.machinery.PathFinder`` and gives it a loader of its
own, so our finder is never asked for what it claims; this models code-loading tools such
as a tracer's or a packager's import hook. With ``--claim writer`` it claims only the
writer module: the hook must still fix it through a callback on a package that imports
it, and warn. With ``--claim megatron`` it claims the whole ``megatron`` tree: we see
nothing, the save fails, and ``status()``/``check`` must say the fix is needed but not
applied. mcore_autopatch is imported only at the end, for ``status()``.
Usage: claiming_finder.py CHECKPOINT_DIR --claim writer|megatron
"""

import argparse
import importlib.machinery
import os
import sys
from typing import Any, Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _save


class ClaimingLoader(importlib.machinery.SourceFileLoader):
    """The other tool's own loader (a plain source loader of another class)."""


class ClaimingFinder:
    def __init__(self, claim: str) -> None:
        self.claim = claim

    def claims(self, fullname: str) -> bool:
        if self.claim == "writer":
            return fullname == _save.WRITER
        return fullname == "megatron" or fullname.startswith("megatron.")

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Optional[Any]:
        if not self.claims(fullname):
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is not None and isinstance(spec.loader, importlib.machinery.SourceFileLoader):
            spec.loader = ClaimingLoader(fullname, spec.origin)
        return spec  # a namespace package ("megatron") keeps its own loader, still claimed


def main(argv: "list[str]") -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("folder")
    parser.add_argument("--claim", choices=["writer", "megatron"], required=True)
    args = parser.parse_args(argv)
    sys.meta_path.insert(0, ClaimingFinder(args.claim))
    out = {"save": _save.save_and_load(args.folder)}
    writer = sys.modules.get(_save.WRITER)
    out["writer_loader"] = type(getattr(getattr(writer, "__spec__", None), "loader", None)).__name__
    out["report"] = _save.write_item_report()
    out["finders"] = _save.our_finders()
    import mcore_autopatch
    from mcore_autopatch.cli import report

    info = mcore_autopatch.status()
    out["status"] = {key: info[key] for key in ("hook_installed", "needed", "applied", "reason")}
    out["check"] = list(report.check(info))
    _save.emit(out)


if __name__ == "__main__":
    main(sys.argv[1:])
