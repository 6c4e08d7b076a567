"""``from pkg_resources import packaging`` in megatron-core 0.6 - 0.8, where setuptools has none.

setuptools 82 removed ``pkg_resources`` (81 deprecated it; 70.0 - 70.3 ship one without its
``packaging`` attribute). megatron-core 0.7 and 0.8 run ``from pkg_resources import
packaging`` while ``import megatron.core`` executes (tensor_parallel/random.py; 0.8 also
dist_checkpointing/strategies/torch.py), 0.6 - 0.8 in the modules of the model code
(transformer/attention.py and others): ``ModuleNotFoundError: No module named
'pkg_resources'``, and no checkpoint at all. They use only ``packaging.version``, which is
the ``packaging`` distribution megatron-core declares.

What is done, and only while the body of one of ``MODULES`` executes (the window): a finder
is put first on ``sys.meta_path``. When code of megatron-core itself imports
``pkg_resources`` in the window and no other finder has one, it gets a stand-in module that
holds only ``packaging`` (the installed ``packaging``). When the real ``pkg_resources`` has no
``packaging``, ``sys.modules["pkg_resources.packaging"]`` holds it for the window, which is
where ``from pkg_resources import packaging`` looks next. When the module's body has run, the
finder, the stand-in and that entry are gone: ``import pkg_resources`` fails afterwards as it
did before, for megatron-core's later code and everyone else.

What is read: whether the module imported ``pkg_resources`` in its window (or, for status,
whether its code imports it), and whether the installed setuptools provides it with
``packaging`` (read from ``pkg_resources``' own code, never by importing it).
"""

from __future__ import annotations

import importlib.util
import os
import sys
import threading
from types import ModuleType
from typing import Any, Callable, Dict, List, Optional

from mcore_autopatch import importhook
from mcore_autopatch.shared import code_reading, versions
from mcore_autopatch.shared.log import logger
from mcore_autopatch.shared.values import Decision

NAME = "pkg_resources_packaging"
MODULES = (
    "megatron.core.tensor_parallel.random",
    "megatron.core.dist_checkpointing.strategies.torch",
    "megatron.core.transformer.attention",
    "megatron.core.transformer.custom_layers.transformer_engine",
    "megatron.core.transformer.moe.grouped_gemm_util",
    "megatron.core.models.retro.config",
)
PKG_RESOURCES = "pkg_resources"
FALLBACK = "pkg_resources.packaging"  # where `from pkg_resources import packaging` looks next
_OUR_FILES = ("<frozen importlib", __file__.rsplit("/", 1)[0])

_lock = threading.Lock()
_windows: List["_Window"] = []  # open windows, innermost last
# module name -> what its window served: "stand-in", "fallback", "real" (pkg_resources had
# packaging) or "none" (the module imported no pkg_resources in its window)
_served: Dict[str, str] = {}


class _Window:
    def __init__(self, module: str) -> None:
        self.module = module
        self.served = "none"
        self.fallback_added = False


class _StandInLoader:
    """Makes the stand-in ``pkg_resources``: a module holding only the installed ``packaging``."""

    def create_module(self, spec: Any) -> Optional[ModuleType]:
        return None

    def exec_module(self, module: ModuleType) -> None:
        import packaging.version

        module.packaging = packaging  # type: ignore[attr-defined]
        module.__doc__ = (
            "mcore-autopatch's stand-in for pkg_resources, for megatron-core's `from pkg_resources import "
            "packaging` only: the installed setuptools has no pkg_resources."
        )
        module.__getattr__ = _no_other_name  # type: ignore[attr-defined]


def _no_other_name(name: str) -> Any:
    raise AttributeError(
        "pkg_resources has no %r here: the installed setuptools has no pkg_resources, and mcore-autopatch's "
        "stand-in gives megatron-core only `packaging`" % name
    )


class _WindowFinder:
    """First on ``sys.meta_path`` while a window is open; answers for ``pkg_resources`` only,
    and only to megatron-core's own code."""

    _mcore_autopatch_window = True

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname != PKG_RESOURCES or not _windows or not _importer_is_megatron():
            return None
        window = _windows[-1]
        spec = importhook.spec_from_finders_behind(self, fullname, path, target)
        if spec is None:
            window.served = "stand-in"
            return importlib.util.spec_from_loader(PKG_RESOURCES, _StandInLoader(), origin="mcore-autopatch")
        window.served = "real"
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            hooks: importhook.Hooks = ((), ("mcore_autopatch.fixes.pkg_resources_packaging:_after_real_pkg_resources",))
            spec.loader = importhook.CallbackLoader(spec.loader, fullname, hooks)
        return spec


_finder = _WindowFinder()


def _importer_is_megatron() -> bool:
    """Whether the import statement being served runs in megatron-core's code."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename.startswith(_OUR_FILES):
        frame = frame.f_back  # type: ignore[assignment]
    return frame is not None and str(frame.f_globals.get("__name__", "")).startswith("megatron.")


def _after_real_pkg_resources(module: ModuleType) -> None:
    if _windows:
        _add_fallback_if_lacking(module, _windows[-1])


def _add_fallback_if_lacking(pkg_resources: ModuleType, window: _Window) -> None:
    if hasattr(pkg_resources, "packaging") or FALLBACK in sys.modules:
        return
    import packaging.version

    sys.modules[FALLBACK] = packaging
    window.fallback_added = True
    window.served = "fallback"


def before(module: ModuleType, mode: str) -> Optional[Callable[[], None]]:
    """Open the window for ``module``'s body; return what closes it."""
    if module.__name__ not in MODULES:
        return None
    window = _Window(module.__name__)
    with _lock:
        _windows.append(window)
        if not any(getattr(f, "_mcore_autopatch_window", False) for f in sys.meta_path):
            sys.meta_path.insert(0, _finder)
    existing = sys.modules.get(PKG_RESOURCES)
    if existing is not None and not hasattr(existing, "packaging") and _code_imports_pkg_resources(module):
        _add_fallback_if_lacking(existing, window)  # setuptools 70.0 - 70.3, imported earlier

    def close() -> None:
        with _lock:
            if window in _windows:
                _windows.remove(window)
            if not _windows:
                while _finder in sys.meta_path:
                    sys.meta_path.remove(_finder)
        if _is_stand_in(sys.modules.get(PKG_RESOURCES)):
            del sys.modules[PKG_RESOURCES]
        if window.fallback_added and sys.modules.get(FALLBACK) is not None:
            sys.modules.pop(FALLBACK, None)
        _served[window.module] = window.served
        if window.served in ("stand-in", "fallback"):
            logger.debug("%s: pkg_resources %s served during its import", window.module, window.served)

    return close


