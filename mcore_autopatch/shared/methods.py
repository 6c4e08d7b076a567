"""A method of a library's class, rebound to a caller of the library's own method.

Three fixes act this way (``sharded_objects_planned_once``, ``results_match_files``,
``allow_shape_mismatch_on_load``): the class keeps every other member, the new function runs
the original, and a mark on it says it is ours, so a re-import or a second look never stacks
a second wrapper.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any, Callable

MARK = "__mcore_autopatch__"


def marked(wrapper: Callable[..., Any], original: Callable[..., Any], qualname: str) -> Callable[..., Any]:
    """``wrapper``, named ``qualname``, with the original's docstring and our mark."""
    wrapper.__wrapped__ = original  # type: ignore[attr-defined]
    wrapper.__doc__ = getattr(original, "__doc__", None)
    wrapper.__qualname__ = qualname
    setattr(wrapper, MARK, True)
    return wrapper


def is_rebound(module: ModuleType, class_name: str, method: str) -> bool:
    """Whether ``module.<class_name>.<method>`` is one of ours, in the class's own dict."""
    cls = vars(module).get(class_name)
    return isinstance(cls, type) and bool(getattr(vars(cls).get(method), MARK, False))


def rebind(cls: type, method: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    """``cls.<method>`` = ``make(<what it resolves to now>)``, unless it is ours already."""
    if not getattr(vars(cls).get(method), MARK, False):
        setattr(cls, method, make(getattr(cls, method)))
