"""Run callbacks right after a watched module's body has executed.

A general mechanism that knows nothing of megatron or torch: the finder in
``mcore_autopatch/__init__.py`` hands a watched name here, with the callbacks named as
``"module:function"`` strings. Imported only when a watched module is imported.

How it stays out of the way:

* The spec comes from the finders *behind* ours on ``sys.meta_path``, walked here rather
  than through ``importlib.util.find_spec`` (which would go through the import system
  again and come back to us).
* The spec's loader is wrapped only for the duration of ``exec_module``; the real loader is
  put back on the module afterwards, so ``inspect``, ``linecache``, ``importlib.resources``
  and later reloads see the loader they expect.
* A callback that fails is logged, never raised into the import that triggered it.
"""

import importlib
import sys
from types import ModuleType
from typing import Any, Optional

from mcore_autopatch._log import logger

# Names whose spec is being looked up right now. A finder behind ours that itself calls
# importlib.util.find_spec would otherwise bring the same lookup back here forever. The
# import system holds the per-module lock while finding, so one set is enough.
_resolving: "set[str]" = set()


def find_spec_behind(finder: Any, fullname: str, path: Any, target: Any) -> Any:
    """The spec the rest of ``sys.meta_path`` gives for ``fullname``, with a loader that
    runs ``finder.watched[fullname]`` after executing the module."""
    if fullname in _resolving:
        return None
    _resolving.add(fullname)
    try:
        spec = _spec_from_finders_behind(finder, fullname, path, target)
    finally:
        _resolving.discard(fullname)
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

    def __init__(self, loader: Any, fullname: str, callbacks: "tuple[str, ...]") -> None:
        self.loader = loader
        self.fullname = fullname
        self.callbacks = callbacks

    def __getattr__(self, name: str) -> Any:
        return getattr(self.loader, name)

    def create_module(self, spec: Any) -> Optional[ModuleType]:
        create = getattr(self.loader, "create_module", None)
        return None if create is None else create(spec)

    def exec_module(self, module: ModuleType) -> None:
        try:
            self.loader.exec_module(module)
        finally:
            _restore_loader(module, self)
        run_callbacks(self.fullname, module, self.callbacks)

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


def run_callbacks(fullname: str, module: ModuleType, callbacks: "tuple[str, ...]") -> None:
    """Call each ``"module:function"`` with the executed module; log, never raise."""
    for name in callbacks:
        try:
            resolve(name)(module)
        except Exception:
            logger.warning("callback %s for %s failed; the import goes on unchanged", name, fullname, exc_info=True)


def run_for_loaded_modules(finder: Any) -> None:
    """Run the callbacks of watched modules that are already imported (late activation)."""
    for fullname, callbacks in list(finder.watched.items()):
        module = sys.modules.get(fullname)
        if module is not None:
            run_callbacks(fullname, module, callbacks)


def resolve(name: str) -> Any:
    """``"pkg.mod:attr"`` to the object it names."""
    module_name, _, attr = name.partition(":")
    obj: Any = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj
