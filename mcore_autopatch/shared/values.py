"""Small value classes: named fields, equality, a repr and ``_replace``, nothing more.

``typing.NamedTuple`` builds each class with ``eval`` and checks every annotation: about
0.25 ms a class on a slow machine, and seven of them were a third of what the hook added to
megatron-core's watched import. A subclass lists its fields in ``__slots__`` and writes its
own ``__init__``, so that type checkers see each field and its default.
"""

from __future__ import annotations

from typing import Any, Optional, Tuple, TypeVar

_R = TypeVar("_R", bound="Record")


class Record:
    __slots__: Tuple[str, ...] = ()

    def _values(self) -> Tuple[Any, ...]:
        return tuple(getattr(self, name) for name in self.__slots__)

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        return self._values() == other._values()  # type: ignore[attr-defined, no-any-return]

    def __hash__(self) -> int:
        return hash((type(self).__name__, self._values()))

    def __repr__(self) -> str:
        fields = ", ".join("%s=%r" % (name, getattr(self, name)) for name in self.__slots__)
        return "%s(%s)" % (type(self).__name__, fields)

    def _replace(self: _R, **changes: Any) -> _R:
        """A copy with ``changes``, as a named tuple's ``_replace``."""
        values = {name: getattr(self, name) for name in self.__slots__}
        unknown = set(changes) - set(values)
        if unknown:
            raise TypeError("%s has no field %s" % (type(self).__name__, ", ".join(sorted(unknown))))
        values.update(changes)
        return type(self)(**values)


class Decision(Record):
    """``needed`` is None when it cannot be told; ``plan`` is set when the fix should be
    applied. ``where``, for a fix over several modules: which module (and functions) the
    reason is about, so that status states one reason once for all the modules it holds for."""

    __slots__ = ("needed", "plan", "reason", "where")

    def __init__(self, needed: Optional[bool], reason: str, plan: Any = None, where: str = "") -> None:
        self.needed = needed
        self.reason = reason
        self.plan = plan
        self.where = where
