"""A module's stand-in inside one other module: the real module for everything but a few names.

The fixes that need a library to behave differently for megatron-core's code only rebind one
global of one megatron-core (or torch) module, e.g. the ``np`` of megatron-core's
``dist_checkpointing.validation``, to a ``ModuleStandIn``: every attribute is the real
module's, looked up at each use, except the few ``overrides``. The real module, and every
other module's view of it, stays exactly as it was.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any, Callable, Dict, Iterable, Mapping, Optional

MARK = "__mcore_autopatch__"  # set on every stand-in: what it overrides, for status and tests


class ModuleStandIn:
    """``real`` with ``overrides`` put in front of it (``why`` says why, in its repr)."""

    def __init__(self, real: ModuleType, overrides: Mapping[str, Any], why: str) -> None:
        vars(self).update(overrides)
        vars(self)[MARK] = tuple(overrides)
        vars(self)["_standin_real"] = real
        vars(self)["_standin_why"] = why

    def __getattr__(self, name: str) -> Any:  # only called for names not overridden
        return getattr(vars(self)["_standin_real"], name)

    def __dir__(self) -> "list[str]":
        return sorted(set(dir(vars(self)["_standin_real"])) | set(vars(self)[MARK]))

    def __repr__(self) -> str:
        return "<%s, with %s (mcore-autopatch: %s)>" % (
            getattr(vars(self)["_standin_real"], "__name__", "module"),
            ", ".join(vars(self)[MARK]),
            vars(self)["_standin_why"],
        )


def real_module(obj: Any) -> Any:
    """The module behind a stand-in, or ``obj`` itself."""
    return vars(obj).get("_standin_real", obj) if is_standin(obj) else obj


def is_standin(obj: Any) -> bool:
    return isinstance(obj, ModuleStandIn)


def overrides(obj: Any) -> "tuple[str, ...]":
    """The names a stand-in overrides; () for anything else."""
    return tuple(vars(obj)[MARK]) if is_standin(obj) else ()


def rebind(namespace: Dict[str, Any], name: str, real: ModuleType, new: Mapping[str, Any], why: str) -> Optional[str]:
    """Make ``namespace[name]`` a stand-in for ``real`` with ``new`` overridden (beside what an
    earlier stand-in of ours overrides; ``new`` wins). Returns None when done, else why it was
    left alone: the global is something else than ``real`` (a job's own shim, say)."""
    current = namespace.get(name)
    if is_standin(current) and real_module(current) is real:
        new = dict({key: getattr(current, key) for key in overrides(current)}, **new)
    elif current is not real:
        return "%s is already %r" % (name, current)
    namespace[name] = ModuleStandIn(real, new, why)
    return None


def override_each(
    namespace: Dict[str, Any],
    owners: Iterable[str],
    name: str,
    make: Callable[[Any], Any],
    why: str,
    real: Optional[ModuleType] = None,
) -> Optional[str]:
    """Give each global ``owners`` of ``namespace`` a stand-in whose ``name`` is ``make(module)``,
    over ``real`` (by default the module the global holds). None when done, else why one was
    left alone (``rebind``)."""
    for owner in sorted(owners):
        current = namespace.get(owner)
        if name in overrides(current):
            continue  # given already (a re-import, or a second look)
        module = real if real is not None else real_module(current)
        refused = rebind(namespace, owner, module, {name: make(module)}, why)
        if refused:
            return refused
    return None
