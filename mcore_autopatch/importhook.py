"""Run callbacks around a watched module's body: just before it executes, and right after.

A general mechanism that knows nothing of megatron or torch: the finder in
``mcore_autopatch/__init__.py`` hands a watched name here, with its hooks: a pair of tuples
of callbacks named as ``"module:function"`` strings, ``(before, after)``. A *before*
callback is called with the module about to execute and may return a cleanup, called once
the body has run, whether it raised or not; an *after* callback is called with the executed
module. Imported only when a watched module is imported.

How it stays out of the way:

* The spec comes from the finders *behind* ours on ``sys.meta_path``, walked here rather
  than through ``importlib.util.find_spec`` (which would go through the import system
  again and come back to us).
* The spec's loader is wrapped only for the duration of ``exec_module``; the real loader is
  put back on the module afterwards, so ``inspect``, ``linecache``, ``importlib.resources``
  and later reloads see the loader they expect.
* A callback or cleanup that fails is logged, never raised into the import that triggered it.
"""

from __future__ import annotations

import importlib
import sys
from types import ModuleType
from typing import Any, Callable, List, Optional, Tuple

from mcore_autopatch.shared.log import logger

Hooks = Tuple[Tuple[str, ...], Tuple[str, ...]]  # (before, after) callback names

# Names whose spec is being looked up right now. A finder behind ours that itself calls
# importlib.util.find_spec would otherwise bring the same lookup back here forever. The
# import system holds the per-module lock while finding, so one set is enough.
_resolving: "set[str]" = set()


def find_spec_behind(finder: Any, fullname: str, path: Any, target: Any) -> Any:
    """The spec the rest of ``sys.meta_path`` gives for ``fullname``, with a loader that
    runs the hooks ``finder.watched[fullname]`` around the module's body."""
    spec = spec_from_finders_behind(finder, fullname, path, target)
    if spec is None:
        return None
    loader = spec.loader
    if loader is None or not hasattr(loader, "exec_module"):
        # A namespace package, or a legacy loader: nothing to wrap. Give the spec back
        # unchanged, so the module imports exactly as it would without us.
        logger.debug("%s: loader %r cannot be wrapped; not watching this import", fullname, loader)
        return spec
    spec.loader = CallbackLoader(loader, fullname, finder.watched[fullname])
    return spec


def spec_from_finders_behind(finder: Any, fullname: str, path: Any, target: Any) -> Any:
    """The spec the finders after ``finder`` on ``sys.meta_path`` give for ``fullname``."""
    if fullname in _resolving:
        return None
    _resolving.add(fullname)
    try:
        return _spec_from_finders_behind(finder, fullname, path, target)
    finally:
        _resolving.discard(fullname)


def _spec_from_finders_behind(finder: Any, fullname: str, path: Any, target: Any) -> Any:
    meta_path = list(sys.meta_path)
    start = next((i + 1 for i, entry in enumerate(meta_path) if entry is finder), 0)
    for entry in meta_path[start:]:
        if entry is finder:
            continue
        find_spec = getattr(entry, "find_spec", None)
        if find_spec is None:
            continue  # a legacy finder; the import system asks it itself after us
        spec = find_spec(fullname, path, target)
        if spec is not None:
            return spec
    return None


class CallbackLoader:
    """Stands in for the real loader during one import, then hands the module back to it.

    Everything but ``create_module``/``exec_module`` is delegated, so loader methods that
    other tools call (``get_code``, ``get_source``, ``get_filename``, ``is_package``,
    ``get_resource_reader``) behave as before.
    """

    def __init__(self, loader: Any, fullname: str, hooks: Hooks) -> None:
        self.loader = loader
        self.fullname = fullname
        self.hooks = hooks

    def __getattr__(self, name: str) -> Any:
        return getattr(self.loader, name)

    def create_module(self, spec: Any) -> Optional[ModuleType]:
        create = getattr(self.loader, "create_module", None)
        return None if create is None else create(spec)

    def exec_module(self, module: ModuleType) -> None:
        cleanups = run_before(self.fullname, module, self.hooks[0])
        try:
            self.loader.exec_module(module)
        finally:
            _restore_loader(module, self)
            run_cleanups(self.fullname, cleanups)
        run_callbacks(self.fullname, module, self.hooks[1])

    def __repr__(self) -> str:
        return "<mcore_autopatch CallbackLoader for %r around %r>" % (self.fullname, self.loader)


def _restore_loader(module: ModuleType, wrapper: CallbackLoader) -> None:
    try:
        if getattr(module, "__loader__", None) is wrapper:
            module.__loader__ = wrapper.loader
        spec = getattr(module, "__spec__", None)
        if spec is not None and spec.loader is wrapper:
            spec.loader = wrapper.loader
    except Exception:  # a module that refuses attributes keeps the wrapper; harmless
        pass


def run_before(fullname: str, module: ModuleType, callbacks: "tuple[str, ...]") -> "List[Callable[[], Any]]":
    """Call each before-callback with the module about to execute; collect the cleanups
    they return. Log, never raise."""
    cleanups: "List[Callable[[], Any]]" = []
    for name in callbacks:
        try:
            cleanup = resolve(name)(module)
        except Exception:
            logger.warning("callback %s before %s failed; the import goes on unchanged", name, fullname, exc_info=True)
            continue
        if callable(cleanup):
            cleanups.append(cleanup)
    return cleanups


def run_cleanups(fullname: str, cleanups: "List[Callable[[], Any]]") -> None:
    for cleanup in reversed(cleanups):
        try:
            cleanup()
        except Exception:
            logger.warning("a cleanup after %s failed", fullname, exc_info=True)


def run_callbacks(fullname: str, module: ModuleType, callbacks: "tuple[str, ...]") -> None:
    """Call each ``"module:function"`` with the executed module; log, never raise."""
    for name in callbacks:
        try:
            resolve(name)(module)
        except Exception:
            logger.warning("callback %s for %s failed; the import goes on unchanged", name, fullname, exc_info=True)


def run_for_loaded_modules(finder: Any) -> None:
    """Run the after-callbacks of watched modules that are already imported (late activation)."""
    for fullname, hooks in list(finder.watched.items()):
        module = sys.modules.get(fullname)
        if module is not None:
            run_callbacks(fullname, module, hooks[1])


def resolve(name: str) -> Any:
    """``"pkg.mod:attr"`` to the object it names."""
    module_name, _, attr = name.partition(":")
    obj: Any = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj
