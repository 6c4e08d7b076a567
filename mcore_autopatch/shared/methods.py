"""A method of a library's class, rebound to a caller of the library's own method.

Several fixes act this way: the class keeps every other member, the new function runs the
original, and a mark on it says it is ours (and, where two fixes wrap the same method, whose),
so a re-import or a second look never stacks a second wrapper of the same fix.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any, Callable, Optional

MARK = "__mcore_autopatch__"


def marked(
    wrapper: Callable[..., Any], original: Callable[..., Any], qualname: str, by: str = ""
) -> Callable[..., Any]:
    """``wrapper``, named ``qualname``, with the original's docstring and our mark (``by``: the
    fix's name, where another fix may wrap the same method)."""
    wrapper.__wrapped__ = original  # type: ignore[attr-defined]
    wrapper.__doc__ = getattr(original, "__doc__", None)
    wrapper.__qualname__ = qualname
    setattr(wrapper, MARK, by or True)
    return wrapper


def is_ours(function: Any, by: Optional[str] = None) -> bool:
    """Whether ``function``, or a function it wraps, carries our mark (of fix ``by``, if given)."""
    for _ in range(8):
        mark = getattr(function, MARK, False)
        if mark and (by is None or mark == by):
            return True
        function = getattr(function, "__wrapped__", None)
        if function is None:
            return False
    return False


def is_rebound(module: ModuleType, class_name: str, method: str, by: Optional[str] = None) -> bool:
    """Whether ``module.<class_name>.<method>`` is one of ours, in the class's own dict."""
    cls = vars(module).get(class_name)
    return isinstance(cls, type) and is_ours(vars(cls).get(method), by)


def rebind(
    cls: type, method: str, make: Callable[[Callable[..., Any]], Callable[..., Any]], by: Optional[str] = None
) -> None:
    """``cls.<method>`` = ``make(<what it resolves to now>)``, unless it is ours already."""
    if not is_ours(vars(cls).get(method), by):
        setattr(cls, method, make(getattr(cls, method)))
