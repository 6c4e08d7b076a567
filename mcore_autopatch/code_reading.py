"""Read what a module's functions do from their code objects: no file is read, nothing runs.

Shared by the fixes that decide from megatron-core's own code (``numpy_fix``,
``weights_only_fix``): which functions a module defines, which attributes of a global they
load (``np.product``, ``torch.load``), and which names they mention. Only functions whose
names already mention what is looked for are disassembled, so reading a module costs little.
"""

from __future__ import annotations

import dis
from types import CodeType, ModuleType
from typing import Any, Dict, FrozenSet, Iterable, Iterator, Tuple

_LOAD_ATTRIBUTE = frozenset(("LOAD_ATTR", "LOAD_METHOD"))


def defined_functions(module: ModuleType) -> "Iterator[Tuple[str, CodeType]]":
    """(qualified name, code) of each function and method the module itself defines, with
    what decorators wrap (staticmethod, classmethod, property, ``functools.wraps`` chains)."""
    home = getattr(module, "__name__", None)
    seen: "set[int]" = set()
    for value in list(vars(module).values()):
        if getattr(value, "__module__", None) != home:
            continue  # imported from elsewhere
        members = list(vars(value).items()) if isinstance(value, type) else [(None, value)]
        for attr, member in members:
            qualname = value.__name__ if attr is None else "%s.%s" % (value.__name__, attr)
            for code in codes_of(member):
                if id(code) not in seen:
                    seen.add(id(code))
                    yield qualname, code


def codes_of(obj: Any) -> "Iterator[CodeType]":
    parts = [getattr(obj, name, None) for name in ("fget", "fset", "fdel")] if isinstance(obj, property) else [obj]
    for part in parts:
        for _ in range(8):  # a decorator chain longer than this is not code we know
            function = getattr(part, "__func__", part)
            code = getattr(function, "__code__", None)
            if isinstance(code, CodeType):
                yield code
            part = getattr(function, "__wrapped__", None)
            if part is None:
                break


def nested(code: CodeType) -> "Iterator[CodeType]":
    """``code`` and the code of every function, lambda and comprehension inside it."""
    stack = [code]
    while stack:
        current = stack.pop()
        yield current
        stack.extend(const for const in current.co_consts if isinstance(const, CodeType))


def mentions(code: CodeType) -> FrozenSet[str]:
    """Every name ``code`` (and code nested in it) uses: globals, attributes, locals, and the
    identifier constants that keyword arguments are passed by."""
    names: "set[str]" = set()
    for current in nested(code):
        names.update(current.co_names, current.co_varnames)
        names.update(c for c in _flat_constants(current.co_consts) if isinstance(c, str) and c.isidentifier())
    return frozenset(names)


def _flat_constants(consts: Iterable[Any]) -> "Iterator[Any]":
    for const in consts:
        if isinstance(const, (tuple, frozenset)):
            yield from _flat_constants(const)
        else:
            yield const


def attributes_loaded(code: CodeType, owners: FrozenSet[str], wanted: FrozenSet[str]) -> FrozenSet[str]:
    """Which of ``wanted`` ``code`` (or code nested in it) loads as ``<owner>.<name>``, for a
    global named in ``owners`` (``np.product``: owners {"np"}, wanted {"product"})."""
    found: "set[str]" = set()
    for current in nested(code):
        if owners.isdisjoint(current.co_names) or wanted.isdisjoint(current.co_names):
            continue
        previous = None
        for instruction in dis.get_instructions(current):
            if (
                instruction.opname in _LOAD_ATTRIBUTE
                and instruction.argval in wanted
                and previous is not None
                and previous.opname in ("LOAD_GLOBAL", "LOAD_NAME")
                and previous.argval in owners
            ):
                found.add(instruction.argval)
            if instruction.opname != "CACHE":
                previous = instruction
    return frozenset(found)


def globals_bound_to(module: ModuleType, target: Any, unwrap: Any = None) -> FrozenSet[str]:
    """The names under which ``module``'s globals hold ``target`` (``np`` for numpy)."""
    unwrap = unwrap or (lambda obj: obj)
    return frozenset(name for name, value in vars(module).items() if unwrap(value) is target)


def short_name(module_name: str, package: str = "megatron.core.") -> str:
    """``megatron.core.dist_checkpointing.mapping`` -> ``dist_checkpointing.mapping``."""
    return module_name[len(package) :] if module_name.startswith(package) else module_name


def by_function(pairs: "Iterable[Tuple[str, Any]]") -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    for qualname, value in pairs:
        out.setdefault(qualname, value)
    return out