def _is_stand_in(module: Any) -> bool:
    return isinstance(getattr(getattr(module, "__spec__", None), "loader", None), _StandInLoader)


# --- reading ------------------------------------------------------------------------------


def _module_code(name: str, module: Optional[ModuleType] = None) -> Any:
    """The code object of module ``name`` without executing anything: from its loader when it
    is imported, else compiled from its file, found under its top package's folders (never by
    importing its parent packages, which is what fails where pkg_resources is missing)."""
    loader = getattr(getattr(module, "__spec__", None), "loader", None)
    if loader is not None and hasattr(loader, "get_code"):
        try:
            return loader.get_code(name)
        except Exception:
            return None
    top, _, rest = name.partition(".")
    try:
        spec = importlib.util.find_spec(top)
    except Exception:
        return None
    for folder in list(getattr(spec, "submodule_search_locations", None) or []):
        base = os.path.join(folder, *rest.split("."))
        for path in (base + ".py", os.path.join(base, "__init__.py")):
            if os.path.isfile(path):
                try:
                    with open(path, "rb") as f:
                        return compile(f.read(), path, "exec", dont_inherit=True)
                except Exception:
                    return None
    return None


def _code_imports_pkg_resources(module: ModuleType) -> bool:
    code = _module_code(module.__name__, module)
    return code is not None and PKG_RESOURCES in code.co_names


def setuptools_provides() -> "tuple[str, str]":
    """("none" | "without packaging" | "with packaging", words): the installed pkg_resources,
    read from its code, never imported."""
    loaded = sys.modules.get(PKG_RESOURCES)
    if loaded is not None and not _is_stand_in(loaded):
        has = hasattr(loaded, "packaging")
    else:
        try:
            found = importlib.util.find_spec(PKG_RESOURCES) if loaded is None else None
        except Exception:
            found = None
        if found is None:
            return "none", "the installed setuptools has no pkg_resources (setuptools 82 removed it)"
        get_code = getattr(found.loader, "get_code", None)
        try:
            code = get_code(PKG_RESOURCES) if get_code is not None else None
        except Exception:
            code = None
        has = code is None or "packaging" in code.co_names
    version = _setuptools_version()
    if has:
        return "with packaging", "setuptools %s's pkg_resources provides packaging" % version
    return "without packaging", "setuptools %s's pkg_resources has no packaging (setuptools 70.0 - 70.3)" % version


def _setuptools_version() -> str:
    try:
        return str(versions._metadata_module().version("setuptools"))
    except Exception:
        return "(unknown version)"


class Evaluation:
    __slots__ = ("decision",)

    def __init__(
        self,
        decision: Decision,
    ) -> None:
        self.decision = decision


def decide(name: str, imports: Optional[bool], served: Optional[str]) -> Decision:
    megatron = versions.megatron_core_label()
    where = code_reading.short_name(name)
    if served == "stand-in":
        reason = (
            "%s imports pkg_resources, which the installed setuptools lacks: a stand-in holding only packaging "
            % (megatron)
        )
        return Decision(True, reason + "answered that import, while the importing module's body ran", where=where)
    if served == "fallback":
        reason = (
            "%s imports packaging from pkg_resources, which has none in the installed setuptools (70.0 - 70.3): "
            % (megatron)
        )
        return Decision(True, reason + "it got packaging, while the importing module's body ran", where=where)
    if imports is False or served == "none":
        return Decision(False, "%s does not import pkg_resources" % megatron, where=where)
    if imports is None:
        return Decision(None, "%s: its code cannot be read" % megatron, where=where)
    provides, words = setuptools_provides()
    if provides == "with packaging":
        return Decision(False, "%s imports pkg_resources; %s" % (megatron, words), where=where)
    reason = "%s runs `from pkg_resources import packaging` at import; %s" % (megatron, words)
    return Decision(True, reason, where=where)


def evaluate(module: ModuleType, mode: str) -> Evaluation:
    served = _served.get(module.__name__)
    if served is not None:
        return Evaluation(decide(module.__name__, None, served))
    code = _module_code(module.__name__, module)
    return Evaluation(decide(module.__name__, None if code is None else PKG_RESOURCES in code.co_names, None))


def evaluate_unimported(name: str, mode: str) -> Optional[Evaluation]:
    """For status: a module not imported yet, read from its code; None when it does not exist."""
    code = _module_code(name)
    if code is None:
        return None
    return Evaluation(decide(name, PKG_RESOURCES in code.co_names, None))


def is_applied(module: ModuleType) -> bool:
    return _served.get(module.__name__) in ("stand-in", "fallback")


def apply(module: ModuleType, mode: str) -> "tuple[Decision, bool]":
    """After the module's body ran: what its window did (the window did the work)."""
    ev = evaluate(module, mode)
    return ev.decision, is_applied(module)
