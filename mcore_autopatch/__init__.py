"""mcore-autopatch: megatron-core torch_dist checkpoints that save and resume on new torch.

This module is the startup room. ``mcore_autopatch.pth`` imports it in every interpreter
of an image, so it uses only ``os`` and ``sys`` (already loaded by ``python -c pass``),
never prints, never raises, and does one thing: unless ``MCORE_AUTOPATCH`` switches it
off, it puts one small finder on ``sys.meta_path`` that ignores every import but the few
checkpointing modules below. The import hook proper (``importhook``), the table of fixes
(``fixes``) and what each reads and rebinds are imported only when such a module is
imported, i.e. in processes that already pay for torch.
"""

import os
import sys

# Type names for checkers only: importing typing here would cost every interpreter.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Mapping

__version__ = "0.1.0"
__all__ = ["__version__", "activate", "install", "read_mode", "status"]

# The modules whose execution the fixes wait for (the table is mcore_autopatch/fixes/, not
# imported here: this runs at every interpreter start; a test checks the two agree).
# megatron-core's writer: its ``_write_item`` global is rebound.
WRITER_MODULE = "megatron.core.dist_checkpointing.strategies.filesystem_async"
# megatron-core's torch_dist strategies: the planner that sets ``mcore_data`` and the loader
# that reads it. It imports the writer at its top in every release from 0.6 to 0.16, so it
# is also where a writer loaded by a finder ahead of ours is looked at again.
IMPORTER_MODULE = "megatron.core.dist_checkpointing.strategies.torch"
# nvidia-resiliency-ext's copy of the writer (0.3.0 makes megatron-core 0.12's call).
NVRX_WRITER_MODULE = "nvidia_resiliency_ext.checkpointing.async_ckpt.filesystem_async"
# The async callers and their queue (megatron-core's and nvidia-resiliency-ext's copy): where a
# failed async save is made to fail on every rank.
ASYNC_MODULES = (
    "megatron.core.dist_checkpointing.strategies.async_utils",
    "nvidia_resiliency_ext.checkpointing.async_ckpt.core",
)
_CHECKPOINTING = "megatron.core.dist_checkpointing."
# The other modules of megatron-core whose code a fix reads: the checkpointing modules that
# call numpy.product or read files with a bare torch.load, and the modules that run
# ``from pkg_resources import packaging`` at import (0.6 - 0.8).
_OTHER_WATCHED = (
    _CHECKPOINTING + "mapping",
    _CHECKPOINTING + "validation",
    _CHECKPOINTING + "exchange_utils",
    _CHECKPOINTING + "serialization",
    _CHECKPOINTING + "strategies.fully_parallel",
    _CHECKPOINTING + "strategies.common",
    "megatron.core.tensor_parallel.random",
    "megatron.core.transformer.attention",
    "megatron.core.transformer.custom_layers.transformer_engine",
    "megatron.core.transformer.moe.grouped_gemm_util",
    "megatron.core.models.retro.config",
)

# Two callbacks, by "module:function" name, resolved only when a watched module is imported:
# one just before its body runs, one right after.
_HOOKS = (("mcore_autopatch.fixes:before_module_executes",), ("mcore_autopatch.fixes:on_module_executed",))
_WATCHED = dict.fromkeys((WRITER_MODULE, IMPORTER_MODULE, NVRX_WRITER_MODULE, *ASYNC_MODULES, *_OTHER_WATCHED), _HOOKS)

_OFF_WORDS = ("0", "off", "false", "no")


def read_mode(environ: "Mapping[str, str] | None" = None) -> "tuple[str, bool]":
    """Return ``(mode, recognised)`` from ``MCORE_AUTOPATCH``.

    ``mode`` is ``"auto"``, ``"off"`` or ``"force"``. An unknown word behaves as
    ``"auto"`` with ``recognised`` False, so that it can be reported once, later, by the
    logger (never here: this runs at interpreter startup).
    """
    raw = (os.environ if environ is None else environ).get("MCORE_AUTOPATCH")
    if raw is None:
        return "auto", True
    word = raw.strip().lower()
    if word in ("", "auto"):
        return "auto", True
    if word in _OFF_WORDS:
        return "off", True
    if word == "force":
        return "force", True
    return "auto", False


class _Finder:
    """The one ``sys.meta_path`` entry we add.

    ``find_spec`` is called for every import of the process, so its reject path is a
    single dict lookup. A watched name is handed to ``mcore_autopatch.importhook``, which
    asks the finders behind this one for the real spec and arranges for the callbacks to
    run right after the module body executes. The finder stays armed, so a reload or a
    re-import after ``del sys.modules[name]`` is fixed again.
    """

    # Looked up on the class, so an instance left by another copy or an older version of
    # this module is recognised and never duplicated.
    _mcore_autopatch_finder = True
    __slots__ = ("activated_by", "watched")

    def __init__(self, watched: "dict[str, tuple[str, ...]]", activated_by: str) -> None:
        self.watched = watched
        self.activated_by = activated_by

    def find_spec(self, fullname: str, path: object = None, target: object = None) -> object:
        if fullname not in self.watched:
            return None
        try:
            from mcore_autopatch import importhook

            return importhook.find_spec_behind(self, fullname, path, target)
        except Exception:  # never break the user's import; importlib goes on without us
            return None

    def __repr__(self) -> str:
        return "<mcore_autopatch finder (%s), watching %s>" % (self.activated_by, sorted(self.watched))


def installed_finder() -> "_Finder | None":
    """The finder on ``sys.meta_path``, whichever copy of this module put it there."""
    for entry in sys.meta_path:
        if getattr(type(entry), "_mcore_autopatch_finder", False):
            return entry  # type: ignore[return-value]
    return None


def activate(_source: str = "startup") -> bool:
    """Put the finder on ``sys.meta_path`` once; fix the writer now if it is already loaded.

    This is what ``mcore_autopatch.pth`` (and ``mcore_autopatch.start`` on Python 3.15+)
    runs. It is idempotent (a ``.pth`` can be processed twice), does nothing at all when
    ``MCORE_AUTOPATCH`` is ``0``/``off``/``false``/``no``, and never raises. Returns
    whether the finder is installed.
    """
    try:
        if read_mode()[0] == "off":
            return False
        finder = installed_finder()
        if finder is None:
            finder = _Finder(dict(_WATCHED), _source)
            sys.meta_path.insert(0, finder)
        if any(name in sys.modules for name in _WATCHED):
            # Only after an explicit install() late in a process: megatron is loaded already.
            from mcore_autopatch import importhook

            importhook.run_for_loaded_modules(finder)
        return True
    except Exception:
        return False


def install() -> bool:
    """Activate the fix explicitly, where ``.pth`` files are not processed.

    For ``python -S``, ``pip install --target`` folders, ``PYTHONPATH`` folders and
    zipapps. Safe to call any number of times, before or after megatron-core is imported.
    Honours ``MCORE_AUTOPATCH=0``. Returns whether the finder is installed.
    """
    return activate("install()")


def status(import_writer: bool = False) -> "dict[str, object]":
    """What mcore-autopatch knows and decided in this interpreter, as a plain dict.

    Keys include ``version, enabled, mode, hook_installed, torch, megatron_core, needed,
    applied, reason``. With ``import_writer`` the writer module is imported first (through
    the normal import system, so the hook fires if it is active) to decide ``needed``.
    """
    from mcore_autopatch.cli import report

    return report.status(import_writer=import_writer)
